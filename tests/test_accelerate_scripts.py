"""A script written as Accelerate's guides write one, with only its import changed, run the ways its users run it:
under torchrun (main() on every rank, the Accelerator used outside any distribute()), under srun, and from
``python`` through distribute(main). Every way trains the same model and evaluates every sample once."""

from __future__ import annotations

import time

import pytest
from support.procs import result_lines, run_script, run_torchrun, script_file, slurm_env

pytestmark = pytest.mark.timeout(240)
SCRIPT = script_file("accelerate_guide.py")


def _result(proc, out):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [result] = result_lines(proc.stdout)
    assert result["seen"] == 300, "gather_for_metrics gathers every rank's predictions: each sample once"
    assert result["accuracy"] > 0.9
    assert result["steps"] == 96 and result["lr"] < 3e-6, "the schedule, sized on the unprepared loader, ran out"
    assert sorted(p.name for p in out.iterdir()) == ["epoch_0", "epoch_1", "epoch_2", "model.pt"]
    return result


def test_torchrun_runs_the_script_unchanged_and_python_through_distribute_to_the_same_model(tmp_path):
    torchrun = _result(
        run_torchrun(SCRIPT, str(tmp_path / "torchrun"), cwd=tmp_path, timeout=200), tmp_path / "torchrun"
    )
    plain = _result(
        run_script(SCRIPT, str(tmp_path / "plain"), "--distribute", cwd=tmp_path, timeout=200), tmp_path / "plain"
    )
    assert plain == torchrun, "the same data order and the same DDP training under both"


@pytest.mark.slurm
def test_srun_runs_the_script_unchanged(tmp_path, slurm_cluster):
    proc = slurm_cluster.srun(
        ["-N1", "-n2", "python", str(SCRIPT), str(tmp_path / "srun")],
        timeout=200,
        env=slurm_env(slurm_cluster),
        cwd=tmp_path,
    )
    _result(proc, tmp_path / "srun")


def test_accelerates_own_even_batches_checks_pass_under_torchrun(tmp_path):
    proc = run_torchrun(script_file("accelerate_data_loop.py"), cwd=tmp_path, timeout=150)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    [result] = result_lines(proc.stdout)
    assert len(result["passed"]) == 6


def test_accelerates_own_accumulation_checks_pass_for_every_split_dispatch_and_sync_each_batch(tmp_path):
    proc = run_script(script_file("accelerate_sync.py"), cwd=tmp_path, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    [result] = result_lines(proc.stdout)
    assert result["ranks"] == [17, 17]


def test_accelerates_own_training_check_passes_under_torchrun_and_distribute(tmp_path):
    """A loader shuffled by a generator the script re-seeds after prepare() trains 2 ranks to the model one process
    trains: the order follows the generator as Accelerate's does (or, with use_seedable_sampler, its seeds)."""
    every = ["no batch split", "batch split", "bf16"]
    for proc in (
        run_torchrun(script_file("accelerate_training_check.py"), cwd=tmp_path, timeout=150),
        run_script(script_file("accelerate_training_check.py"), cwd=tmp_path, timeout=150),
    ):
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        [result] = result_lines(proc.stdout)
        assert result == {"use_seedable_sampler=False": every, "use_seedable_sampler=True": every}


def test_a_rank_raising_outside_distribute_ends_the_torchrun_job_with_its_error(tmp_path):
    started = time.monotonic()
    proc = run_torchrun(script_file("accelerate_raises.py"), cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and "ValueError: failing on purpose on rank 1" in proc.stderr, proc.stderr
    assert time.monotonic() - started < 60, "torchrun stopped the waiting rank"


# Accelerate's test_script.py and test_ops.py (tests/scripts/accelerate_test_script.py): the checks that pass on 2 CPU
# ranks, under torchrun and through distribute() alike.
TEST_SCRIPT_PASSED = [
    "init_state_check",
    "process_execution_check",
    "test_split_between_processes_list",
    "test_split_between_processes_nested_dict",
    "test_split_between_processes_tensor",
    "test_split_between_processes_evenly",
    "rng_sync_check",
    "dl_preparation_check",
    "central_dl_preparation_check",
    "custom_sampler_check",
    "check_seedable_sampler",
    "check_seedable_sampler_with_data_seed",
    *(
        f"training_check(use_seedable_sampler={seedable}): {block}"
        for seedable in (False, True)
        for block in ("baseline on both processes", "no batch split", "batch split", "bf16", "fp16")
    ),
    "test_trigger",
    "test_ops.test_gather",
    "test_ops.test_gather_object",
    "test_ops.test_gather_non_contiguous",
    "test_ops.test_broadcast",
    "test_ops.test_pad_across_processes",
    "test_ops.test_reduce_sum",
    "test_ops.test_reduce_mean",
    "test_ops.test_reduce_max",
    "test_ops.test_op_checker: pad_across_processes",
    "test_ops.test_op_checker: reduce",
]
# Skipped inside the script, each printing why: GPU/XLA-only blocks, the datasets check (datasets is not a test
# dependency), Accelerate internals, and a difference the guide states (debug mode checks only broadcast's source).
TEST_SCRIPT_SKIPPED = [
    "test_split_between_processes_dataset",
    "check_seedable_sampler_in_batch_sampler_shard",
    "training_check(use_seedable_sampler=False): keep fp32 wrapper",
    "training_check(use_seedable_sampler=True): keep fp32 wrapper",
    "test_reinstantiated_state",
    "test_ops.test_op_checker: broadcast",
    "test_ops.test_copy_tensor_to_devices",
]


@pytest.mark.timeout(120)
def test_accelerates_own_test_script_and_ops_checks_under_torchrun_and_distribute(tmp_path):
    """40 checks: 33 pass, 7 are skipped with their reason printed, none fails."""
    import importlib.util

    passed, skipped = list(TEST_SCRIPT_PASSED), list(TEST_SCRIPT_SKIPPED)
    if importlib.util.find_spec("datasets") is not None:  # the check runs where datasets is installed
        skipped.remove("test_split_between_processes_dataset")
        passed.append("test_split_between_processes_dataset")
    script = script_file("accelerate_test_script.py")
    for proc in (run_torchrun(script, cwd=tmp_path, timeout=100), run_script(script, cwd=tmp_path, timeout=100)):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
        [result] = result_lines(proc.stdout)
        assert sorted(result["passed"]) == sorted(passed), result
        assert sorted(result["skipped"]) == sorted(skipped), result
        for name, reason in result["skipped"].items():
            assert f"SKIPPED {name}: {reason}" in proc.stdout, "a skipped check prints its reason"
        assert result["failed"] == {}, result["failed"]
        assert len(result["passed"]) + len(result["skipped"]) + len(result["failed"]) == 40
