"""Resuming on another number of ranks: the interrupted epoch goes on where all ranks had stopped together, so
across the two worlds every sample of it is taken exactly once; with the global batch kept (split_batches, or
keep_global_batch scaling gradient accumulation) the resumed run ends where the uninterrupted one does, within
1e-5.

The uninterrupted run is the first world's run that saved the checkpoint mid-epoch and went on to its end (saving
changes nothing of a run: that run, too, must take every sample once); a checkpoint several tests resume is written
once per session and copied into each test's own folder."""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from support.procs import once_per_session
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from qaccel import Accelerator, cli

pytestmark = pytest.mark.timeout(300)
SIZE = 60  # 7 full batches of 8 and one of 4: the last step is padded


class Curve(Dataset):
    def __len__(self):
        return SIZE

    def __getitem__(self, i):
        x = torch.tensor([i / SIZE, (i % 5) / 5.0])
        return i, x, torch.sin(3 * x[:1]) + x[1:]


class Stream(IterableDataset):
    def __iter__(self):
        curve = Curve()
        return (curve[i] for i in range(SIZE))


def _loader(acc, batch_size, data):
    if data == "stream":
        return DataLoader(Stream(), batch_size=batch_size)
    if data == "own_sampler":
        sampler = DistributedSampler(Curve(), num_replicas=acc.world_size, rank=acc.rank, seed=4)
        return DataLoader(Curve(), batch_size=batch_size, sampler=sampler)
    return DataLoader(
        Curve(), batch_size=batch_size, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(4)
    )


def _run(acc, folder, batch_size, stop=None, epochs=3, accumulate=True, data="map", go_on=False):
    """Train ``epochs`` epochs from the newest checkpoint in ``folder``; at ``stop`` (epoch, step) save and return
    None, or with ``go_on`` save and train on to the end. Returns the ids of the real samples this rank trained on
    per epoch (up to the stop, if any; with ``go_on`` those of the whole run under "whole run"), and the
    parameters. ``accumulate``: the step is inside ``accumulate()``; ``data``: "map" (shuffled, 2 workers),
    "stream" or "own_sampler" (a DistributedSampler of the user's)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.8)
    loader = _loader(acc, batch_size, data)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        acc.resume(folder)
    ids = {"said": said.getvalue()}
    saved = None
    for epoch in range(loader.epoch, epochs):
        for step, (i, x, y) in enumerate(loader):
            ids.setdefault(epoch, []).extend(i[: len(i) - acc.padding_in_batch].tolist())
            if acc.even_batches:  # (gather_for_metrics refuses steps only some ranks take)
                ids.setdefault(("gathered", epoch), []).extend(acc.gather_for_metrics(i).tolist())
            with acc.accumulate(model) if accumulate else contextlib.nullcontext():
                acc.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            if acc.sync_gradients:
                scheduler.step()
            if (epoch, step) == stop:
                acc.save_state()
                if not go_on:
                    return ids, None
                saved = copy.deepcopy(ids)
    params = list(acc.get_state_dict(model).values())  # full tensors on the main process (FSDP: gathered)
    return ({**saved, "whole run": ids} if saved is not None else ids), params


def _every_epoch_once(*runs, dropped=None):
    """Each epoch's ids over every rank of every run are the dataset, each sample once (but for the samples
    ``dropped`` names per epoch)."""
    for epoch in range(3):
        want = [i for i in range(SIZE) if i not in (dropped or {}).get(epoch, ())]
        seen = sorted(i for ranks in runs for ids, _ in ranks for i in ids.get(epoch, []))
        assert seen == want, f"epoch {epoch}"
        gathered = [ranks[0][0][("gathered", epoch)] for ranks in runs if ("gathered", epoch) in ranks[0][0]]
        if gathered:  # rank 0's gather_for_metrics: every sample once, the padding left out, in both worlds
            assert sorted(i for part in gathered for i in part) == want, f"gather_for_metrics, epoch {epoch}"


def _world(n, **options):
    return Accelerator(nprocs=n, compute_setup="cpu", timeout=60, **options)


def _stopped_and_gone_on(n, folder, batch_size, **options):
    """A run of ``n`` ranks that saves at epoch 1, step 3 and goes on: every rank's ids up to the checkpoint, and
    the parameters it ends with, those of the uninterrupted run (checked: it took every sample once)."""
    acc = _world(n, **options)
    stopped = acc.distribute(_run, all_results=True)(acc, str(folder), batch_size, stop=(1, 3), go_on=True)
    _every_epoch_once([(ids["whole run"], None) for ids, _ in stopped])
    return stopped


def _shared(tmp_path_factory, name, n, batch_size, **options):
    """``_stopped_and_gone_on`` run once per session (for every pytest-xdist worker): the folder holding its
    checkpoints ("ckpt") and what its ranks returned."""

    def compute():
        tmp = tmp_path_factory.mktemp(name)
        stopped = _stopped_and_gone_on(n, tmp / "ckpt", batch_size, **options)
        (tmp / "stopped.pickle").write_bytes(pickle.dumps(stopped))
        return str(tmp)

    return Path(once_per_session(tmp_path_factory, f"world_change_{name}", compute))


def _copied(shared, tmp_path):
    """The shared run's checkpoints copied to ``tmp_path / "ckpt"``, for this test alone: what its ranks returned."""
    shutil.copytree(shared / "ckpt", tmp_path / "ckpt")
    return pickle.loads((shared / "stopped.pickle").read_bytes())


