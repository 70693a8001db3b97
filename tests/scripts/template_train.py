"""The training script tests/cluster/test_slurm_scripts.py gives the sbatch templates in slurm/: every rank takes two
DDP steps on its own data and prints one line ``RESULT {json}`` with its ranks, its SLURM node, the world size, an
all-reduced sum, the trained weights and its own arguments. In a job that SLURM gave GPUs, every rank first prints
``GPU {json}``: the GPU qaccel's rule gives it (gpu_choice.py; the ranks train on the CPU all the same).

FAIL_RANK makes that rank raise first; TRAIN_TIMEOUT sets the ranks' timeout (default 60 s).
"""

import json
import os
import sys

import torch
from gpu_choice import choice

from qaccel import Accelerator
from qaccel.environment import detect, gpus

acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=float(os.environ.get("TRAIN_TIMEOUT", "60")))
KIND = str(detect().kind)
if gpus.allocated() is not None:
    os.write(1, ("GPU " + json.dumps(choice()) + "\n").encode())


def train():
    if acc.rank == int(os.environ.get("FAIL_RANK", "-1")):
        raise ValueError(f"rank {acc.rank} fails on purpose")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    x = torch.full((8, 4), float(acc.rank + 1))  # each rank its own data: only DDP keeps the weights equal
    for _ in range(2):
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    rank_sum = acc.all_reduce_dict({"rank": acc.rank}, op="sum")["rank"]
    return {
        "rank": acc.rank,
        "local_rank": acc.local_rank,
        "node_rank": acc.node_rank,
        "world_size": acc.world_size,
        "rank_sum": rank_sum,
        "kind": KIND,
        "weight": acc.unwrap_model(model).weight.flatten().tolist(),
        "slurm_node": os.environ.get("SLURMD_NODENAME"),
        "argv": sys.argv[1:],
        "pid": os.getpid(),
    }


if __name__ == "__main__":
    result = acc.distribute(train)()
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())  # one write: lines of ranks never interleave
