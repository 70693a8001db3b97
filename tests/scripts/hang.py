"""Two ranks, one of which hangs, with the ranks' timeout in seconds in HANG_TIMEOUT; each rank first touches
OUT_DIR/pid-<pid>.

Usage: hang.py barrier|usr2 OUT_DIR. barrier: rank 1 sleeps while rank 0 waits in a barrier until it times out.
usr2: each rank says "ready N" on stderr, then rank 1 polls for OUT_DIR/go while rank 0 waits in a barrier, so both
can be asked where they are (SIGUSR2); each rank returns whether a child it forks ignores SIGUSR2.

The words in capitals in comments mark the lines that tests/comm/test_hangs.py expects the reports to name.
"""

import os
import signal
import sys
import time
from pathlib import Path

from qaccel import Accelerator

MODE, OUT = sys.argv[1], Path(sys.argv[2])
acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=float(os.environ["HANG_TIMEOUT"]))


def forked_child_ignores_sigusr2():
    pid = os.fork()
    if pid == 0:
        os._exit(0 if signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN else 1)
    return os.waitpid(pid, 0)[1] == 0


def train(acc):
    (OUT / f"pid-{os.getpid()}").touch()
    acc.all_reduce_dict({"step": 1.0})
    if MODE == "usr2":
        print(f"ready {acc.rank}", file=sys.stderr, flush=True)
        # one line, so that the answer names it whether the signal lands in the sleep or in the check
        while acc.rank == 1 and not (OUT / "go").exists(): time.sleep(0.05)  # RANK1_POLLS  # fmt: skip
        acc.wait_for_everyone()  # USR2_RANK0
        return forked_child_ignores_sigusr2()
    if acc.rank == 1:
        time.sleep(60)  # RANK1_SLEEPS
    acc.wait_for_everyone()  # RANK0_WAITS


if __name__ == "__main__":
    os.write(1, f"RESULT {acc.distribute(train, all_results=True)(acc)}\n".encode())  # one write: ranks share stdout
