"""Each rank opens and closes a process pool 40 times and returns "closed". Run by tests/launch/test_worker.py: no pool
may hang."""

import multiprocessing

from qaccel import Accelerator


def cube(n):
    return n**3


def work():
    for _ in range(40):
        with multiprocessing.Pool(2) as pool:
            assert pool.map(cube, range(4)) == [0, 1, 8, 27]
    return "closed"


if __name__ == "__main__":
    print(Accelerator(nprocs=2, compute_setup="cpu").distribute(work, all_results=True)(), flush=True)
