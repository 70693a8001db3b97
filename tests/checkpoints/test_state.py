"""save_state / load_state: a run resumed in fresh processes continues bitwise where it stopped."""

from __future__ import annotations

import os

import pytest
import torch
from support import component
from support.pagecache import cached_in, droppable
from support.states import Counter
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator, CheckpointError, ProjectConfiguration

pytestmark = pytest.mark.timeout(240)


def _run(acc, ckpt, iterations, resume=False, save=True, stop_after=None):
    """``iterations`` passes over the loader (each a new epoch); optionally stop and save mid-pass."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(48, 4, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    counter = Counter()
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    acc.register_for_checkpointing(counter)
    if resume:
        acc.load_state(ckpt)
    for _ in range(iterations):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            acc.backward(loss)
            optimizer.step()
            counter.n += 1
            if stop_after is not None and counter.n == stop_after:
                acc.save_state(ckpt)
                return None
        scheduler.step()
    if save:
        acc.save_state(ckpt)
    params = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in acc.unwrap_model(model).parameters()]
    return params, moments, counter.n, optimizer.param_groups[0]["lr"]


def _assert_bitwise(a, b):
    (pa, ma, na, lra), (pb, mb, nb, lrb) = a, b
    assert na == nb and lra == lrb
    for x, y in zip(pa + ma, pb + mb):
        assert torch.equal(x, y)


def test_three_epochs_equal_two_plus_save_plus_a_fresh_run_of_one(acc, tmp_path):
    straight = acc.distribute(_run, all_results=True)(acc, str(tmp_path / "a"), 3)
    acc.distribute(_run)(acc, str(tmp_path / "b"), 2)
    resumed = acc.distribute(_run, all_results=True)(acc, str(tmp_path / "b"), 1, resume=True, save=False)
    for rank in range(2):
        _assert_bitwise(resumed[rank], straight[rank])
    files = sorted(os.listdir(tmp_path / "b"))
    assert "random_states_0.pt" in files and "random_states_1.pt" in files and "model_0.pt" in files


def test_resume_mid_epoch(acc, tmp_path):
    straight = acc.distribute(_run, all_results=True)(acc, str(tmp_path / "a"), 2)
    acc.distribute(_run)(acc, str(tmp_path / "b"), 2, stop_after=9)  # 6 batches per epoch: 3 into epoch 2
    resumed = acc.distribute(_run, all_results=True)(acc, str(tmp_path / "b"), 1, resume=True, save=False)
    for rank in range(2):
        _assert_bitwise(resumed[rank], straight[rank])


def test_resume_mid_epoch_with_split_batches(tmp_path):
    split = Accelerator(nprocs=2, compute_setup="cpu", split_batches=True)  # the loader's 4: 2 per rank
    straight = split.distribute(_run, all_results=True)(split, str(tmp_path / "a"), 2)
    split.distribute(_run)(split, str(tmp_path / "b"), 2, stop_after=15)  # 12 steps per epoch: 3 into epoch 2
    resumed = split.distribute(_run, all_results=True)(split, str(tmp_path / "b"), 1, resume=True, save=False)
    for rank in range(2):
        _assert_bitwise(resumed[rank], straight[rank])
    assert straight[0][2] == 24, "every rank takes a slice of each of the loader's 12 batches an epoch"


def _save_then_fail(acc, ckpt):
    model = torch.nn.Linear(2, 1)
    torch.nn.init.constant_(model.weight, 7.0)
    model = acc.prepare(model)
    acc.save_state(ckpt)
    torch.nn.init.constant_(acc.unwrap_model(model).weight, 8.0)
    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):
        f.write(b"half")
        raise OSError("disk full")

    torch.save = dying_save
    try:
        acc.save_state(ckpt)
    finally:
        torch.save = real_save


def _load_weight(acc, ckpt):
    model = acc.prepare(torch.nn.Linear(2, 1))
    acc.load_state(ckpt)
    return acc.unwrap_model(model).weight.flatten().tolist()


def _two_numbered_saves(acc, folder):
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    model, optimizer = acc.prepare(model, torch.optim.Adam(model.parameters()))
    cached = []
    for _ in range(2):
        model(torch.randn(2, 256)).sum().backward()
        optimizer.step()
        cached.append(cached_in(acc.save_state(folder, keep=5)))
    return cached, {name: cached_in(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_save_first_drops_the_checkpoint_before_it_from_the_page_cache(strategy, tmp_path):
    """The pages freed are what the save's copy and files take next (see _hand_on_pages)."""
    if why := droppable(tmp_path):
        component.unavailable(why)
    sharding = {"strategy": "fsdp", "fsdp_min_params": 1} if strategy == "fsdp" else {}
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60, **sharding)
    written, now = acc.distribute(_two_numbered_saves)(acc, str(tmp_path))
    assert all(written), "a checkpoint just written is in the page cache"
    assert now == {"checkpoint_00000001": {}, "checkpoint_00000002": written[1]}


def test_a_failed_save_leaves_the_previous_checkpoint_intact(acc, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(OSError, match="disk full"):
        acc.distribute(_save_then_fail)(acc, ckpt)
    assert acc.distribute(_load_weight)(acc, ckpt) == [7.0, 7.0]
    acc.distribute(_save_again)(acc, ckpt)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], "no temporary directory is left behind"


def _save_again(acc, ckpt):
    acc.prepare(torch.nn.Linear(2, 1))
    acc.save_state(ckpt)


