"""Scripts under torchrun --standalone: each worker is a rank run in place, a process group the user made is reused
and left alone. A rank's error naming the rank: tests/launch/test_launcher_failures.py (5 torchrun runs where rank 1
raises, each checked for the ValueError and "[qaccel] raised on rank 1 of 2")."""

from __future__ import annotations

import subprocess

import pytest
from support.procs import report_results, script_env, script_file, torchrun_cmd

pytestmark = pytest.mark.timeout(180)


def test_torchrun_standalone_runs_in_place(tmp_path):
    script = script_file("report_ranks.py")
    proc = subprocess.run(
        [*torchrun_cmd(tmp_path / "torchelastic", "--standalone", "--nproc_per_node", "2"), str(script), "tr"],
        capture_output=True,
        text=True,
        timeout=150,
        env=script_env(),
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    results = sorted(report_results(proc.stdout), key=lambda r: r["rank"])
    assert [(r["rank"], r["local"], r["world"], r["sum"], r["env_rank"]) for r in results] == [
        (0, 0, 2, 1, "0"),
        (1, 1, 2, 1, "1"),
    ]
    assert len({r["pid"] for r in results}) == 2
    assert "initialized_after False" in proc.stdout


def test_existing_process_group_is_reused_and_not_destroyed(tmp_path):
    script = script_file("user_process_group.py")
    proc = subprocess.run(
        [*torchrun_cmd(tmp_path / "torchelastic", "--standalone", "--nproc_per_node", "2"), str(script)],
        capture_output=True,
        text=True,
        timeout=150,
        env=script_env(),
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("OUT 3 True 2.0") == 2
