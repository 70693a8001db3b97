"""Ranks that ignore SIGTERM (a handler of the user's) and finish while the caller is told to stop: the caller, which
got SIGTERM and passed it on, must still end by it, never report a finished run. Prints ``RESULT`` only if
distribute() returned; ``ranks ignore SIGTERM`` on stderr once both do."""

import signal
import sys
import time

from qaccel import Accelerator


def train(acc):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    acc.wait_for_everyone()
    if acc.is_main_process:
        print("ranks ignore SIGTERM", file=sys.stderr, flush=True)
    time.sleep(2)  # the caller gets SIGTERM meanwhile
    return "finished"


if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
    print("RESULT", acc.distribute(train)(acc), flush=True)
