"""even_batches=False on real 2-rank gloo worlds: no padding, rank 0 takes one step more in a short last round, and
DDP training still equals one process; collectives the other rank cannot join fail at once instead of hanging."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator

pytestmark = pytest.mark.timeout(180)
SIZE = 36  # 9 batches of 4: rank 0 takes 5 steps an epoch, rank 1 takes 4


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SIZE, 3, generator=g)
    return TensorDataset(torch.arange(SIZE), x, x @ torch.tensor([[1.0], [-2.0], [0.5]]))


def _train(acc, batch_size, folder=None, epochs=2, stop_at=None):
    """AdamW with an LR scheduler stepped every update; returns the parameters, the ids this rank trained on per
    epoch, its steps per epoch, what an uneven evaluation loop saw, and the counts every rank must agree on."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.7)
    loader = DataLoader(_data(), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(3))
    evaluation = DataLoader(_data(), batch_size=batch_size)
    model, optimizer, loader, evaluation, scheduler = acc.prepare(model, optimizer, loader, evaluation, scheduler)
    if folder is not None:
        acc.resume(folder)  # arms the stop agreement, which runs every few steps
    ids, steps = [], []
    for epoch in range(loader.epoch, epochs):
        ids.append([])
        for step, (i, x, y) in enumerate(loader):
            ids[-1] += i.tolist()
            with acc.accumulate(model):
                acc.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                if acc.sync_gradients:
                    scheduler.step()
            if stop_at == (epoch, step):
                acc.save_state()
                return None
        steps.append(len(loader))
    seen = []
    model.eval()
    with torch.no_grad():
        for i, x, y in evaluation:
            seen += i.tolist()
            model(x)
    weights = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in acc.unwrap_model(model).parameters()]
    return {
        "weights": weights,
        "moments": moments,
        "ids": ids,
        "steps": steps,
        "seen": acc.gather_object(seen),
        "agreed": (acc.step, scheduler.last_epoch, optimizer.param_groups[0]["lr"]),
    }


def _close(a, b, tol=1e-6):
    return all(torch.allclose(x, y, atol=tol, rtol=tol) for x, y in zip(a, b))


def test_uneven_epochs_train_as_one_process_and_every_rank_ends_with_rank_0s_state(tmp_path):
    single = Accelerator(nprocs=1, compute_setup="cpu").distribute(_train)(
        Accelerator(nprocs=1, compute_setup="cpu"), 8
    )
    uneven = Accelerator(nprocs=2, compute_setup="cpu", even_batches=False, timeout=60)
    ranks = uneven.distribute(_train, all_results=True)(uneven, 4, str(tmp_path / "ckpt"))
    assert [r["steps"] for r in ranks] == [[5, 5], [4, 4]]
    for epoch in range(2):
        assert sorted(ranks[0]["ids"][epoch] + ranks[1]["ids"][epoch]) == list(range(SIZE)), "no padding"
    assert sorted(ranks[0]["seen"]) == list(range(SIZE)), "evaluation too: every sample once"
    for rank in ranks:
        assert _close(rank["weights"], single["weights"]) and _close(rank["moments"], single["moments"])
        assert rank["agreed"] == single["agreed"] == (10, 10, pytest.approx(0.05 * 0.7**3))
    padded = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
    even = padded.distribute(_train)(padded, 4)
    assert not _close(even["weights"], single["weights"]), "padding changes training: the comparison can fail"


def test_accumulation_with_sync_each_batch_equals_one_process():
    one = Accelerator(nprocs=1, compute_setup="cpu", gradient_accumulation_steps=2)
    single = one.distribute(_train)(one, 8)
    uneven = Accelerator(
        nprocs=2,
        compute_setup="cpu",
        even_batches=False,
        gradient_accumulation_steps=2,
        sync_each_batch=True,
        timeout=60,
    )
    for rank in uneven.distribute(_train, all_results=True)(uneven, 4):
        assert _close(rank["weights"], single["weights"]) and rank["agreed"] == single["agreed"]


def test_resuming_mid_epoch_continues_bitwise(tmp_path):
    uneven = Accelerator(nprocs=2, compute_setup="cpu", even_batches=False, timeout=60)
    straight = uneven.distribute(_train, all_results=True)(uneven, 4)
    uneven.distribute(_train)(uneven, 4, str(tmp_path / "ckpt"), stop_at=(1, 2))
    resumed = uneven.distribute(_train, all_results=True)(uneven, 4, str(tmp_path / "ckpt"))
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(resumed[rank]["weights"], straight[rank]["weights"]))
        assert resumed[rank]["ids"][-1] == straight[rank]["ids"][-1][12:], (
            "the rest of the epoch (3 steps of 4 were done)"
        )


def _joined_as_accelerate_writes_it(acc):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(_data(), batch_size=4))
    steps = []
    for even in (None, False, True):
        with acc.join_uneven_inputs([model], even_batches=even):
            steps.append(sum(1 for _ in loader))
            for _, x, y in loader:
                acc.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
    return steps, acc.unwrap_model(model).weight.detach().clone()


def test_join_uneven_inputs_overrides_even_batches_inside_its_block(acc):
    (steps0, weight0), (steps1, weight1) = acc.distribute(_joined_as_accelerate_writes_it, all_results=True)(acc)
    assert steps0 == [5, 5, 5] and steps1 == [5, 4, 5], "None keeps the Accelerator's (padded) value"
    assert torch.equal(weight0, weight1)
    with pytest.raises(ValueError, match="needs strategy='ddp'"):
        fsdp = Accelerator(nprocs=1, compute_setup="cpu", strategy="fsdp")
        with fsdp.join_uneven_inputs([], even_batches=False):
            pass


def _gather_each_step(acc):
    loader = acc.prepare(DataLoader(_data(), batch_size=4))
    for i, _, _ in loader:
        acc.gather_for_metrics(i)


def _reduce_each_step(acc):
    loader = acc.prepare(DataLoader(_data(), batch_size=4))
    for i, _, _ in loader:
        acc.all_reduce_dict({"n": float(len(i))})


def test_collectives_the_other_rank_cannot_join_fail_at_once():
    uneven = Accelerator(nprocs=2, compute_setup="cpu", even_batches=False, timeout=60)
    with pytest.raises(RuntimeError, match=r"gather_for_metrics\(\) needs every rank .* take \[5, 4\] steps"):
        uneven.distribute(_gather_each_step)(uneven)
    with pytest.raises(
        RuntimeError,
        match=r"all_reduce_dict\(\) cannot run here: step 5 of this epoch is taken by "
        r"rank\(s\) \[0\] only",
    ):
        uneven.distribute(_reduce_each_step)(uneven)


def test_what_cannot_be_uneven_is_refused_at_construction():
    with pytest.raises(ValueError, match="even_batches=False needs strategy='ddp'"):
        Accelerator(nprocs=2, compute_setup="cpu", even_batches=False, strategy="fsdp")
    with pytest.raises(ValueError, match="needs sync_each_batch=True"):
        Accelerator(nprocs=2, compute_setup="cpu", even_batches=False, gradient_accumulation_steps=2)
    with pytest.raises(TypeError, match="even_batches must be True or False"):
        Accelerator(nprocs=2, compute_setup="cpu", even_batches="no")
