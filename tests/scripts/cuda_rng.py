"""The ranks draw on the GPU after the caller seeded torch, then after the caller drew on the GPU itself: each time
they must draw what the caller draws, with CUDA not yet initialised in them. Prints ``OUT <seeded ok> <advanced
ok>``. Run on a GPU by tests/test_cuda.py."""

import torch

from qaccel import Accelerator


def draw():
    fresh = not torch.cuda.is_initialized()
    return fresh, torch.rand(3, device="cuda").tolist()


if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    torch.manual_seed(0)
    seeded = acc.distribute(draw, all_results=True)()
    torch.manual_seed(0)
    want_seeded = torch.rand(3, device="cuda").tolist()
    advanced = acc.distribute(draw, all_results=True)()
    want_advanced = torch.rand(3, device="cuda").tolist()
    print("OUT", seeded == [(True, want_seeded)] * 2, advanced == [(True, want_advanced)] * 2, flush=True)
