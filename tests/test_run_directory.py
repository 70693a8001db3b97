"""The private run directory a launch makes under TMPDIR: 0700, removed afterwards, short enough for the
forkserver's socket under a long TMPDIR."""

from __future__ import annotations

import pytest

from procs import left_in, run_script, script_env, write_script

pytestmark = pytest.mark.timeout(180)


def test_a_long_tmpdir_does_not_break_the_forkserver_socket(tmp_path):
    """multiprocessing puts the forkserver's Unix socket under TMPDIR: past 107 bytes it cannot bind (CI failure
    when pytest's tmp path grew by one digit)."""
    tmpdir = tmp_path / ("a-long-per-job-temporary-directory-" * 3)
    tmpdir.mkdir()
    script = write_script(tmp_path, """
        from qaccel import Accelerator
        if __name__ == "__main__":
            acc = Accelerator(nprocs=2, compute_setup="cpu")
            print("OUT", acc.distribute(lambda: acc.rank, all_results=True)(), flush=True)
    """)
    proc = run_script(script, env=script_env(TMPDIR=str(tmpdir)))
    assert len(str(tmpdir)) > 107
    assert proc.returncode == 0, proc.stderr
    assert "OUT [0, 1]" in proc.stdout
    assert left_in(tmpdir) == [], "nothing is left in TMPDIR"


def test_private_run_directory_is_0700_and_removed(tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    script = write_script(tmp_path, """
        import os, stat, sys, tempfile
        from pathlib import Path
        from qaccel import Accelerator

        def look(fail):
            dirs = list(Path(tempfile.gettempdir()).glob("qaccel-*"))
            modes = [oct(stat.S_IMODE(d.stat().st_mode)) for d in dirs]
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
            print("left", sorted(p.name for p in Path(tempfile.gettempdir()).glob("qaccel-*")), flush=True)
    """)
    proc = run_script(script, env=script_env(TMPDIR=str(tmpdir)))
    assert proc.returncode == 0, proc.stderr
    # torch 2.8-2.10 print "[Gloo] Rank N is connected to M peer ranks. ..." to stdout from every rank at each
    # process-group init, and the ranks' pieces can interleave mid-line: keep only the lines this script prints.
    out = [line for line in proc.stdout.splitlines() if line.startswith(("['", "raised ", "left "))]
    assert out[0] == "['0o700']"
    assert out[1] == "raised failing on purpose ['0o700']"
    assert out[2] == "left []"
    assert left_in(tmpdir) == []
