"""A hanging job says where every rank is (qaccel/comm/hangs.py), and debug mode catches mismatched collectives.

Real ranks throughout: plain launches, torchrun and srun run a script whose rank 1 sleeps while rank 0 waits in a
collective with a short timeout; SIGUSR2 is sent to a running plain launch.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.procs import (
    REPO,
    run_torchrun,
    script_env,
    script_file,
    slurm_env,
    torchrun_cmd,
    wait_dead,
    wait_for_text,
)

TIMEOUT_S = 4
SCRIPT = script_file("hang.py")


def _line(script, mark: str) -> str:
    lines = script.read_text().splitlines()
    return f"{script.name}:{next(i for i, text in enumerate(lines, 1) if mark in text)}"


def _pids(out) -> list[int]:
    return [int(p.name.split("-")[1]) for p in out.glob("pid-*")]


IN_PROCESS_TIMEOUT_S = 3


def _train(acc, mode: str, out: str) -> None:
    """The in-process tests' function: rank 1 sleeps while rank 0 waits in a collective (or returns)."""
    import torch
    import torch.distributed as dist

    (Path(out) / f"pid-{os.getpid()}").touch()
    acc.all_reduce_dict({"step": 1.0})
    if acc.rank == 1:
        time.sleep(60)  # FN_RANK1_SLEEPS
    if mode == "barrier":
        acc.wait_for_everyone()  # FN_RANK0_WAITS
    elif mode == "torch":
        dist.all_reduce(torch.ones(1))  # FN_RANK0_TORCH


@pytest.fixture(scope="module")
def short():
    """Two ranks with a short timeout, launched from this process (its forkserver stays warm between tests)."""
    from qaccel import Accelerator

    return Accelerator(nprocs=2, compute_setup="cpu", timeout=IN_PROCESS_TIMEOUT_S)


def _caller_error(short, mode: str, out) -> tuple[str, float]:
    """Launch _train in ``mode``; the caller's error (notes included) and the seconds from the ranks' start to it."""
    with pytest.raises(RuntimeError) as info:
        short.distribute(_train)(short, mode, str(out))
    took = time.time() - max(p.stat().st_mtime for p in out.glob("pid-*"))
    return "\n".join([str(info.value), *getattr(info.value, "__notes__", [])]), took


def _here(mark: str) -> str:
    return _line(Path(__file__), mark)


@pytest.fixture
def hang(tmp_path):
    """The script and an output folder for its ranks' pid files."""
    out = tmp_path / "out"
    out.mkdir()
    return SCRIPT, out


@pytest.mark.timeout(60)
def test_a_plain_launch_names_the_line_of_every_rank_when_a_barrier_times_out(short, tmp_path):
    error, took = _caller_error(short, "barrier", tmp_path)
    assert f"a collective waited longer than timeout={IN_PROCESS_TIMEOUT_S}s; where every rank was:" in error, error
    assert re.search(
        rf"rank 0: timed out in wait_for_everyone\(\) after {IN_PROCESS_TIMEOUT_S}\.\d s \(its collective "
        rf"#2; 1 completed before\) at \S*{_here('FN_RANK0_WAITS')} in _train: acc.wait_for_everyone\(\)",
        error,
    ), error
    assert re.search(
        rf"rank 1: not in a qaccel collective \(1 completed\) at \S*{_here('FN_RANK1_SLEEPS')} in _train: "
        r"time.sleep\(60\)",
        error,
    ), error
    assert error.count("where every rank was") == 1
    assert took < 15, took  # the report within 15 s: the timeout, then the ranks' answers and the caller's exit
    pids = _pids(tmp_path)
    assert len(pids) == 2 and wait_dead(pids, timeout=3) == []


@pytest.mark.timeout(60)
def test_a_timeout_in_torchs_own_collective_is_explained_too(short, tmp_path):
    error, _ = _caller_error(short, "torch", tmp_path)
    assert re.search(
        r"rank 0: timed out in a collective qaccel did not make \(1 qaccel collective completed\) at "
        rf"\S*{_here('FN_RANK0_TORCH')} in _train: dist.all_reduce\(torch.ones\(1\)\)",
        error,
    ), error
    assert re.search(rf"rank 1: not in a qaccel collective \(1 completed\) at \S*{_here('FN_RANK1_SLEEPS')}", error)
    assert wait_dead(_pids(tmp_path), timeout=3) == []


