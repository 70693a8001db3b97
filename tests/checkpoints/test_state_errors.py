"""When saving or loading a checkpoint goes wrong, every rank says what happened and nothing is lost or half-loaded:
a disk that fills up during save_state, a checkpoint damaged after it completed (cut short, changed, a file
missing), a folder that is not a checkpoint, and a checkpoint written for another model. Real 2-rank gloo worlds."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from support.states import Unwritable
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator, CheckpointError, consolidate, storage
from qaccel.checkpoints import folders
from qaccel.checkpoints import state as checkpoint

pytestmark = pytest.mark.timeout(180)


def _net(width=8, extra=False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)]
    if extra:
        layers.append(torch.nn.Linear(1, 1))
    return torch.nn.Sequential(*layers)


def _prepared(acc, width=8, extra=False):
    model = _net(width, extra)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.arange(32.0).reshape(8, 4)), batch_size=2, shuffle=True)
    return acc.prepare(model, optimizer, loader)


def _train(acc, model, optimizer, loader, steps):
    for _, (x,) in zip(range(steps), loader):
        optimizer.zero_grad()
        acc.backward(model(x).pow(2).mean())
        optimizer.step()


def _params(model):
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]  # FSDP2: DTensors
    return [round(v, 6) for p in full for v in p.detach().flatten().tolist()[:3]]


def _checkpoints(acc, folder):
    """Two numbered checkpoints (steps 2 and 4); returns the parameters at each."""
    model, optimizer, loader = _prepared(acc)
    acc.resume(folder, keep=None)
    seen = []
    for _ in range(2):
        _train(acc, model, optimizer, loader, 2)
        acc.save_state()
        seen.append(_params(model))
    return seen


def _resume(acc, folder):
    model, _optimizer, _loader = _prepared(acc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = acc.resume(folder)
    said = [str(w.message) for w in caught if "resume()" in str(w.message)]
    return os.path.basename(loaded), acc.step, _params(model), said


def _outcome(fn, *args):
    """fn's result, or the type and message of what it raised: what one rank saw."""
    try:
        return ("returned", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return (type(exc).__name__, str(exc), getattr(exc, "file", None))


def _load_explicitly(acc, path):
    model, optimizer, loader = _prepared(acc)
    before = (_params(model), optimizer.state_dict()["state"], loader.state_dict())
    result = _outcome(acc.load_state, path)
    after = (_params(model), optimizer.state_dict()["state"], loader.state_dict())
    return result, before == after


def _cut_short(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["cut short", "changed", "missing"])
def test_resume_skips_a_damaged_newest_checkpoint_on_every_rank(acc, tmp_path, damage):
    folder = str(tmp_path / "ckpt")
    seen = acc.distribute(_checkpoints)(acc, folder)
    newest = tmp_path / "ckpt" / "checkpoint_00000004"
    victim = newest / ("model_0.pt" if damage != "missing" else "random_states_1.pt")
    {"cut short": _cut_short, "changed": _flip_a_byte, "missing": os.remove}[damage](victim)

    ranks = acc.distribute(_resume, all_results=True)(acc, folder)
    assert [r[:3] for r in ranks] == [("checkpoint_00000002", 2, seen[0])] * 2, "the same older checkpoint everywhere"
    [said] = ranks[0][3]
    assert ranks[1][3] == [], "one warning, from rank 0"
    assert (
        str(newest) in said
        and victim.name in said
        and {"cut short": "bytes long", "changed": "checksum", "missing": "is missing"}[damage] in said
    )

    # load_state() given that checkpoint raises on every rank, naming it and the file, and loads nothing
    ranks = acc.distribute(_load_explicitly, all_results=True)(acc, str(newest))
    assert [untouched for _, untouched in ranks] == [True, True]
    errors = {result for result, _ in ranks}
    assert len(errors) == 1, "every rank raises the same error"
    kind, message, file = errors.pop()
    assert kind == "CheckpointError" and file == str(victim)
    assert message.startswith(f"checkpoint {newest} is damaged: {victim.name} ")


def test_a_checkpoint_torch_cannot_read_is_damaged_too(acc, tmp_path):
    """A file that holds what its marker records but that torch cannot read (written wrong, not damaged later):
    torch's own error, named."""
    folder = tmp_path / "ckpt"
    acc.distribute(_checkpoints)(acc, str(folder))
    newest = folder / "checkpoint_00000004"
    marker = newest / "qaccel_state.json"
    _cut_short(newest / "optimizer_0.pt")
    recorded = json.loads(marker.read_text())
    recorded["files"]["optimizer_0.pt"] = storage.sums(newest / "optimizer_0.pt").to_json()
    marker.write_text(json.dumps(recorded))
    ranks = acc.distribute(_load_explicitly, all_results=True)(acc, str(newest))
    (kind, message, file), untouched = ranks[0]
    assert ranks[1] == ranks[0] and untouched
    assert kind == "CheckpointError" and file == str(newest / "optimizer_0.pt")
    assert "optimizer_0.pt cannot be read (RuntimeError: PytorchStreamReader failed" in message


def test_resume_raises_when_every_checkpoint_is_damaged(acc, tmp_path):
    folder = tmp_path / "ckpt"
    acc.distribute(_checkpoints)(acc, str(folder))
    for step in (2, 4):
        _cut_short(folder / f"checkpoint_{step:08d}" / "model_0.pt")
    with pytest.raises(CheckpointError, match=f"every checkpoint in {folder} is damaged, so none was loaded") as info:
        acc.distribute(_resume)(acc, str(folder))
    assert "checkpoint_00000004 is damaged" in str(info.value) and "checkpoint_00000002 is damaged" in str(info.value)


def test_resume_skips_a_damaged_sharded_checkpoint(tmp_path):
    acc = Accelerator(nprocs=2, compute_setup="cpu", strategy="fsdp", fsdp_min_params=1, timeout=60)
    folder = tmp_path / "ckpt"
    seen = acc.distribute(_checkpoints)(acc, str(folder))
    shards = sorted((folder / "checkpoint_00000004" / "sharded").glob("__1_*"))
    assert shards, "rank 1's shard files"
    _cut_short(shards[0])
    ranks = acc.distribute(_resume, all_results=True)(acc, str(folder))
    assert [r[:3] for r in ranks] == [("checkpoint_00000002", 2, seen[0])] * 2
    assert f"sharded/{shards[0].name} is " in ranks[0][3][0]


# ---- checkpoints written for another model ----


def _save_one(acc, path):
    model, optimizer, loader = _prepared(acc)
    _train(acc, model, optimizer, loader, 2)
    acc.save_state(path)


@pytest.mark.parametrize(
    "other, wanted",
    [
        ({"width": 16}, "its '0.weight' has shape [8, 4], the model's [16, 4]"),
        ({"extra": True}, "it holds no '3.weight'"),
    ],
)
def test_loading_another_models_checkpoint_names_the_parameter_and_loads_nothing(acc, tmp_path, other, wanted):
    path = str(tmp_path / "ckpt")
    acc.distribute(_save_one)(acc, path)

    def load_into_other(acc):
        model, _optimizer, loader = _prepared(acc, **other)
        before = (_params(model), loader.state_dict())
        result = _outcome(acc.load_state, path)
        return result, before == (_params(model), loader.state_dict())

    ranks = acc.distribute(load_into_other, all_results=True)(acc)
    assert ranks[0] == ranks[1], "the same error on every rank"
    (kind, message, file), untouched = ranks[0]
    assert kind == "CheckpointError" and untouched
    assert message == (
        f"checkpoint {path} was not written for this run's model 0 (prepared model number 0): "
        f"{wanted}; nothing was loaded"
    )
    assert file == os.path.join(path, "model_0.pt")


def test_a_smaller_model_than_saved_is_named_too(single, tmp_path):
    path = str(tmp_path / "ckpt")
    _model, _optimizer, _loader = _prepared(single, extra=True)
    single.save_state(path)
    fresh = Accelerator(nprocs=1, compute_setup="cpu")
    _prepared(fresh)
    with pytest.raises(CheckpointError, match="it holds '3.weight', which the model has not; nothing was loaded"):
        fresh.load_state(path)


def test_a_sharded_checkpoint_of_another_model_is_refused_on_every_rank(tmp_path):
    acc = Accelerator(nprocs=2, compute_setup="cpu", strategy="fsdp", fsdp_min_params=1, timeout=60)
    path = str(tmp_path / "ckpt")
    acc.distribute(_save_one)(acc, path)

    def load_wider(acc):
        _model, _, _ = _prepared(acc, width=16)
        return _outcome(acc.load_state, path)

    ranks = acc.distribute(load_wider, all_results=True)(acc)
    assert ranks[0] == ranks[1]
    assert ranks[0][0] == "CheckpointError" and "its '0.weight' has shape [8, 4], the model's [16, 4]" in ranks[0][1]


def test_a_checkpoint_of_one_process_loads_into_two_ranks_with_rng_states_of_their_own(single, tmp_path):
    path = str(tmp_path / "ckpt")
    model, _, _ = _prepared(single)
    single.save_state(path)
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=30)

    def load(acc):
        model, _, _ = _prepared(acc)
        outcome = _outcome(acc.load_state, path)
        return outcome, acc.unwrap_model(model).state_dict(), torch.rand(1).item()

    (first, weights0, draw0), (second, weights1, draw1) = acc.distribute(load, all_results=True)(acc)
    assert first == second and first[0] == "returned"
    for name, value in single.unwrap_model(model).state_dict().items():
        assert torch.equal(weights0[name], value) and torch.equal(weights1[name], value)
    assert draw0 != draw1, "each rank derives RNG states of its own from the seed, the step and its rank"


