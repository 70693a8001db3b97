"""A real training script (tests/scripts/real_train.py: a Dataset class in the script with num_workers=2, logging
and seeds set at the top, a checkpoint every epoch) behaves the same under python, torchrun and a real srun:
same ranks, same log lines, both DataLoader workers used, bitwise the same parameters. Under torchrun
--max-restarts, a run that crashes and restarts ends bitwise where an uninterrupted run does."""

from __future__ import annotations

import pytest

from procs import REPO, result_lines, run_script, run_torchrun, script_env

pytestmark = pytest.mark.timeout(300)

REAL = REPO / "tests" / "scripts" / "real_train.py"


def _env(**extra):
    env = script_env(OMP_NUM_THREADS="1", **extra)  # the same thread count under every launcher
    env.pop("PYTHONUNBUFFERED", None)  # output must arrive without it
    return env


def _checked(proc, world=2):
    """The rank-0 result of a finished run, after the checks every launcher must pass."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [result] = result_lines(proc.stdout)
    assert (result["rank"], result["world"], result["dtype"]) == (0, world, "torch.float64"), result
    assert result["workers"] == [0, 1], "both DataLoader workers delivered batches"
    for rank in range(world):
        assert f"INFO [real_train] rank {rank} epoch 3 loss" in proc.stderr, proc.stderr
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The parameters' hash of an uninterrupted plain launch."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = run_script(REAL, "--ckpt", str(tmp / "ckpt"), env=_env(), cwd=tmp, timeout=200)
    return _checked(proc)["hash"]


def test_plain_launch_runs_the_real_script(reference, tmp_path):
    proc = run_script(REAL, "--ckpt", str(tmp_path / "ckpt"), env=_env(), cwd=tmp_path, timeout=200)
    assert _checked(proc)["hash"] == reference
    assert (tmp_path / "ckpt" / "registered_0.pt").exists()


def test_torchrun_runs_the_real_script_to_the_same_parameters(reference, tmp_path):
    proc = run_torchrun(REAL, "--ckpt", str(tmp_path / "ckpt"), env=_env(), cwd=tmp_path, timeout=200)
    assert _checked(proc)["hash"] == reference


@pytest.mark.slurm
def test_srun_runs_the_real_script_to_the_same_parameters(reference, slurm_cluster, tmp_path):
    from test_slurm import _env as slurm_env

    env = slurm_env(slurm_cluster)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTHONUNBUFFERED", None)
    proc = slurm_cluster.srun(["-N1", "-n2", "python", str(REAL), "--ckpt", str(tmp_path / "ckpt")], timeout=200, env=env)
    assert _checked(proc)["hash"] == reference


def test_torchrun_restarts_resume_bitwise(reference, tmp_path):
    """Attempt 0 dies before the first checkpoint, attempt 1 after it (and resumes from it); attempt 2 must end
    with the uninterrupted run's parameters. Each restart must rendezvous anew: the dead attempt's addresses
    stay in torchrun's store (they made restarts hang or fail with 'Connection refused')."""
    proc = run_torchrun(REAL, "--ckpt", str(tmp_path / "ckpt"), "--crash-at", "0:3,1:2",
                        torchrun_args=("--max-restarts", "2"), env=_env(), cwd=tmp_path, timeout=250)
    result = _checked(proc)
    assert (result["attempt"], result["resumed"]) == ("2", True), result
    assert "rank 1 crashes at epoch 0 batch 3 on purpose" in proc.stderr
    assert "rank 1 crashes at epoch 1 batch 2 on purpose" in proc.stderr
    assert result["hash"] == reference
