"""A rank that raises under a real torchrun or srun: the job exits non-zero within seconds, the raising rank's
traceback is in the output, and the launcher's summary names that rank, not a peer that only lost its connection.

Which rank torchrun's "Root Cause" names is a race: rank 0, which sees the broken barrier, may end first, or in the
same poll of torchrun's agent. A launcher that takes the first failure it observes names rank 0 in about 5 of 12
runs where rank 1 raised; one run shows that too rarely, so the torchrun test repeats it.
"""

from __future__ import annotations

import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.procs import run_torchrun, script_file, slurm_env, wait_dead, wait_for

SCRIPT = script_file("rank_1_fails.py")
USER_LINE = 'raise ValueError("rank 1 fails on purpose")'
# 3 runs where rank 1 raises and 1 where it calls sys.exit(3), 2 at a time: 2 rounds. Every run is a draw of the
# race above, and every run must name rank 1. A launcher that takes the first failure it observes names rank 1 in
# a run with probability about 7/12 (11/20 on a loaded machine), so all 4 runs pass with it with probability
# (7/12)**4 = 12% ((11/20)**4 = 9%): this test catches it in 88% of runs (the 3 raising runs alone: 80%), and
# the suite runs it every time. The exiting run is such a draw too: on a loaded machine, such a launcher names
# rank 0 in about 4 of 6 exiting runs.
RAISE_RUNS, PARALLEL = 3, 2
# From rank 1's raise to the launcher's exit: 1-4 s here (a rank held for the cause to go first waits 3 s), up to
# 11 s while other test suites load the 2 cores. The ranks' timeout is the default 30 min: a hang shows.
AFTER_RAISE_S = 25.0


def _pids(out: Path) -> list[int]:
    return [int((out / f"pid{rank}").read_text()) for rank in (0, 1) if (out / f"pid{rank}").exists()]


def _after_raise(out: Path, ended: float) -> float:
    return ended - float((out / "raised_at").read_text())


def _root_cause(stderr: str) -> str:
    """The "Root Cause" section of torchrun's summary ('' if there is none)."""
    if "Root Cause (first observed failure):" not in stderr:
        return ""
    return stderr.split("Root Cause (first observed failure):", 1)[1].split("\n====", 1)[0]


def _ranks_output(stderr: str) -> str:
    """What the ranks wrote, without torchrun's own traceback and summary (printed after the ranks are gone)."""
    return stderr.split("torch.distributed.elastic.multiprocessing.errors.ChildFailedError", 1)[0]


def _torchrun_once(script: Path, out: Path, mode: str = "raise") -> dict:
    out.mkdir()
    started = time.time()
    proc = run_torchrun(script, str(out), mode, cwd=out.parent, timeout=120)
    ended = time.time()
    return {"proc": proc, "took": ended - started, "after_raise": _after_raise(out, ended), "pids": _pids(out)}


@pytest.mark.timeout(240)
def test_torchrun_names_the_raising_rank_as_root_cause_every_time_and_no_system_exit_as_an_error(tmp_path):
    """Every run: rank 1 is torchrun's Root Cause. A raise is recorded with its traceback; sys.exit(3) (or a stop
    after a signal, a SystemExit too) is an exit code, not an error with a traceback."""
    script = SCRIPT
    modes = ["raise"] * RAISE_RUNS + ["exit"]
    with ThreadPoolExecutor(PARALLEL) as pool:
        runs = list(pool.map(lambda i: _torchrun_once(script, tmp_path / f"run{i}", modes[i]), range(len(modes))))
    named = [re.search(r"rank\s*: (\d+) \(local_rank: (\d+)\)", _root_cause(r["proc"].stderr)) for r in runs]
    wrong = [i for i, m in enumerate(named) if m is None or m.groups() != ("1", "1")]
    assert not wrong, (
        f"root cause not rank 1 in {len(wrong)} of {len(runs)} runs ({[modes[i] for i in wrong]}): "
        f"{[m and m.group(0) for m in named]}\n{runs[wrong[0]]['proc'].stderr[-6000:]}"
    )
    for mode, r in zip(modes, runs):
        proc = r["proc"]
        assert proc.returncode != 0
        root = _root_cause(proc.stderr)
        if mode == "raise":
            assert "ValueError: rank 1 fails on purpose" in root and USER_LINE in root, root
            assert "[qaccel] raised on rank 1 of 2" in root
            assert USER_LINE in _ranks_output(proc.stderr), "rank 1's own traceback is missing from the output"
        else:
            assert re.search(r"exitcode\s*: 3 ", root) and "error_file: <N/A>" in root, root
            assert "SystemExit" not in proc.stderr, proc.stderr[-4000:]
        assert r["after_raise"] < AFTER_RAISE_S, (mode, r["after_raise"], proc.stderr[-4000:])
        assert len(r["pids"]) == 2 and wait_dead(r["pids"], timeout=5) == []
    print(
        f"\n{len(runs)} torchrun runs ({RAISE_RUNS} raising, 1 exiting), {PARALLEL} at a time: each took "
        f"{min(r['took'] for r in runs):.1f}-{max(r['took'] for r in runs):.1f} s, "
        f"{max(r['after_raise'] for r in runs):.1f} s at most after the raise"
    )


