"""What a script defines reaches its ranks, run in fresh interpreters: functions and classes of __main__, a call
without a main guard, a module-global Accelerator."""

from __future__ import annotations

import json

import pytest

from support.procs import run_script, write_script

pytestmark = pytest.mark.timeout(180)


def test_function_defined_in_main(tmp_path):
    script = write_script(tmp_path, """
        import json
        from qaccel import Accelerator

        class Point:
            def __init__(self, x):
                self.x = x

        def train(point, accelerator):
            return {"rank": accelerator.rank, "x": point.x, "world": accelerator.world_size}

        if __name__ == "__main__":
            acc = Accelerator(nprocs=2, compute_setup="cpu")
            print(json.dumps(acc.distribute(train, all_results=True)(Point(7), acc)))
    """)
    proc = run_script(script)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [
        {"rank": 0, "x": 7, "world": 2},
        {"rank": 1, "x": 7, "world": 2},
    ]


def test_missing_main_guard_runs_once_without_recursive_spawn(tmp_path):
    """Ranks never re-import the script, so an unguarded call cannot start ranks recursively."""
    script = write_script(tmp_path, """
        import os
        from qaccel import Accelerator
        print("top-level", os.getpid(), flush=True)
        acc = Accelerator(nprocs=2, compute_setup="cpu")
        print("result", acc.distribute(lambda a: a.world_size * 100 + a.rank, all_results=True)(acc), flush=True)
    """)
    proc = run_script(script, timeout=90)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("top-level") for line in lines) == 1
    assert "result [200, 201]" in lines


def test_module_global_accelerator_is_the_ranks_own(tmp_path):
    (tmp_path / "trainlib.py").write_text(
        "from qaccel import Accelerator\n"
        "acc = Accelerator(nprocs=2, compute_setup='cpu')\n"
        "def train():\n"
        "    return (acc.rank, acc.world_size)\n"
    )
    script = write_script(tmp_path, """
        import trainlib
        if __name__ == "__main__":
            print(trainlib.acc.distribute(trainlib.train, all_results=True)())
    """)
    proc = run_script(script)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[(0, 2), (1, 2)]"
