"""How the forkserver of a plain launch starts: forked from the caller when that is provably safe (one thread,
after OpenBLAS parked its pool and OpenMP ended its own; no CUDA), else a fresh interpreter; that ranks of a forked server start as
those of a fresh one (no caller's signal handler, no output written twice, parallel ops working); and that a first
launch is served by a quick server while the server's imports are paused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import component
from support.procs import described, run_in_kernel, script_env, script_file, wait_dead, wait_for

pytestmark = pytest.mark.timeout(120)


def _facts(mode: str) -> tuple[dict, str]:
    env = script_env()
    env.pop("PYTHONUNBUFFERED", None)  # stdout into a pipe is then block-buffered, as for most users' logs
    proc = subprocess.run(
        [sys.executable, str(script_file("server_start.py")), mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("FACTS "))
    return json.loads(line[len("FACTS ") :]), proc.stdout


def _fresh_interpreter(command: list[str]) -> bool:
    return any("from qaccel.launch.server import _serve" in part for part in command)


def test_a_script_with_the_accelerator_at_its_top_forks_the_server_from_itself():
    facts, stdout = _facts("plain")
    cores = len(os.sched_getaffinity(0))
    assert facts["caller_threads"] > 1 or cores == 1, "numpy's OpenBLAS pool was up: parked before the fork"
    assert not _fresh_interpreter(facts["command"]) and facts["command"][1].endswith("server_start.py")
    assert facts["server_threads"] == 1, "the server stays single-threaded, so its own forks are safe"
    assert stdout.count("written before") == 1, "the caller's unwritten output is not written again by a fork"
    first, second = facts["ranks"][:2], facts["ranks"][2:]
    quick = cores >= 2  # else the ranks would queue for the core: the launch waits
    assert ({rank["parent"] for rank in first} != {facts["server"]}) == quick, "a quick server took the first launch"
    for rank in facts["ranks"]:
        assert rank["sigterm_default"], "the caller's Python handler stays in the caller"
        assert rank["product"] == 512.0
        assert rank["gc_enabled"] and rank["frozen"] > 100_000, rank
    assert all(rank["parent"] == facts["server"] for rank in second)
    _preloaded({"ranks": second})


def _preloaded(facts):
    """The server imported torch._dynamo for the ranks with its garbage collector off, then froze what existed
    (hundreds of thousands of objects no collection scans again); ranks collect garbage as usual."""
    for rank in facts["ranks"]:
        assert rank["dynamo"] and rank["gc_enabled"] and rank["frozen"] > 100_000, rank


def test_a_caller_whose_openmp_pool_ran_has_it_stopped_and_forks_the_server():
    """The seed's order: data built with parallel torch ops, then the Accelerator. The pool's threads are ended
    (and counted gone) before the fork; ranks run parallel ops on more threads than the machine has cores."""
    facts, _stdout = _facts("openmp")
    assert facts["caller_threads"] > 2 or len(os.sched_getaffinity(0)) == 1, "OpenMP's and OpenBLAS's pools ran"
    assert not _fresh_interpreter(facts["command"]) and facts["command"][1].endswith("server_start.py")
    assert facts["server_threads"] == 1
    for rank in facts["ranks"]:
        assert rank["threads"] == 4 and rank["product"] == 512.0 and rank["total"] == 2.0 * (1 << 20), rank
    assert facts["caller_after"] == 2.0 * (1 << 20), "the caller's parallel ops run after its pool was stopped"


@pytest.mark.parametrize("after", ["paused", "as_is"])
def test_a_child_forked_after_an_openmp_pool_ran_hangs_unless_the_pool_was_stopped(after):
    """Why the pool is stopped: without it, the child waits for ever in its first parallel region."""
    if len(os.sched_getaffinity(0)) < 2:
        component.unavailable("torch starts no OpenMP pool on one core: there is no pool to leave behind")
    proc = subprocess.run(
        [sys.executable, str(script_file("fork_after_openmp.py")), after],
        capture_output=True,
        text=True,
        env=script_env(),
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("finished" if after == "paused" else "hung"), proc.stdout


@pytest.mark.parametrize("mode", ["threaded", "pthreadpool"])
def test_a_caller_running_other_threads_gets_a_fresh_interpreter_server(mode):
    facts, stdout = _facts(mode)
    assert _fresh_interpreter(facts["command"]), facts["command"]
    assert stdout.count("written before") == 1
    assert all(rank["parent"] == facts["server"] and rank["product"] == 512.0 for rank in facts["ranks"])
    _preloaded(facts)
    if mode == "pthreadpool":
        assert facts["caller_threads_at_launch"] > 1, "torch's pthreadpool stayed: nothing ends it"


def _two_cores() -> None:
    """The quick server serves a first launch only with a core per rank (the scripts start two)."""
    if len(os.sched_getaffinity(0)) < 2:
        component.unavailable("a quick server needs a core per rank, and this machine gives the tests one")


def _quick(mode: str, tmp_path) -> dict:
    out = tmp_path / "facts.json"
    proc = subprocess.run(
        [sys.executable, str(script_file("quick_server.py")), mode, str(out)],
        capture_output=True,
        text=True,
        env=script_env(),
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_the_first_launch_is_served_at_once_while_the_server_imports_dynamo(tmp_path):
    """The first launch does not wait for the server's torch._dynamo: a quick server forked at the call serves
    it while the server is paused; its ranks import dynamo themselves (DDP trains) and the second launch comes
    from the server, resumed, with dynamo preloaded."""
    _two_cores()
    facts = _quick("facts", tmp_path)
    first, second = facts["runs"]
    quick = first[0]["parent"]
    assert quick != facts["server"] and all(rank["parent"] == quick for rank in first)
    assert all(not rank["dynamo_at_start"] and rank["server_state"] == "T" for rank in first), first
    assert all(rank["dynamo_at_start"] and rank["parent"] == facts["server"] for rank in second), second
    assert all(rank["server_state"] in "RS" for rank in second), "resumed after the first launch"
    assert first[0]["loss"] == first[1]["loss"] and second[0]["loss"] == second[1]["loss"]
    assert facts["first_server_reaped"], "the quick server ends with its launch and is reaped: no zombie is left"


def test_with_fewer_cores_than_ranks_the_first_launch_waits_for_the_server(tmp_path):
    """Ranks importing dynamo side by side would queue for the cores: the server's one import is faster."""
    facts = _quick("one_core", tmp_path)
    for run in facts["runs"]:
        assert all(rank["dynamo_at_start"] and rank["parent"] == facts["server"] for rank in run), run


