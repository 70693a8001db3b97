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
