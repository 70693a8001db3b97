"""Quick start: one training function, run unchanged by `python`, `torchrun` or `srun`.

    python examples/quickstart.py                                   # qaccel starts 2 ranks
    torchrun --standalone --nproc_per_node 2 examples/quickstart.py  # torchrun's ranks, run in place
    srun -n 2 python examples/quickstart.py                          # each SLURM task is a rank

Until `prepare()` lands, the function shards its data with torch's DistributedSampler and wraps the
model in DistributedDataParallel itself, using the rank facts the Accelerator gives it.
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from qaccel import Accelerator


def make_data(n: int = 512) -> TensorDataset:
    """y = 3x - 1 with a little noise, made here: nothing is downloaded."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, generator=g) * 2 - 1
    return TensorDataset(x, 3 * x - 1 + 0.05 * torch.randn(n, 1, generator=g))


def train(model: torch.nn.Module, dataset: TensorDataset, epochs: int, accelerator: Accelerator) -> dict:
    model = model.to(accelerator.device)
    if accelerator.world_size > 1:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = DistributedSampler(dataset, num_replicas=accelerator.world_size, rank=accelerator.rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(accelerator.device), y.to(accelerator.device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        metrics = accelerator.all_reduce_dict({"loss": loss.item(), "epoch": epoch})
        accelerator.print(f"epoch {metrics['epoch']:.0f}  loss {metrics['loss']:.4f}  ({accelerator.world_size} ranks)")
    weight = (model.module if accelerator.world_size > 1 else model).weight.item()
    return {"loss": metrics["loss"], "weight": weight}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    acc = Accelerator(nprocs=args.nprocs, compute_setup="auto", log_setup="cpu")
    result = acc.distribute(train)(torch.nn.Linear(1, 1), make_data(), args.epochs, acc)
    if acc.is_main_process:
        print(f"final mean loss {result['loss']:.4f}, learned weight {result['weight']:.3f} (true 3)")


if __name__ == "__main__":
    main()