def test_a_first_launch_that_fails_leaves_the_server_resumed(tmp_path):
    facts = _quick("raise", tmp_path)
    assert facts["runs"][0] == "the first launch fails"
    assert all(
        rank["dynamo_at_start"] and rank["parent"] == facts["server"] and rank["server_state"] in "RS"
        for rank in facts["runs"][1]
    ), facts["runs"][1]


@pytest.mark.parametrize("mode", ["hang", "hang_late"])
def test_a_killed_caller_leaves_no_server_behind_not_even_a_paused_one(tmp_path, mode):
    """SIGKILL the caller while its first launch runs: the paused server (which cannot read the EOF that ends a
    server), the quick server and the ranks all end; also when the server ran late, the launch already made."""
    _two_cores()
    out = tmp_path / "facts.json"
    proc = subprocess.Popen(
        [sys.executable, str(script_file("quick_server.py")), mode, str(out)],
        env=script_env(),
        start_new_session=True,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        wait_for(
            lambda: all(Path(f"{out}.{rank}").exists() for rank in (0, 1)), 60, "both ranks to start", interval=0.1
        )
        time.sleep(0.2)  # the files are written whole
        ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
        assert ranks[0]["server_state"] == "T" and ranks[0]["parent"] != ranks[0]["server"], ranks
        roles = {
            ranks[0]["server"]: "paused server",
            ranks[0]["parent"]: "quick server",
            **{rank["pid"]: f"rank {i}" for i, rank in enumerate(ranks)},
        }
        pids = list(roles)
        proc.kill()
        proc.wait(10)
        left = {roles[pid]: described(pid) for pid in wait_dead(pids, timeout=15)}
        assert left == {}, "still running after the caller was killed"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pid in wait_dead(pids, timeout=0):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("caller", ["plain", "threaded"])
def test_ranks_write_to_fd_1_whatever_object_the_caller_made_its_stdout(caller, tmp_path):
    """A forked server does not hand the caller's replaced sys.stdout (a tee to a log file) to its ranks: they
    write to fd 1 with their prefix, as the ranks of a fresh-interpreter server do."""
    log = tmp_path / "log"
    args = [str(log)] + (["threaded"] if caller == "threaded" else [])
    proc = subprocess.run(
        [sys.executable, str(script_file("replaced_streams.py")), *args],
        capture_output=True,
        text=True,
        env=script_env(),
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[rank 0] rank 0 says hello\n" in proc.stdout and "[rank 1] rank 1 says hello\n" in proc.stdout, proc.stdout
    assert log.read_text() == "caller starts\ncaller ends\n", "the caller's lines went through its tee, once each"


def test_a_jupyter_kernel_has_threads_and_gets_a_fresh_interpreter_server(tmp_path):
    cell = """
        import json, multiprocessing.forkserver, os, threading
        from qaccel import Accelerator
        acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)

        def where(acc):
            return acc.rank, os.getppid()

        ranks = acc.distribute(where, all_results=True)(acc)
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        with open(f"/proc/{server}/cmdline") as f:
            command = f.read().split(chr(0))
        print("FACTS " + json.dumps({"ranks": ranks, "server": server, "command": command,
                                     "threads": threading.active_count()}))
        """
    text = run_in_kernel([cell], tmp_path)
    line = next(line for line in text.splitlines() if line.startswith("FACTS "))
    facts = json.loads(line[len("FACTS ") :])
    assert facts["threads"] > 1 and _fresh_interpreter(facts["command"]), facts
    assert facts["ranks"] == [[0, facts["server"]], [1, facts["server"]]]


def test_in_a_jupyter_kernel_the_accelerator_starts_the_server_its_launches_use_and_the_import_nothing(tmp_path):
    """A kernel's server is a fresh interpreter (≈ 1.6 s of imports): started by the cell that makes the
    Accelerator, it imports while later cells run; importing qaccel starts nothing."""
    cells = [
        """
        import json, multiprocessing.forkserver, os, sys
        import qaccel
        at_import = multiprocessing.forkserver._forkserver._forkserver_pid
        acc = qaccel.Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
        made = multiprocessing.forkserver._forkserver._forkserver_pid
        """,
        """
        def parent():
            return os.getppid(), "IPython" in sys.modules

        with open(f"/proc/{made}/cmdline") as f:
            command = f.read().split(chr(0))
        print("FACTS " + json.dumps({"at_import": at_import, "made": made, "command": command,
                                     "parents": acc.distribute(parent, all_results=True)()}))
        """,
    ]
    text = run_in_kernel(cells, tmp_path)
    facts = json.loads(next(line for line in text.splitlines() if line.startswith("FACTS "))[len("FACTS ") :])
    assert facts["at_import"] is None, "importing qaccel starts no process"
    assert facts["made"] is not None and _fresh_interpreter(facts["command"]), facts
    assert facts["parents"] == [[facts["made"], False]] * 2, "the kernel's IPython is not imported in ranks"
    assert "cannot be copied" not in text, "the kernel's own logger stays the kernel's"


def test_importing_qaccel_in_a_script_starts_no_process_and_registers_nothing():
    """Outside a kernel too the server starts with the first Accelerator that launches: a script that never launches
    (nprocs=1, under torchrun, --help) has no process it did not ask for. Fork hooks are registered by the first
    session, not by the import."""
    code = """
import multiprocessing.forkserver, multiprocessing.resource_tracker, os, threading
registered, register = [], os.register_at_fork
os.register_at_fork = lambda **hooks: registered.extend(f.__module__ for f in hooks.values()) or register(**hooks)
import qaccel
try:
    os.waitpid(-1, os.WNOHANG)  # raises when this process has no child at all
    children = "some"
except ChildProcessError:
    children = "none"
ours = lambda: sorted(m for m in registered if (m or "").startswith("qaccel"))  # torch registers its own at import
at_import = ours()
qaccel.Accelerator(compute_setup="cpu").distribute(lambda: None)()
qaccel.Accelerator(compute_setup="cpu").distribute(lambda: None)()
print(multiprocessing.forkserver._forkserver._forkserver_pid, multiprocessing.resource_tracker._resource_tracker._pid,
      children, threading.active_count(), ",".join(at_import) or "-", ",".join(ours()))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=script_env(), timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["None", "None", "none", "1", "-", "qaccel.comm.session,qaccel.comm.session"], (
        proc.stdout
    )
