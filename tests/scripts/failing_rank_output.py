"""Both ranks write a line to stdout and one to stderr; then rank 1 prints half a line and raises, while rank 0 waits
in a barrier until the caller stops it. Run by tests/launch/test_launch.py without PYTHONUNBUFFERED: all the ranks
wrote must reach the caller's output."""

import sys

from qaccel import Accelerator


def work(acc):
    print(f"rank {acc.rank} printed a line")
    sys.stderr.write(f"rank {acc.rank} wrote to stderr\n")
    acc.wait_for_everyone()  # both ranks have printed
    if acc.rank == 1:
        print("rank 1 printed half a line", end="")
        raise ValueError("rank 1 fails after printing")
    acc.wait_for_everyone()  # rank 0 waits here, inside gloo, until the caller stops it


if __name__ == "__main__":
    Accelerator(nprocs=2, compute_setup="cpu").distribute(work)(Accelerator(nprocs=2, compute_setup="cpu"))
