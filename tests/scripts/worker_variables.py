"""What a rank's environment adds to its caller's, the names only, against what a torchrun worker's adds to
torchrun's; and whether torch and a process the rank starts take it for a torchrun worker. Prints ``RESULT {...}``
(every rank's under torchrun).

Usage: worker_variables.py (run by tests/launch/test_worker.py with python and with torchrun)"""

import json
import os
import subprocess
import sys

import torch.distributed as dist

from qaccel import Accelerator

CALLER = set(json.loads(os.environ.get("CALLER_NAMES", "[]")))  # under torchrun: its parent's, given by the test
DETECT = "from qaccel.environment import detect; print(detect().kind)"


def report():
    child = subprocess.run([sys.executable, "-c", DETECT], capture_output=True, text=True, check=True)
    return {
        "added": sorted(set(os.environ) - CALLER),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "elastic": dist.is_torchelastic_launched(),
        "child_kind": child.stdout.strip(),
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
    }


if __name__ == "__main__":
    if not CALLER:
        CALLER = set(os.environ)
    result = Accelerator(nprocs=2, compute_setup="cpu", timeout=60).distribute(report, all_results=True)()
    os.write(1, f"RESULT {json.dumps(result)}\n".encode())
