"""Starts ranks without an ``if __name__ == "__main__":`` guard: prints "top-level" once, then the ranks' results. Run
by tests/launch/test_script_functions.py."""

import os

from qaccel import Accelerator

print("top-level", os.getpid(), flush=True)
acc = Accelerator(nprocs=2, compute_setup="cpu")
print("result", acc.distribute(lambda a: a.world_size * 100 + a.rank, all_results=True)(acc), flush=True)
