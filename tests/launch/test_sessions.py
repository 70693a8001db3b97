"""Each distribute() call is a session of its own: what one session prepared, registered, counted or marked does not
leak into the next one in the same process (a notebook, nprocs=1, torchrun, srun).

later_sessions.py makes, in one process, the sessions of both kinds of check: two sessions, the second loading the
first one's checkpoint, then the sessions whose DataLoader workers collect garbage. It runs once under torchrun and
once in a real srun step, each run feeding two tests (the second session starts clean; no worker crashes). A real
step sets every variable that srun-like tasks started without SLURM would, so those need no run of their own; and
one run per launcher holds four later sessions that fork workers."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
from scripts.sessions import Counter, session
from support.procs import once_per_session, result_lines, run_torchrun, script_file, slurm_env
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


LATER = script_file("later_sessions.py")
WANT = {"first": {"first_step_syncs": False, "counter": 1}, "second": {"first_step_syncs": False, "counter": 2}}
LATER_WANT = {"returned": ["Sequential", "Adam"], "left_after_first": 0, "counts": [96, 96, 96, 96]}


def _run(name: str, tmp_path_factory, launch) -> dict:
    """later_sessions.py run once in the test session by ``launch(out_dir)``: its exit status, stdout and stderr."""

    def compute():
        out = tmp_path_factory.mktemp(name)
        proc = launch(out)
        return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}

    return once_per_session(tmp_path_factory, name, compute)


@pytest.fixture(scope="module")
def under_torchrun(tmp_path_factory) -> dict:
    return _run(
        "later-sessions-torchrun", tmp_path_factory, lambda out: run_torchrun(LATER, str(out), cwd=out, timeout=240)
    )


@pytest.fixture(scope="module")
def under_srun(tmp_path_factory, slurm_cluster) -> dict:
    def launch(out):
        return slurm_cluster.srun(
            ["-N1", "-n2", sys.executable, str(LATER), str(out)], timeout=240, env=slurm_env(slurm_cluster), cwd=out
        )

    return _run("later-sessions-srun", tmp_path_factory, launch)


def _check_second_sessions(run: dict) -> None:
    """Each rank's two first sessions: the second one loaded the first one's checkpoint, registered as it was."""
    results = sorted((r for r in result_lines(run["stdout"]) if "first" in r), key=lambda r: r["rank"])
    assert results == [{"rank": r, **WANT} for r in (0, 1)], run["stderr"][-6000:]


def test_a_second_session_under_torchrun_starts_clean(under_torchrun):
    _check_second_sessions(under_torchrun)


@pytest.mark.slurm
def test_a_second_session_under_a_real_srun_starts_clean(under_srun):
    _check_second_sessions(under_srun)


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


def _check_later_sessions(run: dict) -> None:
    stdout, stderr = run["stdout"], run["stderr"]
    # the ranks' tracebacks come before torchrun's long summary: show the lines that name errors, then the tail
    errors = "\n".join(line for line in stderr.splitlines() if "Error" in line or "raised on rank" in line)
    assert run["returncode"] == 0, errors[-6000:] + "\n---\n" + stderr[-3000:]
    results = sorted((r for r in result_lines(stdout) if "counts" in r), key=lambda r: r["rank"])
    assert results == [{"rank": r, **LATER_WANT} for r in (0, 1)], stderr[-6000:]
    assert "Segmentation fault" not in stderr and "exited unexpectedly" not in stderr


def test_later_sessions_under_torchrun_never_crash_in_dataloader_workers(under_torchrun):
    """Sessions that trained a DDP model (one kept by the script in a cycle of its own, one failed and its
    exception kept), then sessions whose DataLoader workers run the garbage collector: the old sessions' models
    must never be destroyed in a worker (destroying one there crashes the worker). Four later sessions."""
    _check_later_sessions(under_torchrun)


@pytest.mark.slurm
def test_later_sessions_under_a_real_srun_never_crash_in_dataloader_workers(under_srun):
    _check_later_sessions(under_srun)


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
