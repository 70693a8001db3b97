"""A first session reports each rank's ranks and RANK, then 40 sessions back to back each all-reduce rank + 1; each
rank prints one line ``RESULT {json}``. Run as srun tasks without a real SLURM by
tests/launch/test_slurm_variables.py."""

import json
import os

from qaccel import Accelerator

acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=30)


def report():
    total = acc.all_reduce_dict({"r": acc.rank}, op="sum")["r"]
    return {
        "rank": acc.rank,
        "local": acc.local_rank,
        "node": acc.node_rank,
        "world": acc.world_size,
        "sum": total,
        "env_rank": os.environ.get("RANK"),
    }


if __name__ == "__main__":
    first = acc.distribute(report)()
    sums = [acc.distribute(lambda: acc.all_reduce_dict({"r": acc.rank + 1}, op="sum")["r"])() for _ in range(40)]
    print("RESULT " + json.dumps({**first, "sums": sums}), flush=True)
