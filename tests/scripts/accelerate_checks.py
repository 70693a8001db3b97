"""The Accelerate-style scripts of tests/scripts run one after another in one launch (each stays a script of its
own, runnable alone), so that a launcher's start is paid once for all of them:

    torchrun --standalone --nproc_per_node 2 accelerate_checks.py OUT   # every part runs on each torchrun rank
    python accelerate_checks.py OUT                                     # each part through distribute()

The parts, in order:

- ``guide``: accelerate_guide.py, run unchanged as ``__main__`` (runpy) with ``OUT/guide`` as its folder; under
  python with ``--distribute``, so the script starts its own 2 ranks as ``python accelerate_guide.py OUT
  --distribute`` would;
- ``even_batches``, ``accumulation``, ``training_check`` and ``test_script``: the main() of Accelerate's checks
  ported in accelerate_data_loop.py, accelerate_sync.py, accelerate_training_check.py and
  accelerate_test_script.py.

Under torchrun each part ends the ranks' session (``end_training()``) before the next starts, so every part joins
the ranks as its script alone does (test_script's first Accelerator, made with ``debug=True``, joins a session in
debug mode). Under python the four check parts run in one distribute() session in debug mode, which test_script's
op checker needs (the debug mode is the session's); the other checks pass in it as well.

The main process prints ``PART <name>`` as each part starts; the part's ``RESULT {...}`` lines follow it (the guide,
even_batches and accumulation print their own; the driver prints the result training_check's and test_script's
main() return).
"""

import json
import os
import runpy
import sys
from pathlib import Path

from qaccel import Accelerator

HERE = Path(__file__).resolve().parent
UNDER_TORCHRUN = "LOCAL_RANK" in os.environ  # torchrun: this process is a rank


def main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def part(name: str) -> None:
    if main_process():
        print(f"PART {name}", flush=True)


def guide(out: str) -> None:
    argv = sys.argv
    sys.argv = [str(HERE / "accelerate_guide.py"), f"{out}/guide", *([] if UNDER_TORCHRUN else ["--distribute"])]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv = argv


def checks() -> None:
    """Every check part, one after another; under torchrun each in a session of its own."""
    import accelerate_data_loop
    import accelerate_sync
    import accelerate_test_script
    import accelerate_training_check

    for name, fn in [
        ("even_batches", accelerate_data_loop.main),
        ("accumulation", accelerate_sync.main),
        ("training_check", accelerate_training_check.main),
        ("test_script", accelerate_test_script.main),
    ]:
        part(name)
        result = fn()
        if result is not None and main_process():
            print("RESULT " + json.dumps(result), flush=True)
        if UNDER_TORCHRUN:
            Accelerator(cpu=True).end_training()


if __name__ == "__main__":
    part("guide")
    guide(sys.argv[1])
    if UNDER_TORCHRUN:
        checks()
    else:
        Accelerator(nprocs=2, cpu=True, debug=True).distribute(checks)()
