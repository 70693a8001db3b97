"""torchrun's workers (torchelastic), by the layout torchrun exports."""

from __future__ import annotations

from collections.abc import Mapping

from qaccel.environment.layout import STARTED_BY_QACCEL, Environment, Kind, _int, _launcher_layout, qaccel_run_id


class Torchrun:
    """torchrun (torchelastic) exports the whole layout, so take it verbatim."""

    kind = Kind.TORCHRUN

    def find(self, env: Mapping[str, str]) -> Environment | None:
        run_id = env.get("TORCHELASTIC_RUN_ID")
        if run_id is None or (STARTED_BY_QACCEL in env and run_id.startswith(qaccel_run_id(""))):
            return None  # a qaccel rank, or a process it started, looks like a torchrun worker but is none
        return _launcher_layout(env, self.kind, _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1))
