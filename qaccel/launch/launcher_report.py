"""How a rank run in place (under torchrun or srun) leaves when it fails, so that the launcher's summary names the
rank that raised, not a peer that only lost its connection to it.

torchrun's summary ("Root Cause (first observed failure)", torch/distributed/elastic/multiprocessing/errors)
names the failed worker with the smallest timestamp: the one in its error file (``$TORCHELASTIC_ERROR_FILE``, the
JSON torch's ``@record`` writes), else, without a file, the whole second in which the agent saw it exit. A tie
goes to the failure the agent recorded first, and among workers found exited in the same poll (every 0.1 s) to
the lowest local rank. When rank 1 raised, rank 0 saw the broken connection at once and often exited first, or
in the same poll, while rank 1 was still tearing down: the summary named rank 0 in 5 of 12 runs, with no
traceback at all. So, for an exception leaving an in-place rank of a multi-rank world:

- A cause (any ``Exception`` that is not a symptom) is written to the error file at once, before the group is
  torn down and so before any peer can notice, with the second it was raised in. The rank's own traceback
  still prints as usual.
- A symptom (the error, or one it was raised from, only says a peer went away: ``errors.is_symptom``) writes no
  error file and holds the rank ``SYMPTOM_HOLD_S`` before it leaves. The raising rank exits first; torchrun, or
  srun with ``--kill-on-bad-exit=1``, then stops this one. Without such a launcher it exits non-zero after the
  hold. The hold is longer than a second, so even when the raising rank is the slower to exit, its error
  file's second is strictly earlier than the second the agent sees this rank exit.
- ``SystemExit`` (``sys.exit``, a stop after a signal) and ``KeyboardInterrupt`` are neither written nor held.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback

from qaccel import storage
from qaccel.errors import is_symptom

ERROR_FILE_VARIABLE = "TORCHELASTIC_ERROR_FILE"
SYMPTOM_HOLD_S = 3.0


def is_cause(exc: BaseException) -> bool:
    """True for an error the launcher should report as this rank's own failure."""
    return isinstance(exc, Exception) and not is_symptom(exc)


def record_cause(exc: BaseException, raised_at: float | None = None) -> bool:
    """Write ``exc`` to torchrun's error file, in the format of torch's ``ErrorHandler.record_exception``, if this
    process has one and ``exc`` is a cause; True when written. Never raises: a rank failing is reported anyway."""
    path = os.environ.get(ERROR_FILE_VARIABLE)
    if not path or not is_cause(exc):
        return False
    stamp = int(time.time() if raised_at is None else raised_at)
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": "".join(traceback.format_exception(exc)), "timestamp": str(stamp)},
        }
    }
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        # whole or not at all: the agent may read it the moment this process dies
        storage.write_bytes(json.dumps(data).encode(), path, durable=False)
    except OSError:
        return False
    return True


def hold_symptom(exc: BaseException, rank: int, world_size: int, hold_s: float = SYMPTOM_HOLD_S) -> bool:
    """If ``exc`` only says a peer went away, say so on stderr and wait ``hold_s`` before this rank leaves, so that
    the rank that raised exits first (the launcher usually stops this one during the wait); True if held."""
    if world_size < 2 or not isinstance(exc, Exception) or not is_symptom(exc):
        return False
    line = (
        f"[qaccel] rank {rank} of {world_size} lost contact with another rank ({type(exc).__name__}: "
        f"{_gist(str(exc))}); the cause is most likely in that rank's log. This rank leaves in {hold_s:g} s, "
        "unless the launcher stops it first.\n"
    )
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    try:
        os.write(2, line.encode(errors="replace"))  # one write(2): ranks share the launcher's stderr
    except OSError:
        pass
    time.sleep(hold_s)
    return True


def _gist(message: str, limit: int = 160) -> str:
    """The first sentence of an error message, without gloo's ``[source/file.cc:123] `` prefix."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", (message.strip().splitlines() or [""])[0])
    text = text.split(". ", 1)[0]
    return text if len(text) <= limit else text[:limit] + "..."
