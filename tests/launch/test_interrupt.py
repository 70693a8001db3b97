"""Ctrl-C (SIGINT to the foreground process group) at any moment of a plain launch's start-up gives one clean
KeyboardInterrupt traceback, from the caller, and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from support import component
from support.procs import marked_pids, script_env, script_file, wait_dead

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("moment", ["forkserver importing", "forkserver importing later", "ranks running"])
def test_ctrl_c_during_start_up_gives_one_traceback_and_leaves_nothing(tmp_path, moment):
    script = script_file("interrupted.py")
    mark = f"QACCEL_TEST_MARK={uuid.uuid4().hex}"
    env = script_env(**dict([mark.split("=")]))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )  # its own group: our SIGINT plays the terminal's Ctrl-C
    try:
        assert proc.stdout.readline().strip() == "made"
        if moment == "ranks running":
            assert proc.stdout.readline().strip() == "rank running"
        else:
            time.sleep(0.1 if moment == "forkserver importing" else 0.8)
        os.killpg(proc.pid, signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGINT, err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.rstrip().splitlines()[-1] == "KeyboardInterrupt", err
    assert wait_dead(marked_pids(mark), timeout=30) == []


@pytest.mark.parametrize("at_fork_of", ["server", "quick server"])
def test_ctrl_c_while_a_server_is_forked_is_raised_once_it_is(at_fork_of):
    """A server starts with SIGINT ignored, so the caller holds Ctrl-C back while it forks one: the Ctrl-C is then
    raised in the caller, not lost (the ranks would run on)."""
    if at_fork_of == "quick server" and len(os.sched_getaffinity(0)) < 2:
        component.unavailable("one usable core: the first launch is served by the server, no quick server is forked")
    mark = f"QACCEL_TEST_MARK={uuid.uuid4().hex}"
    proc = subprocess.Popen(
        [sys.executable, str(script_file("interrupted.py")), at_fork_of],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=script_env(**dict([mark.split("=")])),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGINT, err
    assert "rank running" not in out
    assert out == ("" if at_fork_of == "server" else "made\n")
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.rstrip().splitlines()[-1] == "KeyboardInterrupt", err
    assert wait_dead(marked_pids(mark), timeout=30) == []
