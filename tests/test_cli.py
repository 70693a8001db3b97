"""The `qaccel` command: env report and the real smoke test, as a user runs them."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.procs import REPO, script_env, torchrun_cmd

import qaccel.options
from qaccel import Accelerator, cli
from qaccel.environment import detect

pytestmark = pytest.mark.timeout(180)


def _qaccel(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "qaccel", *args],
        capture_output=True,
        text=True,
        timeout=150,
        env=env or script_env(),
        check=False,
    )


def test_env_reports_versions_and_plan():
    proc = _qaccel("env", "--nprocs", "2", "--compute-setup", "cpu")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for needle in (
        "qaccel ",
        "torch ",
        "environment       plain",
        "would start       2 ranks",
        "backend           gloo",
        "device (rank 0)   cpu",
        "threads per rank  ",
    ):
        assert needle in out, out
    assert "nprocs  " not in out  # asked: no hint needed


def test_env_without_nprocs_says_the_script_decides_and_how_to_ask():
    proc = _qaccel("env", "--compute-setup", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "your script's Accelerator(nprocs=N) decides" in proc.stdout
    assert "`qaccel env --nprocs N`" in proc.stdout
    assert "would start       nothing: fn runs in this process" in proc.stdout


def test_env_under_slurm_variables():
    env = script_env(
        SLURM_PROCID="1",
        SLURM_LOCALID="1",
        SLURM_NODEID="0",
        SLURM_STEP_ID="3",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_NODELIST="gpu[07-08]",
        SLURM_JOB_ID="123456",
    )
    proc = _qaccel("env", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "environment       slurm" in proc.stdout
    assert "rank 1 of 2" in proc.stdout and "gpu07:18456" in proc.stdout


@pytest.mark.parametrize(
    ("variables", "seen", "line"),
    [
        (
            {"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "0,1"},
            2,
            "cuda:1: sees 2 GPUs (CUDA_VISIBLE_DEVICES=0,1), its node runs 2 rank(s): the local rank picks",
        ),
        (
            {"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "1"},
            1,
            "cuda:0: sees 1 GPU (CUDA_VISIBLE_DEVICES=1), one of its node's 2 ranks: the launcher bound it",
        ),
    ],
)
def test_env_says_which_gpu_a_rank_takes_and_why(monkeypatch, variables, seen, line):
    """The GPU count is the only thing faked (this machine has none); the variables are srun's for rank 1 of 2."""
    monkeypatch.setattr(qaccel.environment.gpus, "cuda_device_count", lambda: seen)
    for name, value in {
        "SLURM_PROCID": "1",
        "SLURM_NODEID": "0",
        "SLURM_STEP_ID": "3",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "gpu07",
        "SLURM_JOB_ID": "123456",
        **variables,
    }.items():
        monkeypatch.setenv(name, value)
    assert cli._gpu_line(Accelerator(backend="gloo"), detect(), seen) == line


def test_env_in_a_plain_process_says_which_gpus_its_ranks_would_take(monkeypatch):
    monkeypatch.setattr(qaccel.environment.gpus, "cuda_device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert (
        cli._gpu_line(Accelerator(nprocs=2, backend="gloo"), detect(), 4)
        == "ranks 0-1 take cuda:0-1: sees 4 GPUs (CUDA_VISIBLE_DEVICES=0,1,2,3), its node runs 2 rank(s): the local rank picks"
    )
    assert (
        cli._gpu_line(Accelerator(compute_setup="cpu"), detect(), 4) == "none (4 visible, CUDA_VISIBLE_DEVICES=0,1,2,3)"
    )


def test_smoke_test_passes_and_counts():
    proc = _qaccel("test", "--nprocs", "2", "--compute-setup", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("launch", "all-reduce", "broadcast", "result", "error path"):
        assert f"PASS {name}" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "qaccel test: 5 passed, 0 failed"


def test_smoke_test_checks_hold_under_python_O():
    """python -O strips assert statements: every check of qaccel test is one that still runs there."""
    code = (
        "from qaccel import cli\n"
        "try:\n    cli._expect(False, 'a wrong result')\nexcept cli.CheckFailed as exc:\n    print('caught', exc)"
    )
    proc = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60, env=script_env(), check=False
    )
    assert proc.stdout.strip() == "caught a wrong result", proc.stdout + proc.stderr
    assert "assert " not in (REPO / "qaccel" / "cli.py").read_text(), "an assert would vanish under -O"
    passed = subprocess.run(
        [sys.executable, "-O", "-m", "qaccel", "test", "--nprocs", "2", "--compute-setup", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        env=script_env(),
        check=False,
    )
    assert passed.stdout.strip().splitlines()[-1] == "qaccel test: 5 passed, 0 failed", passed.stdout + passed.stderr


def test_bad_arguments_exit_2_with_message():
    proc = _qaccel("test", "--nprocs", "0")
    assert proc.returncode == 2
    assert "nprocs must be a positive int; got 0" in proc.stderr


def test_smoke_test_under_torchrun_passes_on_every_rank(tmp_path):
    proc = subprocess.run(
        [
            *torchrun_cmd(tmp_path / "torchelastic", "--standalone", "--nproc_per_node", "2"),
            "-m",
            "qaccel",
            "test",
            "--compute-setup",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env=script_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("qaccel test: 4 passed, 0 failed") == 1
    assert proc.stdout.count("note: ranks were started by a launcher") == 1
    assert "FAIL" not in proc.stdout
