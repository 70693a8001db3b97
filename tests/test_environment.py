"""Unit tests for qaccel.environment: every launch kind read from explicit environment dicts."""

from __future__ import annotations

import os

import pytest

from qaccel.environment import Environment, derived_port, detect, parse_nodelist, parse_tasks_per_node, slurm_port
from support import component

SBATCH_WITHOUT_SRUN = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOBID": "4242",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_NNODES": "1",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_JOB_NODELIST": "node01",
    "SLURM_NODELIST": "node01",
}

SRUN_TWO_NODES = {
    "SLURM_JOB_ID": "987654",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "gpu[3-4]",
    "SLURM_JOB_NODELIST": "gpu[1-8]",
    "SLURM_NTASKS": "8",
}

TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "abc",
    "RANK": "5",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


def test_empty_environment_is_plain() -> None:
    env = detect({})
    assert env == Environment(kind="plain")
    assert env.is_launched is False
    assert (env.rank, env.world_size, env.master_addr, env.master_port) == (0, 1, None, None)


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


def test_torchrun_num_nodes_rounds_up_and_port_is_optional() -> None:
    env = detect(
        {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "2"}
    )
    assert env.kind == "torchrun"
    assert env.num_nodes == 3
    assert env.node_rank == 0
    assert env.master_addr is None
    assert env.master_port is None


def test_torchrun_wins_over_slurm() -> None:
    env = detect({**SRUN_TWO_NODES, **TORCHRUN})
    assert env.kind == "torchrun"
    assert env.rank == 5


def test_sbatch_script_without_srun_is_plain() -> None:
    env = detect(SBATCH_WITHOUT_SRUN)
    assert env == Environment(kind="plain")
    assert env.is_launched is False


def test_salloc_single_task_step_is_plain() -> None:
    salloc = {
        "SLURM_JOB_ID": "77",
        "SLURM_PROCID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "1",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NODELIST": "node1",
    }
    assert detect(salloc).kind == "plain"


def test_step_task_count_wins_over_job_task_count() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "8"}
    assert detect(env).kind == "plain"
    env = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "1", "SLURM_STEP_NUM_TASKS": "3", "SLURM_NTASKS": "1"}
    assert detect(env).world_size == 3


def test_ntasks_is_used_when_step_count_is_absent() -> None:
    env = detect({"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"})
    assert env.kind == "slurm"
    assert env.rank == 1
    assert env.world_size == 2


def test_multi_node_srun_step() -> None:
    env = detect(SRUN_TWO_NODES)
    assert env == Environment(
        kind="slurm",
        rank=3,
        local_rank=1,
        node_rank=1,
        world_size=4,
        local_world_size=2,
        num_nodes=2,
        master_addr="gpu3",
        master_port=15000 + 7654,
    )
    assert env.is_launched is True


def test_slurm_user_master_addr_and_port_win() -> None:
    env = detect({**SRUN_TWO_NODES, "MASTER_ADDR": "head", "MASTER_PORT": "12345"})
    assert env.master_addr == "head"
    assert env.master_port == 12345


def test_slurm_port_derived_from_job_id_with_jobid_fallback() -> None:
    base = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}
    assert detect({**base, "SLURM_JOB_ID": "31337"}).master_port == 16337
    assert detect({**base, "SLURM_JOBID": "42"}).master_port == 15042
    assert detect(base).master_port is None


def test_slurm_fallbacks_without_step_layout() -> None:
    env = detect(
        {
            "SLURM_PROCID": "2",
            "SLURM_STEP_ID": "0",
            "SLURM_STEP_NUM_TASKS": "6",
            "SLURM_NODELIST": "n[1-3]",
        }
    )
    assert env.num_nodes == 3
    assert env.local_world_size == 2
    assert env.master_addr == "n1"
    assert (env.local_rank, env.node_rank) == (0, 0)


def test_slurm_nodelist_prefers_step_then_job() -> None:
    base = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}
    assert detect({**base, "SLURM_JOB_NODELIST": "job1", "SLURM_NODELIST": "old1"}).master_addr == "job1"
    assert detect({**base, "SLURM_STEP_NODELIST": "s9", "SLURM_JOB_NODELIST": "job1"}).master_addr == "s9"
    assert detect(base).master_addr is None


