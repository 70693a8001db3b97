"""torchrun's workers: the layout torchrun exports, taken verbatim."""

from __future__ import annotations

from support.launcher_variables import TORCHRUN

from qaccel.environment import Environment, detect


def test_torchrun_values() -> None:
    env = detect(TORCHRUN)
    assert env == Environment(
        kind="torchrun",
        rank=5,
        local_rank=1,
        node_rank=1,
        world_size=8,
        local_world_size=4,
        num_nodes=2,
        master_addr="10.0.0.1",
        master_port=29500,
    )
    assert env.is_launched is True
    assert env.address_from == "MASTER_ADDR, which torchrun set"


def test_torchrun_num_nodes_rounds_up_and_port_is_optional() -> None:
    env = detect(
        {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "2"}
    )
    assert env.kind == "torchrun"
    assert env.num_nodes == 3
    assert env.node_rank == 0
    assert env.master_addr is None
    assert env.master_port is None
