"""A run another local user attacks (tests/test_other_users.py), started with python (a plain launch of 2 ranks) or
torchrun.

    attacked_run.py CHECKPOINTS RELEASE [--umask 077] [--fail]

Each rank prepares a model, calls ``acc.resume(CHECKPOINTS)`` (so a stop on a signal is armed), and rank 0 prints
``READY <port>`` to stderr, the port at MASTER_PORT (a plain launch's caller's TCPStore, or torchrun's store). Then each step waits until the file RELEASE
exists, with a secret on the line it waits at: a rank asked where it is would show that line. After 8 steps every
rank saves, and rank 0 prints one RESULT line: the steps taken (8 when nothing stopped the run), the sum of the
parameters over the ranks (the same on every rank of a DDP run), and the modes of the checkpoint's files.
``--umask`` sets the process's umask after a first launch (the ranks' server is started and ready) and before
this one. ``--fail``: rank 1 raises after saving, instead of returning.
"""

import argparse
import json
import logging
import os
import stat
import time

import torch

from qaccel import Accelerator

logging.basicConfig(level=logging.INFO, format="%(levelname)s [%(name)s] %(message)s")


def train(acc, checkpoints, release, fail):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    acc.resume(checkpoints)
    if acc.rank == 0:
        os.write(2, f"READY {os.environ['MASTER_PORT']}\n".encode())
    x = torch.ones(4, 3) * (acc.rank + 1)
    for _ in range(8):
        while not os.path.exists(release):
            time.sleep(
                0.05
            )  # a secret on the line a rank waits at, which where it is would show: sk-attacked-run-0123456789
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        acc.backward(loss)
        optimizer.step()
    path = acc.save_state()
    if fail and acc.rank == 1:
        raise RuntimeError("rank 1 fails on purpose, after its checkpoint")
    params = sum(p.detach().sum().item() for p in acc.unwrap_model(model).parameters())
    modes = {}
    for base, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(base, name)
            modes[os.path.relpath(full, path)] = oct(stat.S_IMODE(os.stat(full).st_mode))
    modes["."] = oct(stat.S_IMODE(os.stat(path).st_mode))
    return {"steps": acc.step, "params": params, "modes": modes}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoints")
    parser.add_argument("release")
    parser.add_argument("--umask", default=None)
    parser.add_argument("--fail", action="store_true")
    args = parser.parse_args()
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=30)
    if args.umask is not None:
        acc.distribute(lambda: None)()
        os.umask(int(args.umask, 8))
    result = acc.distribute(train)(acc, args.checkpoints, args.release, args.fail)
    if acc.is_main_process:
        os.write(1, f"RESULT {json.dumps(result)}\n".encode())