def test_slurm_num_nodes_falls_back_to_nnodes() -> None:
    env = detect({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NNODES": "4"})
    assert env.num_nodes == 4
    assert env.local_world_size == 1


def test_slurm_tasks_per_node_out_of_range_falls_back_to_even_split() -> None:
    env = detect(
        {
            "SLURM_PROCID": "5",
            "SLURM_STEP_ID": "0",
            "SLURM_STEP_NUM_TASKS": "6",
            "SLURM_STEP_NUM_NODES": "2",
            "SLURM_NODEID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "3",
        }
    )
    assert env.local_world_size == 3
    assert env.node_rank == 1


def test_slurm_uneven_tasks_per_node_picks_this_node() -> None:
    env = detect({**SRUN_TWO_NODES, "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_TASKS_PER_NODE": "9(x2)"})
    assert env.local_world_size == 1


@pytest.mark.parametrize(
    ("environ", "name", "value"),
    [
        ({**SRUN_TWO_NODES, "SLURM_PROCID": "x"}, "SLURM_PROCID", "x"),
        ({**SRUN_TWO_NODES, "SLURM_STEP_NUM_TASKS": "four"}, "SLURM_STEP_NUM_TASKS", "four"),
        ({**SRUN_TWO_NODES, "MASTER_PORT": "http"}, "MASTER_PORT", "http"),
        ({**SRUN_TWO_NODES, "SLURM_NODEID": ""}, "SLURM_NODEID", ""),
        ({**TORCHRUN, "WORLD_SIZE": "8.0"}, "WORLD_SIZE", "8.0"),
        ({**TORCHRUN, "LOCAL_RANK": "one"}, "LOCAL_RANK", "one"),
    ],
)
def test_bad_integer_names_variable_and_value(environ: dict[str, str], name: str, value: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name}='{value}' is not an integer$"):
        detect(environ)


def test_malformed_slurm_layout_variables_raise() -> None:
    with pytest.raises(ValueError, match="SLURM_STEP_TASKS_PER_NODE"):
        detect({**SRUN_TWO_NODES, "SLURM_STEP_TASKS_PER_NODE": "2(x"})
    with pytest.raises(ValueError, match="SLURM_STEP_NODELIST"):
        no_node_count = {k: v for k, v in SRUN_TWO_NODES.items() if k != "SLURM_STEP_NUM_NODES"}
        detect({**no_node_count, "SLURM_STEP_NODELIST": "gpu[3-"})


def test_detect_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("SLURM_", "TORCHELASTIC_")):
            monkeypatch.delenv(key)
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    assert detect().kind == "torchrun"
    assert detect().world_size == 8


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


@pytest.mark.parametrize(
    ("nodelist", "expected"),
    [
        ("node1", ["node1"]),
        ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
        ("n[1-2]", ["n1", "n2"]),
        ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
        ("host-1,host-2", ["host-1", "host-2"]),
        ("", []),
        ("   ", []),
        ("  node[1-2] ", ["node1", "node2"]),
        ("node[008-010]", ["node008", "node009", "node010"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("n[3]", ["n3"]),
        ("n[1,3],m[2-3]", ["n1", "n3", "m2", "m3"]),
        ("[1-2]x", ["1x", "2x"]),
        ("rack[1-2]node", ["rack1node", "rack2node"]),
        ("a, b", ["a", "b"]),
        ("gpu[3-4]", ["gpu3", "gpu4"]),
    ],
)
def test_parse_nodelist(nodelist: str, expected: list[str]) -> None:
    assert parse_nodelist(nodelist) == expected


@pytest.mark.parametrize(
    "nodelist",
    [
        "node[1-2",
        "node1-2]",
        "node[[1-2]]",
        "node[5-3]",
        "node[a-b]",
        "node[]",
        "node[1-]",
        "node[1-2-3]",
        "a,,b",
        "a,",
    ],
)
def test_parse_nodelist_malformed(nodelist: str) -> None:
    with pytest.raises(ValueError, match="malformed SLURM nodelist") as info:
        parse_nodelist(nodelist)
    assert repr(nodelist) in str(info.value)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("2(x3),1", [2, 2, 2, 1]),
        ("4", [4]),
        ("", []),
        ("1,2,3", [1, 2, 3]),
        ("8(x1)", [8]),
        (" 2(x2) ", [2, 2]),
    ],
)
def test_parse_tasks_per_node(spec: str, expected: list[int]) -> None:
    assert parse_tasks_per_node(spec) == expected


@pytest.mark.parametrize("spec", ["x", "2(x)", "2(3)", "2(x0)", "2,,1", "-1", "2(x3", "1.5"])
def test_parse_tasks_per_node_malformed(spec: str) -> None:
    with pytest.raises(ValueError, match="malformed SLURM tasks-per-node spec"):
        parse_tasks_per_node(spec)


@pytest.mark.parametrize(
    ("job_id", "port"),
    [("4242", 19242), ("987654", 22654), ("7", 15007), ("123_4", 16234), ("0000", 15000), ("12345_678", 20678)],
)
def test_slurm_port(job_id: str, port: int) -> None:
    assert slurm_port(job_id) == port


def test_slurm_port_without_digits_raises() -> None:
    with pytest.raises(ValueError, match="'abc'"):
        slurm_port("abc")


OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "1234567"}


