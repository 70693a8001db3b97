"""step_scheduler_with_optimizer: prepared LR schedulers are yours by default, or stepped as Accelerate's."""

from __future__ import annotations

import torch

from qaccel import Accelerator


def test_a_prepared_scheduler_steps_as_accelerates_only_when_asked():
    model = torch.nn.Linear(1, 1)
    mine = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    assert mine.prepare(scheduler) is scheduler, "yours, unchanged, by default"
    theirs = Accelerator(cpu=True, gradient_accumulation_steps=2, step_scheduler_with_optimizer=True)
    optimizer = theirs.prepare(torch.optim.SGD(model.parameters(), lr=1.0))
    prepared = theirs.prepare(torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5))
    lrs = []
    for _ in range(4):
        with theirs.accumulate(model):
            optimizer.step()
            prepared.step()
        lrs.append(prepared.get_last_lr()[0])
    assert lrs == [1.0, 0.5, 0.5, 0.25], "it steps on updates only (once per rank: one here)"
    assert prepared.state_dict()["last_epoch"] == 2


def _scheduled_steps(acc, model, optimizer, scheduler, first):
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if first == "scheduler":
            scheduler.step()
        optimizer.step()
        scheduler.step()
    return [str(w.message)[:60] for w in caught]


def test_a_scheduler_that_crossed_into_the_ranks_still_knows_its_optimizers_steps():
    """The optimizer and scheduler are pickled into the ranks: torch's check that optimizer.step() comes first
    still works there, and a right order warns nothing."""
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    assert acc.distribute(_scheduled_steps, all_results=True)(acc, model, optimizer, scheduler, "optimizer") == [[], []]
    wrong = acc.distribute(_scheduled_steps)(acc, model, optimizer, scheduler, "scheduler")
    assert wrong == ["Detected call of `lr_scheduler.step()` before `optimizer.ste"], wrong
