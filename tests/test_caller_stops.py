"""When the script that started the ranks stops (Ctrl-C, SIGKILL), no rank outlives it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from procs import script_env, wait_dead, write_script

pytestmark = pytest.mark.timeout(180)


PID_SCRIPT = """
import os, sys, time
from pathlib import Path
from qaccel import Accelerator

acc = Accelerator(nprocs=2, compute_setup="cpu")

def work(out):
    Path(out, f"pid-{acc.rank}.tmp").write_text(str(os.getpid()))
    os.replace(Path(out, f"pid-{acc.rank}.tmp"), Path(out, f"pid-{acc.rank}"))  # never seen half-written
    time.sleep(120)

if __name__ == "__main__":
    acc.distribute(work)(sys.argv[1])
"""


def _start_and_wait_for_ranks(tmp_path):
    script = write_script(tmp_path, PID_SCRIPT)
    tmpdir = tmp_path / "tmp"  # a killed caller's run directory stays there, not in /tmp, until a next launch
    tmpdir.mkdir()
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=script_env(TMPDIR=str(tmpdir)),
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(tmp_path.glob("pid-*"))) < 2:
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("pid-*"))]
    assert len(pids) == 2, "ranks did not start"
    return parent, pids


def test_ctrl_c_in_caller_stops_all_ranks(tmp_path):
    parent, pids = _start_and_wait_for_ranks(tmp_path)
    parent.send_signal(signal.SIGINT)
    _, stderr = parent.communicate(timeout=20)
    assert parent.returncode != 0
    assert "KeyboardInterrupt" in stderr
    assert wait_dead(pids, timeout=5) == []


def test_killed_caller_leaves_no_rank_behind(tmp_path):
    parent, pids = _start_and_wait_for_ranks(tmp_path)
    parent.kill()
    parent.wait(10)
    assert wait_dead(pids, timeout=10) == []
