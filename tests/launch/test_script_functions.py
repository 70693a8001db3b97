"""What a script defines reaches its ranks, run in fresh interpreters: functions and classes of __main__, a call
without a main guard, a module-global Accelerator."""

from __future__ import annotations

import json

import pytest
from support.procs import run_script, script_file

pytestmark = pytest.mark.timeout(180)


def test_function_defined_in_main(tmp_path):
    script = script_file("main_class_and_function.py")
    proc = run_script(script, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [
        {"rank": 0, "x": 7, "world": 2},
        {"rank": 1, "x": 7, "world": 2},
    ]


def test_missing_main_guard_runs_once_without_recursive_spawn(tmp_path):
    """Ranks never re-import the script, so an unguarded call cannot start ranks recursively."""
    script = script_file("no_main_guard.py")
    proc = run_script(script, cwd=tmp_path, timeout=90)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("top-level") for line in lines) == 1
    assert "result [200, 201]" in lines


def test_module_global_accelerator_is_the_ranks_own(tmp_path):
    script = script_file("global_accelerator.py")  # and trainlib.py next to it
    proc = run_script(script, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[(0, 2), (1, 2)]"
