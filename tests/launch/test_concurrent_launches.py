"""Several scripts launching ranks at the same time on one machine do not get in each other's way."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.procs import script_env, script_file

pytestmark = pytest.mark.timeout(180)


def test_several_scripts_launching_at_the_same_time(tmp_path):
    script = script_file("rank_sum.py")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i)],
            env=script_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    outs = [p.communicate(timeout=150) for p in procs]
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err
        # ignore torch 2.8-2.10's "[Gloo] Rank N is connected to ..." lines (see above)
        assert [line for line in out.splitlines() if line.startswith("sum ")] == [f"sum {1 + 2 * i}"]