def test_a_save_that_died_between_its_renames_is_recovered(acc, tmp_path):
    ckpt = tmp_path / "ckpt"
    single = Accelerator(compute_setup="cpu")
    model = single.prepare(torch.nn.Linear(2, 1))
    torch.nn.init.constant_(model.weight, 3.0)
    single.save_state(str(ckpt))
    os.rename(ckpt, f"{ckpt}.old-deadbeef0123")  # the first rename of a swap happened, the second did not
    fresh = Accelerator(compute_setup="cpu")
    restored = fresh.prepare(torch.nn.Linear(2, 1))
    fresh.load_state(str(ckpt))
    assert restored.weight.flatten().tolist() == [3.0, 3.0]


def test_a_users_folders_named_like_what_a_save_leaves_survive_saves_and_pruning(tmp_path):
    single = Accelerator(compute_setup="cpu")
    single.prepare(torch.nn.Linear(2, 1))
    mine = [
        tmp_path / "ckpt.tmp-mine",
        tmp_path / "ckpt.old-notes",
        tmp_path / "runs" / "checkpoint_00000000.tmp-a",
        tmp_path / "runs" / "checkpoint_00000000.old-backup",
    ]
    for folder in mine:
        folder.mkdir(parents=True)
        (folder / "notes.txt").write_text("mine")
    for _ in range(2):
        single.save_state(str(tmp_path / "ckpt"))
        single.save_state(str(tmp_path / "runs"), keep=1)  # prunes what killed saves left beside its checkpoints
    assert all((folder / "notes.txt").read_text() == "mine" for folder in mine), "only what a save made goes"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [
        "checkpoint_00000000",
        "checkpoint_00000000.old-backup",
        "checkpoint_00000000.tmp-a",
    ]


def test_loading_into_different_objects_is_refused(tmp_path):
    single = Accelerator(compute_setup="cpu")
    single.prepare(torch.nn.Linear(2, 1))
    single.save_state(str(tmp_path / "c"))
    other = Accelerator(compute_setup="cpu")
    other.prepare(torch.nn.Linear(2, 1), torch.nn.Linear(2, 1))
    with pytest.raises(CheckpointError, match="holds 1 model state\\(s\\) but this run prepared/registered 2"):
        other.load_state(str(tmp_path / "c"))
    with pytest.raises(TypeError, match="needs state_dict\\(\\) and load_state_dict\\(\\)"):
        other.register_for_checkpointing(object())


def _skipped(acc):
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(32)), batch_size=4))
    acc.skip_first_batches(loader, 2)
    first = [int(i) for (ids,) in loader for i in ids]
    again = [int(i) for (ids,) in loader for i in ids]
    return first, again


def test_skip_first_batches_applies_to_the_next_epoch_only(acc):
    first, again = acc.distribute(_skipped)(acc)
    assert first == [16, 17, 18, 19, 24, 25, 26, 27] and again[:4] == [0, 1, 2, 3]


def _in_the_project(a, epochs_before):
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = a.prepare(model, optimizer)
    resumed = a.resume()  # <project_dir>/checkpoints
    saved = []
    for _ in range(epochs_before):
        a.backward(model(torch.ones(2, 3)).sum())
        optimizer.step()
        optimizer.zero_grad()
        saved.append(a.save_state())
    return resumed, saved, a.load_state(), a.step


def test_project_dir_holds_the_checkpoints_that_save_load_and_resume_without_a_folder_use(tmp_path):
    acc = Accelerator(nprocs=2, compute_setup="cpu", project_dir=tmp_path / "project")
    folder = tmp_path / "project" / "checkpoints"
    resumed, saved, loaded, step = acc.distribute(_in_the_project)(acc, 2)
    assert resumed is None and saved == [str(folder / "checkpoint_00000001"), str(folder / "checkpoint_00000002")]
    assert loaded == saved[-1] and step == 2
    resumed, saved, loaded, step = acc.distribute(_in_the_project)(acc, 1)  # a second run continues the project
    assert resumed == str(folder / "checkpoint_00000002") and saved == [str(folder / "checkpoint_00000003")]
    assert step == 3
    with pytest.raises(
        ValueError,
        match=r"needs a directory, a resume\(directory\) call before it, or "
        r"Accelerator\(project_dir=...\)",
    ):
        Accelerator(compute_setup="cpu").save_state()


def _saved_as_accelerate_names_them(a):
    model = torch.nn.Linear(3, 1)
    model, optimizer = a.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    saved = []
    for _ in range(3):
        a.backward(model(torch.ones(2, 3)).sum())
        optimizer.step()
        optimizer.zero_grad()
        saved.append(a.save_state())
    return saved, a.load_state(), a.project_dir


def test_accelerates_project_configuration_keeps_its_total_limit_of_numbered_checkpoints(tmp_path):
    project = ProjectConfiguration(project_dir=str(tmp_path / "p"), automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(nprocs=2, compute_setup="cpu", project_config=project)
    saved, loaded, project_dir = acc.distribute(_saved_as_accelerate_names_them)(acc)
    folder = tmp_path / "p" / "checkpoints"
    assert saved == [str(folder / f"checkpoint_0000000{step}") for step in (1, 2, 3)] and loaded == saved[-1]
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint_00000002", "checkpoint_00000003"], "total_limit"
    assert project_dir == str(tmp_path / "p")
    with pytest.raises(
        ValueError,
        match=r"ProjectConfiguration\(iteration=4\) is not in qaccel: numbered "
        r"checkpoints are named by the optimizer step",
    ):
        Accelerator(project_config=ProjectConfiguration(iteration=4))
    with pytest.raises(ValueError, match=r"ProjectConfiguration\(total_limit=2\) contradicts keep_checkpoints=3"):
        Accelerator(keep_checkpoints=3, project_config=ProjectConfiguration(total_limit=2))