@pytest.fixture(scope="module")
def split_4(tmp_path_factory):
    """4 ranks with split_batches (8 samples a step), saved at step 12 (epoch 1, batch 4 of 8) and gone on."""
    return _shared(tmp_path_factory, "split_4", 4, 8, split_batches=True)


@pytest.fixture(scope="module")
def by_4_of_3(tmp_path_factory):
    """4 ranks x 3 samples (keep_global_batch acts at resume only: a run resuming nothing trains as any), saved at
    step 9 (epoch 1, batch 4 of 5) and gone on."""
    return _shared(tmp_path_factory, "by_4_of_3", 4, 3, keep_global_batch=True)


@pytest.mark.parametrize(("before", "after"), [(4, 2), (4, 1), (1, 4)])
def test_split_batches_resumes_on_another_world_and_ends_as_the_uninterrupted_run(request, tmp_path, before, after):
    if before == 4:  # the 4 ranks' run shared by both tests that resume it
        stopped = _copied(request.getfixturevalue("split_4"), tmp_path)
    else:
        stopped = _stopped_and_gone_on(before, tmp_path / "ckpt", 8, split_batches=True)
    second = _world(after, split_batches=True)
    resumed = second.distribute(_run, all_results=True)(second, str(tmp_path / "ckpt"), 8)
    _every_epoch_once(stopped, resumed)
    for got, want in zip(resumed[0][1], stopped[0][1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    line = f"(written by {before} rank{'s' * (before > 1)}) on {after} rank{'s' * (after > 1)} at epoch 1, batch 4 of 8"
    assert line + "; global batch 8 kept (split_batches)" in resumed[0][0]["said"]


def test_without_split_batches_the_batch_per_rank_is_kept_and_resume_says_so(by_4_of_3, tmp_path, capsys):
    stopped = _copied(by_4_of_3, tmp_path)
    assert cli.main(["inspect", str(tmp_path / "ckpt")]) == 0
    shown = capsys.readouterr().out
    assert "checkpoint_00000009" in shown and "written by   4 rank(s)" in shown
    assert "step         9 optimizer updates, of 1 micro-step(s) each" in shown
    assert (
        "loader 0     epoch 1, 16 of the epoch's batches done by all ranks together (4 per rank); batch 3 per "
        "rank, global batch 12"
    ) in shown
    second = _world(2)
    resumed = second.distribute(_run, all_results=True)(second, str(tmp_path / "ckpt"), 3)
    _every_epoch_once(stopped, resumed)
    assert (
        "(written by 4 ranks) on 2 ranks at epoch 1, batch 8 of 10; batch per rank 3 kept, so the global "
        "batch changes from 12 to 6 (keep_global_batch=True keeps it)"
    ) in resumed[0][0]["said"]


def test_a_sharded_run_resumes_on_fewer_ranks(tmp_path):
    options = {"split_batches": True, "strategy": "fsdp", "fsdp_min_params": 1}
    stopped = _stopped_and_gone_on(4, tmp_path / "ckpt", 8, **options)
    second = _world(2, **options)
    resumed = second.distribute(_run, all_results=True)(second, str(tmp_path / "ckpt"), 8)
    _every_epoch_once(stopped, resumed)
    for got, want in zip(resumed[0][1], stopped[0][1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_keep_global_batch_scales_gradient_accumulation_and_ends_as_the_uninterrupted_run(by_4_of_3, tmp_path):
    """4 ranks x 3 samples, resumed on 2 ranks: 2 micro-steps of 3 per update keep the global batch of 12."""
    stopped = _copied(by_4_of_3, tmp_path)
    second = _world(2, keep_global_batch=True)
    resumed = second.distribute(_run, all_results=True)(second, str(tmp_path / "ckpt"), 3)
    _every_epoch_once(stopped, resumed)
    for got, want in zip(resumed[0][1], stopped[0][1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (
        "(written by 4 ranks) on 2 ranks at epoch 1, batch 8 of 10; global batch 12 kept (gradient accumulation 2)"
    ) in resumed[0][0]["said"]


def test_keep_global_batch_refuses_at_resume_a_world_that_cannot_keep_it_and_a_loop_outside_accumulate(
    by_4_of_3, tmp_path
):
    _copied(by_4_of_3, tmp_path)
    three = _world(3, keep_global_batch=True)
    with pytest.raises(
        Exception,
        match=r"written by 4 ranks with gradient accumulation 1: keep_global_batch cannot "
        r"keep its global batch on 3 ranks \(4 x 1 = 4 micro-batches per update do not divide by 3\); "
        r"resume on 1, 2, 4 ranks, or with keep_global_batch=False .*nothing was loaded",
    ):
        three.distribute(_run)(three, str(tmp_path / "ckpt"), 3)
    two = _world(2, keep_global_batch=True)
    with pytest.raises(
        RuntimeError,
        match=r"gradient accumulation of 2 micro-steps \(keep_global_batch, resuming "
        r"checkpoint_00000009 of 4 ranks on 2\) needs each training step inside `with "
        r"accelerator.accumulate\(model\):`",
    ):
        two.distribute(_run)(two, str(tmp_path / "ckpt"), 3, accumulate=False)


@pytest.mark.parametrize(
    ("options", "data"),
    [
        ({"even_batches": False}, "map"),
        ({"dispatch_batches": True}, "map"),
        ({}, "stream"),
        ({"dispatch_batches": True}, "stream"),
    ],
)
def test_uneven_dispatched_and_streamed_epochs_resume_on_fewer_ranks_taking_every_sample_once(tmp_path, options, data):
    first = _world(4, **options)
    stopped = first.distribute(_run, all_results=True)(first, str(tmp_path / "ckpt"), 2, stop=(1, 3), data=data)
    second = _world(2, **options)
    resumed = second.distribute(_run, all_results=True)(second, str(tmp_path / "ckpt"), 2, data=data)
    # a stream's incomplete last round is dropped: 30 batches make 7 rounds of 4 ranks (epoch 0), 15 of 2
    _every_epoch_once(stopped, resumed, dropped={0: range(56, 60)} if data == "stream" else None)
    assert "(written by 4 ranks) on 2 ranks at epoch 1, batch 8" in resumed[0][0]["said"]


def test_a_distributed_sampler_of_the_users_is_refused_on_another_world_before_anything_loads(tmp_path):
    first = _world(2)
    first.distribute(_run)(first, str(tmp_path / "ckpt"), 2, stop=(1, 3), data="own_sampler")
    second = _world(1)
    with pytest.raises(
        Exception,
        match=r"cannot be loaded into prepared DataLoader 0: this DataLoader's "
        r"DistributedSampler of yours shards for 1 ranks, and its checkpoint was written by 2: .*"
        r"nothing was loaded",
    ):
        second.distribute(_run)(second, str(tmp_path / "ckpt"), 2, data="own_sampler")
