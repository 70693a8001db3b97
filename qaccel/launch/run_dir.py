"""The private directory of one launch, where fn, results and errors travel between the caller and its ranks.

Layout: one folder per user, ``$TMPDIR/qaccel-runs-<uid>`` (mode 0700), holds a run directory ``run-*`` per live
launch, removed when the launch ends. qaccel creates the folder with a marker file inside (``QACCEL_RUNS``), in one
rename, so a folder without the marker was not made by qaccel; it is kept, holding only its marker. If that name is
taken by anything else (a symlink, a folder of another user, not private, or without the marker), the next name
``qaccel-runs-<uid>.1``, ``.2``, ... is used, the same on every launch, then ``$XDG_RUNTIME_DIR/qaccel-runs`` (a
folder only this user can write in). Another user can take all those names in a shared TMPDIR, but cannot stop a
launch: it then makes a fresh private folder (mkdtemp) for itself, removed when it ends, and warns.

A caller killed outright (SIGKILL, out of memory) cannot remove its run directory, so each holds a lock its caller
keeps for the launch; before making one, a launch removes the ``run-*`` directories of that folder whose lock is
free. An flock is released by the kernel when its holder dies, so a reused pid never makes a dead caller look
alive. A run directory takes its ``run-*`` name only once its lock is held, so a live launch's is never removed;
while it is made (``.new-*``) it is removed only once older than UNLOCKED_GRACE_S with its lock free.
Nothing outside the marked folder is ever removed, symlinks are never followed, and what another user owns is
never touched: qaccel removes only what it can prove it created and whose caller is dead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
import time
import warnings
from collections.abc import Iterator

LOCK = "caller.lock"
MARKER = "QACCEL_RUNS"
MARKER_TEXT = b"qaccel made this folder for its run directories (run-*) and removes those whose caller died.\n"
RUN, STAGING = "run-", ".new-"
CANDIDATES = 10  # names tried after qaccel-runs-<uid>, when that one is taken by something not ours
UNLOCKED_GRACE_S = 60.0  # a staging directory this young may be one being created right now (lock not yet held)


class RootsTaken(RuntimeError):
    """Every name runs_root() may use is taken by something that qaccel did not make for this user."""


@contextlib.contextmanager
def run_directory() -> Iterator[str]:
    """A fresh private directory held for the caller's lifetime, removed on exit (even after an error)."""
    try:
        root, fresh = runs_root(), False
    except RootsTaken as taken:
        root, fresh = tempfile.mkdtemp(prefix=f"qaccel-runs-{os.getuid()}-"), True
        warnings.warn(
            f"qaccel: {taken}; each launch makes a fresh private folder for itself instead, removed when it ends",
            stacklevel=3,
        )  # the same text each time: Python's filter shows it once
    if not fresh:
        remove_stale(root)
    staging = tempfile.mkdtemp(dir=root, prefix=STAGING)
    path, lock = staging, None
    try:
        # locked before it takes its run-* name: a directory with that name always has a live holder or none
        lock = os.open(os.path.join(staging, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        final = os.path.join(root, RUN + os.path.basename(staging)[len(STAGING) :])  # mkdtemp's suffix: unique
        os.rename(staging, final)
        path = final
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)  # lock still held: no other launch takes it for a dead one's
        if lock is not None:
            os.close(lock)
        if fresh:
            shutil.rmtree(root, ignore_errors=True)


def runs_root(tmp: str | None = None) -> str:
    """This user's marked folder for run directories under ``tmp`` (TMPDIR), or in $XDG_RUNTIME_DIR, created if
    missing; RootsTaken when something else holds every name."""
    tmp = tmp or tempfile.gettempdir()
    base = os.path.join(tmp, f"qaccel-runs-{os.getuid()}")
    candidates = [base] + [f"{base}.{i}" for i in range(1, CANDIDATES + 1)]
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime) and _why_not_ours(runtime, marked=False) is None:
        candidates.append(os.path.join(runtime, "qaccel-runs"))
    refused = []
    for path in candidates:
        why = _why_not_ours(path)
        if why == "missing":
            _create_root(os.path.dirname(path), path)
            why = _why_not_ours(path)  # ours, or taken by another launch (ours too) or by something else
        if why is None:
            return path
        refused.append(f"{path} {why}")
    raise RootsTaken(
        "every folder qaccel may keep its run directories in is taken by something it did not make, "
        "which it leaves alone: " + "; ".join(refused)
    )


def _create_root(tmp: str, path: str) -> None:
    """Create ``path`` with its marker in one rename, so that no launch ever sees it unmarked."""
    staging = tempfile.mkdtemp(dir=tmp, prefix=f".{os.path.basename(path)}.new-")
    try:
        fd = os.open(os.path.join(staging, MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as marker:
            marker.write(MARKER_TEXT)
        if not os.path.lexists(path):  # a rename onto an empty directory would replace it: rename onto nothing
            os.rename(staging, path)
            return
    except OSError:
        pass  # the name was taken meanwhile; the caller checks what holds it
    shutil.rmtree(staging, ignore_errors=True)


def _why_not_ours(path: str, marked: bool = True) -> str | None:
    """None when ``path`` is a folder qaccel made for this user (``marked``: with its marker; else any private
    folder of this user), "missing", or why it is not ours."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"has mode {oct(stat.S_IMODE(st.st_mode))}, not 0o700"
    if not marked:
        return None
    try:
        fd = os.open(os.path.join(path, MARKER), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return f"has no regular file {MARKER}"
    try:
        mst = os.fstat(fd)
        if not stat.S_ISREG(mst.st_mode) or mst.st_uid != os.getuid() or os.read(fd, 4096) != MARKER_TEXT:
            return f"has a {MARKER} that qaccel did not write"
    finally:
        os.close(fd)
    return None


def remove_stale(root: str | None = None) -> list[str]:
    """Remove the run directories in ``root`` (this user's marked folder) whose caller died; return their paths."""
    root = root or runs_root()
    if (why := _why_not_ours(root)) is not None:
        raise RuntimeError(f"{root} {why}: qaccel removes nothing there")
    removed = []
    for entry in os.scandir(root):
        if not entry.name.startswith((RUN, STAGING)):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            if entry.name.startswith(STAGING) and time.time() - st.st_mtime <= UNLOCKED_GRACE_S:
                continue  # maybe being created now: its lock file exists a moment before it is locked
            if _remove_if_dead(entry.path, lockless_is_dead=entry.name.startswith(RUN)):
                removed.append(entry.path)
        except OSError:
            continue  # gone meanwhile (another launch removed it)
    return removed


def _remove_if_dead(path: str, lockless_is_dead: bool) -> bool:
    """Remove ``path`` when no live caller holds its lock (held meanwhile); True when removed.

    A ``run-*`` directory without its lock file is one whose removal began, since it takes that name only once
    locked; a staging one without it is left alone.
    """
    try:
        lock = os.open(os.path.join(path, LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if not lockless_is_dead:
            return False
        lock = None
    try:
        if lock is not None:
            if not stat.S_ISREG(os.fstat(lock).st_mode):
                return False
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        shutil.rmtree(path)  # never follows a symlink inside
        return True
    except BlockingIOError:
        return False  # a live caller holds it
    finally:
        if lock is not None:
            os.close(lock)
