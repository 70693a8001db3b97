"""Makes and drops run directories in a loop until DEADLINE (a time.time()), checking its own directory and lock each
time, or with remove, removes stale ones as fast as it can; prints how many it made and what it removed.

Usage: run_dir_churn.py make|remove DEADLINE RUN_DIR_PY, where RUN_DIR_PY is the file of qaccel.launch.run_dir,
loaded alone (no torch import). Run by tests/launch/test_run_directory.py.
"""

import importlib.util
import os
import sys
import time

spec = importlib.util.spec_from_file_location("run_dir", sys.argv[3])
run_dir = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_dir)

mode, deadline, made, removed = sys.argv[1], float(sys.argv[2]), 0, []
while time.time() < deadline:
    if mode == "remove":
        removed += run_dir.remove_stale()
        continue
    with run_dir.run_directory() as path:
        open(os.path.join(path, "mine"), "w").close()
        time.sleep(0.002)
        assert os.path.isfile(os.path.join(path, run_dir.LOCK)) and os.path.isfile(os.path.join(path, "mine")), path
    made += 1
print(made, removed, flush=True)
