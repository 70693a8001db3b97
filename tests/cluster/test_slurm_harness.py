"""Tests of the real-SLURM harness (tests/support/slurm_cluster.py) and of the SLURM facts the
library relies on.  Every test runs against a real slurmctld + 2 slurmd (fake nodes
n1, n2 on localhost) started by the ``slurm_cluster`` fixture."""

import os
import subprocess

import pytest
from support.procs import alive, wait_for
from support.slurm_cluster import LocalSlurm, SlurmError

pytestmark = pytest.mark.slurm

STEP_VARS = (
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_STEP_ID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NODELIST",
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
)


def _parse_records(text: str) -> list[dict[str, str]]:
    """Lines 'REC K=V K=V ...' -> list of dicts (one per task)."""
    recs = []
    for line in text.splitlines():
        if line.startswith("REC "):
            recs.append(dict(kv.split("=", 1) for kv in line.split()[1:]))
    return recs


def _env_dict(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


_PRINT_VARS = "echo REC " + " ".join(f"{v}=${{{v}:-UNSET}}" for v in STEP_VARS)


@pytest.mark.timeout(120)
def test_srun_two_nodes_gives_each_task_its_own_rank_vars(slurm_cluster):
    r = slurm_cluster.srun(["-N2", "-n2", "sh", "-c", _PRINT_VARS], timeout=60)
    assert r.returncode == 0, r.stderr
    recs = _parse_records(r.stdout)
    assert len(recs) == 2, r.stdout
    by_rank = {int(x["SLURM_PROCID"]): x for x in recs}
    assert set(by_rank) == {0, 1}
    assert {int(x["SLURM_NODEID"]) for x in recs} == {0, 1}
    # one task per node: every task is local rank 0 of its node; rank i on node i
    assert all(x["SLURM_LOCALID"] == "0" for x in recs)
    assert [by_rank[i]["SLURM_NODEID"] for i in (0, 1)] == ["0", "1"]
    for x in recs:
        assert x["SLURM_NODELIST"] == "n[1-2]"
        assert x["SLURM_STEP_NODELIST"] == "n[1-2]"
        assert x["SLURM_STEP_NUM_TASKS"] == "2"
        assert x["SLURM_STEP_ID"] == "0"
        assert x["SLURM_JOB_ID"].isdigit()
    assert recs[0]["SLURM_JOB_ID"] == recs[1]["SLURM_JOB_ID"]


@pytest.mark.timeout(120)
def test_srun_two_tasks_on_one_node_get_local_ids(slurm_cluster):
    r = slurm_cluster.srun(["-N1", "-n2", "sh", "-c", _PRINT_VARS], timeout=60)
    assert r.returncode == 0, r.stderr
    recs = _parse_records(r.stdout)
    assert sorted((x["SLURM_PROCID"], x["SLURM_LOCALID"]) for x in recs) == [("0", "0"), ("1", "1")]
    assert {x["SLURM_NODEID"] for x in recs} == {"0"}
    assert {x["SLURM_STEP_NUM_TASKS"] for x in recs} == {"2"}


@pytest.mark.timeout(120)
def test_sbatch_without_srun_has_no_step_vars(slurm_cluster, tmp_path):
    """The batch shell itself is task 0 of the allocation but NOT a job step of the
    --ntasks tasks: SLURM_PROCID=0 and SLURM_NTASKS=2 are set, SLURM_STEP_ID and
    SLURM_STEP_NUM_TASKS are not.  qaccel relies on this to tell 'inside sbatch,
    plain process' from 'srun task'."""
    script = tmp_path / "env.sbatch"
    script.write_text("#!/bin/sh\n#SBATCH --ntasks=2\n#SBATCH --time=1\nenv\n")
    job_id, out = slurm_cluster.sbatch_wait(script, timeout=60)
    env = _env_dict(out)
    assert env.get("SLURM_JOB_ID") == str(job_id), out
    assert env.get("SLURM_PROCID") == "0"
    assert env.get("SLURM_NTASKS") == "2"
    assert "SLURM_STEP_ID" not in env
    assert "SLURM_STEP_NUM_TASKS" not in env
    assert slurm_cluster.job_info(job_id).get("ExitCode") == "0:0"


@pytest.mark.timeout(120)
def test_srun_inside_sbatch_makes_each_task_a_step_task(slurm_cluster, tmp_path):
    script = tmp_path / "step.sbatch"
    script.write_text(f"#!/bin/sh\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\nsrun sh -c '{_PRINT_VARS}'\n")
    job_id, out = slurm_cluster.sbatch_wait(script, timeout=60)
    recs = _parse_records(out)
    assert sorted(x["SLURM_PROCID"] for x in recs) == ["0", "1"], out
    assert sorted(x["SLURM_NODEID"] for x in recs) == ["0", "1"]
    assert {x["SLURM_STEP_NUM_TASKS"] for x in recs} == {"2"}
    assert {x["SLURM_NODELIST"] for x in recs} == {"n[1-2]"}
    assert {x["SLURM_JOB_ID"] for x in recs} == {str(job_id)}


@pytest.mark.timeout(120)
def test_failing_srun_task_gives_nonzero_exit(slurm_cluster):
    # only task 1 (on n2) fails
    r = slurm_cluster.srun(["-N2", "-n2", "sh", "-c", 'exit "$SLURM_PROCID"'], timeout=60)
    assert r.returncode != 0
    assert "task 1" in r.stderr
    r = slurm_cluster.srun(["-n1", "false"], timeout=60)
    assert r.returncode != 0


@pytest.mark.timeout(120)
def test_failing_batch_job_reports_exit_code(slurm_cluster, tmp_path):
    script = tmp_path / "fail.sbatch"
    script.write_text("#!/bin/sh\necho before\nexit 3\n")
    job_id, out = slurm_cluster.sbatch_wait(script, timeout=60)
    assert out.strip() == "before"
    info = slurm_cluster.job_info(job_id)
    assert info["JobState"] == "FAILED"
    assert info["ExitCode"] == "3:0"


@pytest.mark.timeout(120)
def test_cluster_env_is_private(slurm_cluster):
    assert "SLURM_CONF" not in os.environ
    assert slurm_cluster.env["SLURM_CONF"] == str(slurm_cluster.conf)
    assert str(slurm_cluster.conf).startswith(str(slurm_cluster.root))
    assert slurm_cluster.env is not slurm_cluster.env  # a fresh copy each time


@pytest.mark.timeout(120)
def test_second_cluster_starts_and_tears_down_completely(slurm_cluster):
    """A second private cluster next to the session one (as another xdist worker
    would have): different ports and name, both usable, and after stop() none of its
    processes is left and its dir is gone."""
    other = LocalSlurm(nodes=1)
    with other:
        assert other.cluster_name != slurm_cluster.cluster_name
        assert {other.ctld_port, *other.node_ports}.isdisjoint({slurm_cluster.ctld_port, *slurm_cluster.node_ports})
        r = other.srun(["-n2", "sh", "-c", "echo $SLURM_NODELIST"], timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["n1", "n1"]
        # leave a running job behind: teardown must cancel/kill it
        sleeper = subprocess.Popen(
            ["srun", "-n1", "sleep", "300"], env=other.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for(
            lambda: other.run(["squeue", "-h", "-t", "R", "-o", "%i"], 10).stdout.strip(), 30, "the sleeper to run"
        )
        pids = [p.pid for p in other._procs.values()]
        root = other.root
        assert other.leftover_pids()
    assert sleeper.wait(30) != 0
    assert other.leftover_pids() == []
    assert not any(os.path.exists(f"/proc/{p}") and alive(p) for p in pids)
    assert not root.exists()
    # the session cluster is unaffected
    r = slurm_cluster.srun(["-N2", "-n2", "true"], timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.timeout(120)
def test_sbatch_wait_timeout_raises_with_logs(slurm_cluster, tmp_path):
    script = tmp_path / "slow.sbatch"
    script.write_text("#!/bin/sh\nsleep 300\n")
    with pytest.raises(SlurmError, match="slurmctld.log"):
        slurm_cluster.sbatch_wait(script, timeout=1)
