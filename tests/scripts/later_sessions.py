"""Several distribute() calls in one process, as a script run under torchrun or srun makes them: first the two
sessions of sessions.py (the second loads the first one's checkpoint); then sessions that train with DataLoader
workers and save a checkpoint each epoch, one whose prepared objects the script keeps in a global (in a reference
cycle of its own), one that fails and whose exception the script keeps, then later sessions whose DataLoader
workers (and a plain DataLoader's) run the garbage collector as they start. Nothing of an ended session may be destroyed in those
workers: its process group is gone, and destroying its copy in a forked worker crashes or hangs.

Usage: later_sessions.py OUT_DIR. Each rank prints two lines ``RESULT {json}``: its two first sessions' results,
then what the later sessions saw.
"""

import gc
import json
import logging
import os
import sys
import weakref

import torch
from sessions import session
from torch.utils.data import DataLoader, Dataset

from qaccel import Accelerator

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
log = logging.getLogger("later_sessions")
torch.manual_seed(0)

OUT = sys.argv[1]
KEPT = []  # what the script holds on to past a session
PREPARED = []  # weak references to the DDP models the sessions prepared


class Points(Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, i):
        x = torch.full((4,), float(i))
        return x, x.sum(dim=0, keepdim=True)


class Run:
    def __init__(self, model, optimizer, loader):
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.on_epoch_end = [self.log]

    def log(self):
        log.info("%s", self.model)


def collect_garbage(worker_id):
    gc.collect()  # what a longer script's worker does by itself sooner or later


def train(acc, name, keep=False, fail=False):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(Points(), batch_size=4, shuffle=True, num_workers=2)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    PREPARED.append(weakref.ref(model))
    if keep:  # as a trainer object holding what it trains, and itself through a callback: a cycle
        run = Run(model, optimizer, loader)
        KEPT.append(run)
    for epoch in range(2):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            acc.backward(loss)
            optimizer.step()
        acc.save_state(os.path.join(OUT, name), keep=1)
        log.info("%s: epoch %d saved", name, epoch)
    if fail:
        raise RuntimeError(f"{name} fails after training")
    return model, optimizer


def later(acc):
    """Iterate a prepared loader and a plain one, both with workers that collect garbage as they start."""
    seen = 0
    prepared = acc.prepare(DataLoader(Points(), batch_size=4, num_workers=2, worker_init_fn=collect_garbage))
    for _ in range(2):
        seen += sum(len(x) for x, _ in prepared)
    plain = DataLoader(Points(), batch_size=4, num_workers=2, worker_init_fn=collect_garbage)
    seen += sum(len(x) for x, _ in plain)
    return seen


if __name__ == "__main__":
    two = Accelerator(compute_setup="cpu", gradient_accumulation_steps=2, timeout=60)
    ckpt = os.path.join(OUT, "ckpt")
    first = two.distribute(session)(two, ckpt, False)
    second = two.distribute(session)(two, ckpt, True)
    os.write(1, ("RESULT " + json.dumps({"rank": two.rank, "first": first, "second": second}) + "\n").encode())
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
    returned = acc.distribute(train)(acc, "first")
    left_after_first = sum(ref() is not None for ref in PREPARED)
    acc.distribute(train)(acc, "second", keep=True)
    try:
        acc.distribute(train)(acc, "third", fail=True)
    except RuntimeError as error:
        KEPT.append(error)  # its traceback holds the third session's model
    counts = [acc.distribute(later)(acc)]
    KEPT.clear()  # what the user kept becomes garbage now, while later sessions fork workers
    counts += [acc.distribute(later)(acc) for _ in range(3)]
    result = {
        "rank": acc.rank,
        "returned": [type(obj).__name__ for obj in returned],
        "left_after_first": left_after_first,
        "counts": counts,
    }
    os.write(1, f"RESULT {json.dumps(result)}\n".encode())
