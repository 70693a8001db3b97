"""A rank started by qaccel looks like a torchrun worker: to third-party code, by the variables it has; to what it
starts, DataLoader workers and pools are forked from it (so classes defined in the script reach them), it leads its
own process group, and whatever it started dies with it however the rank is stopped (when its caller is stopped:
tests/launch/test_caller_stops.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.procs import (
    result_lines,
    run_script,
    run_torchrun,
    script_env,
    script_file,
    stuck_ranks_and_workers,
    wait_dead,
)

pytestmark = pytest.mark.timeout(180)


def test_dataset_and_pool_functions_defined_in_the_script_reach_the_ranks_children(tmp_path):
    script = script_file("rank_children.py")
    proc = run_script(script, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.split("OUT ", 1)[1])
    assert sorted(out[0]["seen"] + out[1]["seen"]) == [i * i for i in range(16)]
    for rank in out:
        assert rank["workers_parent_is_rank"] and rank["group_leader"] and rank["ctrl_c_raises"], rank
        assert (rank["cubes"], rank["start_method"]) == ([0, 1, 8, 27, 64], "fork")


def test_dataloader_workers_die_with_their_rank_when_another_rank_fails(tmp_path):
    """Stopped by its caller (Ctrl-C, SIGKILL), the same ranks and workers: tests/launch/test_caller_stops.py."""
    script = script_file("stuck_workers.py")
    caller = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), "fail"],
        env=script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ranks, workers = stuck_ranks_and_workers(tmp_path)
        _, err = caller.communicate(timeout=30)
        assert caller.returncode != 0
        assert "rank 1 fails while every rank's workers are busy" in err
        assert wait_dead(ranks + workers, timeout=10) == [], "left running after another rank failed"
    finally:
        caller.kill()
        caller.wait()


def test_pools_opened_and_closed_in_a_rank_never_hang(tmp_path):
    """Pool.__exit__ stops its workers with SIGTERM and waits for them: a worker still starting when the pool
    closes must die of it (with a Python-level SIGTERM handler inherited from the rank, it would miss the signal)."""
    script = script_file("pools_in_a_rank.py")
    proc = run_script(script, cwd=tmp_path, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['closed', 'closed']"


NOT_EXPORTED = {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE"}
"""torchrun's, for its own use: where ``@record`` writes a failure for the agent, the signals the agent passes on."""


def test_a_rank_has_every_variable_a_torchrun_worker_has_and_is_taken_for_one(tmp_path):
    script = script_file("worker_variables.py")
    plain = run_script(script, cwd=tmp_path, timeout=100)
    assert plain.returncode == 0, plain.stderr
    [ranks] = result_lines(plain.stdout)
    caller = json.dumps(sorted(script_env()) + ["CALLER_NAMES"])
    torchrun = run_torchrun(script, cwd=tmp_path, env=script_env(CALLER_NAMES=caller), timeout=100)
    assert torchrun.returncode == 0, torchrun.stderr
    workers = result_lines(torchrun.stdout)[0]
    missing = set(workers[0]["added"]) - set(ranks[0]["added"])
    assert missing == NOT_EXPORTED, f"a torchrun worker has {sorted(missing)} too"
    assert all(r["elastic"] for r in ranks), "torch.distributed.is_torchelastic_launched(), as Lightning asks"
    assert ranks[0]["run_id"] == ranks[1]["run_id"] and ranks[0]["run_id"].startswith("qaccel-run-")
    assert {r["child_kind"] for r in ranks} == {"plain"}, "a process a rank starts is no torchrun worker"
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert {r["threads"] for r in ranks} == {str(threads)}, "OMP_NUM_THREADS: qaccel's budget, where torchrun says 1"
