"""A script that copies its stdout to a log file (a common research-script idiom) before making its Accelerator,
run by tests/launch/test_server.py: ranks write to fd 1, with their prefix, as ranks of any server do; the caller's
own lines go through its tee.

    python replaced_streams.py LOG [threaded]
"""

import sys
import threading
import time


class Tee:
    def __init__(self, stream, path):
        self.stream, self.file = stream, open(path, "a")  # noqa: SIM115 - a tee, open for the process

    def write(self, text):
        self.file.write(text)
        return self.stream.write(text)

    def flush(self):
        self.file.flush()
        self.stream.flush()

    def __eq__(self, other):  # and so unhashable, as a class defining __eq__ alone is
        return self is other


sys.stdout = Tee(sys.stdout, sys.argv[1])
if sys.argv[2:] == ["threaded"]:
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()

from qaccel import Accelerator

acc = Accelerator(nprocs=2, compute_setup="cpu", rank_prefix=True)


def say(acc):
    print(f"rank {acc.rank} says hello")


if __name__ == "__main__":
    print("caller starts")
    acc.distribute(say)(acc)
    print("caller ends")
    sys.stdout.flush()
