"""A training script written as people write them, run by the tests under python, torchrun and srun.

Top-level set-up (logging, seeds, default dtype), a Dataset class defined here with num_workers=2, a model built
inside the training function from the global RNG, a checkpoint every epoch and a resume from it. With
``--crash-at E:B[,E:B...]`` rank 1 raises at epoch E, batch B of torchrun's attempt 0 (then of attempt 1, ...), as
TORCHELASTIC_RESTART_COUNT counts them.
It prints one RESULT line (rank 0) with a hash of the final parameters' bytes.
"""

import argparse
import hashlib
import json
import logging
import os

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from qaccel import Accelerator

logging.basicConfig(level=logging.INFO, format="%(levelname)s [%(name)s] %(message)s")
log = logging.getLogger("real_train")
torch.manual_seed(0)
np.random.seed(0)
torch.set_default_dtype(torch.float64)


class Regression(Dataset):
    """Defined in the script: DataLoader workers of a plain launch must find it, as torchrun's do."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], get_worker_info().id


class Progress:
    """Epochs done, saved with the checkpoint."""

    def __init__(self) -> None:
        self.epoch = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]


def train(args, acc):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    loader = DataLoader(Regression(96), batch_size=8, shuffle=True, num_workers=2)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    resumed = os.path.isdir(args.ckpt)
    if resumed:
        acc.load_state(args.ckpt)
        log.info("rank %d resumed at epoch %d", acc.rank, progress.epoch)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    crashes = [tuple(map(int, point.split(":"))) for point in args.crash_at.split(",") if point]
    crash = crashes[int(attempt)] if int(attempt) < len(crashes) else None
    workers = set()
    while progress.epoch < args.epochs:
        for i, (x, y, worker) in enumerate(loader):
            if crash == (progress.epoch, i) and acc.rank == 1:
                raise RuntimeError(f"rank 1 crashes at epoch {progress.epoch} batch {i} on purpose")
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            acc.backward(loss)
            optimizer.step()
            workers.update(worker.tolist())
        progress.epoch += 1
        log.info("rank %d epoch %d loss %.6f", acc.rank, progress.epoch, loss.item())
        acc.save_state(args.ckpt)
    params = torch.cat([p.detach().reshape(-1) for p in acc.unwrap_model(model).parameters()])
    return {
        "rank": acc.rank,
        "world": acc.world_size,
        "hash": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
        "dtype": str(params.dtype),
        "workers": sorted(workers),
        "resumed": resumed,
        "attempt": attempt,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--crash-at", default="")
    args = parser.parse_args()
    acc = Accelerator(nprocs=args.nprocs, compute_setup="cpu", timeout=60)
    result = acc.distribute(train)(args, acc)
    if acc.is_main_process:
        os.write(1, f"RESULT {json.dumps(result)}\n".encode())  # one write: ranks may share the pipe
