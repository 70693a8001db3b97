"""A launcher that exports torch's env:// variables itself (a PyTorchJob's pods, the DeepSpeed launcher)."""

from __future__ import annotations

from support.launcher_variables import OPEN_MPI

from qaccel.environment import Environment, detect


def test_env_variables_of_a_launcher_are_a_world_one_process_per_node_unless_told():
    pod = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    assert detect(pod) == Environment(
        kind="env",
        rank=3,
        local_rank=0,
        node_rank=3,
        world_size=4,
        local_world_size=1,
        num_nodes=4,
        master_addr="job-master-0",
        master_port=23456,
    )
    deepspeed = {**pod, "LOCAL_RANK": "1", "LOCAL_SIZE": "2"}
    assert (detect(deepspeed).local_rank, detect(deepspeed).node_rank, detect(deepspeed).num_nodes) == (1, 1, 2)
    assert detect({**pod, "TORCHELASTIC_RUN_ID": "x"}).kind == "torchrun", "torchrun's own variables win"
    assert detect({**pod, **OPEN_MPI}).kind == "mpi", "an MPI's own variables win"
