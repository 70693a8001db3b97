"""Several of this folder's scripts one after another in one process, each run as ``python SCRIPT OUTPUT_DIR/STEM``
would run it (``runpy``, ``__name__ == "__main__"``).

Usage: run_scripts.py OUTPUT_DIR SCRIPT... (under python each script's Accelerator starts 2 ranks per call; under
torchrun each process is one rank of every script)."""

import os
import runpy
import sys

if __name__ == "__main__":
    out, scripts = sys.argv[1], sys.argv[2:]
    here = os.path.dirname(os.path.abspath(__file__))
    for script in scripts:
        path = os.path.join(here, script)
        sys.argv = [path, os.path.join(out, os.path.splitext(script)[0])]
        runpy.run_path(path, run_name="__main__")
