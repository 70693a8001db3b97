"""Quick start: one training function, run unchanged by `python`, `torchrun` or `srun`.

python examples/quickstart.py                                   # qaccel starts 2 ranks
torchrun --standalone --nproc_per_node 2 examples/quickstart.py  # torchrun's ranks, run in place
srun -n 2 python examples/quickstart.py                          # each SLURM task is a rank
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator


def train(model, optimizer, dataloader, accelerator, epochs=20):
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    for epoch in range(epochs):
        for batch in dataloader:  # this rank's shard, reshuffled every epoch
            x, y = accelerator.prepare_batch(batch)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        metrics = accelerator.all_reduce_dict({"loss": loss.item()})  # mean over ranks
        accelerator.print(f"epoch {epoch}  loss {metrics['loss']:.4f}  ({accelerator.world_size} ranks)")
    return {**metrics, "weight": accelerator.unwrap_model(model).weight.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()

    acc = Accelerator(nprocs=args.nprocs, compute_setup="auto", log_setup="cpu", backend=None, dtype=None)
    x = torch.rand(512, 1, generator=torch.Generator().manual_seed(0)) * 2 - 1
    dataloader = DataLoader(TensorDataset(x, 3 * x - 1), batch_size=32, shuffle=True)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = acc.distribute(train)(model, optimizer, dataloader, acc, args.epochs)
    if acc.is_main_process:
        print(f"final mean loss {metrics['loss']:.5f}, learned weight {metrics['weight']:.3f} (true 3)")


if __name__ == "__main__":
    main()
