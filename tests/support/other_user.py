"""A second unix account on this machine, for the tests that try a run as another local user would (marker
``other_user``): made by the tests as root with useradd, with no home and no login shell, and never given a
privilege.

Its processes (tests/scripts/other_user.py) start as root and drop to it (supplementary groups, gid, uid) before
they touch the run: the interpreter lives where the account may not reach (under /root here), so it could not be
started as that user. What they read and write afterwards they do as that account, with no privilege left.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Callable

from .procs import script_env, script_file

NAME = "qaccel-other"
NEEDS_ROOT = "a second unix account (useradd) needs root; -m 'not other_user' leaves these tests out"
ATTACKER = script_file("other_user.py")


def missing(announce: Callable[[str], None]) -> str | None:
    """None when the second account exists (as root, after making it), else why the other_user tests cannot run."""
    if os.geteuid() != 0:
        return NEEDS_ROOT
    try:
        pwd.getpwnam(NAME)
        return None
    except KeyError:
        pass
    useradd = shutil.which("useradd")
    if useradd is None:
        return "no useradd to make a second unix account with"
    announce(f"making a second unix account {NAME!r} (useradd) for the tests that try a run as another user")
    made = subprocess.run(
        [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", NAME],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if made.returncode not in (0, 9):  # 9: made meanwhile by another pytest-xdist worker
        return f"useradd {NAME} failed (rc={made.returncode}): {made.stderr.strip()}"
    return None


def ids() -> tuple[int, int]:
    entry = pwd.getpwnam(NAME)
    return entry.pw_uid, entry.pw_gid


def command(*args: str) -> list[str]:
    uid, gid = ids()
    return [sys.executable, str(ATTACKER), str(uid), str(gid), *args]


def run(*args: str, timeout: float = 60) -> dict:
    """Run tests/scripts/other_user.py as the second account; what it printed, as JSON."""
    env = {k: v for k, v in script_env().items() if not k.startswith(("QACCEL", "MASTER_", "TORCHELASTIC"))}
    done = subprocess.run(
        command(*args), capture_output=True, text=True, timeout=timeout, env=env, cwd="/", check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
