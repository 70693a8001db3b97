"""Prints "made" once the Accelerator is made, then starts two ranks that print "rank running" and sleep for a minute:
tests/launch/test_interrupt.py sends Ctrl-C at moments of this start-up."""

import time
from qaccel import Accelerator

def work():
    print("rank running", flush=True)
    time.sleep(60)

if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    print("made", flush=True)
    acc.distribute(work)()
