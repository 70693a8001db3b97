"""What a rank's watchers say on its stderr, written so that the lines of ranks sharing a terminal do not mix: used
by the hang reports (hangs.py) and the sealed store's warnings (sealed.py), which import each other's nothing."""

from __future__ import annotations

import os
import sys


def write_stderr(text: str) -> None:
    """One write, so the lines of ranks sharing a terminal do not mix."""
    try:
        sys.stderr.flush()
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass
