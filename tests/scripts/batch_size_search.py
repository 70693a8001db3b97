"""find_executable_batch_size in a real training script: rank 1 runs out of memory (raised on purpose, in the
forward pass while rank 0 waits in the backward pass's all-reduce) above FITS samples per batch; every rank must
end at the same size. The inner function prepares its objects, trains 2 epochs and saves a checkpoint per epoch,
as Accelerate's guide writes it. Logging is set up at the top, the Dataset class is the script's own and the loader
uses 2 workers.

    python batch_size_search.py OUT [--fits N] [--twice] [--then-raise ValueError]  # qaccel starts 2 ranks
    torchrun --nproc_per_node 2 batch_size_search.py OUT              # the same, in place
    torchrun --nproc_per_node 2 batch_size_search.py OUT --top-level  # first without distribute(): as Accelerate's
                                                                      # scripts, nothing joins the ranks before the
                                                                      # search; then in a distribute() call

Prints ``RESULT {...}`` once per search (the main process; a distribute() call, two with --twice, and with
--top-level one before them): every rank's sizes tried, the size reached, the trained parameters' hash, and the
hash of a run started at the size reached (no retries: equal to it). ``--then-raise ERROR``: after those, one more
distribute() call in which rank 1 raises ERROR (a builtin exception) instead of running out of memory; the line
before it says when it starts (time.monotonic(), the same clock in every process of the machine).
"""

import argparse
import builtins
import hashlib
import json
import logging
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

from qaccel import Accelerator, find_executable_batch_size

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
logger = logging.getLogger("batch_size_search")


class Curve(Dataset):
    def __len__(self):
        return 300

    def __getitem__(self, i):
        x = torch.tensor([i / 300.0])
        return x, torch.sin(3 * x)


def train_at(acc, out, batch_size, fits, error):
    """2 epochs at ``batch_size``, prepared anew; rank 1 fails above ``fits`` in epoch 1's first forward."""
    acc.free_memory()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(Curve(), batch_size=batch_size, shuffle=True, num_workers=2)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    for epoch in range(2):
        for step, (x, y) in enumerate(loader):
            if acc.rank == 1 and batch_size > fits and epoch == 1 and step == 0:
                raise error(f"CUDA out of memory. Tried to allocate 2.00 GiB at batch size {batch_size} (on purpose)")
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        acc.save_state(f"{out}/epoch_{epoch}")
    weights = acc.unwrap_model(model).state_dict()
    return hashlib.sha256(b"".join(w.numpy().tobytes() for w in weights.values())).hexdigest()


def main(acc, args, error="RuntimeError"):
    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def search(batch_size):
        tried.append(batch_size)
        logger.info("rank %d trying batch size %d", acc.rank, batch_size)
        return batch_size, train_at(acc, args.out, batch_size, args.fits, getattr(builtins, error))

    size, digest = search()
    reference = find_executable_batch_size(starting_batch_size=size)(
        lambda batch_size: train_at(acc, f"{args.out}/reference", batch_size, args.fits, RuntimeError)
    )()
    everyone = acc.gather_object([{"rank": acc.rank, "tried": tried, "size": size, "hash": digest}])
    if acc.is_main_process:
        print("RESULT " + json.dumps({"ranks": everyone, "reference": reference, "world": acc.world_size}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--fits", type=int, default=51)
    parser.add_argument("--then-raise", default="")
    parser.add_argument("--twice", action="store_true")
    parser.add_argument("--top-level", action="store_true")
    arguments = parser.parse_args()
    accelerator = Accelerator(nprocs=2, compute_setup="cpu")
    if arguments.top_level:
        main(accelerator, arguments)
    for _ in range(2 if arguments.twice else 1):
        accelerator.distribute(main)(accelerator, arguments)
    if arguments.then_raise:
        print(f"batch_size_search: the last search starts at {time.monotonic()}", file=sys.stderr, flush=True)
        accelerator.distribute(main)(accelerator, arguments, arguments.then_raise)
