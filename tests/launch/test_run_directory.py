"""The private run directory a launch makes in its user's marked folder $TMPDIR/qaccel-runs-<uid>: 0700, removed
afterwards, short enough for the forkserver's socket under a long TMPDIR. A caller killed outright leaves its
directory behind; the next launch removes it, and only it: a live launch's directory, one being created, and
anything qaccel did not make (a user's own qaccel-* folders, symlinks, impostors of the folder) are never touched."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.procs import left_in, run_script, script_env, script_file, wait_for

from qaccel.launch import run_dir

pytestmark = pytest.mark.timeout(180)

ROOT = f"qaccel-runs-{os.getuid()}"
HOUR_AGO = time.time() - 3600


def _age(*paths: Path) -> None:
    for path in paths:
        os.utime(path, (HOUR_AGO, HOUR_AGO), follow_symlinks=False)


def _users_folders(tmpdir: Path, outside: Path) -> dict[str, str]:
    """Folders of a user in TMPDIR whose names start with qaccel-, which qaccel did not make; {path: content}."""
    (tmpdir / "qaccel-experiments").mkdir()
    (tmpdir / "qaccel-experiments" / "results.csv").write_text("epoch,loss\n1,0.5\n")
    (tmpdir / "qaccel-empty").mkdir()
    (tmpdir / "qaccel-new").mkdir()
    (tmpdir / "qaccel-abc123").mkdir()  # looks like a run directory (a free lock file, old), outside qaccel's folder
    (tmpdir / "qaccel-abc123" / "caller.lock").write_text("")
    (tmpdir / "qaccel-venv" / "bin").mkdir(parents=True)
    (tmpdir / "qaccel-venv" / "bin" / "python").write_text("#!/bin/sh\n")
    outside.mkdir()
    (outside / "keep.txt").write_text("outside TMPDIR")
    (tmpdir / "qaccel-link").symlink_to(outside)
    _age(
        tmpdir / "qaccel-experiments" / "results.csv",
        tmpdir / "qaccel-abc123" / "caller.lock",
        tmpdir / "qaccel-experiments",
        tmpdir / "qaccel-empty",
        tmpdir / "qaccel-abc123",
        tmpdir / "qaccel-link",
    )
    return _snapshot(tmpdir, outside)


def _snapshot(*dirs: Path) -> dict[str, str]:
    """Every path under ``dirs`` (symlinks not followed) with a file's content, a link's target, or "dir"."""
    found = {}
    for top in dirs:
        for base, subdirs, files in os.walk(top):
            for name in subdirs + files:
                path = Path(base, name)
                if name.startswith("torchinductor_"):
                    continue  # torch's own cache, which some versions (2.11) make on import (see support.procs.left_in)
                found[str(path)] = (
                    os.readlink(path) if path.is_symlink() else "dir" if path.is_dir() else path.read_text()
                )
    return found


def test_private_run_directory_is_0700_and_removed_under_a_long_tmpdir_and_others_are_kept(tmp_path):
    """The run directory and its folder are 0700, the run directory is removed after a launch, a failed one too,
    and the user's own qaccel-* folders, old or new, a symlink and what it points to, all survive. TMPDIR is long
    on purpose (the same launches serve): multiprocessing puts the forkserver's Unix socket under TMPDIR, and past
    107 bytes it cannot bind, and pytest's own tmp paths are not far below that."""
    tmpdir = tmp_path / ("a-long-per-job-temporary-directory-" * 3)
    tmpdir.mkdir()
    before = _users_folders(tmpdir, tmp_path / "outside")
    script = script_file("run_dir_modes.py")
    proc = run_script(script, env=script_env(TMPDIR=str(tmpdir)), cwd=tmp_path)
    assert len(str(tmpdir)) > 107
    assert proc.returncode == 0, proc.stderr
    # torch 2.8-2.10 print "[Gloo] Rank N is connected to M peer ranks. ..." to stdout from every rank at each
    # process-group init, and the ranks' pieces can interleave mid-line: keep only the lines this script prints.
    out = [line for line in proc.stdout.splitlines() if line.startswith(("['", "raised ", "left "))]
    assert out[0] == "['0o700', '0o700']"
    assert out[1] == "raised failing on purpose ['0o700', '0o700']"
    assert out[2] == f"left ['{run_dir.MARKER}']"
    added = {str(tmpdir / ROOT): "dir", str(tmpdir / ROOT / run_dir.MARKER): run_dir.MARKER_TEXT.decode()}
    assert _snapshot(tmpdir, tmp_path / "outside") == {**before, **added}, "only the folder added, nothing touched"
    assert left_in(tmpdir) == sorted(
        [ROOT, "qaccel-abc123", "qaccel-empty", "qaccel-experiments", "qaccel-link", "qaccel-new", "qaccel-venv"]
    )
    assert os.listdir(tmpdir / ROOT) == [run_dir.MARKER], "the folder is left empty"
    assert (tmpdir / ROOT / run_dir.MARKER).read_bytes() == run_dir.MARKER_TEXT