# ---- not a checkpoint ----


def test_consolidate_and_load_state_say_what_is_there_instead_of_a_checkpoint(single, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    (tmp_path / "file.pt").write_bytes(b"x")
    out = str(tmp_path / "out.pt")
    with pytest.raises(
        FileNotFoundError,
        match=r"notes is not a qaccel checkpoint: it holds no qaccel_state.json .* "
        r"it holds a.txt$",
    ):
        consolidate(tmp_path / "notes", out)
    with pytest.raises(FileNotFoundError, match="file.pt: it is a file; give the checkpoint's folder"):
        consolidate(tmp_path / "file.pt", out)
    with pytest.raises(FileNotFoundError, match="missing: there is no such file or folder"):
        consolidate(tmp_path / "missing", out)
    _prepared(single)
    with pytest.raises(FileNotFoundError, match="notes is not a qaccel checkpoint"):
        single.load_state(tmp_path / "notes")
    assert single.load_state(tmp_path / "notes", missing_ok=True) is None
    assert not os.path.exists(out)


def test_complete_means_a_marker_listing_every_file(single, tmp_path):
    """One rule for a complete checkpoint: its marker, of the current format, listing every file. Parts without a
    marker are not a checkpoint; a marker of another form is a damaged one."""
    path = tmp_path / "ckpt"
    _prepared(single)
    single.save_state(path)
    marker = path / "qaccel_state.json"
    text = marker.read_text()
    marker.unlink()
    with pytest.raises(FileNotFoundError, match="ckpt is not a qaccel checkpoint: it holds no qaccel_state.json"):
        single.load_state(path)
    marker.write_text(text.replace('"format": 2', '"format": 1'))
    with pytest.raises(CheckpointError, match="qaccel_state.json is not what save_state\\(\\) writes \\(format 2"):
        single.load_state(path)
    with pytest.raises(CheckpointError, match="is damaged: qaccel_state.json is not what save_state"):
        consolidate(path, tmp_path / "out.pt")


def test_consolidate_refuses_a_damaged_checkpoint(single, tmp_path):
    path = tmp_path / "ckpt"
    _prepared(single)
    single.save_state(path)
    assert consolidate(path, tmp_path / "ok.pt") == str(path)
    _flip_a_byte(path / "model_0.pt")
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is damaged: model_0.pt does not hold what was"):
        consolidate(path, tmp_path / "out.pt")
    _flip_a_byte(path / "model_0.pt")  # back as it was
    with pytest.raises(CheckpointError, match="holds no model 3 \\(it holds 1\\)"):
        consolidate(path, tmp_path / "out.pt", model=3)
    assert not (tmp_path / "out.pt").exists()


# ---- a disk that fills up ----


def _big(acc):
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 300)  # 0.34 MiB, Adam's moments twice that: one checkpoint fits in 2 MiB
    return acc.prepare(model, torch.optim.Adam(model.parameters()))


