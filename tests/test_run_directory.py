"""The private run directory a launch makes under TMPDIR: 0700, removed afterwards, short enough for the
forkserver's socket under a long TMPDIR. A caller killed outright leaves its directory behind; the next launch
removes it, and only it: a live launch's directory is never touched."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import left_in, run_script, script_env, write_script
from qaccel import run_dir

pytestmark = pytest.mark.timeout(180)


def test_private_run_directory_is_0700_and_removed_under_a_long_tmpdir(tmp_path):
    """The run directory is 0700 and removed after a launch, a failed one too. TMPDIR is long on purpose (one
    launch serves both checks): multiprocessing puts the forkserver's Unix socket under TMPDIR, and past 107 bytes
    it cannot bind (CI failure when pytest's tmp path grew by one digit)."""
    tmpdir = tmp_path / ("a-long-per-job-temporary-directory-" * 3)
    tmpdir.mkdir()
    script = write_script(tmp_path, """
        import os, stat, sys, tempfile
        from pathlib import Path
        from qaccel import Accelerator

        def look(fail):
            dirs = list(Path(tempfile.gettempdir()).glob("qaccel-*"))
            modes = [oct(stat.S_IMODE(d.stat().st_mode)) for d in dirs]
            if fail:
                raise RuntimeError(f"failing on purpose {modes}")
            return modes

        if __name__ == "__main__":
            acc = Accelerator(nprocs=2, compute_setup="cpu")
            print(acc.distribute(look)(False), flush=True)
            try:
                acc.distribute(look)(True)
            except RuntimeError as exc:
                print("raised", exc, flush=True)
            print("left", sorted(p.name for p in Path(tempfile.gettempdir()).glob("qaccel-*")), flush=True)
    """)
    proc = run_script(script, env=script_env(TMPDIR=str(tmpdir)))
    assert len(str(tmpdir)) > 107
    assert proc.returncode == 0, proc.stderr
    # torch 2.8-2.10 print "[Gloo] Rank N is connected to M peer ranks. ..." to stdout from every rank at each
    # process-group init, and the ranks' pieces can interleave mid-line: keep only the lines this script prints.
    out = [line for line in proc.stdout.splitlines() if line.startswith(("['", "raised ", "left "))]
    assert out[0] == "['0o700']"
    assert out[1] == "raised failing on purpose ['0o700']"
    assert out[2] == "left []"
    assert left_in(tmpdir) == [], "nothing is left in TMPDIR"


STALE_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
from qaccel import Accelerator

def work(mode, caller, gate):
    if mode == "killed" and int(os.environ["RANK"]) == 0:
        os.kill(caller, signal.SIGKILL)  # the caller dies without any chance to clean up
    while mode != "quick" and not Path(gate).exists():
        time.sleep(0.05)
    return mode

if __name__ == "__main__":
    mode, gate = sys.argv[1], sys.argv[2]
    print(Accelerator(nprocs=2, compute_setup="cpu", timeout=60).distribute(work)(mode, os.getpid(), gate), flush=True)
"""


def _run_dirs(tmp):
    return sorted(p.name for p in tmp.glob("qaccel-*"))


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_next_launch_removes_a_killed_callers_directory_and_keeps_a_live_ones(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = write_script(tmp_path, STALE_SCRIPT)
    env = script_env(TMPDIR=str(tmp))
    gate = tmp_path / "gate"
    live = subprocess.Popen([sys.executable, str(script), "live", str(gate)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(_run_dirs(tmp)) == 1)
        [live_dir] = _run_dirs(tmp)
        killed = run_script(script, "killed", str(tmp_path / "never"), env=env, timeout=120)
        assert killed.returncode == -9
        [dead_dir] = [d for d in _run_dirs(tmp) if d != live_dir]  # left behind

        quick = run_script(script, "quick", str(gate), env=env, timeout=120)
        assert quick.returncode == 0 and quick.stdout.strip() == "quick", quick.stderr
        assert _run_dirs(tmp) == [live_dir], "the dead caller's directory is gone, the live one's kept"
        assert dead_dir not in _run_dirs(tmp)
        gate.touch()
        out, _ = live.communicate(timeout=120)
        assert live.returncode == 0 and out.strip() == "live"
    finally:
        gate.touch()
        live.kill()
        live.wait()
    assert _run_dirs(tmp) == []


def test_a_lockless_directory_is_left_alone_while_it_may_be_in_creation(tmp_path):
    young = tmp_path / "qaccel-young"
    old = tmp_path / "qaccel-old"
    other = tmp_path / "not-qaccel"
    for d in (young, old, other):
        d.mkdir()
    past = time.time() - run_dir.UNLOCKED_GRACE_S - 5
    os.utime(old, (past, past))
    os.utime(other, (past, past))
    assert run_dir.remove_stale(str(tmp_path)) == [str(old)]
    assert young.is_dir() and other.is_dir() and not old.exists()


def test_a_held_directory_is_kept_and_removed_with_its_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    with run_dir.run_directory() as path:
        assert Path(path).parent == tmp_path and oct(os.stat(path).st_mode & 0o777) == "0o700"
        assert run_dir.remove_stale(str(tmp_path)) == []
        assert Path(path, run_dir.LOCK).exists()
    assert not Path(path).exists()
