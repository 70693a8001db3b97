"""Each distribute() call is a session of its own: what one session prepared, registered, counted or marked does not
leak into the next one in the same process (a notebook, nprocs=1, torchrun, srun)."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest
import torch
from scripts.sessions import Counter, session
from support.procs import free_job_id, result_lines, run_torchrun, script_file, slurm_env, srun_env
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator

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


SESSIONS = script_file("sessions.py")
WANT = {"first": {"first_step_syncs": False, "counter": 1}, "second": {"first_step_syncs": False, "counter": 2}}


def test_a_second_session_under_torchrun_starts_clean(tmp_path):
    proc = run_torchrun(SESSIONS, str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    results = sorted(result_lines(proc.stdout), key=lambda r: r["rank"])
    assert results == [{"rank": r, **WANT} for r in (0, 1)]


def test_a_second_session_in_srun_tasks_starts_clean(tmp_path):
    job = free_job_id()
    procs = [
        subprocess.Popen(
            [sys.executable, str(SESSIONS), str(tmp_path)],
            env=srun_env(r, job),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
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


def _prepare_everything(acc, ckpt, refs):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=2)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    acc.resume(ckpt)
    for (x,) in loader:
        with acc.accumulate(model):
            acc.backward(model(x).sum())
            optimizer.step()
            optimizer.zero_grad()
        if acc.sync_gradients:
            scheduler.step()
    acc.save_state()
    refs.extend(weakref.ref(obj) for obj in (model, optimizer, loader, scheduler, counter, acc._registry()))
    return model, optimizer


def test_a_session_leaves_no_reference_cycle_to_what_it_prepared(tmp_path):
    """Prepared optimizers and loaders point back at the session's state, which lists them: the session's end must
    break that cycle, so what it prepared goes when its last name does, without waiting for the garbage collector
    (which could run it later in a forked DataLoader worker)."""
    acc = Accelerator(nprocs=1, compute_setup="cpu", gradient_accumulation_steps=2)
    torch.optim.Adam(torch.nn.Linear(1, 1).parameters())  # torch's first optimizer imports dynamo, leaving garbage
    refs = []
    gc.collect()
    gc.disable()
    try:
        returned = acc.distribute(_prepare_everything)(acc, str(tmp_path / "ckpt"), refs)
        assert [type(obj).__name__ for obj in returned] == ["Linear", "Adam"], "your own objects come back"
        del returned
        assert [type(ref()).__name__ for ref in refs if ref() is not None] == []
    finally:
        gc.enable()


LATER = script_file("later_sessions.py")
LATER_WANT = {"returned": ["Sequential", "Adam"], "left_after_first": 0, "counts": [96, 96, 96, 96]}


def _check_later_sessions(returncodes, stdout, stderr):
    # the ranks' tracebacks come before torchrun's long summary: show the lines that name errors, then the tail
    errors = "\n".join(line for line in stderr.splitlines() if "Error" in line or "raised on rank" in line)
    assert returncodes == [0] * len(returncodes), errors[-6000:] + "\n---\n" + stderr[-3000:]
    results = sorted(result_lines(stdout), key=lambda r: r["rank"])
    assert results == [{"rank": r, **LATER_WANT} for r in (0, 1)], stderr[-6000:]
    assert "Segmentation fault" not in stderr and "exited unexpectedly" not in stderr


@pytest.mark.parametrize("attempt", [1, 2])
def test_later_sessions_under_torchrun_never_crash_in_dataloader_workers(tmp_path, attempt):
    """Sessions that trained a DDP model (one kept by the script in a cycle of its own, one failed and its
    exception kept), then sessions whose DataLoader workers run the garbage collector: the old sessions' models
    must never be destroyed in a worker (destroying one there crashes the worker). Two runs, each with four later
    sessions."""
    proc = run_torchrun(LATER, str(tmp_path), cwd=tmp_path, timeout=240)
    _check_later_sessions([proc.returncode], proc.stdout, proc.stderr)


def test_later_sessions_in_srun_tasks_never_crash_in_dataloader_workers(tmp_path):
    job = free_job_id()
    procs = [
        subprocess.Popen(
            [sys.executable, str(LATER), str(tmp_path)],
            env=srun_env(r, job),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    _check_later_sessions([p.returncode for p in procs], "".join(o for o, _ in outs), "".join(e for _, e in outs))


@pytest.mark.slurm
def test_later_sessions_under_a_real_srun_never_crash_in_dataloader_workers(slurm_cluster, tmp_path):
    proc = slurm_cluster.srun(
        ["-N1", "-n2", sys.executable, str(LATER), str(tmp_path)],
        timeout=240,
        env=slurm_env(slurm_cluster),
        cwd=tmp_path,
    )
    _check_later_sessions([proc.returncode], proc.stdout, proc.stderr)


def _nothing():
    return None


def test_sessions_that_make_groups_prefix_tracebacks_once(monkeypatch):
    """torch's init_process_group wraps sys.excepthook to prefix a traceback's lines with [rankN]:, at every call:
    without care, a script's N-th session would print its uncaught error with N prefixes."""

    def original(*args):  # the hook the script had (restored after the test)
        sys.__excepthook__(*args)

    monkeypatch.setattr(sys, "excepthook", original)
    acc = Accelerator(nprocs=1, compute_setup="cpu", strategy="fsdp")  # a group of one, made by each session
    for _ in range(3):
        acc.distribute(_nothing)()
    hook = sys.excepthook
    assert hook.__name__ == "_distributed_excepthook"
    wrapped = dict(zip(hook.__code__.co_freevars, (c.cell_contents for c in hook.__closure__)))["old_hook"]
    assert wrapped is original, "one torch hook, wrapping the hook from before the first session"
