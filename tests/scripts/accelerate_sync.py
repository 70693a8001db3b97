"""Accelerate's own gradient accumulation checks (its test_sync.py script: accumulation with every combination of
split_batches, dispatch_batches and sync_each_batch, with an optimizer and an LR scheduler, and loops over two
loaders), ported to qaccel. Changes beside the import: ``set_seed`` is the Accelerator's method,
Accelerate's test RegressionDataset/RegressionModel are written out below, its ``GradientState._reset_state()`` is
not needed (qaccel's state is per Accelerator), the scheduler checks pass
``step_scheduler_with_optimizer=True``, which Accelerate does by default, and the data set is seeded
(``seed=0``): Accelerate's draws it from fresh OS entropy in every process, so that, now and then, a rank's
unsynchronised gradients came within the checks' 1 % of the synchronised ones and "in sync" failed.

    python accelerate_sync.py      # qaccel starts 2 ranks: distribute(main)

Prints ``RESULT {"passed": N}`` on the main process once every check passed on every rank.
"""

import json
import logging
from copy import deepcopy

import numpy as np
import torch
import torch.nn.functional as F
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from qaccel import Accelerator, DataLoaderConfiguration, GradientAccumulationPlugin  # was: from accelerate ...

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


class RegressionDataset:
    def __init__(self, a=2, b=3, length=64, seed=None):
        rng = np.random.default_rng(seed)
        self.length = length
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = a * self.x + b + rng.normal(scale=0.1, size=(length,)).astype(np.float32)

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class RegressionModel(torch.nn.Module):
    def __init__(self, a=0, b=0):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a).float())
        self.b = torch.nn.Parameter(torch.tensor(b).float())

    def forward(self, x=None):
        return x * self.a + self.b


def check_model_parameters(model_a, model_b, did_step, iteration, **kwargs):
    for param, grad_param in zip(model_a.parameters(), model_b.parameters()):
        if not did_step:
            assert torch.allclose(param.grad, grad_param.grad) is False, f"in sync at iteration {iteration}"
        else:
            assert torch.allclose(param.grad, grad_param.grad, **kwargs) is True, f"not in sync at {iteration}"


def step_model(model, input, target, accelerator, do_backward=True):
    model.train()
    loss = F.mse_loss(model(input), target.to(model(input).device))
    if not do_backward:
        loss /= accelerator.gradient_accumulation_steps
        loss.backward()
    else:
        accelerator.backward(loss)


def get_training_setup(accelerator, sched=False):
    accelerator.set_seed(42)
    model = RegressionModel()
    ddp_model = deepcopy(model)
    dataloader = DataLoader(RegressionDataset(length=80, seed=0), batch_size=16)  # was: RegressionDataset(length=80)
    model.to(accelerator.device)
    if sched:
        opt = AdamW(params=model.parameters(), lr=1e-3)
        ddp_opt = AdamW(params=ddp_model.parameters(), lr=1e-3)
        sched = LambdaLR(opt, lr_lambda=lambda epoch: epoch**0.65)
        ddp_sched = LambdaLR(ddp_opt, lr_lambda=lambda epoch: epoch**0.65)
        ddp_model, ddp_opt, ddp_sched, dataloader = accelerator.prepare(ddp_model, ddp_opt, ddp_sched, dataloader)
        return model, opt, sched, dataloader, ddp_model, ddp_opt, ddp_sched
    ddp_model, dataloader = accelerator.prepare(ddp_model, dataloader)
    return model, ddp_model, dataloader


def test_gradient_accumulation(split_batches=False, dispatch_batches=False, sync_each_batch=False):
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(split_batches=split_batches, dispatch_batches=dispatch_batches),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch),
    )
    model, ddp_model, dataloader = get_training_setup(accelerator)
    for iteration, batch in enumerate(dataloader):
        ddp_input, ddp_target = batch.values()
        input, target = accelerator.gather((ddp_input, ddp_target))
        step_model(model, input, target, accelerator, False)
        with accelerator.accumulate(ddp_model):
            step_model(ddp_model, ddp_input, ddp_target, accelerator)
        for param, ddp_param in zip(model.parameters(), ddp_model.parameters()):
            if ((iteration + 1) % 2 == 0) or (iteration == len(dataloader) - 1) or sync_each_batch:
                assert torch.allclose(param.grad, ddp_param.grad) is True, f"not in sync at {iteration}"
            else:
                assert torch.allclose(param.grad, ddp_param.grad) is False, f"in sync at {iteration}"


