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


def left_in(tmpdir: Path) -> list[str]:
    """What a run left in ``tmpdir``, except torch's own inductor cache (``torchinductor_<user>``), which
    ``import torch._dynamo`` creates there on some torch versions (2.11) and keeps on purpose."""
    return sorted(p.name for p in Path(tmpdir).iterdir() if not p.name.startswith("torchinductor_"))


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


def run_torchrun(script: Path, *args: str, nprocs: int = 2, torchrun_args: tuple = (), timeout: float = 150,
                 env: dict | None = None, cwd=None):
    """Run ``torchrun --standalone --nproc_per_node nprocs script args`` to completion.

    On timeout torchrun gets SIGTERM, which it passes on to its workers (each in a session of its own, out of
    reach of a kill of torchrun alone), then the TimeoutExpired is raised.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs),
           *torchrun_args, str(script), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or script_env(),
                            cwd=cwd or Path(script).parent)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        finally:
            proc.kill()
            proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def result_lines(stdout: str) -> list:
    """The JSON objects of every ``RESULT {...}`` line, in order."""
    import json

    return [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("RESULT ")]