def _fill_up(acc, folder):
    """Save a checkpoint that fits, then one that does not (the first one stays): what each rank saw."""
    model, optimizer = _big(acc)
    for _ in range(2):
        acc.backward(model(torch.ones(2, 300)).sum())
        optimizer.step()
        if acc.step == 1:
            first = acc.save_state(folder, keep=5)
    return first, _outcome(lambda: acc.save_state(folder, keep=5))


def _load_big(acc, folder):
    _big(acc)
    return os.path.basename(acc.load_state(folder)), acc.step


@pytest.mark.small_disk
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_disk_that_fills_up_during_save_state_is_named_on_every_rank(small_disk, strategy):
    options = {"strategy": "fsdp", "fsdp_min_params": 1} if strategy == "fsdp" else {}
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60, **options)
    folder = os.path.join(small_disk, "ckpt")
    ranks = acc.distribute(_fill_up, all_results=True)(acc, folder)
    first = ranks[0][0]
    for rank, (_, (kind, message, _)) in enumerate(ranks):
        assert kind == "OSError", (rank, message)
        assert message.startswith(
            f"[Errno {errno.ENOSPC}] save_state() could not write {folder}/checkpoint_00000002: "
            "the disk is full while writing "
        ), message
        assert f"MiB free of 2.0 MiB on the file system holding {folder} now; the previous checkpoint stands" in message
        assert "checkpoint_00000002.tmp-" in message, "the file (or the shards' folder) being written"
    assert "(the partial checkpoint, " in ranks[0][1][1]
    assert os.listdir(folder) == [os.path.basename(first)], "no partial checkpoint is left"
    assert acc.distribute(_load_big)(acc, folder) == ("checkpoint_00000001", 1), "the previous checkpoint loads"


