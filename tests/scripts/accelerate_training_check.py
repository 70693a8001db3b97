"""Accelerate's training check (src/accelerate/test_utils/scripts/test_script.py, training_check and mock_training,
huggingface/accelerate 16cb6eb8): a DataLoader shuffled by a generator that is re-seeded *after* prepare() must
train N ranks to the model one process trains, with and without Accelerate's seedable sampler and split batches.

Changed from Accelerate's: the imports (qaccel's Accelerator, DataLoaderConfiguration and set_seed); the world
size read from the Accelerator (Accelerate reads its AcceleratorState); AcceleratorState._reset_state() calls
dropped (qaccel keeps no global state); are_the_same_tensors written with qaccel's gather; its GPU-only blocks
(keep_fp32_wrapper with fp16 inputs) left out. Run under torchrun, or as ``python script.py`` (2 ranks).
"""

import sys

import torch
from accelerate.data_loader import SeedableRandomSampler
from accelerate.test_utils import RegressionDataset, RegressionModel
from torch.utils.data import DataLoader

from qaccel import Accelerator
from qaccel.utils import DataLoaderConfiguration, gather, set_seed

ATOL = 1e-6
RTOL = 1e-6


def are_the_same_tensors(tensor):
    tensors = gather(tensor[None].clone())
    return all(torch.equal(t, tensors[0]) for t in tensors)


def generate_baseline_dataloader(train_set, generator, batch_size, use_seedable_sampler=False):
    if use_seedable_sampler:
        sampler = SeedableRandomSampler(generator=generator, data_source=train_set, num_samples=len(train_set))
        return DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    return DataLoader(train_set, batch_size=batch_size, shuffle=True, generator=generator)


def mock_training(length, batch_size, generator, use_seedable_sampler=False):
    set_seed(42)
    generator.manual_seed(42)
    train_set = RegressionDataset(length=length, seed=42)
    train_dl = generate_baseline_dataloader(train_set, generator, batch_size, use_seedable_sampler)
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        for batch in train_dl:
            model.zero_grad()
            output = model(batch["x"])
            loss = torch.nn.functional.mse_loss(output, batch["y"])
            loss.backward()
            optimizer.step()
    return train_set, model


def train(accelerator, train_dl, generator):
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_dl, model, optimizer = accelerator.prepare(train_dl, model, optimizer)
    set_seed(42)
    generator.manual_seed(42)
    for _ in range(3):
        for batch in train_dl:
            model.zero_grad()
            output = model(batch["x"])
            loss = torch.nn.functional.mse_loss(output, batch["y"])
            accelerator.backward(loss)
            optimizer.step()
    return accelerator.unwrap_model(model).cpu()


def training_check(use_seedable_sampler=False):
    num_processes = Accelerator().num_processes
    generator = torch.Generator()
    batch_size = 8
    length = batch_size * 4 * num_processes
    train_set, old_model = mock_training(length, batch_size * num_processes, generator, use_seedable_sampler)
    assert are_the_same_tensors(old_model.a), "Did not obtain the same model on both processes."
    assert are_the_same_tensors(old_model.b), "Did not obtain the same model on both processes."
    checked = []
    for name, config, per_loader in [
        ("no batch split", DataLoaderConfiguration(use_seedable_sampler=use_seedable_sampler), batch_size),
        ("batch split", DataLoaderConfiguration(split_batches=True, use_seedable_sampler=use_seedable_sampler),
         batch_size * num_processes),
        ("bf16", DataLoaderConfiguration(use_seedable_sampler=use_seedable_sampler), batch_size),
    ]:
        accelerator = Accelerator(dataloader_config=config, mixed_precision="bf16" if name == "bf16" else None)
        train_dl = generate_baseline_dataloader(train_set, generator, per_loader, use_seedable_sampler)
        model = train(accelerator, train_dl, generator)
        torch.testing.assert_close(old_model.a, model.a, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(old_model.b, model.b, atol=ATOL, rtol=RTOL)
        checked.append(name)
        accelerator.print(f"Training yielded the same results on one CPU or distributed setup ({name}, "
                          f"use_seedable_sampler={use_seedable_sampler}).")
    return checked


def main():
    return {f"use_seedable_sampler={seedable}": training_check(seedable) for seedable in (False, True)}


if __name__ == "__main__":
    import json
    import os

    if "LOCAL_RANK" in os.environ:  # torchrun: this process is a rank
        result = main()
    else:
        result = Accelerator(nprocs=int(sys.argv[1]) if len(sys.argv) > 1 else 2, compute_setup="cpu").distribute(main)()
    if Accelerator().is_main_process:
        print("RESULT " + json.dumps(result), flush=True)
