"""save_state(background=True): training goes on while the files are written; what is written is the state at the
call, bitwise; a failure reaches every rank at the same step; a crash, a full disk or a stop leaves the previous
checkpoint the newest complete one; one copy of the state at most, copied into again by the next save and let go by
free_memory()."""

from __future__ import annotations

import errno
import gc
import glob
import os
import signal
import time
import weakref

import pytest
import torch
from support.states import FailsWhenTold
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator, Preempted
from qaccel.checkpoints import background
from qaccel.checkpoints.folders import MARKER_FILE, newest_checkpoint

pytestmark = pytest.mark.timeout(240)

WIDTH = 1024  # 1M parameters: 4 MiB, Adam's moments twice that; writing them takes far longer than spoiling them
STATE_MIB = 12
ROW_WIDTH = 2048  # the saves in a row: a 48 MiB state, so that the heap's few MiB of noise cannot pass for a copy
ROW_STATE_MIB = 48


def _accelerator(kind: str) -> Accelerator:
    if kind == "one process":
        return Accelerator(nprocs=1, compute_setup="cpu")
    options = {"strategy": "fsdp", "fsdp_min_params": 1} if kind == "fsdp" else {}
    return Accelerator(nprocs=2, compute_setup="cpu", timeout=60, **options)


def _setup(acc, seed=0, width=WIDTH):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    return acc.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))


def _step(acc, model, optimizer, width=WIDTH):
    x = torch.randn(8, width)  # from the global generator, whose state the checkpoint holds
    optimizer.zero_grad()
    acc.backward(model(x).pow(2).mean())
    optimizer.step()


def _spoil(model, optimizer):
    """Change every parameter, optimizer state (the step counts too) and the random state, in place."""
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(-3).add_(1)
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    value.add_(7)
    torch.randn(5)


def _save_then_spoil(acc, folder, background):
    """Two steps, a save, a step, the save looked at, and at once every value it holds changed (torch #144657). The
    second background save copies into the first one's memory: whether each of its tensors did is returned."""
    model, optimizer = _setup(acc)
    for _ in range(2):
        _step(acc, model, optimizer)
    acc.save_state(f"{folder}-before", background=background)
    _step(acc, model, optimizer)
    staged = _staged_memory(acc)
    path = acc.save_state(folder, background=background)
    complete_at_return = os.path.exists(os.path.join(path, MARKER_FILE))
    reused = staged == _staged_memory(acc) and (bool(staged) or not background)
    _spoil(model, optimizer)
    return path, complete_at_return, acc.wait_for_checkpoint(), reused or (acc.process_index > 0 and not staged)


def _staged_memory(acc):
    """Where this rank's staging memory is (under DDP, only rank 0 copies anything)."""
    staging = background.staging_of(acc._registry())
    return (
        [] if staging is None else [(t.to_local() if hasattr(t, "to_local") else t).data_ptr() for t in staging.staged]
    )


def _resume_and_train(acc, folder):
    model, optimizer = _setup(acc, seed=1)
    acc.load_state(folder)
    for _ in range(3):
        _step(acc, model, optimizer)
    return {k: v.clone() for k, v in acc.get_state_dict(model).items()}, acc.step


@pytest.mark.parametrize("kind", ["one process", "ddp", "fsdp"])
def test_a_background_save_writes_the_state_at_the_call_and_resumes_as_a_blocking_one(tmp_path, kind):
    acc = _accelerator(kind)
    blocking = acc.distribute(_save_then_spoil)(acc, str(tmp_path / "blocking"), False)
    background = acc.distribute(_save_then_spoil)(acc, str(tmp_path / "background"), True)
    assert blocking == (str(tmp_path / "blocking"), True, None, True), "a blocking save is complete when it returns"
    assert background == (str(tmp_path / "background"), False, str(tmp_path / "background"), True), (
        "returned before the files were written, its copy in the memory of the save before; complete once waited for"
    )
    if kind != "fsdp":
        for name in ("model_0.pt", "optimizer_0.pt", "random_states_0.pt"):
            saved = [torch.load(tmp_path / which / name, weights_only=True) for which in ("blocking", "background")]
            assert _equal(*saved), name
    (state, step), (expected, expected_step) = (
        acc.distribute(_resume_and_train)(acc, str(tmp_path / which)) for which in ("background", "blocking")
    )
    assert step == expected_step == 6
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)


