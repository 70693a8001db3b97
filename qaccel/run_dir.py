"""The private directory of one launch, where fn, results and errors travel between the caller and its ranks.

It is created mode 0700 under TMPDIR and removed when the launch ends. A caller killed outright (SIGKILL, out of
memory) cannot remove it, so each directory holds a lock its caller keeps for the launch; the next launch on the
machine removes directories whose lock is free, whoever's caller they were (of the same user). An flock is
released by the kernel when its holder dies, so a reused pid never makes a dead caller look alive.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

PREFIX = "qaccel-"
LOCK = "caller.lock"
UNLOCKED_GRACE_S = 60.0  # a directory without a lock file this young may be one being created right now


@contextlib.contextmanager
def run_directory() -> Iterator[str]:
    """A fresh private directory held for the caller's lifetime, removed on exit (even after an error)."""
    remove_stale()
    path = tempfile.mkdtemp(prefix=PREFIX)
    # locked before it takes its name: another launch must never find the lock file free while this one lives
    lock = os.open(os.path.join(path, LOCK + ".new"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.rename(os.path.join(path, LOCK + ".new"), os.path.join(path, LOCK))
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(lock)


def remove_stale(parent: str | None = None) -> list[str]:
    """Remove the run directories whose caller died without removing them; return their paths."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        candidates = [e for e in os.scandir(parent) if e.name.startswith(PREFIX) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return removed
    for entry in candidates:
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid() or not _abandoned(entry.path):
                continue
        except OSError:
            continue  # gone meanwhile, or not ours to read
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _abandoned(path: str) -> bool:
    """True when no live caller holds the directory's lock (or, lockless, when it is too old to be in creation)."""
    try:
        lock = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return time.time() - os.stat(path).st_mtime > UNLOCKED_GRACE_S
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(lock)
    return True


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary name then rename, so a reader never sees a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
