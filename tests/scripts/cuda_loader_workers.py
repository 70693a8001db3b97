"""Ranks that use CUDA fork DataLoader workers (pinned memory) and start a spawned pool whose child uses CUDA; prints
each rank's total, the spawned child's result and the start method. Run on a GPU by tests/test_cuda.py."""

import multiprocessing

import torch
from torch.utils.data import DataLoader, Dataset

from qaccel import Accelerator


class Rows(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.full((4,), float(i))


def on_gpu(n):
    return torch.ones(n, device="cuda").sum().item()


def work(acc):
    torch.ones(1, device="cuda")  # CUDA is up in the rank before its workers are forked
    loader = DataLoader(Rows(), batch_size=8, num_workers=2, pin_memory=True)
    total = sum(batch.cuda(non_blocking=True).sum().item() for batch in acc.prepare(loader))
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        spawned = pool.map(on_gpu, [3])
    return total, spawned, multiprocessing.get_start_method()


if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    print("OUT", acc.distribute(work, all_results=True)(acc), flush=True)
