"""Prints "made" once the Accelerator is made, then starts two ranks that print "rank running" and sleep for a minute:
tests/launch/test_interrupt.py sends Ctrl-C at moments of this start-up.

With an argument, the script sends itself SIGINT from a before-fork hook: ``server`` at the fork of the forkserver
(``Accelerator()``), ``quick server`` at the fork of the first launch's quick server. Those windows hold SIGINT back.
"""

import os
import signal
import sys
import time

from qaccel import Accelerator

at_fork_of = sys.argv[1] if len(sys.argv) > 1 else None
armed = False


def interrupt_once():
    global armed
    if armed:
        armed = False
        os.kill(os.getpid(), signal.SIGINT)


def work():
    print("rank running", flush=True)
    time.sleep(60)


if __name__ == "__main__":
    os.register_at_fork(before=interrupt_once)
    armed = at_fork_of == "server"
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    print("made", flush=True)
    armed = at_fork_of == "quick server"
    acc.distribute(work)()