@pytest.mark.timeout(60)
def test_a_rank_that_returned_waits_in_the_barrier_that_ends_distribute(short, tmp_path):
    error, _ = _caller_error(short, "return", tmp_path)
    assert "rank 0: timed out in the barrier that ends distribute() (fn returned) after" in error, error
    assert re.search(rf"rank 1: not in a qaccel collective \(1 completed\) at \S*{_here('FN_RANK1_SLEEPS')}", error)


def _check_logs(script, out, proc) -> None:
    """Under a launcher: rank 0's error lists both ranks, rank 1 wrote its own part, and no rank is left."""
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert f"[qaccel] rank 0 timed out after {TIMEOUT_S} s; where rank 1 of 2 is:" in log, log[-4000:]
    assert re.search(rf"rank 0: timed out in wait_for_everyone\(\) .* at \S*{_line(script, 'RANK0_WAITS')}", log), log
    assert re.search(rf"rank 1: not in a qaccel collective \(1 completed\) at \S*{_line(script, 'RANK1_SLEEPS')}", log)
    assert wait_dead(_pids(out), timeout=5) == []


@pytest.mark.timeout(120)
def test_under_torchrun_each_rank_writes_its_part_to_its_log(hang):
    script, out = hang
    proc = run_torchrun(
        script, "barrier", str(out), env=script_env(HANG_TIMEOUT=str(TIMEOUT_S)), cwd=out.parent, timeout=100
    )
    _check_logs(script, out, proc)


@pytest.mark.slurm
@pytest.mark.timeout(150)
def test_under_srun_each_rank_writes_its_part_to_its_log(hang, slurm_cluster):
    script, out = hang
    proc = slurm_cluster.srun(
        ["-N1", "-n2", "--kill-on-bad-exit=1", sys.executable, str(script), "barrier", str(out)],
        timeout=90,
        env={**slurm_env(slurm_cluster), "HANG_TIMEOUT": str(TIMEOUT_S)},
    )
    _check_logs(script, out, proc)


