"""One distribute() run in place under a launcher (srun, torchrun) whose rendezvous host is wrong: every rank prints
what it raised and how long after distribute() was called, then exits 1.

    srun -n 2 python rendezvous_host.py
"""

import json
import os
import sys
import time

from qaccel import Accelerator


def nothing(acc):
    return acc.rank


if __name__ == "__main__":
    acc = Accelerator(timeout=120)
    started = time.monotonic()
    try:
        acc.distribute(nothing)(acc)
    except Exception as exc:  # noqa: BLE001 - what every rank raised is the result
        print(
            "RESULT "
            + json.dumps(
                {
                    "rank": int(os.environ["RANK"]),
                    "type": type(exc).__name__,
                    "message": str(exc),
                    "seconds": time.monotonic() - started,
                }
            ),
            flush=True,
        )
        sys.exit(1)
    print("RESULT " + json.dumps({"rank": acc.rank, "type": None}), flush=True)
