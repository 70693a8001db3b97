"""Processes started with the variables srun and sbatch set, without a real SLURM: srun tasks are ranks run in
place, an sbatch shell without srun spawns its own ranks. (tests/cluster/test_slurm.py runs a real SLURM.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.procs import free_job_id, free_port, report_results, run_script, script_file, srun_env

pytestmark = pytest.mark.timeout(180)


def _run_as_srun_tasks(script, tag, job_id, **extra):
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), tag],
            env=srun_env(r, job_id, **extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    return sorted((r for out, _ in outs for r in report_results(out)), key=lambda r: r["rank"])


def test_srun_task_that_loses_its_peer_says_the_cause_is_in_the_other_ranks_log(tmp_path):
    """Each srun task logs alone: rank 0 must not read as the origin when rank 1 died under it."""
    script = script_file("silent_rank_death.py")
    job_id = free_job_id()
    procs = [
        subprocess.Popen([sys.executable, str(script)], env=srun_env(r, job_id), stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [1, 3], errs
    assert (
        "[qaccel] raised on rank 0 of 2 because it lost contact with another rank: the cause is most likely in "
        "that rank's log" in errs[0]
    )


def test_srun_tasks_run_in_place_with_slurm_ranks_for_many_sessions_back_to_back(tmp_path):
    """One pair of tasks for both checks. Each task is its rank, run in place, with the rank variables SLURM gives
    (and RANK set for the code in it). Each session re-rendezvouses; a peer must never reach rank 0's store of the
    session before: it fails with "Failed to recv, got 0 bytes" (with a new store per session hosted by rank 0, in
    about 1 of 3 runs of 25 sessions)."""
    script = script_file("many_sessions.py")
    results = _run_as_srun_tasks(script, "many", free_job_id())
    assert [(r["rank"], r["local"], r["node"], r["world"], r["sum"], r["env_rank"]) for r in results] == [
        (0, 0, 0, 2, 1, "0"),
        (1, 1, 0, 2, 1, "1"),
    ]
    assert [r["sums"] for r in results] == [[3] * 40] * 2


def test_srun_user_master_addr_and_port_win(tmp_path):
    script = script_file("report_ranks.py")
    results = _run_as_srun_tasks(
        script,
        "user",
        "1",
        SLURM_NODELIST="nosuchhost[1-2]",
        SLURM_STEP_NODELIST="nosuchhost[1-2]",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    assert [r["sum"] for r in results] == [1, 1]


def test_sbatch_shell_without_srun_spawns_its_own_ranks(tmp_path):
    """Inside an sbatch script without srun: SLURM_PROCID/NTASKS set, no step: a plain process that spawns."""
    script = script_file("report_ranks.py")
    env = srun_env(0, "4242")
    for key in (
        "SLURM_STEP_ID",
        "SLURM_STEP_NUM_TASKS",
        "SLURM_STEP_NODELIST",
        "SLURM_STEP_NUM_NODES",
        "SLURM_STEP_TASKS_PER_NODE",
    ):
        env.pop(key)
    proc = run_script(script, "batch", env=env, cwd=tmp_path, timeout=90)
    assert proc.returncode == 0, proc.stderr
    [result] = report_results(proc.stdout)
    assert (result["rank"], result["world"], result["sum"]) == (0, 2, 1)
