"""One rank of a world its launcher started (env:// variables, as a Kubernetes pod gets them), on the GPU it sees:
its device and an all-reduce of a CUDA tensor over gloo.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p CUDA_VISIBLE_DEVICES=0 python gpu_ranks.py
"""

import json

import torch

from qaccel import Accelerator


def report(acc):
    total = torch.full((2,), float(acc.rank + 1), device=acc.device)
    torch.distributed.all_reduce(total)
    return {"rank": acc.rank, "device": str(acc.device), "sum": total.tolist(), "on": total.device.type}


if __name__ == "__main__":
    acc = Accelerator(compute_setup="gpu", backend="gloo", timeout=60)
    print("RESULT " + json.dumps(acc.distribute(report)(acc)), flush=True)
