"""What a rank process started by qaccel sets up before user code runs, so that it looks like a torchrun worker.

- **Own session and process group**, as torchrun's agent gives each worker (``start_new_session``): the launcher
  stops a rank by signalling its group, so the DataLoader workers and pools it started stop with it.
- **``fork`` for the processes a rank creates** (DataLoader workers, ``multiprocessing`` pools), as a torchrun
  worker on Linux gets. A rank never re-imports the user's script (fn travels by value), so a child started with
  spawn or forkserver could not find a Dataset class defined in the script; a forked child inherits it. Forking
  is also what makes an epoch's workers start in milliseconds. It is CUDA-safe in the way torchrun's is: workers
  forked from a rank that uses CUDA must not use CUDA themselves (torch raises "Cannot re-initialize CUDA in
  forked subprocess"); DataLoader workers don't, and pinning runs in a thread of the rank.
- **Ctrl-C raises KeyboardInterrupt**, as in any Python process: the forkserver it was forked from ignores SIGINT
  (so that a Ctrl-C while it imports torch does not print a second traceback), and that setting is undone here.
- **Output that survives a stop**: stdout is line-buffered (each line reaches the caller whole and at once, so
  lines of two ranks never split each other), and both streams are flushed before a failure is reported.
- **SIGTERM kills at once** (its default action, as in a torchrun worker). A Python-level handler would run only
  between bytecodes: a rank blocked in a collective would wait for the SIGKILL, and a forked child that inherits
  it can miss the signal while it starts, which left ``multiprocessing.Pool.__exit__`` waiting forever for a
  worker about 1 run in 6.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys

CHILD_START_METHOD = "fork"


def become_worker(environ: dict[str, str]) -> None:
    """Turn this freshly started rank process into a torchrun-like worker with environment ``environ``."""
    os.setsid()
    os.environ.clear()
    os.environ.update(environ)
    multiprocessing.set_start_method(CHILD_START_METHOD, force=True)
    if sys.stdout is not None and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def flush_std_streams() -> None:
    """Flush stdout and stderr, ignoring a closed or broken stream."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - a rank on its way out must not fail on its output
            pass
