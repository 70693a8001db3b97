"""The caller initialises CUDA before it starts two CPU ranks, which can still use CUDA; prints their results. Run on a
GPU by tests/test_cuda.py."""

import torch

from qaccel import Accelerator

if __name__ == "__main__":
    torch.ones(1, device="cuda")  # CUDA initialised in the caller before the launch
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    print(
        "OUT",
        acc.distribute(lambda: torch.ones(2, device="cuda").sum().item() + acc.rank, all_results=True)(),
        flush=True,
    )
