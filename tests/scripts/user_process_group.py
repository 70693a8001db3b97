"""Under torchrun, the script makes its own gloo process group before qaccel: qaccel's collectives use it, and it is
still there and usable after distribute(). Each rank writes one line ``OUT <sum> <initialized> <all-reduced one>``.
Run by tests/launch/test_torchrun.py."""

import os

import torch
import torch.distributed as dist

from qaccel import Accelerator

if __name__ == "__main__":
    dist.init_process_group("gloo")
    acc = Accelerator(compute_setup="cpu")
    r = acc.distribute(lambda: acc.all_reduce_dict({"x": dist.get_rank() + 1}, op="sum")["x"])()
    t = torch.ones(1)
    dist.all_reduce(t)
    os.write(1, f"OUT {r} {dist.is_initialized()} {t.item()}\n".encode())  # one write: ranks share the pipe
    dist.destroy_process_group()