def _equal(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


# ---- failures ----


def _until_raised(acc, model, optimizer, width=WIDTH):
    """Steps until one raises: at which step, and what (type, message, notes)."""
    for i in range(10_000):
        try:
            _step(acc, model, optimizer, width)
        except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
            return i, type(exc).__name__, str(exc), getattr(exc, "__notes__", [])
        time.sleep(0.001)
    return None


def _failing_in_the_thread(acc, folder):
    model, optimizer = _setup(acc)
    failing = FailsWhenTold("the device went away")
    acc.register_for_checkpointing(failing)
    _step(acc, model, optimizer)
    first = acc.save_state(folder, keep=5, background=True)
    failing.fail = True
    _step(acc, model, optimizer)  # it waits for nothing: the first save may be in flight still
    acc.save_state(folder, keep=5, background=True)  # waits for the first, then fails in its thread
    return first, _until_raised(acc, model, optimizer), acc.wait_for_checkpoint()


def test_a_failed_background_save_is_raised_on_every_rank_at_the_same_step(acc, tmp_path):
    folder = tmp_path / "ckpt"
    ranks = acc.distribute(_failing_in_the_thread, all_results=True)(acc, str(folder))
    target = folder / "checkpoint_00000002"
    (first, (at, kind, message, notes), waited), (_, (at_1, kind_1, message_1, notes_1), _) = ranks
    assert at == at_1, "the same step on every rank"
    assert (kind, message) == ("OSError", "the device went away")
    assert notes[0] == f"[qaccel] while writing {target}.tmp-" + notes[0].split(".tmp-")[1], "the file"
    assert notes[0].endswith("/registered_0.pt")
    assert (kind_1, message_1, notes_1) == (kind, message, notes), "the same error and notes on every rank"
    assert (
        notes[1] == "[qaccel] save_state() failed on rank 0 while writing the checkpoint, and every rank raised "
        "it; the previous checkpoint stands"
    )
    for said in (notes[-1], notes_1[-1]):
        assert (
            said == f"[qaccel] raised by the background save of {target} (save_state at step 2); the "
            "checkpoint before it stands"
        )
    assert waited is None, "raised once, then forgotten"
    assert os.listdir(folder) == ["checkpoint_00000001"] and first == str(folder / "checkpoint_00000001")


def _fill_up_in_background(acc, folder):
    model, optimizer = _setup(acc, width=300)  # 0.34 MiB, Adam's moments twice that: one checkpoint fits in 2 MiB
    _step(acc, model, optimizer, 300)
    first = acc.save_state(folder, keep=5, background=True)
    _step(acc, model, optimizer, 300)
    acc.save_state(folder, keep=5, background=True)
    return first, _until_raised(acc, model, optimizer, 300)


@pytest.mark.small_disk
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_disk_that_fills_up_during_a_background_save_is_raised_on_every_rank(small_disk, kind):
    acc = _accelerator(kind)
    folder = os.path.join(small_disk, "ckpt")
    ranks = acc.distribute(_fill_up_in_background, all_results=True)(acc, folder)
    assert ranks[0][1][0] == ranks[1][1][0], "the same step on every rank"
    for first, (_, kind_, message, notes) in ranks:
        assert kind_ == "OSError", message
        assert message.startswith(
            f"[Errno {errno.ENOSPC}] save_state() could not write {folder}/checkpoint_00000002:"
            " the disk is full while writing "
        ), message
        assert "the previous checkpoint stands" in message and "checkpoint_00000002.tmp-" in message
        assert notes[-1].startswith(f"[qaccel] raised by the background save of {folder}/checkpoint_00000002")
    assert os.listdir(folder) == ["checkpoint_00000001"], "the previous checkpoint, and nothing half-written"
    assert first == os.path.join(folder, "checkpoint_00000001")


def _killed_while_writing(acc, folder):
    model, optimizer = _setup(acc)
    _step(acc, model, optimizer)
    acc.save_state(folder, keep=5)
    _step(acc, model, optimizer)
    acc.save_state(folder, keep=5, background=True)
    if acc.rank == 0:
        while not glob.glob(os.path.join(glob.escape(folder), "checkpoint_00000002.tmp-*", "*.pt")):
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)  # the thread has begun writing
    acc.wait_for_checkpoint()


def _load(acc, folder):
    _model, _optimizer = _setup(acc, seed=1)
    return acc.load_state(folder), acc.step


