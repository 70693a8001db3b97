"""The first launch of a script, served by a quick server while the forkserver's own imports are paused; run by
tests/launch/test_server.py.

    python quick_server.py facts OUT      # two launches; what each rank saw, as JSON in OUT
    python quick_server.py one_core OUT   # the same with one usable core for two ranks: no quick server
    python quick_server.py raise OUT      # the first launch fails; the second still gets the preloaded server
    python quick_server.py hang OUT       # the first launch never ends: OUT names the processes, to kill the caller
    python quick_server.py hang_late OUT  # the same with a server that runs only a second after its fork
"""

import json
import multiprocessing.forkserver
import os
import sys
import time

import torch

MODE, OUT = sys.argv[1], sys.argv[2]
if MODE == "one_core":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
if MODE == "hang_late":  # as on a loaded machine, the server is not scheduled before the launch: it could be paused
    late = [True]  # before it armed its death with the caller
    os.register_at_fork(after_in_parent=late.clear, after_in_child=lambda: late and time.sleep(1))

from qaccel import Accelerator

acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
PRELOADING = multiprocessing.forkserver._forkserver._forkserver_pid  # the server Accelerator() started


def state(pid):
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def train(mode):
    seen = {
        "dynamo_at_start": "torch._dynamo" in sys.modules,
        "parent": os.getppid(),
        "server_state": state(PRELOADING),
        "pid": os.getpid(),
    }
    if mode.startswith("hang"):
        with open(f"{OUT}.{acc.rank}", "w") as f:
            json.dump({**seen, "server": PRELOADING}, f)
        time.sleep(600)
    model = torch.nn.Linear(4, 1)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))  # dynamo, DDP
    loss = model(torch.ones(8, 4)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if mode == "raise" and acc.rank == 1:
        raise ValueError("the first launch fails")
    return {**seen, "loss": acc.all_reduce_dict({"loss": loss.item()})["loss"]}


def reaped(pid):
    """The process ``pid`` is gone, its exit status collected: no zombie is left."""
    try:
        return state(pid) is None
    except FileNotFoundError:
        return True


if __name__ == "__main__":
    runs = []
    try:
        runs.append(acc.distribute(train, all_results=True)(MODE))
    except ValueError as exc:
        runs.append(str(exc))
    first = runs[0][0]["parent"] if isinstance(runs[0], list) else None
    first_server_reaped = first is None or first == PRELOADING or reaped(first)  # as soon as the launch returned
    runs.append(acc.distribute(train, all_results=True)("again"))
    with open(OUT, "w") as f:
        json.dump(
            {"server": PRELOADING, "caller": os.getpid(), "runs": runs, "first_server_reaped": first_server_reaped}, f
        )
