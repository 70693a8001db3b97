"""A training script whose steps are fast and whose epochs spend most of their time between steps, as real runs do:
an evaluation after each epoch (a prepared loader of its own, its losses gathered over the ranks, then a wait that
stands for a bigger model's evaluation) and a checkpoint after it. The tests signal it there and check where and how
soon every rank stops, and that a second run continues to the uninterrupted run's parameters.

Top-level set-up as people write it: logging with times, seeds, a Dataset class defined here, ``num_workers=2``,
``acc.resume()``. 6 steps per epoch and rank (96 samples, batches of 8, 2 ranks).

    --epochs N       epochs to train (default 6)
    --eval-s S       seconds each epoch's evaluation takes (default 1.0)
    --save-s S       seconds each checkpoint takes (a registered object slow to save; default 0)

Logs ``rank R evaluates epoch E`` and ``rank R saves epoch E`` as those start (a test signals then), and
``rank R resumed from PATH at epoch E step S``. Prints ``RESULT {...}`` once (rank 0): a hash of the final
parameters and the step count.
"""

import argparse
import hashlib
import json
import logging
import os
import time

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from qaccel import Accelerator

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [%(name)s] %(message)s")
log = logging.getLogger("stop_between_steps")
torch.manual_seed(0)


class Regression(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        info = get_worker_info()
        return self.x[i], self.y[i], -1 if info is None else info.id


class SlowToSave:
    """Registered for checkpointing: its state_dict() takes ``seconds``, as a big state's writing does."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.saved = 0

    def state_dict(self) -> dict:
        time.sleep(self.seconds)
        self.saved += 1
        return {"saved": self.saved}

    def load_state_dict(self, state: dict) -> None:
        self.saved = state["saved"]


def evaluate(acc, model, loader, seconds: float) -> float:
    start = time.monotonic()
    losses = []
    with torch.no_grad():
        for x, y, _ in loader:
            losses.append(acc.gather_for_metrics(torch.nn.functional.mse_loss(model(x), y, reduction="none")))
    time.sleep(max(0.0, seconds - (time.monotonic() - start)))  # the rest of a bigger model's evaluation
    return torch.cat(losses).mean().item()


def train(args, acc):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    loader = DataLoader(Regression(96, 1), batch_size=8, shuffle=True, num_workers=2)
    val_loader = DataLoader(Regression(32, 2), batch_size=8)
    model, optimizer, loader, val_loader = acc.prepare(model, optimizer, loader, val_loader)
    acc.register_for_checkpointing(SlowToSave(args.save_s))
    resumed = acc.resume(args.ckpt, keep=2)
    if resumed:
        log.info("rank %d resumed from %s at epoch %d step %d", acc.rank, resumed, loader.epoch, acc.step)
    for epoch in range(loader.epoch, args.epochs):
        for x, y, _ in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            acc.backward(loss)
            optimizer.step()
        log.info("rank %d evaluates epoch %d", acc.rank, epoch + 1)
        val_loss = evaluate(acc, model, val_loader, args.eval_s)
        log.info("rank %d saves epoch %d (validation loss %.6f)", acc.rank, epoch + 1, val_loss)
        acc.save_state()
    params = torch.cat([p.detach().reshape(-1) for p in acc.unwrap_model(model).parameters()])
    return {
        "hash": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
        "step": acc.step,
        "resumed": resumed is not None,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--eval-s", type=float, default=1.0)
    parser.add_argument("--save-s", type=float, default=0.0)
    parser.add_argument("--nprocs", type=int, default=2)
    args = parser.parse_args()
    acc = Accelerator(nprocs=args.nprocs, compute_setup="cpu", timeout=60)
    result = acc.distribute(train)(args, acc)
    if acc.is_main_process:
        os.write(1, f"RESULT {json.dumps(result)}\n".encode())  # one write: ranks may share the pipe