def test_a_rank_killed_during_a_background_save_leaves_the_previous_checkpoint_the_newest(acc, tmp_path):
    folder = str(tmp_path / "ckpt")
    with pytest.raises(Exception, match="rank 0"):
        acc.distribute(_killed_while_writing)(acc, folder)
    assert newest_checkpoint(folder) == os.path.join(folder, "checkpoint_00000001")
    assert acc.distribute(_load)(acc, folder) == (os.path.join(folder, "checkpoint_00000001"), 1)


def _stopped_while_writing(acc, folder):
    model, optimizer = _setup(acc)
    loader = acc.prepare(DataLoader(TensorDataset(torch.zeros(400, 1)), batch_size=1))
    acc.resume(folder, keep=None)
    for _ in loader:
        _step(acc, model, optimizer)
        if acc.step == 2:
            acc.save_state(background=True)
            if acc.rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)
    return "finished"


def test_a_stop_signal_waits_for_the_background_save_in_flight_then_saves(acc, tmp_path):
    folder = tmp_path / "ckpt"
    with pytest.raises(Preempted) as stopped:
        acc.distribute(_stopped_while_writing)(acc, str(folder))
    stop = stopped.value.checkpoint
    assert stop != str(folder / "checkpoint_00000002"), "the stop came at a later step"
    names = sorted(os.listdir(folder))
    assert names == ["checkpoint_00000002", os.path.basename(stop)], "both complete, nothing half-written"
    for name in names:
        assert (folder / name / MARKER_FILE).exists()
    assert newest_checkpoint(folder) == stop


# ---- one save at a time, one copy at most ----


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _saves_in_a_row(acc, folder, count):
    model, optimizer = _setup(acc, width=ROW_WIDTH)
    at_call, idle = [], []
    for i in range(count):
        _step(acc, model, optimizer, width=ROW_WIDTH)
        before = _rss_mib()
        acc.save_state(folder, keep=2, background=True)  # waits for the one before
        at_call.append(_rss_mib() - before)
        if i % 5 == 4:
            acc.wait_for_checkpoint()
            idle.append(_rss_mib())  # no save in flight: the staging memory kept
    names = sorted(os.listdir(folder))
    kept = [weakref.ref(t) for t in background.staging_of(acc._registry()).staged]
    acc.free_memory()
    gc.collect()
    return at_call, idle, [ref() is None for ref in kept], names


def test_saves_in_a_row_wait_for_each_other_and_reuse_one_copy_until_free_memory(single, tmp_path):
    at_call, idle, freed, names = single.distribute(_saves_in_a_row)(single, str(tmp_path / "ckpt"), 20)
    assert names == ["checkpoint_00000019", "checkpoint_00000020"]
    assert at_call[0] <= 1.25 * ROW_STATE_MIB + 4, f"the first save takes one copy of the state: {at_call} MiB"
    assert max(at_call[1:]) <= 0.25 * ROW_STATE_MIB + 4, f"the later ones copy into it: {at_call} MiB"
    # RSS after saves 5, 10, 15, 20: the heap may grow once while the first saves run (+8 MiB over saves 5 to 15 in a
    # loaded suite, then flat) and move by a few MiB either way (387 then 379 then 383 MiB in one run); a kept copy
    # per save would add a state's size each time, five of them over the last 5 saves
    assert idle[-1] <= idle[0] + ROW_STATE_MIB, f"20 saves grow the process by less than one state: {idle} MiB"
    assert idle[-1] <= max(idle[:-1]) + 0.25 * ROW_STATE_MIB, f"the last 5 saves do not grow the process: {idle} MiB"
    assert freed and all(freed), "free_memory() lets the copy go (RSS need not fall: glibc keeps freed heap memory)"


def test_staging_copies_into_the_memory_of_the_save_before_while_each_tensor_fits():
    staging = background.Staging(pin=False)
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(4)
    first = staging.copy({"a": a, "b": [b, 3], "again": a})
    a.add_(1)
    second = staging.copy({"a": a, "b": [b, 3], "again": a})
    assert second["a"].data_ptr() == first["a"].data_ptr() and second["b"][0].data_ptr() == first["b"][0].data_ptr()
    assert torch.equal(second["a"], a) and second["again"] is second["a"] and second["b"][1] == 3
    a.add_(1)
    assert not torch.equal(second["a"], a), "a copy, not the tensor"
    kept_b = weakref.ref(first["b"][0])
    del first, second
    third = staging.copy({"a": a, "b": [torch.ones(5), 3]})  # b's shape changed
    assert torch.equal(third["b"][0], torch.ones(5)) and kept_b() is None, "a buffer that no longer fits goes"
    assert len(staging.staged) == 2