def _no_jobs_left(cluster, timeout: float = 10.0) -> bool:
    """True once squeue lists no job; fails after ``timeout`` s."""
    return wait_for(
        lambda: not cluster.run(["squeue", "-h"], timeout=10).stdout.strip(),
        timeout,
        "squeue to list no job",
        interval=0.2,
    )


@pytest.mark.slurm
@pytest.mark.timeout(150)
@pytest.mark.parametrize("kill_on_bad_exit", [True, False], ids=["kill-on-bad-exit", "no-kill-on-bad-exit"])
def test_srun_step_fails_within_seconds_with_the_raising_ranks_traceback(slurm_cluster, tmp_path, kill_on_bad_exit):
    script = SCRIPT
    out = tmp_path / "run"
    out.mkdir()
    kill = ["--kill-on-bad-exit=1"] if kill_on_bad_exit else ["--kill-on-bad-exit=0"]
    started = time.time()
    proc = slurm_cluster.srun(
        ["-N1", "-n2", *kill, sys.executable, str(script), str(out), "raise"], timeout=90, env=slurm_env(slurm_cluster)
    )
    ended = time.time()
    assert proc.returncode != 0
    assert "ValueError: rank 1 fails on purpose" in proc.stderr and USER_LINE in proc.stderr, proc.stderr[-4000:]
    assert "[qaccel] raised on rank 1 of 2" in proc.stderr
    after = _after_raise(out, ended)
    assert after < AFTER_RAISE_S, (after, proc.stderr[-4000:])
    # srun names the tasks in the order they ended: the raising one first, alone
    ended_lines = [line for line in proc.stderr.splitlines() if re.match(r"srun: error: \S+: tasks? ", line)]
    assert ended_lines and re.match(r"srun: error: \S+: task 1: Exited with exit code 1", ended_lines[0]), ended_lines
    pids = _pids(out)
    assert len(pids) == 2 and wait_dead(pids, timeout=5) == []
    assert _no_jobs_left(slurm_cluster)
    print(f"\nsrun {kill[0]}: rc {proc.returncode}, {ended - started:.1f} s, {after:.1f} s after the raise")


# Without processes: the error file torch's own classes read, and what is never written to it.


def _error(exc_type, *args, cause=None):
    try:
        try:
            if cause is not None:
                raise cause
        finally:
            raise exc_type(*args)
    except BaseException as exc:  # noqa: BLE001 - any exception, as a rank sees it
        return exc


def test_the_error_file_is_what_torchrun_reads_and_it_wins_over_a_later_peer(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from qaccel.launch import launcher_report

    path = tmp_path / "attempt_0" / "1" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    raised_at = time.time() - 1.5
    assert launcher_report.record_cause(_error(ValueError, "bad value"), raised_at)
    cause = ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=str(path))
    assert cause.timestamp == int(raised_at)
    assert cause.message["message"] == "ValueError: bad value"
    assert "raise exc_type(*args)" in cause.message["extraInfo"]["py_callstack"]
    peer = ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(tmp_path / "none.json"))  # no file
    assert ChildFailedError("train.py", {0: peer, 1: cause}).get_first_failure()[0] == 1
    assert json.loads(path.read_text()) == cause.error_file_data


@pytest.mark.parametrize(
    "exc",
    [
        SystemExit(0),
        SystemExit(3),
        KeyboardInterrupt(),
        RuntimeError("[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"),
        "ValueError from a peer loss",
    ],
    ids=["exit-0", "exit-3", "keyboard-interrupt", "peer-loss", "raised-from-peer-loss"],
)
def test_no_error_file_for_an_exit_an_interrupt_or_a_symptom(tmp_path, monkeypatch, exc):
    from qaccel.launch import launcher_report

    if exc == "ValueError from a peer loss":
        exc = _error(ValueError, "step failed", cause=RuntimeError("Connection reset by peer"))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert not launcher_report.record_cause(exc)
    assert not (tmp_path / "error.json").exists()


def test_no_error_file_without_torchrun(monkeypatch):
    from qaccel.launch import launcher_report

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert not launcher_report.record_cause(_error(ValueError, "x"))


def test_only_a_symptom_is_held_and_it_says_why(capfd):
    from qaccel.launch import launcher_report

    started = time.monotonic()
    assert not launcher_report.hold_symptom(_error(ValueError, "x"), 1, 2, hold_s=5)
    assert not launcher_report.hold_symptom(KeyboardInterrupt(), 1, 2, hold_s=5)
    assert not launcher_report.hold_symptom(RuntimeError("Connection reset by peer"), 0, 1, hold_s=5)  # alone
    assert time.monotonic() - started < 1
    assert launcher_report.hold_symptom(RuntimeError("Connection reset by peer"), 0, 2, hold_s=0.05)
    err = capfd.readouterr().err
    assert "[qaccel] rank 0 of 2 lost contact with another rank (RuntimeError: Connection reset by peer)" in err
