"""A training script written as people write them, run by the tests under python, torchrun and srun.

Top-level set-up (logging, seeds, default dtype), a Dataset class defined here with num_workers=2, a model built
inside the training function from the global RNG, a checkpoint every epoch, and ``acc.resume()``: it continues from
the newest checkpoint, and on SIGTERM (or SLURM's USR1) every rank finishes what it is doing, saves and stops. With
``--crash-at E:B[,E:B...]`` rank 1 raises at epoch E, batch B of attempt 0 (then of attempt 1, ...), as
``acc.restart_count`` counts them (torchrun --max-restarts, or ``--max-restarts`` for a plain launch); with
``--cut-before-crash FILE`` rank 1 first cuts FILE (a path under --ckpt, if it exists) to 100 bytes: a checkpoint
damaged as the run died.
``--step-sleep`` slows each step of a run that did not resume, so that a test can signal it mid-run;
``--strategy fsdp`` shards it with FSDP2;
``--split-batches`` makes the loader's batch of 8 the batch of all ranks together; ``--record DIR`` writes the
samples each rank trains on, per epoch, to a file of its own there. It prints one RESULT line (rank 0) with a hash
of the final parameters' bytes, the steps this run took itself (``trained``) and, with ``--record``, the
parameters.
"""

import argparse
import hashlib
import json
import logging
import os
import time

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
        return self.x[i], self.y[i], get_worker_info().id, i


def train(args, acc):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    loader = DataLoader(Regression(96), batch_size=8, shuffle=True, num_workers=2)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    resumed = acc.resume(args.ckpt, keep=2)
    if resumed:
        log.info("rank %d resumed from %s at epoch %d step %d", acc.rank, resumed, loader.epoch, acc.step)
    attempt = acc.restart_count
    crashes = [tuple(map(int, point.split(":"))) for point in args.crash_at.split(",") if point]
    crash = crashes[attempt] if attempt < len(crashes) else None
    workers = set()
    trained = 0  # steps this run took itself: a run that resumed nothing would take all of them again
    for epoch in range(loader.epoch, args.epochs):
        loss = torch.tensor(float("nan"))  # a run stopped after an epoch's last step resumes with none of it left
        for i, (x, y, worker, index) in enumerate(loader):
            if crash == (epoch, i) and acc.rank == 1:
                cut = os.path.join(args.ckpt, args.cut_before_crash)
                if args.cut_before_crash and os.path.isfile(cut):
                    with open(cut, "r+b") as f:
                        f.truncate(100)
                raise RuntimeError(f"rank 1 crashes at epoch {epoch} batch {i} on purpose")
            if args.record:
                with open(os.path.join(args.record, f"rank{acc.rank}_of_{acc.world_size}_{os.getpid()}"), "a") as f:
                    f.write(json.dumps({"epoch": epoch, "ids": index[: len(index) - acc.padding_in_batch].tolist()}))
                    f.write("\n")
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            acc.backward(loss)
            optimizer.step()
            trained += 1
            workers.update(worker.tolist())
            time.sleep(0.0 if resumed else args.step_sleep)
        log.info("rank %d epoch %d loss %.6f", acc.rank, epoch + 1, loss.item())
        acc.save_state()
    state = acc.get_state_dict(model)  # on every rank: under strategy="fsdp" it gathers the shards (to rank 0)
    params = torch.cat([v.reshape(-1) for v in state.values()]) if state else torch.zeros(0)
    return {
        "rank": acc.rank,
        "world": acc.world_size,
        "hash": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
        "dtype": str(params.dtype),
        "workers": sorted(workers),
        "resumed": resumed is not None,
        "attempt": str(attempt),
        "step": acc.step,
        "trained": trained,
        **({"params": params.tolist()} if args.record else {}),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--crash-at", default="")
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--cut-before-crash", default="")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--split-batches", action="store_true")
    parser.add_argument("--record", default="")
    args = parser.parse_args()
    acc = Accelerator(
        nprocs=args.nprocs,
        compute_setup="cpu",
        timeout=60,
        max_restarts=args.max_restarts,
        strategy=args.strategy,
        split_batches=args.split_batches,
    )
    result = acc.distribute(train)(args, acc)
    if acc.is_main_process:
        os.write(1, f"RESULT {json.dumps(result)}\n".encode())  # one write: ranks may share the pipe
