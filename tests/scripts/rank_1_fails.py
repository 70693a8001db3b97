"""Rank 1 fails after one collective, while rank 0 waits in a barrier. Each rank writes its pid to OUT_DIR/pid<rank>,
and rank 1 the time it fails to OUT_DIR/raised_at.

Usage: rank_1_fails.py OUT_DIR raise|exit (raise: a ValueError; exit: sys.exit(3)). Run under torchrun and srun by
tests/launch/test_launcher_failures.py.
"""

import os
import sys
import time
from pathlib import Path

from qaccel import Accelerator

acc = Accelerator(compute_setup="cpu")  # the default timeout (30 min): a peer left waiting would hang the test
out, mode = Path(sys.argv[1]), sys.argv[2]


def mark(name, text):
    tmp = out / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, out / name)  # whole or not at all: the test reads it after a kill


def work():
    mark(f"pid{acc.rank}", str(os.getpid()))
    total = acc.all_reduce_dict({"r": acc.rank}, op="sum")["r"]
    if acc.rank == 1:
        mark("raised_at", repr(time.time()))
        if mode == "exit":
            sys.exit(3)
        raise ValueError("rank 1 fails on purpose")
    acc.wait_for_everyone()  # rank 0 waits here and sees the connection break
    return total


if __name__ == "__main__":
    acc.distribute(work)()
