"""The tasks of an srun step: SLURM's variables, host lists and task counts; an sbatch or salloc shell is no rank."""

from __future__ import annotations

import pytest
from support.launcher_variables import SBATCH_WITHOUT_SRUN, SRUN_TWO_NODES

from qaccel.environment import Environment, detect, parse_nodelist, parse_tasks_per_node, slurm_port


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
    assert env.address_from == "the first node of SLURM_STEP_NODELIST", "what a rendezvous error names"


def test_slurm_user_master_addr_and_port_win() -> None:
    env = detect({**SRUN_TWO_NODES, "MASTER_ADDR": "head", "MASTER_PORT": "12345"})
    assert env.address_from == "MASTER_ADDR"
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


def test_malformed_slurm_layout_variables_raise() -> None:
    with pytest.raises(ValueError, match="SLURM_STEP_TASKS_PER_NODE"):
        detect({**SRUN_TWO_NODES, "SLURM_STEP_TASKS_PER_NODE": "2(x"})
    with pytest.raises(ValueError, match="SLURM_STEP_NODELIST"):
        no_node_count = {k: v for k, v in SRUN_TWO_NODES.items() if k != "SLURM_STEP_NUM_NODES"}
        detect({**no_node_count, "SLURM_STEP_NODELIST": "gpu[3-"})


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
