"""Each distribute() call is a session of its own: what one session prepared, registered, counted or marked does not
leak into the next one in the same process (a notebook, nprocs=1, torchrun, srun)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from procs import REPO, free_job_id, result_lines, run_torchrun, srun_env
from qaccel import Accelerator
from scripts.sessions import session

pytestmark = pytest.mark.timeout(180)


def test_a_second_session_in_one_process_starts_clean(tmp_path):
    acc = Accelerator(nprocs=1, compute_setup="cpu", gradient_accumulation_steps=2)
    ckpt = str(tmp_path / "ckpt")
    first = acc.distribute(session)(acc, ckpt, False)
    second = acc.distribute(session)(acc, ckpt, True)  # a stale registration would fail load_state's count check
    assert first == {"first_step_syncs": False, "counter": 1}
    assert second == {"first_step_syncs": False, "counter": 2}


def _fails_on_the_last_batch(acc):
    model = torch.nn.Linear(2, 1)
    model, loader = acc.prepare(model, DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2))
    batches = iter(loader)  # held by the frame, which the kept traceback holds
    for i, (x,) in enumerate(batches):
        if i == len(loader) - 1:
            raise RuntimeError("fails on the epoch's last batch")


def test_loop_marks_of_a_failed_session_do_not_reach_the_next(tmp_path):
    """A notebook keeps the failed session's traceback, and with it its loader loop, suspended on the last batch."""
    acc = Accelerator(nprocs=1, compute_setup="cpu", gradient_accumulation_steps=2)
    with pytest.raises(RuntimeError) as kept:
        acc.distribute(_fails_on_the_last_batch)(acc)
    second = acc.distribute(session)(acc, str(tmp_path / "ckpt"), False)
    assert second["first_step_syncs"] is False, "the first micro-step of k=2 must not sync"
    assert kept.value.__traceback__ is not None


SESSIONS = REPO / "tests" / "scripts" / "sessions.py"
WANT = {"first": {"first_step_syncs": False, "counter": 1}, "second": {"first_step_syncs": False, "counter": 2}}


def test_a_second_session_under_torchrun_starts_clean(tmp_path):
    proc = run_torchrun(SESSIONS, str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    results = sorted(result_lines(proc.stdout), key=lambda r: r["rank"])
    assert results == [{"rank": r, **WANT} for r in (0, 1)]


def test_a_second_session_in_srun_tasks_starts_clean(tmp_path):
    job = free_job_id()
    procs = [subprocess.Popen([sys.executable, str(SESSIONS), str(tmp_path)], env=srun_env(r, job),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    results = sorted((r for out, _ in outs for r in result_lines(out)), key=lambda r: r["rank"])
    assert results == [{"rank": r, **WANT} for r in (0, 1)]


def _rank_from_a_thread(acc):
    import threading

    seen = []
    thread = threading.Thread(target=lambda: seen.append((acc.rank, acc.world_size, str(acc.device))))
    thread.start()
    thread.join()
    return seen[0]


def test_a_thread_started_in_fn_sees_its_rank_and_world():
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
    assert acc.distribute(_rank_from_a_thread, all_results=True)(acc) == [(0, 2, "cpu"), (1, 2, "cpu")]