def test_gradient_accumulation_with_opt_and_scheduler(split_batches=False, dispatch_batches=False,
                                                      sync_each_batch=False):
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(split_batches=split_batches, dispatch_batches=dispatch_batches),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch),
        step_scheduler_with_optimizer=True,  # Accelerate's default
    )
    model, opt, sched, dataloader, ddp_model, ddp_opt, ddp_sched = get_training_setup(accelerator, True)
    for iteration, batch in enumerate(dataloader):
        ddp_input, ddp_target = batch.values()
        input, target = accelerator.gather((ddp_input, ddp_target))
        model.train()
        ddp_model.train()
        step_model(model, input, target, accelerator, False)
        opt.step()
        if ((iteration + 1) % 2 == 0) or ((iteration + 1) == len(dataloader)):
            for _ in range(1 if split_batches else accelerator.num_processes):
                sched.step()
        with accelerator.accumulate(ddp_model):
            step_model(ddp_model, ddp_input, ddp_target, accelerator)
            ddp_opt.step()
            ddp_sched.step()
        assert opt.param_groups[0]["lr"] == ddp_opt.param_groups[0]["lr"], "learning rates differ"
        did_step = (((iteration + 1) % 2) == 0) or ((iteration + 1) == len(dataloader))
        check_model_parameters(model, ddp_model, did_step or sync_each_batch, iteration, rtol=1e-2)
        if did_step:
            opt.zero_grad()
        ddp_opt.zero_grad()
        torch.manual_seed(1337 + iteration)


def test_dataloader_break():
    accelerator = Accelerator(cpu=True)
    first_dataloader = DataLoader(RegressionDataset(length=80), batch_size=16)
    second_dataloader = DataLoader(RegressionDataset(length=96), batch_size=16)
    first_dataloader, second_dataloader = accelerator.prepare(first_dataloader, second_dataloader)
    assert accelerator.gradient_state.active_dataloader is None
    for iteration, _ in enumerate(first_dataloader):
        assert id(accelerator.gradient_state.active_dataloader) == id(first_dataloader)
        if iteration < len(first_dataloader) - 1:
            assert not accelerator.gradient_state.end_of_dataloader
            if iteration == 1:
                for batch_num, _ in enumerate(second_dataloader):
                    assert id(accelerator.gradient_state.active_dataloader) == id(second_dataloader)
                    if batch_num < len(second_dataloader) - 1:
                        assert not accelerator.gradient_state.end_of_dataloader
                    else:
                        assert accelerator.gradient_state.end_of_dataloader
        else:
            assert accelerator.gradient_state.end_of_dataloader
    assert accelerator.gradient_state.active_dataloader is None


def main():
    passed = 0
    for split_batches in (False, True):
        for dispatch_batches in (False, True):
            for sync_each_batch in (False, True):
                test_gradient_accumulation(split_batches, dispatch_batches, sync_each_batch)
                passed += 1
                if split_batches or dispatch_batches or sync_each_batch:
                    test_gradient_accumulation_with_opt_and_scheduler(split_batches, dispatch_batches,
                                                                      sync_each_batch)
                    passed += 1
    test_gradient_accumulation_with_opt_and_scheduler()
    test_dataloader_break()
    passed += 2
    accelerator = Accelerator(cpu=True)
    counts = accelerator.gather_object([passed])
    if accelerator.is_main_process:
        print("RESULT " + json.dumps({"passed": counts[0], "ranks": counts}), flush=True)


if __name__ == "__main__":
    Accelerator(nprocs=2, cpu=True).distribute(main)()