def test_open_mpi_on_two_nodes_needs_the_rendezvous_address_and_says_how():
    with pytest.raises(ValueError, match="an MPI job of 4 ranks on 2 nodes .* needs the rendezvous address of rank "
                                         "0's node: pass MASTER_ADDR .* mpirun -x MASTER_ADDR="):
        detect(OPEN_MPI)
    env = detect({**OPEN_MPI, "MASTER_ADDR": "node1"})
    assert env == Environment(kind="mpi", rank=3, local_rank=1, node_rank=1, world_size=4, local_world_size=2,
                              num_nodes=2, master_addr="node1", master_port=derived_port("1234567"))


def test_mpi_on_one_node_rendezvouses_on_loopback_at_a_port_of_the_job_or_its_daemon():
    one_node = {**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}
    env = detect(one_node)
    assert (env.master_addr, env.master_port, env.node_rank, env.num_nodes) == ("127.0.0.1", derived_port("1234567"), 0, 1)
    mpich = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    assert detect(mpich).master_port == derived_port(f"daemon {os.getppid()}"), "every local rank's parent"
    assert detect({**mpich, "MASTER_PORT": "29400"}).master_port == 29400, "yours wins"
    assert 20000 <= derived_port("x") < 30000 and derived_port("x") == derived_port("x")


def test_a_single_mpi_process_or_a_stray_variable_is_no_rank():
    assert detect({"PMI_RANK": "0", "PMI_SIZE": "1"}).kind == "plain", "mpirun -np 1: a plain process"
    assert detect({"PMI_RANK": "0"}).kind == "plain"
    assert detect({"RANK": "1", "WORLD_SIZE": "2"}).kind == "plain", "a leftover RANK, no rendezvous"
    assert detect({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}).kind == "plain"
    qaccel_rank = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "5", "QACCEL_RANK_OF": "9"}
    assert detect(qaccel_rank).kind == "plain", "a process a qaccel rank started"
    elastic = {"TORCHELASTIC_RUN_ID": "qaccel-run-ab12", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert detect({**qaccel_rank, **elastic}).kind == "plain", "a qaccel rank's torchrun variables are no torchrun's"
    inside = {**qaccel_rank, **elastic, "TORCHELASTIC_RUN_ID": "none"}
    assert detect(inside).kind == "torchrun", "a torchrun a qaccel rank started: its workers are torchrun's"
    assert detect({"JSM_NAMESPACE_RANK": "0", "JSM_NAMESPACE_SIZE": "1"}).kind == "plain"


def test_env_variables_of_a_launcher_are_a_world_one_process_per_node_unless_told():
    pod = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    assert detect(pod) == Environment(kind="env", rank=3, local_rank=0, node_rank=3, world_size=4, local_world_size=1,
                                      num_nodes=4, master_addr="job-master-0", master_port=23456)
    deepspeed = {**pod, "LOCAL_RANK": "1", "LOCAL_SIZE": "2"}
    assert (detect(deepspeed).local_rank, detect(deepspeed).node_rank, detect(deepspeed).num_nodes) == (1, 1, 2)
    assert detect({**pod, "TORCHELASTIC_RUN_ID": "x"}).kind == "torchrun", "torchrun's own variables win"
    assert detect({**pod, **OPEN_MPI}).kind == "mpi", "an MPI's own variables win"


def test_jsrun_takes_the_first_compute_host_and_the_jobs_port():
    jsrun = {"JSM_NAMESPACE_RANK": "5", "JSM_NAMESPACE_SIZE": "8", "JSM_NAMESPACE_LOCAL_RANK": "1",
             "JSM_NAMESPACE_LOCAL_SIZE": "4", "LSB_JOBID": "8842", "LSB_MCPU_HOSTS": "batch1 1 c01 4 c02 4"}
    assert detect(jsrun) == Environment(kind="lsf", rank=5, local_rank=1, node_rank=1, world_size=8,
                                        local_world_size=4, num_nodes=2, master_addr="c01",
                                        master_port=derived_port("8842"))
    with pytest.raises(ValueError, match="a jsrun rank needs LSB_MCPU_HOSTS and LSB_JOBID"):
        detect({k: v for k, v in jsrun.items() if k != "LSB_JOBID"})


def test_every_launcher_kind_runs_in_place_and_exports_torchruns_variables():
    from qaccel.environment import LAUNCHERS, Kind

    assert [launcher.kind for launcher in LAUNCHERS] == ["initialized", "torchrun", "slurm", "mpi", "lsf", "env"]
    for kind in ("mpi", "lsf", "env"):
        assert Kind(kind).started_by_launcher and Kind(kind).exports_rank_variables and not Kind(kind).creates_processes
