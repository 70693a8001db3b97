"""Ranks run with the caller's environment and working directory as they are when distribute() is called; a user's
OMP_NUM_THREADS wins over the thread budget."""

from __future__ import annotations

import os

import pytest
from support.procs import run_script, script_env, script_file

pytestmark = pytest.mark.timeout(180)


def test_a_users_omp_num_threads_wins_and_ranks_see_the_callers_environment_at_call_time(tmp_path):
    """One launch, two distribute() calls. The first: OMP_NUM_THREADS set by the user before the start wins over
    the thread budget. The forkserver starts at Accelerator(), with the environment of then; variables set after
    that, OMP_NUM_THREADS changed too, must still reach the ranks of the second call."""
    script = script_file("caller_environment.py")
    budget = max(1, len(os.sched_getaffinity(0)) // 2)
    want = 1 if budget != 1 else 2
    late_threads = next(n for n in (2, 3, 4) if n not in (budget, want))  # neither the budget nor the first value
    proc = run_script(script, env=script_env(OMP_NUM_THREADS=str(want), LATE_THREADS=str(late_threads)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    # without torch 2.8-2.10's "[Gloo] Rank N is connected to ..." lines, which ranks print at each group's start
    first, second = [line for line in proc.stdout.splitlines() if not line.startswith("[Gloo]")][-2:]
    assert first == f"[{want}, {want}]"
    late = ("set-after-construction", late_threads)
    assert second == str([late, late])


def test_ranks_work_in_the_callers_directory_of_the_call(tmp_path):
    """The servers the ranks are forked from started in the directory of Accelerator(); the caller moved since."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    proc = run_script(script_file("caller_cwd.py"), str(first), str(second), env=script_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")][-2:]
    assert lines == [str([str(first)] * 2), str([str(second)] * 2)]
