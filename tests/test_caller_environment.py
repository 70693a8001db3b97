"""Ranks run with the caller's environment as it is when distribute() is called; a user's OMP_NUM_THREADS wins over
the thread budget."""

from __future__ import annotations

import os

import pytest

from procs import run_script, script_env, write_script

pytestmark = pytest.mark.timeout(180)


def test_omp_num_threads_set_by_user_wins(tmp_path):
    script = write_script(tmp_path, """
        import torch
        from qaccel import Accelerator
        if __name__ == "__main__":
            print(Accelerator(nprocs=2, compute_setup="cpu").distribute(torch.get_num_threads, all_results=True)())
    """)
    budget = max(1, len(os.sched_getaffinity(0)) // 2)
    want = 1 if budget != 1 else 2
    proc = run_script(script, env=script_env(OMP_NUM_THREADS=str(want)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"[{want}, {want}]"


def test_ranks_see_the_callers_environment_at_call_time(tmp_path):
    """The forkserver starts at Accelerator(); variables set after that must still reach the ranks."""
    script = write_script(tmp_path, """
        import os, torch
        from qaccel import Accelerator
        if __name__ == "__main__":
            acc = Accelerator(nprocs=2, compute_setup="cpu")
            os.environ["QACCEL_LATE_VAR"] = "set-after-construction"
            os.environ["OMP_NUM_THREADS"] = os.environ["WANT_THREADS"]
            print(acc.distribute(lambda: (os.environ.get("QACCEL_LATE_VAR"), torch.get_num_threads()), all_results=True)())
    """)
    budget = max(1, len(os.sched_getaffinity(0)) // 2)
    want = 1 if budget != 1 else 2
    proc = run_script(script, env=script_env(WANT_THREADS=str(want)))
    assert proc.returncode == 0, proc.stderr
    late = ("set-after-construction", want)
    assert proc.stdout.strip().splitlines()[-1] == str([late, late])
