"""Running tests/scripts/real_train.py, a training script as people write it, and the checks every run of it must
pass under any launcher; shared by the tests that run it with DDP (tests/launch/test_real_script.py) and with FSDP
(tests/train/test_fsdp.py)."""

from __future__ import annotations

from .procs import result_lines, script_env, script_file

REAL = script_file("real_train.py")


def real_env(**extra):
    """The environment of a run, ``extra`` added."""
    env = script_env(OMP_NUM_THREADS="1", **extra)  # the same thread count under every launcher
    env.pop("PYTHONUNBUFFERED", None)  # output must arrive without it
    return env


def checked(proc, world=2):
    """The rank-0 result of a finished run, after the checks every launcher must pass."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [result] = result_lines(proc.stdout)
    assert (result["rank"], result["world"], result["dtype"]) == (0, world, "torch.float64"), result
    assert result["workers"] == [0, 1], "both DataLoader workers delivered batches"
    for rank in range(world):
        assert f"INFO [real_train] rank {rank} epoch 3 loss" in proc.stderr, proc.stderr
    return result