def _ask_where_and_release(cmd: list[str], out, env: dict, ask=None) -> tuple[subprocess.CompletedProcess, str, str]:
    """Start ``cmd`` (the script in usr2 mode), ask the ranks where they are once both are ready (``ask(proc)``;
    default: ``qaccel where PID``), wait for both ranks' answers, then let rank 1 go on; the finished process, what
    ``ask`` printed and what the ranks printed."""
    err_path = out.parent / "stderr"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=out.parent, start_new_session=True
        )
    try:
        wait_for_text(err_path, "ready 0", "ready 1")
        time.sleep(0.5)  # rank 0 is in its barrier by now
        asked = subprocess.run(
            ask(proc) if ask else [sys.executable, "-m", "qaccel", "where", str(proc.pid)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert asked.returncode == 0, asked.stderr
        text = wait_for_text(err_path, "SIGUSR2: rank 0 of 2", "SIGUSR2: rank 1 of 2")
        (out / "go").touch()
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, err_path.read_text()), asked.stdout, text


def _check_answers(script, text: str) -> None:
    assert re.search(
        rf"SIGUSR2: rank 0 of 2 is waiting in wait_for_everyone\(\) after \d+\.\d s \(its collective #2; "
        rf"1 completed before\) at \S*{_line(script, 'USR2_RANK0')} in train",
        text,
    ), text
    assert re.search(
        rf"SIGUSR2: rank 1 of 2 is not in a qaccel collective \(1 completed\) at "
        rf"\S*{_line(script, 'RANK1_POLLS')} in train: while .*time.sleep\(0.05\)",
        text,
    ), text


@pytest.mark.timeout(90)
def test_qaccel_where_makes_every_rank_of_a_plain_launch_say_where_it_is_and_the_run_goes_on(hang):
    script, out = hang
    proc, cli, text = _ask_where_and_release(
        [sys.executable, str(script), "usr2", str(out)], out, script_env(HANG_TIMEOUT="60")
    )
    assert proc.returncode == 0, proc.stderr
    assert "sent SIGUSR2 to process" in cli
    _check_answers(script, text)
    assert "RESULT [True, True]" in proc.stdout  # and a process forked by a rank (a DataLoader worker) ignores it


@pytest.mark.timeout(120)
def test_qaccel_where_signals_torchruns_workers_not_torchrun(hang, tmp_path):
    script, out = hang
    cmd = [*torchrun_cmd(tmp_path / "logs", "--standalone", "--nproc_per_node", "2"), str(script), "usr2", str(out)]
    proc, cli, text = _ask_where_and_release(cmd, out, script_env(HANG_TIMEOUT="60"))
    assert proc.returncode == 0, proc.stderr
    assert "sent SIGUSR2 to the workers of torchrun" in cli
    _check_answers(script, text)
    assert proc.stdout.count("RESULT [True, True]") == 2


@pytest.mark.slurm
@pytest.mark.timeout(150)
def test_scancel_signal_usr2_makes_every_srun_task_say_where_it_is(hang, slurm_cluster):
    script, out = hang
    name = f"where-{os.getpid()}-{time.monotonic_ns()}"
    env = {**slurm_cluster.env, **slurm_env(slurm_cluster), "HANG_TIMEOUT": "60"}
    cmd = ["srun", "-J", name, "-N1", "-n2", sys.executable, str(script), "usr2", str(out)]
    proc, _, text = _ask_where_and_release(cmd, out, env, ask=lambda _: ["scancel", "--signal=USR2", "--name", name])
    assert proc.returncode == 0, proc.stderr
    _check_answers(script, text)
    assert proc.stdout.count("RESULT [True, True]") == 2


# Debug mode: one launch catches several mismatches (each raised on every rank, after which the group is usable).


def _mismatches(acc):
    import torch

    from qaccel import CollectiveMismatchError

    caught = []

    def attempt(call):
        try:
            call()
        except CollectiveMismatchError as exc:
            caught.append(str(exc))
        else:
            caught.append(None)

    rank = acc.rank
    attempt(lambda: acc.gather(torch.ones(rank + 1, 3)))  # dim 0 may differ: no mismatch
    attempt(lambda: acc.wait_for_everyone() if rank == 0 else acc.all_reduce_dict({"loss": 1.0}))
    attempt(lambda: acc.all_reduce_dict({"loss": 1.0} if rank == 0 else {"loss": 1.0, "acc": 0.5}))
    attempt(lambda: acc.reduce(torch.ones(3 + rank)))
    attempt(lambda: acc.broadcast("x", src=rank))
    attempt(lambda: acc.gather_for_metrics(torch.ones(2)))
    return caught, acc.debug


@pytest.mark.timeout(60)
def test_debug_mode_names_the_mismatch_and_each_ranks_call_site_on_every_rank():
    from qaccel import Accelerator

    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=30, debug=True)
    results = acc.distribute(_mismatches, all_results=True)(acc)
    assert results[0] == results[1]
    caught, debug = results[0]
    assert debug is True
    assert caught[0] is None and caught[5] is None, caught
    here = os.path.basename(__file__)
    assert "the ranks called different collectives" in caught[1]
    assert re.search(
        rf"rank 0: wait_for_everyone\(\) at \S*{here}:\d+\n  rank 1: all_reduce_dict\(\{{'loss': float\}}, "
        rf"op='mean'\) at \S*{here}:\d+",
        caught[1],
    ), caught[1]
    assert "the ranks called all_reduce_dict() with different arguments" in caught[2]
    assert "rank 1: all_reduce_dict({'loss': float, 'acc': float}, op='mean')" in caught[2], caught[2]
    assert "rank 0: reduce([float32[3]], op='sum')" in caught[3] and "rank 1: reduce([float32[4]]" in caught[3]
    assert "rank 0: broadcast(src=0)" in caught[4] and "rank 1: broadcast(src=1)" in caught[4]


def test_debug_comes_from_the_argument_or_qaccel_debug(monkeypatch):
    from qaccel import Accelerator

    monkeypatch.delenv("QACCEL_DEBUG", raising=False)
    assert Accelerator().debug is False
    monkeypatch.setenv("QACCEL_DEBUG", "1")
    assert Accelerator().debug is True
    assert Accelerator(debug=False).debug is False
    monkeypatch.setenv("QACCEL_DEBUG", "maybe")
    with pytest.raises(ValueError, match="QACCEL_DEBUG must be 1/true/yes/on or 0/false/no/off"):
        Accelerator()
    monkeypatch.delenv("QACCEL_DEBUG")
    with pytest.raises(TypeError, match="debug must be True, False or None"):
        Accelerator(debug="yes")


