"""Two ranks all-reduce rank + I, and the script prints ``sum <total>``.

Usage: rank_sum.py I. tests/launch/test_concurrent_launches.py runs several at once.
"""

import sys

from qaccel import Accelerator

if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    r = acc.distribute(lambda a, i: a.all_reduce_dict({"v": a.rank + i}, op="sum")["v"])(acc, int(sys.argv[1]))
    print("sum", r)
