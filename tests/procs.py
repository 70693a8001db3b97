"""Test helpers: run scripts in fresh interpreters and check processes through /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_dead(pids, timeout: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` is alive; return those still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def script_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def write_script(directory: Path, code: str, name: str = "script.py") -> Path:
    path = Path(directory) / name
    path.write_text(textwrap.dedent(code))
    return path


def run_script(path: Path, *args: str, timeout: float = 120, env: dict | None = None, cwd=None):
    """Run ``python path args`` to completion; the CompletedProcess has text stdout/stderr."""
    return subprocess.run(
        [sys.executable, str(path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or script_env(),
        cwd=cwd or Path(path).parent,
    )
