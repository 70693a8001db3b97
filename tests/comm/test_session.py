"""A training body written for torchrun (it makes the default group itself and destroys it at its end) runs
unchanged inside distribute(), under a plain launch, under torchrun and in a real srun step: one world of 2, disjoint shards, equal
weights on both ranks, and qaccel's own work before and after it (every rank's result, a second call) still works.
Under torchrun the script also makes the group at its top, before the Accelerator, and the body destroys that one.

Both ways of making the group (from the environment alone; init_method="env://" with the rank and world size
passed) run in the one plain launch, one per call: they read the same variables under every launcher, so torchrun
and srun run the first way only."""

from __future__ import annotations

import sys

import pytest
import torch.distributed as dist
from support.procs import result_lines, run_script, run_torchrun, script_file, slurm_env

pytestmark = pytest.mark.timeout(180)
SCRIPT = script_file("ddp_body.py")


def _trained_together(result: dict) -> None:
    assert result["world"] == 2
    assert result["weights"][0] == result["weights"][1], "DDP kept the ranks' weights equal"


def test_a_ddp_body_that_makes_and_destroys_its_group_runs_in_a_plain_launch_from_env_then_with_rank_and_world(
    tmp_path,
):
    """The first call's body initialises from the environment, the second passes init_method="env://", its rank and
    the world size (the script checks that both return the same)."""
    proc = run_script(SCRIPT, "explicit", cwd=tmp_path, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [result] = result_lines(proc.stdout)
    _trained_together(result)
    assert result["rank"] == 0 and sorted(result["seen"]) == [0.0, 0.0, 4.0, 4.0, 8.0, 8.0, 12.0, 12.0], (
        "rank 0's shard of the 8 samples (DistributedSampler: every other one), for 2 epochs"
    )


def test_under_torchrun_a_body_that_destroys_the_group_the_script_made_at_its_top_then_one_that_makes_its_own_run(
    tmp_path,
):
    """The first call runs in the group the script made (every rank's result comes back, and the group is gone
    after it, as the body asked); the second call's group is made anew although rank 1 comes first: it does not
    read the destroyed group's addresses from torchrun's store (a refused connection, or a hang). The
    Accelerator's reduce outside distribute() then joins the ranks the same way, and sums over both."""
    _each_process_a_rank(run_torchrun(SCRIPT, "top", cwd=tmp_path, timeout=150))


@pytest.mark.slurm
def test_a_ddp_body_that_makes_and_destroys_its_group_runs_in_a_real_srun_step(tmp_path, slurm_cluster):
    _each_process_a_rank(
        slurm_cluster.srun(
            ["-N1", "-n2", sys.executable, str(SCRIPT)], timeout=150, env=slurm_env(slurm_cluster), cwd=tmp_path
        )
    )


def _each_process_a_rank(proc) -> None:
    """A launcher's two processes printed one result each: ranks 0 and 1, trained together on disjoint shards."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = sorted(result_lines(proc.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        _trained_together(result)
    assert not set(results[0]["seen"]) & set(results[1]["seen"]), "disjoint shards"


def _asks_for_nccl():
    dist.init_process_group("nccl")


def test_a_body_that_asks_for_another_backend_is_told_which_one_qaccel_made(acc):
    with pytest.raises(
        ValueError,
        match=r"init_process_group\(backend='nccl'\) inside distribute\(\): qaccel already "
        r"made this rank's group with backend 'gloo' \(choose it with "
        r"Accelerator\(backend=...\)\)",
    ):
        acc.distribute(_asks_for_nccl)()
