"""A long run that continues where it stopped: after a crash, a restart, a SIGTERM or a SLURM time limit.

    python examples/long_run.py                                        # 2 ranks; run it again to continue
    python examples/long_run.py --max-restarts 3                       # restart all ranks after a rank fails
    torchrun --standalone --nproc_per_node 2 --max-restarts 3 examples/long_run.py
    sbatch slurm/requeue.sbatch examples/long_run.py --ckpt /shared/runs/long    # requeues itself at the limit

``acc.resume(dir)`` is the whole recipe: it loads the newest complete checkpoint in ``dir`` (if any), makes
``save_state()`` write numbered checkpoints there (keeping the newest ``--keep``), and on SIGTERM, or the USR1 that
requeue.sbatch asks SLURM to send before the time limit, every rank finishes what it is doing, saves before its
next step and stops (under SLURM the job is requeued). ``range(loader.epoch, epochs)`` and ``acc.step`` pick up in
the middle of an epoch. The Dataset is defined here and read by 2 DataLoader workers per rank; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import logging
import math

import torch
from torch.utils.data import DataLoader, Dataset

from qaccel import Accelerator

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
log = logging.getLogger("long_run")


class NoisySine(Dataset):
    """y = sin(3x) + noise at n fixed points of [-1, 1]."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(n, 1, generator=g) * 2 - 1
        self.y = torch.sin(3 * self.x) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def train(args: argparse.Namespace, acc: Accelerator) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(NoisySine(4096), batch_size=32, shuffle=True, num_workers=2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=args.epochs * math.ceil(len(loader) / acc.world_size)
    )
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)

    resumed = acc.resume(args.ckpt, keep=args.keep)
    if resumed:
        acc.print(f"resumed from {resumed} at epoch {loader.epoch}, step {acc.step} (restart {acc.restart_count})")
    loss = torch.zeros(())
    for epoch in range(loader.epoch, args.epochs):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            acc.backward(loss)
            optimizer.step()
            scheduler.step()
            if acc.step % args.save_every == 0:
                acc.save_state()
        acc.save_state()
        if acc.is_main_process:
            log.info("epoch %d: loss %.4f, step %d", epoch, loss.item(), acc.step)
    return acc.all_reduce_dict({"loss": loss.item()})["loss"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", default="long_run_checkpoints", help="folder of the numbered checkpoints")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=50, help="optimizer steps between checkpoints")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--max-restarts", type=int, default=0, help="plain launch: restarts after a rank fails")
    parser.add_argument("--cpu", action="store_true", help="train on CPUs even where GPUs are visible")
    args = parser.parse_args()
    acc = Accelerator(nprocs=args.nprocs, compute_setup="cpu" if args.cpu else "auto", max_restarts=args.max_restarts)
    final = acc.distribute(train)(args, acc)
    acc.print(f"final loss {final:.4f} after {args.epochs} epochs")
