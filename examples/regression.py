"""Regression: a small MLP learns y = sin(3x) from noisy points, with the qadence-style ``train`` loop.

    python examples/regression.py                                   # qaccel starts 2 ranks (--nprocs)
    torchrun --standalone --nproc_per_node 2 examples/regression.py  # torchrun's ranks, run in place
    srun -n 2 python examples/regression.py                          # each SLURM task is a rank

Options: --epochs N, --nprocs N (ignored under torchrun/srun, whose world size wins), --dtype float64.
The data (a few thousand points) is made here: nothing is downloaded.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator


def make_data(n: int, seed: int) -> TensorDataset:
    """n points x in [-1, 1] with y = sin(3x) + noise (std 0.1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=g) * 2 - 1
    y = torch.sin(3 * x) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataloader: DataLoader,
    accelerator: Accelerator,
    *,
    val_loader: DataLoader,
    epochs: int,
) -> dict:
    """Runs on every rank. Returns the train/validation loss (mean over ranks) and the first epoch's loss."""
    model, optimizer, dataloader, val_loader = accelerator.prepare(model, optimizer, dataloader, val_loader)
    accelerator.print(
        f"{accelerator.world_size} rank(s) on {accelerator.device}, model in {next(model.parameters()).dtype}, "
        f"{len(dataloader)} steps per epoch per rank"
    )
    every = max(1, epochs // 5)  # print about five progress lines
    for epoch in range(epochs):
        model.train()
        total, steps = 0.0, 0
        for batch in dataloader:  # this rank's share of the batches, reshuffled each epoch
            x, y = accelerator.prepare_batch(batch)  # on the device, cast to the Accelerator's dtype
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients over ranks here
            optimizer.step()
            total, steps = total + loss.item(), steps + 1
        epoch_loss = accelerator.all_reduce_dict({"loss": total / steps})["loss"]  # mean over ranks
        if epoch == 0:
            first_loss = epoch_loss
        if epoch == 0 or (epoch + 1) % every == 0 or epoch == epochs - 1:
            accelerator.print(f"epoch {epoch + 1:3d}/{epochs}  train loss {epoch_loss:.4f}")

    # Validation: every rank's squared errors are gathered, so the loss is over the exact validation set.
    model.eval()
    squared = []
    with torch.no_grad():
        for batch in val_loader:
            x, y = accelerator.prepare_batch(batch)
            squared.append(accelerator.gather_for_metrics((model(x) - y) ** 2))
    val_loss = torch.cat(squared).mean().item()
    return accelerator.all_reduce_dict({"first_loss": first_loss, "loss": epoch_loss, "val_loss": val_loss})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, help="ranks to start under plain python (default 2)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = parser.parse_args()
    if args.epochs < 1 or args.nprocs < 1:
        parser.error("--epochs and --nprocs must be at least 1")

    # Create the Accelerator first: under plain python it starts warming up the rank launcher at once.
    acc = Accelerator(nprocs=args.nprocs, compute_setup="auto", log_setup="cpu", dtype=getattr(torch, args.dtype))

    torch.manual_seed(0)  # same initial weights on every rank under torchrun/srun (DDP also syncs them)
    model = torch.nn.Sequential(
        torch.nn.Linear(1, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    # A seeded generator makes the shuffling seed, so the run is the same however it is started.
    shuffle_rng = torch.Generator().manual_seed(0)
    dataloader = DataLoader(make_data(4000, seed=0), batch_size=64, shuffle=True, generator=shuffle_rng)
    val_loader = DataLoader(make_data(1000, seed=1), batch_size=64)

    metrics = acc.distribute(train)(model, optimizer, dataloader, acc, val_loader=val_loader, epochs=args.epochs)

    if acc.is_main_process:
        print(
            f"{acc.world_size} rank(s), {args.dtype}: train loss {metrics['first_loss']:.4f} -> {metrics['loss']:.4f}, "
            f"validation loss {metrics['val_loss']:.4f} (noise floor 0.0100)"
        )
    if args.epochs > 1 and not metrics["loss"] < 0.5 * metrics["first_loss"]:
        raise SystemExit(f"loss did not go down: {metrics}")


if __name__ == "__main__":
    main()
