"""A class and a function defined in __main__ reach the ranks; the script prints the ranks' results as JSON. Run by
tests/launch/test_script_functions.py."""

import json

from qaccel import Accelerator


class Point:
    def __init__(self, x):
        self.x = x


def train(point, accelerator):
    return {"rank": accelerator.rank, "x": point.x, "world": accelerator.world_size}


if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    print(json.dumps(acc.distribute(train, all_results=True)(Point(7), acc)))
