"""Under torchrun on two simulated hosts, one rank on each: every rank prints its ranks, its host and an all-reduced
sum as a JSON line, in two sessions.

Usage: two_hosts.py FAIL_RANK (-1: no rank fails; else that rank raises ValueError). Run by
tests/cluster/test_two_hosts.py.
"""

import json
import os
import socket
import sys

from qaccel import Accelerator

acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)


def info(fail_rank):
    if acc.rank == fail_rank:
        raise ValueError(f"boom on rank {acc.rank}")
    total = acc.all_reduce_dict({"r": acc.rank}, op="sum")["r"]
    return {
        "rank": acc.rank,
        "local_rank": acc.local_rank,
        "node_rank": acc.node_rank,
        "world": acc.world_size,
        "sum": total,
        "host": socket.gethostname(),
    }


if __name__ == "__main__":
    for session in range(2):  # a second session in the same process must work too
        out = acc.distribute(info)(int(sys.argv[1]))
        os.write(1, (json.dumps(dict(out, session=session)) + "\n").encode())  # one write: one line
