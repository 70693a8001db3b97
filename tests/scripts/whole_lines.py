"""Two ranks of a plain launch print many lines at once to the caller's stdout and stderr (no rank_prefix), run by
tests/launch/test_launch.py unbuffered (python -u): every line must arrive whole."""

import sys

from qaccel import Accelerator

LINES = 300


def shout(acc):
    acc.wait_for_everyone()
    for i in range(LINES):
        print(f"rank {acc.rank} line {i} " + "x" * 100)
        print(f"rank {acc.rank} error {i} " + "y" * 100, file=sys.stderr)


if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    acc.distribute(shout)(acc)
