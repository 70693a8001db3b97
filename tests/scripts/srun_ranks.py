"""Each rank reports who it is as one line ``RESULT {json}``, and a second session in the same process must give the
same answer. Run on the local SLURM, as srun tasks and from an sbatch shell without srun, by
tests/cluster/test_slurm.py."""

import json
import os

from qaccel import Accelerator

acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)


def work():
    total = acc.all_reduce_dict({"r": acc.rank}, op="sum")["r"]
    return {
        "rank": acc.rank,
        "local": acc.local_rank,
        "node": acc.node_rank,
        "world": acc.world_size,
        "sum": total,
        "pid": os.getpid(),
        "procid": os.environ.get("SLURM_PROCID"),
    }


if __name__ == "__main__":
    first = acc.distribute(work)()
    again = acc.distribute(work)()  # a second group in the same task re-rendezvouses on the same port
    assert {**again, "pid": 0} == {**first, "pid": 0}, (again, first)
    os.write(1, ("RESULT " + json.dumps(first) + "\n").encode())  # one write: a line never splits
