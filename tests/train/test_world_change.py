"""Resuming on another number of ranks: the interrupted epoch goes on where all ranks had stopped together, so
across the two worlds every sample of it is taken exactly once; with the global batch kept (split_batches, or
keep_global_batch scaling gradient accumulation) the resumed run ends where the uninterrupted one does, within
1e-5."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
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


def _run(acc, folder, batch_size, stop=None, epochs=3, accumulate=True, data="map"):
    """Train ``epochs`` epochs from the newest checkpoint in ``folder``; at ``stop`` (epoch, step) save and return
    None. Returns the ids of the real samples this rank trained on per epoch, and the parameters. ``accumulate``:
    the step is inside ``accumulate()``; ``data``: "map" (shuffled, 2 workers), "stream" or "own_sampler" (a
    DistributedSampler of the user's)."""
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
                return ids, None
    return ids, list(acc.get_state_dict(model).values())  # full tensors on the main process (FSDP: gathered)


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


@pytest.mark.parametrize(("before", "after"), [(4, 2), (4, 1), (1, 4)])
def test_split_batches_resumes_on_another_world_and_ends_as_the_uninterrupted_run(tmp_path, before, after):
    straight = _world(before, split_batches=True).distribute(_run, all_results=True)(
        _world(before, split_batches=True), str(tmp_path / "straight"), 8
    )
    first = _world(before, split_batches=True)
    stopped = first.distribute(_run, all_results=True)(first, str(tmp_path / "ckpt"), 8, stop=(1, 3))
    second = _world(after, split_batches=True)
    resumed = second.distribute(_run, all_results=True)(second, str(tmp_path / "ckpt"), 8)
    _every_epoch_once(stopped, resumed)
    for got, want in zip(resumed[0][1], straight[0][1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    line = f"(written by {before} rank{'s' * (before > 1)}) on {after} rank{'s' * (after > 1)} at epoch 1, batch 4 of 8"
    assert line + "; global batch 8 kept (split_batches)" in resumed[0][0]["said"]


def test_without_split_batches_the_batch_per_rank_is_kept_and_resume_says_so(tmp_path, capsys):
    first = _world(4)
    stopped = first.distribute(_run, all_results=True)(first, str(tmp_path / "ckpt"), 2, stop=(1, 3))
    assert cli.main(["inspect", str(tmp_path / "ckpt")]) == 0
    shown = capsys.readouterr().out
    assert "checkpoint_00000012" in shown and "written by   4 rank(s)" in shown
    assert "step         12 optimizer updates, of 1 micro-step(s) each" in shown
    assert (
        "loader 0     epoch 1, 16 of the epoch's batches done by all ranks together (4 per rank); batch 2 per "
        "rank, global batch 8"
    ) in shown
    second = _world(2)
    resumed = second.distribute(_run, all_results=True)(second, str(tmp_path / "ckpt"), 2)
    _every_epoch_once(stopped, resumed)
    assert (
        "(written by 4 ranks) on 2 ranks at epoch 1, batch 8 of 15; batch per rank 2 kept, so the global "
        "batch changes from 8 to 4 (keep_global_batch=True keeps it)"
    ) in resumed[0][0]["said"]


def test_a_sharded_run_resumes_on_fewer_ranks(tmp_path):
    options = {"split_batches": True, "strategy": "fsdp", "fsdp_min_params": 1}
    straight = _world(4, **options).distribute(_run, all_results=True)(
        _world(4, **options), str(tmp_path / "straight"), 8
    )
    first = _world(4, **options)
    stopped = first.distribute(_run, all_results=True)(first, str(tmp_path / "ckpt"), 8, stop=(1, 3))
    second = _world(2, **options)
    resumed = second.distribute(_run, all_results=True)(second, str(tmp_path / "ckpt"), 8)
    _every_epoch_once(stopped, resumed)
    for got, want in zip(resumed[0][1], straight[0][1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_keep_global_batch_scales_gradient_accumulation_and_ends_as_the_uninterrupted_run(tmp_path):
    """4 ranks x 3 samples, resumed on 2 ranks: 2 micro-steps of 3 per update keep the global batch of 12."""
    straight = _world(4).distribute(_run, all_results=True)(_world(4), str(tmp_path / "straight"), 3)
    first = _world(4, keep_global_batch=True)
    stopped = first.distribute(_run, all_results=True)(first, str(tmp_path / "ckpt"), 3, stop=(1, 3))
    second = _world(2, keep_global_batch=True)
    resumed = second.distribute(_run, all_results=True)(second, str(tmp_path / "ckpt"), 3)
    _every_epoch_once(stopped, resumed)
    for got, want in zip(resumed[0][1], straight[0][1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (
        "(written by 4 ranks) on 2 ranks at epoch 1, batch 8 of 10; global batch 12 kept (gradient accumulation 2)"
    ) in resumed[0][0]["said"]


def test_keep_global_batch_refuses_at_resume_a_world_that_cannot_keep_it_and_a_loop_outside_accumulate(
    tmp_path, capsys
):
    first = _world(4, keep_global_batch=True)
    first.distribute(_run)(first, str(tmp_path / "ckpt"), 3, stop=(1, 3))
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
