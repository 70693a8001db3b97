"""Test helpers: run scripts (tests/scripts) and launchers in fresh interpreters, check processes through /proc, wait
for what they do (one ``wait_for``), and pick free ports (one ``free_port``)."""

from __future__ import annotations

import fcntl
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "scripts"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, drawn at random below the kernel's ephemeral range: never a fixed port, so
    runs side by side never count on the same one, and no outgoing connection (which takes an ephemeral port) can
    take it in the seconds before a launched rank binds it, as one did to an srun test's MASTER_PORT (EADDRINUSE).
    Another process binding it explicitly still can."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(25000, low)  # above the 15000-24999 of SLURM's port rule (environment/slurm.py)
        if 29400 <= port < 29600:  # torch's default ports (29500, 29400)
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # below the range everything is taken: let the kernel pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux: net.ipv4.ip_local_port_range, 32768 by default)."""
    try:
        return max(25001, int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


class WaitTimedOut(AssertionError):
    """What ``wait_for`` raises when the time is up: a failed check, as pytest reports it."""


def wait_for(condition, timeout: float, what, *, interval: float = 0.05):
    """Call ``condition()`` every ``interval`` s until it returns a true value, and return that value. After
    ``timeout`` s, raise WaitTimedOut saying what was waited for: ``what``, a string, or a callable that gives one
    then (so the message can show the state at the end)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise WaitTimedOut(f"waited {timeout:g} s for {what() if callable(what) else what}")
        time.sleep(interval)


def wait_for_text(path: Path, *needles: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> str:
    """The text of the file ``path`` once it holds every one of ``needles`` (a missing file holds nothing yet).
    Fails after ``timeout`` s, or as soon as ``proc``, the process that writes it, has ended without them."""

    def read() -> str:
        return Path(path).read_text() if Path(path).exists() else ""

    def holds_all() -> str | None:
        ended = proc is not None and proc.poll() is not None  # before the read: what it wrote last is read too
        text = read()
        if all(needle in text for needle in needles):
            return text
        if ended:
            raise AssertionError(f"{needles} never came in {path} (exit {proc.returncode}):\n{text}")
        return None

    return wait_for(holds_all, timeout, lambda: f"{needles} in {path}:\n{read()}")


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name: state, ppid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is neither a zombie nor dead."""
    try:
        return _stat(pid)[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def described(pid: int) -> str:
    """A process's state and parent, as /proc tells them (for a failure's message)."""
    try:
        state, parent = _stat(pid)[:2]
    except (OSError, ValueError):
        return "gone"
    return f"state {state}, parent {parent}"


def ppid(pid: int) -> int:
    """The parent of ``pid``, as /proc tells it."""
    return int(_stat(pid)[1])


def wait_dead(pids, timeout: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` is alive; return those still alive after ``timeout``."""
    pids = list(pids)
    try:
        wait_for(lambda: not any(alive(p) for p in pids), timeout, "the processes to end")
    except WaitTimedOut:
        pass
    return [p for p in pids if alive(p)]


def left_in(tmpdir: Path) -> list[str]:
    """What a run left in ``tmpdir``, except torch's own inductor cache (``torchinductor_<user>``), which
    ``import torch._dynamo`` creates there on some torch versions (2.11) and keeps on purpose."""
    return sorted(p.name for p in Path(tmpdir).iterdir() if not p.name.startswith("torchinductor_"))


def marked_pids(mark: str) -> list[int]:
    """Processes whose environment carries ``mark`` (a caller, its forkserver and its ranks all get its env)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if mark.encode() in (proc / "environ").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def signal_when(
    cmd: list[str],
    sig: int,
    ready: str,
    *,
    env: dict,
    cwd: Path,
    timeout: float = 120,
    then: str | None = None,
    send=None,
    delay: float = 0.0,
):
    """Run ``cmd``, send it ``sig`` ``delay`` s after its stderr shows ``ready``, and wait for it to end; a
    CompletedProcess with text output. Output goes through files in ``cwd``, so nothing blocks on a full pipe. With
    ``then``, the result's ``then_s`` says how many seconds after the signal the text ``then`` came on stderr (None:
    never). ``send(sig)``: how to signal, when not to ``cmd``'s process (a scheduler's command, say)."""
    out_path, err_path = Path(cwd) / "signalled.out", Path(cwd) / "signalled.err"
    deadline = time.monotonic() + timeout
    then_s = None
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd, start_new_session=True)
        try:
            wait_for_text(err_path, ready, timeout=timeout, proc=proc)
            time.sleep(delay)
            (send or proc.send_signal)(sig)
            sent = time.monotonic()
            while proc.poll() is None and time.monotonic() < deadline:
                if then is not None and then_s is None and then in err_path.read_text():
                    then_s = time.monotonic() - sent
                time.sleep(0.02)
            proc.wait(max(1.0, deadline - time.monotonic()))
            if then is not None and then_s is None and then in err_path.read_text():
                then_s = time.monotonic() - sent  # came just before the end: the end bounds it
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    done = subprocess.CompletedProcess(cmd, proc.returncode, out_path.read_text(), err_path.read_text())
    done.then_s = then_s
    return done


def stuck_ranks_and_workers(out: Path, timeout: float = 60) -> tuple[list[int], list[int]]:
    """The pids of the 2 ranks and 4 DataLoader workers of tests/scripts/stuck_workers.py (writing to ``out``), once all are up; every worker must be a child
    of a rank (found by parent pid, as /proc tells it), not of the forkserver."""
    ranks = [int(p.name.split("-")[1]) for p in _files(out, "rank-*", 2, timeout)]
    workers = [int(p.name.split("-")[1]) for p in _files(out, "worker-*", 4, timeout)]
    assert {ppid(w) for w in workers if alive(w)} <= set(ranks), "workers must be children of their rank"
    return ranks, workers


def _files(directory: Path, pattern: str, count: int, timeout: float) -> list[Path]:
    """The files matching ``pattern`` in ``directory`` once there are ``count`` of them."""

    def found() -> list[Path] | None:
        files = list(Path(directory).glob(pattern))
        return files if len(files) >= count else None

    return wait_for(
        found, timeout, lambda: f"{count} {pattern} in {directory}: {sorted(p.name for p in Path(directory).iterdir())}"
    )


def run_mpirun(*args: str, **extra: str) -> subprocess.CompletedProcess:
    """``mpirun -np 2 args`` to completion (root may run it: containers, CI; two slots on any machine), in
    script_env() without the rank variables an outer launcher may have left."""
    env = script_env(**extra)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", *args]
    return subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=150)


def script_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def script_file(name: str) -> Path:
    """The test script tests/scripts/``name``: scripts are files there, which linters check and tests run by path."""
    path = SCRIPTS / name
    if not path.is_file():
        raise FileNotFoundError(f"no test script {path}")
    return path


def run_script(path: Path, *args: str, cwd, timeout: float = 120, env: dict | None = None):
    """Run ``python path args`` in ``cwd`` to completion; the CompletedProcess has text stdout/stderr."""
    return subprocess.run(
        [sys.executable, str(path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or script_env(),
        cwd=cwd,
        check=False,
    )


def torchrun_cmd(log_dir: Path, *torchrun_args: str) -> list[str]:
    """``torchrun --log-dir log_dir torchrun_args``: without --log-dir torchrun makes a ``torchelastic_*`` directory
    in the system temp dir for every run and leaves it there."""
    return [sys.executable, "-m", "torch.distributed.run", "--log-dir", str(log_dir), *torchrun_args]


def run_torchrun(
    script: Path,
    *args: str,
    cwd,
    nprocs: int = 2,
    torchrun_args: tuple = (),
    timeout: float = 150,
    env: dict | None = None,
):
    """Run ``torchrun --standalone --nproc_per_node nprocs script args`` to completion, its log dir removed after.

    On timeout torchrun gets SIGTERM, which it passes on to its workers (each in a session of its own, out of
    reach of a kill of torchrun alone), then the TimeoutExpired is raised.
    """
    with tempfile.TemporaryDirectory(prefix="torchrun-logs-", ignore_cleanup_errors=True) as log_dir:
        cmd = [
            *torchrun_cmd(Path(log_dir), "--standalone", "--nproc_per_node", str(nprocs), *torchrun_args),
            str(script),
            *args,
        ]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or script_env(), cwd=cwd
        )
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


def report_results(stdout):
    """The JSON objects of the ``RESULT`` lines of tests/scripts/report_ranks.py, in order."""
    return [
        json.loads(line.split(" ", 1)[1].rsplit(" initialized_after", 1)[0])
        for line in stdout.splitlines()
        if line.startswith("RESULT")
    ]


def free_job_id() -> str:
    """A job id whose derived port (15000 + last 4 digits) is free right now; tests only."""
    for job in range(48000 + os.getpid() % 1000, 60000, 7):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 15000 + job % 10000))
                return str(job)
            except OSError:
                continue
    raise RuntimeError("no free port in the SLURM range")


def slurm_env(cluster) -> dict:
    """The environment for commands run on the local SLURM (tests/support/slurm_cluster.py): its fake nodes n1/n2 do not
    resolve here, so qaccel rendezvouses on loopback, on a port free now (user-set MASTER_* win)."""
    env = cluster.env
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONPATH=str(REPO))
    return env


def srun_env(rank: int, job_id: str, **extra: str) -> dict:
    """The environment srun gives task ``rank`` of a 2-task step on one node (without a real SLURM)."""
    env = script_env(
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank),
        SLURM_NODEID="0",
        SLURM_NTASKS="2",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_ID="0",
        SLURM_STEP_NUM_NODES="1",
        SLURM_NNODES="1",
        SLURM_STEP_TASKS_PER_NODE="2",
        SLURM_TASKS_PER_NODE="2",
        SLURM_NODELIST="localhost",
        SLURM_STEP_NODELIST="localhost",
        SLURM_JOB_ID=job_id,
        SLURM_JOB_NAME="train",
    )
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    env.update(extra)
    return env


def once_per_session(tmp_path_factory, name: str, compute):
    """``compute()``, a JSON-able result, computed once per test session, not once per pytest-xdist worker.

    A module- or session-scoped fixture runs in every worker that runs one of its tests; for a fixture that runs
    real launches, that is the launches again. The first worker to need the result computes it while holding a
    lock in the session's shared temporary directory; a worker that needs it later reads it from there. Without
    xdist this is just ``compute()``. If ``compute()`` fails, nothing is stored and the next worker tries anew.
    """
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return compute()
    shared = tmp_path_factory.getbasetemp().parent  # the session's base: each worker's basetemp is a child of it
    path = shared / f"once-{name}.json"
    with open(shared / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, and if this worker dies
        if path.exists():
            return json.loads(path.read_text())
        result = compute()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)
        return json.loads(path.read_text())  # what the other workers get, so every worker sees the same


def run_in_kernel(cells: list[str], cwd: Path, timeout: float = 100) -> str:
    """Run ``cells`` one after another in a real Jupyter kernel (python3) started in ``cwd`` with the scripts'
    environment; the text they printed. A cell that fails fails the test with the kernel's reply."""
    import textwrap

    from support import component

    jupyter_client = component.module("jupyter_client")
    manager = jupyter_client.KernelManager(kernel_name="python3")
    manager.start_kernel(env=script_env(), cwd=str(cwd))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        shown: list = []
        for cell in cells:
            reply = client.execute_interactive(textwrap.dedent(cell), timeout=timeout, output_hook=shown.append)
            assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return "".join(m["content"].get("text", "") for m in shown if m["msg_type"] == "stream")
