"""A process group the user made before distribute(): run in it."""

from __future__ import annotations

import sys
from collections.abc import Mapping

from qaccel.environment.layout import Environment, Kind
from qaccel.environment.variables import launcher_layout


class InitializedGroup:
    """The user made a torch.distributed group: run in it. Read without importing torch when nobody else has."""

    kind = Kind.INITIALIZED

    def find(self, env: Mapping[str, str]) -> Environment | None:
        if "torch" not in sys.modules:
            return None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        return launcher_layout(env, self.kind, dist.get_rank(), dist.get_world_size())
