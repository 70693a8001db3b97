"""Reports how the forkserver of a plain launch started, and what its ranks inherited; run by
tests/launch/test_server.py.

    python server_start.py plain      # Accelerator() at the top of a script: the server is forked from it
    python server_start.py threaded   # a thread runs in the caller: the server is a fresh interpreter
    python server_start.py openmp     # the caller ran a multi-threaded torch op first: a fresh interpreter too
"""

import gc
import json
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time

import torch

MODE = sys.argv[1]
if MODE == "threaded":
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
if MODE == "openmp":
    torch.set_num_threads(2)
    (torch.ones(1 << 20) * 2).sum()  # starts the OpenMP pool
signal.signal(signal.SIGTERM, lambda signum, frame: print("the caller's handler"))
print("written before", end="")  # not flushed yet: stdout is a pipe
THREADS = len(os.listdir("/proc/self/task"))

from qaccel import Accelerator  # noqa: E402

acc = Accelerator(nprocs=2, compute_setup="cpu")


def facts():
    preloaded = {"gc_enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
                 "dynamo": "torch._dynamo" in sys.modules}  # before this function imports anything
    torch.set_num_threads(2)
    product = torch.ones(512, 512) @ torch.ones(512, 512)  # a parallel op in the rank
    return {"sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "product": float(product[0, 0]),
            "parent": os.getppid(), **preloaded}


if __name__ == "__main__":
    ranks = [acc.distribute(facts, all_results=True)() for _ in range(2)]
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    with open(f"/proc/{server}/cmdline") as cmdline:
        command = cmdline.read().split("\0")
    print()
    print("FACTS " + json.dumps({
        "caller_threads": THREADS, "server": server, "command": command,
        "server_threads": len(os.listdir(f"/proc/{server}/task")), "ranks": ranks[0] + ranks[1],
    }))
