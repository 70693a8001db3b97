"""Two launches, the second failing on purpose, whose ranks report the modes of their run directory and of the folder
that holds it; then the script prints what is left in that folder. Run with a long TMPDIR by
tests/launch/test_run_directory.py."""

import stat
import tempfile
from pathlib import Path

from qaccel import Accelerator


def look(fail):
    dirs = list(Path(tempfile.gettempdir()).glob("qaccel-runs-*/run-*"))
    modes = [oct(stat.S_IMODE(d.stat().st_mode)) for d in [*dirs, dirs[0].parent]]
    if fail:
        raise RuntimeError(f"failing on purpose {modes}")
    return modes


if __name__ == "__main__":
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    print(acc.distribute(look)(False), flush=True)
    try:
        acc.distribute(look)(True)
    except RuntimeError as exc:
        print("raised", exc, flush=True)
    print("left", sorted(p.name for p in Path(tempfile.gettempdir()).glob("qaccel-runs-*/*")), flush=True)
