"""Regression: a small MLP learns y = sin(3x) from noisy points, with the qadence-style ``train`` loop.

    python examples/regression.py                                   # qaccel starts 2 ranks (--nprocs)
    torchrun --standalone --nproc_per_node 2 examples/regression.py  # torchrun's ranks, run in place
    srun -n 2 python examples/regression.py                          # each SLURM task is a rank

Options: --epochs N (the total, also when resuming), --nprocs N (ignored under torchrun/srun, whose world
size wins), --dtype float64, --accumulate K (an optimizer update every K batches), --bf16 (bf16 mixed
precision, CPU or GPU; not with float64), --checkpoint DIR (save_state after every epoch) and --resume
(load_state from DIR first and train the remaining epochs).
The data (a few thousand points) is made here: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator


def make_data(n: int, seed: int) -> TensorDataset:
    """n points x in [-1, 1] with y = sin(3x) + noise (std 0.1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=g) * 2 - 1
    y = torch.sin(3 * x) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class Progress:
    """Epochs done and their first/last train loss: save_state() writes it, load_state() restores it."""

    def __init__(self) -> None:
        self.epochs, self.first_loss, self.loss = 0, float("nan"), float("nan")

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataloader: DataLoader,
    accelerator: Accelerator,
    *,
    val_loader: DataLoader,
    epochs: int,
    checkpoint: str | None = None,
    resume: bool = False,
) -> dict:
    """Runs on every rank. Returns the train/validation loss (mean over ranks) and the first epoch's loss."""
    model, optimizer, dataloader, val_loader = accelerator.prepare(model, optimizer, dataloader, val_loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if resume:  # weights, Adam state, data order, every rank's RNG states and progress, as they were saved
        accelerator.load_state(checkpoint)
        accelerator.print(f"resumed from {checkpoint} after epoch {progress.epochs}/{epochs}")
    accelerator.print(
        f"{accelerator.world_size} rank(s) on {accelerator.device}, model in {next(model.parameters()).dtype}, "
        f"{len(dataloader)} steps per epoch per rank"
    )
    every = max(1, epochs // 5)  # print about five progress lines
    start = progress.epochs
    for epoch in range(start, epochs):
        model.train()
        total, steps = 0.0, 0
        for batch in dataloader:  # this rank's share of the batches, reshuffled each epoch
            x, y = accelerator.prepare_batch(batch)  # on the device, cast to the Accelerator's dtype
            with accelerator.accumulate(model):  # one micro-step: an update every --accumulate batches
                loss = torch.nn.functional.mse_loss(model(x), y)  # forward under autocast with --bf16
                accelerator.backward(loss)  # on update steps DDP averages the gradients over ranks here
                optimizer.step()  # does nothing on accumulation steps, nor does zero_grad()
                optimizer.zero_grad()
            total, steps = total + loss.item(), steps + 1
        epoch_loss = accelerator.all_reduce_dict({"loss": total / steps})["loss"]  # mean over ranks
        progress.epochs, progress.loss = epoch + 1, epoch_loss
        if epoch == 0:
            progress.first_loss = epoch_loss
        if epoch == start or (epoch + 1) % every == 0 or epoch == epochs - 1:
            accelerator.print(f"epoch {epoch + 1:3d}/{epochs}  train loss {epoch_loss:.4f}")
        if checkpoint:
            accelerator.save_state(checkpoint)  # on every rank: it is collective

    # Validation: every rank's squared errors are gathered, so the loss is over the exact validation set.
    model.eval()
    squared = []
    with torch.no_grad():
        for batch in val_loader:
            x, y = accelerator.prepare_batch(batch)
            squared.append(accelerator.gather_for_metrics((model(x) - y) ** 2))
    val_loss = torch.cat(squared).mean().item()
    return accelerator.all_reduce_dict({"first_loss": progress.first_loss, "loss": progress.loss, "val_loss": val_loss})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, help="ranks to start under plain python (default 2)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--accumulate", type=int, default=1, metavar="K", help="batches per optimizer update")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (the model stays float32)")
    parser.add_argument("--checkpoint", metavar="DIR", help="save_state(DIR) after every epoch")
    parser.add_argument("--resume", action="store_true", help="load_state(DIR) first; --epochs is the total")
    args = parser.parse_args()
    if args.epochs < 1 or args.nprocs < 1 or args.accumulate < 1:
        parser.error("--epochs, --nprocs and --accumulate must be at least 1")
    if args.bf16 and args.dtype == "float64":
        parser.error("--bf16 runs a float32 model in bfloat16: it does not combine with --dtype float64")
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint DIR")
    if args.resume and not os.path.isdir(args.checkpoint):
        parser.error(f"--resume: no checkpoint directory {args.checkpoint}")

    # Create the Accelerator first: under plain python it starts warming up the rank launcher at once.
    acc = Accelerator(
        nprocs=args.nprocs,
        compute_setup="auto",
        log_setup="cpu",
        dtype=getattr(torch, args.dtype),
        gradient_accumulation_steps=args.accumulate,
        mixed_precision="bf16" if args.bf16 else "no",
    )

    torch.manual_seed(0)  # same initial weights on every rank under torchrun/srun (DDP also syncs them)
    model = torch.nn.Sequential(
        torch.nn.Linear(1, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    # A seeded generator makes the shuffling seed, so the run is the same however it is started.
    shuffle_rng = torch.Generator().manual_seed(0)
    dataloader = DataLoader(make_data(4000, seed=0), batch_size=64, shuffle=True, generator=shuffle_rng)
    val_loader = DataLoader(make_data(1000, seed=1), batch_size=64)

    metrics = acc.distribute(train)(
        model,
        optimizer,
        dataloader,
        acc,
        val_loader=val_loader,
        epochs=args.epochs,
        checkpoint=args.checkpoint,
        resume=args.resume,
    )

    if acc.is_main_process:
        precision = f"{args.dtype} with bf16" if args.bf16 else args.dtype
        print(
            f"{acc.world_size} rank(s), {precision}: train loss {metrics['first_loss']:.4f} -> {metrics['loss']:.4f}, "
            f"validation loss {metrics['val_loss']:.4f} (noise floor 0.0100)"
        )


if __name__ == "__main__":
    main()
