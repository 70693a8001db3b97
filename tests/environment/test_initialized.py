"""A group the user made: run in it, with the layout its variables give around its rank and world."""

from __future__ import annotations

from support import component
from support.launcher_variables import TORCHRUN

from qaccel.environment import detect


def test_initialized_process_group() -> None:
    import torch.distributed as dist

    if not dist.is_available():
        component.unavailable("torch.distributed is not available in this torch")
    assert detect({}).kind == "plain"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        env = detect({**TORCHRUN, "RANK": "7", "MASTER_PORT": "29511"})
        assert env.kind == "initialized"
        assert env.is_launched is True
        assert (env.rank, env.world_size) == (0, 1)
        assert env.local_rank == 1
        assert env.local_world_size == 4
        assert env.node_rank == 1
        assert env.master_addr == "10.0.0.1"
        assert env.master_port == 29511
        assert env.num_nodes == 1
        bare = detect({})
        assert (bare.local_rank, bare.local_world_size, bare.node_rank, bare.num_nodes) == (0, 1, 0, 1)
        assert bare.master_addr is None
    finally:
        dist.destroy_process_group()
    assert detect({}).kind == "plain"
