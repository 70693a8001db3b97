"""When the script that started the ranks stops (Ctrl-C, SIGKILL), no rank outlives it, nor what a rank started: the
ranks iterate a DataLoader whose 2 workers are busy. (The same ranks when another rank fails:
tests/launch/test_worker.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from support.procs import script_env, script_file, stuck_ranks_and_workers, wait_dead

pytestmark = pytest.mark.timeout(180)


def _start(tmp_path):
    """The caller, once its ranks and their DataLoader workers run: (caller, rank pids, worker pids)."""
    script = script_file("stuck_workers.py")
    tmpdir = tmp_path / "tmp"  # a killed caller's run directory stays there, not in /tmp, until a next launch
    tmpdir.mkdir()
    caller = subprocess.Popen([sys.executable, str(script), str(tmp_path), "run"], env=script_env(TMPDIR=str(tmpdir)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        return (caller, *stuck_ranks_and_workers(tmp_path))
    except BaseException:
        caller.kill()
        caller.wait()
        raise


def test_ctrl_c_in_caller_stops_all_ranks_and_their_workers(tmp_path):
    caller, ranks, workers = _start(tmp_path)
    try:
        caller.send_signal(signal.SIGINT)
        _, stderr = caller.communicate(timeout=20)
        assert caller.returncode != 0
        assert "KeyboardInterrupt" in stderr
        assert wait_dead(ranks, timeout=5) == [], "ranks left running after Ctrl-C"
        assert wait_dead(workers, timeout=10) == [], "DataLoader workers left running after Ctrl-C"
    finally:
        caller.kill()
        caller.wait()


def test_killed_caller_leaves_no_rank_or_worker_behind(tmp_path):
    caller, ranks, workers = _start(tmp_path)
    try:
        caller.kill()
        caller.communicate(timeout=10)
        assert wait_dead(ranks + workers, timeout=10) == [], "left running after the caller was killed"
    finally:
        caller.kill()
        caller.wait()