@pytest.mark.small_disk
def test_save_on_a_full_disk_says_so(single, small_disk):
    path = os.path.join(small_disk, "big.pt")
    with pytest.raises(OSError, match=f"no space left on device writing {path} \\(.* MiB free of 2.0 MiB") as info:
        single.save(torch.zeros(1_000_000), path)
    assert info.value.errno == errno.ENOSPC and os.listdir(small_disk) == []


class _Fails:
    """A registered object that fails where it is told: saying its state, or taking it back."""

    def __init__(self):
        self.n, self.where = torch.zeros(1), None

    def state_dict(self):
        if self.where == "state_dict":
            raise ValueError("this object cannot say its state")
        return (
            {"n": self.n, "payload": Unwritable("the device went away")}
            if self.where == "unwritable"
            else {"n": self.n}
        )

    def load_state_dict(self, state):
        if self.where == "load_state_dict":
            raise KeyError("this object cannot take its state back")
        self.n = state["n"]


@contextlib.contextmanager
def _broken(owner, name, exc, on_rank, rank):
    """``owner.name`` raising ``exc`` the first time it is called on rank ``on_rank`` (an OS failure no test user can
    cause as root)."""
    kept = getattr(owner, name)

    def fails(*args, **kwargs):
        setattr(owner, name, kept)
        raise exc

    if rank == on_rank:
        setattr(owner, name, fails)
    try:
        yield
    finally:
        setattr(owner, name, kept)


def _every_failure(acc, root):
    """Each way a save or a load can fail, on one rank, caught on every rank; then a step and a save each time."""
    model, optimizer, loader = _prepared(acc)
    fails = _Fails()
    acc.register_for_checkpointing(fails)
    rank, outcomes = acc.process_index, {}

    def saved(name, fn, *args, where=None):
        fails.where = where
        outcomes[name] = _failure(fn, *args)
        fails.where = None
        _train(acc, model, optimizer, loader, 1)
        acc.save_state(os.path.join(root, "after"))  # the next steps and the next save work on every rank

    saved("folder", acc.save_state, os.path.join(root, "a file", "checkpoint"))
    saved("not a checkpoint", acc.save_state, os.path.join(root, "mine"))
    saved("collecting", acc.save_state, os.path.join(root, "new"), where="state_dict")
    saved("writing", acc.save_state, os.path.join(root, "new"), where="unwritable")
    with _broken(storage, "write_bytes", OSError(errno.EIO, "Input/output error"), 0, rank):
        saved("marker", acc.save_state, os.path.join(root, "new"))
    with _broken(os, "rename", OSError(errno.EXDEV, "Invalid cross-device link"), 0, rank):
        saved("rename", acc.save_state, os.path.join(root, "new"))
    acc.save_state(os.path.join(root, "numbered"), keep=1)
    _train(acc, model, optimizer, loader, 1)
    with _broken(folders, "prune", PermissionError(errno.EACCES, "Permission denied"), 0, rank):
        saved("pruning", functools.partial(acc.save_state, keep=1), os.path.join(root, "numbered"))
    with _broken(folders, "candidates_in", PermissionError(errno.EACCES, "Permission denied"), 0, rank):
        saved("finding", acc.load_state, os.path.join(root, "after"))
    with _broken(checkpoint, "_check_fit", MemoryError("no memory left to check"), 1, rank):
        saved("reading", acc.load_state, os.path.join(root, "after"))
    saved("applying", acc.load_state, os.path.join(root, "after"), where="load_state_dict" if rank == 1 else None)
    return outcomes, os.path.basename(acc.load_state(os.path.join(root, "after"))), acc.step


