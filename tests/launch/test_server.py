"""How the forkserver of a plain launch starts: forked from the caller when that is provably safe (one thread,
after OpenBLAS parked its pool; no CUDA), else a fresh interpreter; and that ranks of a forked server start as
those of a fresh one (no caller's signal handler, no output written twice, parallel ops working)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from support.procs import script_env, script_file

pytestmark = pytest.mark.timeout(120)


def _facts(mode: str) -> tuple[dict, str]:
    env = script_env()
    env.pop("PYTHONUNBUFFERED", None)  # stdout into a pipe is then block-buffered, as for most users' logs
    proc = subprocess.run([sys.executable, str(script_file("server_start.py")), mode], capture_output=True,
                          text=True, env=env, timeout=100)
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("FACTS "))
    return json.loads(line[len("FACTS "):]), proc.stdout


def _fresh_interpreter(command: list[str]) -> bool:
    return any("from qaccel.launch.server import _serve" in part for part in command)


def test_a_script_with_the_accelerator_at_its_top_forks_the_server_from_itself():
    facts, stdout = _facts("plain")
    assert facts["caller_threads"] > 1, "numpy's OpenBLAS pool was up: parked before the fork"
    assert not _fresh_interpreter(facts["command"]) and facts["command"][1].endswith("server_start.py")
    assert facts["server_threads"] == 1, "the server stays single-threaded, so its own forks are safe"
    assert stdout.count("written before") == 1, "the caller's unwritten output is not written again by a fork"
    for rank in facts["ranks"]:
        assert rank["parent"] == facts["server"]
        assert rank["sigterm_default"], "the caller's Python handler stays in the caller"
        assert rank["product"] == 512.0
    _preloaded(facts)


def _preloaded(facts):
    """The server imported torch._dynamo for the ranks with its garbage collector off, then froze what existed
    (hundreds of thousands of objects no collection scans again); ranks collect garbage as usual."""
    for rank in facts["ranks"]:
        assert rank["dynamo"] and rank["gc_enabled"] and rank["frozen"] > 100_000, rank


@pytest.mark.parametrize("mode", ["threaded", "openmp"])
def test_a_caller_running_other_threads_gets_a_fresh_interpreter_server(mode):
    facts, stdout = _facts(mode)
    assert _fresh_interpreter(facts["command"]), facts["command"]
    assert stdout.count("written before") == 1
    assert all(rank["parent"] == facts["server"] and rank["product"] == 512.0 for rank in facts["ranks"])
    _preloaded(facts)


@pytest.mark.parametrize("caller", ["plain", "threaded"])
def test_ranks_write_to_fd_1_whatever_object_the_caller_made_its_stdout(caller, tmp_path):
    """A forked server does not hand the caller's replaced sys.stdout (a tee to a log file) to its ranks: they
    write to fd 1 with their prefix, as the ranks of a fresh-interpreter server do."""
    log = tmp_path / "log"
    args = [str(log)] + (["threaded"] if caller == "threaded" else [])
    proc = subprocess.run([sys.executable, str(script_file("replaced_streams.py")), *args], capture_output=True,
                          text=True, env=script_env(), timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert "[rank 0] rank 0 says hello\n" in proc.stdout and "[rank 1] rank 1 says hello\n" in proc.stdout, proc.stdout
    assert log.read_text() == "caller starts\ncaller ends\n", "the caller's lines went through its tee, once each"


def test_a_jupyter_kernel_has_threads_and_gets_a_fresh_interpreter_server(tmp_path):
    jupyter_client = pytest.importorskip("jupyter_client", reason="the notebook test needs jupyter_client and "
                                                                  "ipykernel (the test extra)")
    manager = jupyter_client.KernelManager(kernel_name="python3")
    manager.start_kernel(env=script_env(), cwd=str(tmp_path))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        cell = textwrap.dedent("""
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
            """)
        shown = []
        reply = client.execute_interactive(cell, timeout=100, output_hook=shown.append)
        assert reply["content"]["status"] == "ok", reply["content"]
        text = "".join(m["content"].get("text", "") for m in shown if m["msg_type"] == "stream")
        line = next(line for line in text.splitlines() if line.startswith("FACTS "))
        facts = json.loads(line[len("FACTS "):])
        assert facts["threads"] > 1 and _fresh_interpreter(facts["command"]), facts
        assert facts["ranks"] == [[0, facts["server"]], [1, facts["server"]]]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
