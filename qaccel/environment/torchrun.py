"""torchrun's workers (torchelastic), by the layout torchrun exports."""

from __future__ import annotations

from collections.abc import Mapping

from qaccel.environment.layout import STARTED_BY_QACCEL, Environment, Kind, qaccel_run_id
from qaccel.environment.variables import int_of, launcher_layout


class Torchrun:
    """torchrun (torchelastic) exports the whole layout, so take it verbatim."""

    kind = Kind.TORCHRUN

    def find(self, env: Mapping[str, str]) -> Environment | None:
        run_id = env.get("TORCHELASTIC_RUN_ID")
        if run_id is None or (STARTED_BY_QACCEL in env and run_id.startswith(qaccel_run_id(""))):
            return None  # a qaccel rank, or a process it started, looks like a torchrun worker but is none
        return launcher_layout(env, self.kind, int_of(env, "RANK", 0), int_of(env, "WORLD_SIZE", 1))