def _failure(fn, *args):
    """What fn raised: its type, its words and its notes."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return type(exc).__name__, str(exc), getattr(exc, "__notes__", [])
    return None


def test_every_failure_of_a_save_or_a_load_is_raised_on_every_rank_and_training_goes_on(tmp_path):
    (tmp_path / "a file").write_text("not a folder")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's")
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=20)
    (outcomes, loaded, step), (outcomes_1, _, step_1) = acc.distribute(_every_failure, all_results=True)(
        acc, str(tmp_path)
    )
    assert outcomes == outcomes_1, "the same error, words and notes on every rank"
    assert (loaded, step, step_1) == ("after", 11, 11), "every failure was followed by a step, and training went on"
    saving = "and every rank raised it; the previous checkpoint stands"
    expected = {
        "folder": ("NotADirectoryError", f"[qaccel] save_state() failed on rank 0 while making its folder, {saving}"),
        "not a checkpoint": (
            "FileExistsError",
            f"[qaccel] save_state() failed on rank 0 while making its folder, {saving}",
        ),
        "collecting": ("ValueError", f"[qaccel] save_state() failed on rank 0 while collecting the state, {saving}"),
        "writing": ("OSError", f"[qaccel] save_state() failed on rank 0 while writing the checkpoint, {saving}"),
        "marker": ("OSError", f"[qaccel] save_state() failed on rank 0 while writing the checkpoint, {saving}"),
        "rename": ("OSError", f"[qaccel] save_state() failed on rank 0 while writing the checkpoint, {saving}"),
        "pruning": (
            "PermissionError",
            (
                "[qaccel] save_state() failed on rank 0 while removing older checkpoints, and "
                f"every rank raised it; the new checkpoint {tmp_path}/numbered/checkpoint_00000007"
                " is complete"
            ),
        ),
        "finding": (
            "PermissionError",
            (
                f"[qaccel] load_state() failed on rank 0 while looking for a checkpoint in "
                f"{tmp_path}/after, and every rank raised it"
            ),
        ),
        "reading": (
            "MemoryError",
            (
                f"[qaccel] load_state() failed on rank 1 while reading {tmp_path}/after, and every "
                "rank raised it; nothing was loaded"
            ),
        ),
        "applying": (
            "KeyError",
            (
                f"[qaccel] load_state() failed on rank 1 while loading {tmp_path}/after into the "
                "prepared objects, and every rank raised it; they may hold part of it: load again"
            ),
        ),
    }
    assert {name: (kind, notes[-1]) for name, (kind, _, notes) in outcomes.items()} == expected
    assert outcomes["writing"][1] == "the device went away" and outcomes["writing"][2][0].startswith(
        f"[qaccel] while writing {tmp_path}/new.tmp-"
    ), "the file it was writing, on every rank"
    assert outcomes["not a checkpoint"][1].startswith(
        f"[Errno 17] save_state() replaces its folder whole, and "
        f"{tmp_path}/mine is not a qaccel checkpoint (it holds notes.txt)"
    )
    assert (tmp_path / "mine" / "notes.txt").read_text() == "the user's", "nothing of the user's is lost"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a file", "after", "mine", "numbered"], "no partial one"
    assert sorted(p.name for p in (tmp_path / "numbered").iterdir()) == ["checkpoint_00000006", "checkpoint_00000007"]


def test_a_single_process_says_what_failed_without_ranks(single, tmp_path):
    (tmp_path / "a file").write_text("not a folder")
    single.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(NotADirectoryError) as info:
        single.save_state(tmp_path / "a file" / "checkpoint")
    assert info.value.__notes__ == [
        "[qaccel] save_state() failed while making its folder; the previous checkpoint stands"
    ]
