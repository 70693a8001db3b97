"""A warnings filter whose category class holds a lock, so it cannot be sent to the ranks: the launch goes on
regardless and prints ``OUT [0, 1]``. Run by tests/launch/test_inherit.py."""

import threading
import warnings

from qaccel import Accelerator


class Chatty(UserWarning):
    guard = threading.Lock()  # the class travels by value, and a lock cannot


warnings.simplefilter("ignore", Chatty)
if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    print("OUT", acc.distribute(lambda: acc.rank, all_results=True)(), flush=True)
