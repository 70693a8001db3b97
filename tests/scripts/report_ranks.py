"""Each rank reports who it is, from two sessions (a second group in the same process must work too), as one line
``RESULT {json} initialized_after <bool>``.

Usage: report_ranks.py TAG. Run under torchrun (tests/launch/test_torchrun.py), as srun tasks and in an sbatch
shell without a real SLURM (tests/launch/test_slurm_variables.py), and under mpirun, on one host
(tests/launch/test_mpirun.py) and on two simulated ones (tests/cluster/test_two_hosts.py, hence ``host``).
"""

import json
import os
import socket
import sys

import torch.distributed as dist

from qaccel import Accelerator

acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)


def work(tag):
    total = acc.all_reduce_dict({"r": acc.rank}, op="sum")["r"]
    return {
        "rank": acc.rank,
        "local": acc.local_rank,
        "node": acc.node_rank,
        "world": acc.world_size,
        "sum": total,
        "tag": tag,
        "pid": os.getpid(),
        "env_rank": os.environ.get("RANK"),
        "host": socket.gethostname(),
    }


if __name__ == "__main__":
    out = acc.distribute(work)(sys.argv[1])
    again = acc.distribute(work)(sys.argv[1])  # a second group in the same process must work too
    assert {**again, "pid": 0} == {**out, "pid": 0}, (again, out)
    # one write(2) per line: ranks share torchrun's stdout pipe, and an unbuffered print() writes piece by piece
    os.write(1, f"RESULT {json.dumps(out)} initialized_after {dist.is_initialized()}\n".encode())
