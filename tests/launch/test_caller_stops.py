"""When the script that started the ranks stops (Ctrl-C, SIGKILL), no rank outlives it, nor what a rank started: the
ranks iterate a DataLoader whose 2 workers are busy. (The same ranks when another rank fails:
tests/launch/test_worker.py.) A caller told to stop (SIGTERM) ends by the signal whatever its ranks did."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from support.procs import script_env, script_file, signal_when, stuck_ranks_and_workers, wait_dead

pytestmark = pytest.mark.timeout(180)


def _start(tmp_path):
    """The caller, once its ranks and their DataLoader workers run: (caller, rank pids, worker pids)."""
    script = script_file("stuck_workers.py")
    tmpdir = tmp_path / "tmp"  # a killed caller's run directory stays there, not in /tmp, until a next launch
    tmpdir.mkdir()
    caller = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), "run"],
        env=script_env(TMPDIR=str(tmpdir)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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


def test_a_caller_told_to_stop_ends_by_the_signal_even_when_its_ranks_ignore_it_and_finish(tmp_path):
    """A caller that got SIGTERM passes it on; ranks that ignore it finish fn, yet the caller must not return their
    result as if nobody had asked it to stop: it ends by the signal, as a process that got SIGTERM does."""
    proc = signal_when(
        [sys.executable, str(script_file("ranks_ignore_sigterm.py"))],
        signal.SIGTERM,
        "ranks ignore SIGTERM",
        env=script_env(),
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    assert "RESULT" not in proc.stdout