def _run_dirs(tmp):
    return sorted(p.name for p in (tmp / ROOT).glob("*") if p.name != run_dir.MARKER)


def test_next_launch_removes_a_killed_callers_directory_and_keeps_a_live_ones(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = script_file("gated_ranks.py")
    env = script_env(TMPDIR=str(tmp))
    gate = tmp_path / "gate"
    live = subprocess.Popen(
        [sys.executable, str(script), "live", str(gate)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        # a run directory is made under a temporary name (.new-*) and renamed into place: wait for the rename
        wait_for(
            lambda: [d[:4] for d in _run_dirs(tmp)] == ["run-"],
            60,
            lambda: f"the live launch's run directory: {_run_dirs(tmp)}",
        )
        [live_dir] = _run_dirs(tmp)
        killed = run_script(script, "killed", str(tmp_path / "never"), env=env, cwd=tmp_path, timeout=120)
        assert killed.returncode == -9
        [_dead_dir] = [d for d in _run_dirs(tmp) if d != live_dir]  # left behind

        quick = run_script(script, "quick", str(gate), env=env, cwd=tmp_path, timeout=120)
        assert quick.returncode == 0 and quick.stdout.strip() == "quick", quick.stderr
        assert _run_dirs(tmp) == [live_dir], "the dead caller's directory is gone, the live one's kept"
        gate.touch()
        out, _ = live.communicate(timeout=120)
        assert live.returncode == 0 and out.strip() == "live"
    finally:
        gate.touch()
        live.kill()
        live.wait()
    assert _run_dirs(tmp) == []


def _lock_file(directory: Path) -> Path:
    directory.mkdir()
    (directory / run_dir.LOCK).write_text("")
    return directory


def test_only_dead_callers_run_directories_are_removed_never_through_a_symlink(tmp_path):
    """In the folder: a staging directory (.new-*) may be one being created (its lock file exists a moment before
    it is locked), so only an old one with a free lock goes; a lockless one stays. A run-* directory goes once its
    lock is free (or gone: its removal began), never while held. Nothing else, and never through a symlink."""
    root = Path(run_dir.runs_root(str(tmp_path)))
    assert root == tmp_path / ROOT
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("outside")
    young = _lock_file(root / ".new-young")
    old = _lock_file(root / ".new-old")
    lockless = root / ".new-lockless"
    lockless.mkdir()
    dead = _lock_file(root / "run-dead")
    (dead / "payload").write_text("x")
    live = _lock_file(root / "run-live")
    removing = root / "run-removing"
    removing.mkdir()
    other = root / "other"
    other.mkdir()
    (root / "run-evil").symlink_to(outside)
    (root / "run-file").write_text("")
    linked_lock = root / "run-linked-lock"
    linked_lock.mkdir()
    (outside / "lock").write_text("")
    (linked_lock / run_dir.LOCK).symlink_to(outside / "lock")
    _age(old, lockless, dead, live, removing, other, linked_lock)

    holder = os.open(live / run_dir.LOCK, os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert sorted(run_dir.remove_stale(str(root))) == sorted(map(str, [old, dead, removing]))
    finally:
        os.close(holder)
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [run_dir.MARKER, young.name, lockless.name, live.name, other.name, "run-evil", "run-file", linked_lock.name]
    )
    assert (outside / "keep.txt").read_text() == "outside" and (outside / "lock").exists()
    assert run_dir.remove_stale(str(root)) == [str(live)], "free once its holder let go"


def test_a_held_directory_is_kept_and_removed_with_its_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    with run_dir.run_directory() as path:
        assert Path(path).parent == tmp_path / ROOT and Path(path).name.startswith("run-")
        assert oct(os.stat(path).st_mode & 0o777) == "0o700"
        assert run_dir.remove_stale() == []
        assert Path(path, run_dir.LOCK).is_file()
    assert not Path(path).exists()
    assert oct(os.stat(tmp_path / ROOT).st_mode & 0o777) == "0o700"
    assert os.listdir(tmp_path / ROOT) == [run_dir.MARKER] and os.listdir(tmp_path) == [ROOT]


def test_a_folder_not_made_by_qaccel_is_passed_over_and_never_touched(tmp_path, monkeypatch):
    """Each name taken by something that is not this user's marked 0700 folder is left alone and the next is used,
    the same one on every launch; with none usable, the launch makes a fresh private folder for itself and removes
    it afterwards, warning with every name and why it was passed over."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr("tempfile.tempdir", None)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("outside")
    (tmp / ROOT).symlink_to(outside)  # a symlink to a folder qaccel could otherwise write into
    impostors = [tmp / f"{ROOT}.{i}" for i in range(1, 6)]
    impostors[0].mkdir(mode=0o700)  # no marker
    (impostors[0] / "run-x").mkdir()
    impostors[1].mkdir(mode=0o700)
    (impostors[1] / run_dir.MARKER).mkdir()  # marker not a file
    impostors[2].mkdir(mode=0o700)
    (impostors[2] / run_dir.MARKER).write_text("something else")  # another marker
    impostors[3].mkdir()
    (impostors[3] / run_dir.MARKER).write_bytes(run_dir.MARKER_TEXT)
    impostors[3].chmod(0o755)  # not private
    impostors[4].write_text("a file")
    if os.getuid() == 0:  # only root can give a folder to another user
        other = tmp / f"{ROOT}.6"
        other.mkdir(mode=0o700)
        (other / run_dir.MARKER).write_bytes(run_dir.MARKER_TEXT)
        os.chown(other / run_dir.MARKER, 65534, 65534)
        os.chown(other, 65534, 65534)
        impostors.append(other)
    _age(*impostors)
    before = _snapshot(tmp, outside)
    usable = tmp / f"{ROOT}.{len(impostors) + 1}"

    for _ in range(2):
        with run_dir.run_directory() as path:
            assert Path(path).parent == usable
    assert _snapshot(tmp, outside) == {
        **before,
        str(usable): "dir",
        str(usable / run_dir.MARKER): run_dir.MARKER_TEXT.decode(),
    }
    assert os.listdir(usable) == [run_dir.MARKER]
    assert sorted(os.listdir(tmp)) == sorted([ROOT, usable.name, *(p.name for p in impostors)]), "no staging left"

    shutil.rmtree(usable)
    for i in range(len(impostors) + 1, run_dir.CANDIDATES + 1):
        Path(tmp, f"{ROOT}.{i}").symlink_to(outside)
    taken = rf"(?s){ROOT} is a symlink.*{ROOT}\.1 has no regular file QACCEL_RUNS"
    with pytest.raises(run_dir.RootsTaken, match=taken):
        run_dir.runs_root()
    before = _snapshot(tmp, outside)
    # the warning comes as the folder is made; the folder is checked while it is there
    with pytest.warns(UserWarning, match=rf"(?s){ROOT} is a symlink.*fresh private folder"):  # noqa: PT031, SIM117
        with run_dir.run_directory() as path:
            fresh = Path(path).parent
            assert fresh.parent == tmp and fresh.name.startswith(f"{ROOT}-")
            assert oct(fresh.stat().st_mode & 0o777) == "0o700"
    assert _snapshot(tmp, outside) == before, "the fresh folder is gone, and nothing else changed"
    assert (outside / "keep.txt").read_text() == "outside" and sorted(os.listdir(outside)) == ["keep.txt"]


def test_a_private_runtime_folder_comes_after_the_names_in_tmpdir(tmp_path, monkeypatch):
    """$XDG_RUNTIME_DIR (private to the user, as logind makes it) holds qaccel-runs when TMPDIR's names are taken;
    one that is not private is not used."""
    tmp, runtime = tmp_path / "tmp", tmp_path / "runtime"
    tmp.mkdir()
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    for i in range(run_dir.CANDIDATES + 1):
        (tmp / (ROOT if i == 0 else f"{ROOT}.{i}")).write_text("taken")
    assert run_dir.runs_root(str(tmp)) == str(runtime / "qaccel-runs")
    assert os.listdir(runtime / "qaccel-runs") == [run_dir.MARKER]
    shutil.rmtree(runtime / "qaccel-runs")
    runtime.chmod(0o755)
    with pytest.raises(run_dir.RootsTaken):
        run_dir.runs_root(str(tmp))


def test_directories_of_live_launches_survive_concurrent_removals(tmp_path):
    """Processes make and drop run directories in a loop while another removes stale ones as fast as it can:
    none ever finds its directory, or the lock in it, gone."""
    script = script_file("run_dir_churn.py")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    deadline = str(time.time() + 2.5)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), mode, deadline, run_dir.__file__],
            env=script_env(TMPDIR=str(tmp)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mode in ("make", "make", "make", "remove")
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err
    assert all(int(out.split()[0]) > 10 for out, _ in outs[:3]), outs
    assert left_in(tmp) == [ROOT] and os.listdir(tmp / ROOT) == [run_dir.MARKER]