def _debug_seen_in_a_rank():
    from qaccel import Accelerator

    inner = Accelerator()  # made in the rank, its own option off: the session's mode is what counts
    return inner.debug, inner.state.debug


@pytest.mark.timeout(60)
def test_an_accelerator_in_a_rank_reports_the_sessions_debug_mode():
    from qaccel import Accelerator

    assert Accelerator(nprocs=2, compute_setup="cpu", debug=True).distribute(_debug_seen_in_a_rank)() == (True, True)
    assert Accelerator(nprocs=2, compute_setup="cpu", debug=False).distribute(_debug_seen_in_a_rank)() == (False, False)


def test_debug_in_one_process_checks_nothing_and_costs_nothing():
    from qaccel import Accelerator

    acc = Accelerator(debug=True)
    assert acc.distribute(lambda: acc.all_reduce_dict({"x": 2.0}))() == {"x": 2.0}


# Without processes: what counts as the user's code, and as a timeout.


def test_the_users_stack_leaves_out_qaccel_torch_and_the_standard_library():
    import json

    from qaccel.comm import hangs

    def user_function():  # user code -> json (standard library) -> user code -> qaccel
        return json.loads("1", parse_int=lambda _: hangs.user_stack(hangs.live_frames(sys._getframe())))

    stack = user_function()
    assert [f.function.rsplit(".", 1)[-1] for f in stack[-2:]] == ["user_function", "<lambda>"], stack
    assert stack[-2].calls == "json.loads"  # the library function the user's line called into
    library = (str(REPO / "qaccel"), os.path.dirname(json.__file__), os.path.dirname(torch_file()))
    assert not any(f.filename.startswith(library) for f in stack), stack


def torch_file() -> str:
    import torch

    return torch.__file__


def test_what_counts_as_a_timeout():
    from qaccel.comm.hangs import is_timeout

    assert is_timeout(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"))
    assert is_timeout(RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3)"))
    assert not is_timeout(RuntimeError("Connection reset by peer"))
    assert is_timeout(RuntimeError("wait timeout after 500ms, keys: /0//qaccel"))  # the store's
    assert not is_timeout(ValueError("timeout must be positive"))
    assert not is_timeout(RuntimeError("the timeout argument is too small"))  # a user's error that only says timeout


def test_qaccel_where_names_a_process_that_is_not_there(capsys):
    from qaccel.cli import main

    assert main(["where", "999999999"]) == 2
    assert "qaccel where: no process 999999999" in capsys.readouterr().err


def test_a_question_someone_else_put_in_the_store_is_not_answered_and_the_real_one_still_is(capfd):
    """Another user who writes a rank's question key gets no answer (the rank's watcher drops it and waits on), and
    the report of a real timeout afterwards still lists that rank: the stranger used nothing up."""
    import datetime

    import torch.distributed as dist

    from qaccel.comm import hangs, sealed

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    stranger = dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=10))
    key = sealed.new_key()
    ranks = [
        hangs.Watch(rank, 2, 5.0, sealed.Sealed(server, key, rank), to_log=False, session_number=1) for rank in (0, 1)
    ]
    try:
        stranger.set("qaccel_where/1/wake/1", "another user asks")
        time.sleep(0.5)
        assert not any("report" in k for k in stranger.list_keys()), "no answer for a stranger"
        assert ranks[1].thread.is_alive(), "the watcher waits on"
        timed_out = RuntimeError("wait timeout after 5000ms")
        ranks[0].explain(timed_out, hangs.live_frames(sys._getframe()))
        report = "\n".join(timed_out.__notes__)
        assert "rank 1: not in a qaccel collective" in report and "no answer" not in report, report
        assert "test_hangs.py" in report
        answer = stranger.get("qaccel_where/1/report/1")
        assert b"test_hangs" not in answer, "the answer is encrypted"
    finally:
        for watch in ranks:
            watch.close()
    assert capfd.readouterr().err.count("not written by this run") == 1
