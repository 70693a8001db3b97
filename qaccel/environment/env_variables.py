"""A launcher that exported torch's env:// variables itself (a Kubernetes PyTorchJob, the DeepSpeed launcher,
SageMaker).
"""

from __future__ import annotations

from collections.abc import Mapping

from qaccel.environment.layout import STARTED_BY_QACCEL, Environment, Kind
from qaccel.environment.variables import ceil_div, first_int, int_of


class EnvVariables:
    """A launcher that exported torch's env:// variables itself: all of ``RANK``, ``WORLD_SIZE`` (more than 1),
    ``MASTER_ADDR`` and ``MASTER_PORT`` (a Kubernetes PyTorchJob, the DeepSpeed launcher, SageMaker, the old
    ``torch.distributed.launch --use-env``). ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (or DeepSpeed's
    ``LOCAL_SIZE``) when given, else one process per node (a PyTorchJob's pods). Not in a process a qaccel rank
    started, which carries these too."""

    kind = Kind.ENV
    NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

    def find(self, env: Mapping[str, str]) -> Environment | None:
        if not all(env.get(name) for name in self.NEEDED) or STARTED_BY_QACCEL in env:
            return None
        world_size = int_of(env, "WORLD_SIZE", 1)
        if world_size <= 1:
            return None
        rank = int_of(env, "RANK", 0)
        local_world_size = first_int(env, ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")) or 1
        node_rank = first_int(env, ("GROUP_RANK", "NODE_RANK"))
        node_rank = rank // local_world_size if node_rank is None else node_rank
        return Environment(
            kind=self.kind,
            rank=rank,
            local_rank=int_of(env, "LOCAL_RANK", rank % local_world_size),
            node_rank=node_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            num_nodes=ceil_div(world_size, local_world_size),
            master_addr=env["MASTER_ADDR"],
            master_port=int_of(env, "MASTER_PORT", 0),
        )
