"""A script written as Accelerate's guides write one, with only its import changed, run the ways its users run it:
under torchrun (main() on every rank, the Accelerator used outside any distribute()), under srun, and from
``python`` through distribute(main). Every way trains the same model and evaluates every sample once. Accelerate's
own check scripts, ported with their imports changed, pass under torchrun and through distribute().

What runs: tests/scripts/accelerate_checks.py runs the guide script unchanged (as ``__main__``), then the main() of
each of Accelerate's ported check scripts (even_batches, gradient accumulation, the training check, test_script.py
with test_ops.py), once under torchrun and once from ``python`` (the guide through its own distribute(), the checks
through one distribute() in debug mode); each of the two launches is made once for all the tests below, which read
its parts. srun runs the guide alone: srun starting the script's ranks is what is tested there, and the checks'
ranks, once started outside qaccel, meet the same way under srun as under torchrun (tests/cluster covers srun's
variables). A rank that raises ends its job, so that check has a torchrun run of its own."""

from __future__ import annotations

import json
import time

import pytest
from support.procs import once_per_session, result_lines, run_script, run_torchrun, script_file, slurm_env

pytestmark = pytest.mark.timeout(240)
SCRIPT = script_file("accelerate_guide.py")
CHECKS = script_file("accelerate_checks.py")
LAUNCH_TIMEOUT = 240  # each launch of CHECKS; a test that starts both waits for both
BOTH_LAUNCHES = pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)


def _parts(stdout: str) -> dict[str, list]:
    """The RESULT objects of each part of CHECKS, by the part's name (its ``PART <name>`` line comes first)."""
    parts: dict[str, list] = {}
    name = None
    for line in stdout.splitlines():
        if line.startswith("PART "):
            name = line.split(" ", 1)[1]
            parts[name] = []
        elif line.startswith("RESULT "):
            parts.setdefault(name, []).append(json.loads(line.split(" ", 1)[1]))
    return parts


def _launch(tmp_path_factory, launcher: str) -> dict:
    def compute():
        out = tmp_path_factory.mktemp(f"checks-{launcher}")
        if launcher == "torchrun":
            proc = run_torchrun(CHECKS, str(out), cwd=out, timeout=LAUNCH_TIMEOUT)
        else:
            proc = run_script(CHECKS, str(out), cwd=out, timeout=LAUNCH_TIMEOUT)
        guide = out / "guide"
        return {
            "launcher": launcher,
            "returncode": proc.returncode,
            "stdout": proc.stdout,
            "stderr": proc.stderr[-6000:],
            "parts": _parts(proc.stdout),
            "guide_files": sorted(p.name for p in guide.iterdir()) if guide.is_dir() else [],
        }

    return once_per_session(tmp_path_factory, f"accelerate_checks_{launcher}", compute)


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    """CHECKS under ``torchrun --nproc_per_node 2``, run once for all pytest-xdist workers."""
    return _launch(tmp_path_factory, "torchrun")


@pytest.fixture(scope="module")
def python_run(tmp_path_factory):
    """CHECKS from ``python`` (each part through distribute(), 2 ranks), run once for all pytest-xdist workers."""
    return _launch(tmp_path_factory, "python")


def _part(run: dict, name: str):
    """The one RESULT of part ``name`` of a launch that ended well."""
    assert run["returncode"] == 0, f"{run['launcher']}:\n{run['stdout'][-3000:]}\n{run['stderr']}"
    results = run["parts"].get(name)
    assert results is not None and len(results) == 1, f"{run['launcher']}, part {name}: {results}"
    return results[0]


def _guide(result: dict, files: list[str]):
    assert result["seen"] == 300, "gather_for_metrics gathers every rank's predictions: each sample once"
    assert result["accuracy"] > 0.9
    assert result["steps"] == 96 and result["lr"] < 3e-6, "the schedule, sized on the unprepared loader, ran out"
    assert files == ["epoch_0", "epoch_1", "epoch_2", "model.pt"]
    return result


@BOTH_LAUNCHES
def test_torchrun_runs_the_script_unchanged_and_python_through_distribute_to_the_same_model(torchrun_run, python_run):
    torchrun = _guide(_part(torchrun_run, "guide"), torchrun_run["guide_files"])
    plain = _guide(_part(python_run, "guide"), python_run["guide_files"])
    assert plain == torchrun, "the same data order and the same DDP training under both"


@pytest.mark.slurm
def test_srun_runs_the_script_unchanged(tmp_path, slurm_cluster):
    proc = slurm_cluster.srun(
        ["-N1", "-n2", "python", str(SCRIPT), str(tmp_path / "srun")],
        timeout=200,
        env=slurm_env(slurm_cluster),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [result] = result_lines(proc.stdout)
    _guide(result, sorted(p.name for p in (tmp_path / "srun").iterdir()))


@BOTH_LAUNCHES
def test_accelerates_own_even_batches_checks_pass_under_torchrun_and_distribute(torchrun_run, python_run):
    for run in (torchrun_run, python_run):
        assert len(_part(run, "even_batches")["passed"]) == 6, run["launcher"]


@BOTH_LAUNCHES
def test_accelerates_own_accumulation_checks_pass_for_every_split_dispatch_and_sync_each_batch(
    torchrun_run, python_run
):
    """Under torchrun and through distribute(), on both ranks."""
    for run in (torchrun_run, python_run):
        assert _part(run, "accumulation")["ranks"] == [17, 17], run["launcher"]


@BOTH_LAUNCHES
def test_accelerates_own_training_check_passes_under_torchrun_and_distribute(torchrun_run, python_run):
    """A loader shuffled by a generator the script re-seeds after prepare() trains 2 ranks to the model one process
    trains: the order follows the generator as Accelerate's does (or, with use_seedable_sampler, its seeds)."""
    every = ["no batch split", "batch split", "bf16"]
    for run in (torchrun_run, python_run):
        assert _part(run, "training_check") == {
            "use_seedable_sampler=False": every,
            "use_seedable_sampler=True": every,
        }, run["launcher"]


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


@BOTH_LAUNCHES
def test_accelerates_own_test_script_and_ops_checks_under_torchrun_and_distribute(torchrun_run, python_run):
    """40 checks: 33 pass, 7 are skipped with their reason printed, none fails."""
    import importlib.util

    passed, skipped = list(TEST_SCRIPT_PASSED), list(TEST_SCRIPT_SKIPPED)
    if importlib.util.find_spec("datasets") is not None:  # the check runs where datasets is installed
        skipped.remove("test_split_between_processes_dataset")
        passed.append("test_split_between_processes_dataset")
    for run in (torchrun_run, python_run):
        result = _part(run, "test_script")
        assert sorted(result["passed"]) == sorted(passed), (run["launcher"], result)
        assert sorted(result["skipped"]) == sorted(skipped), (run["launcher"], result)
        for name, reason in result["skipped"].items():
            assert f"SKIPPED {name}: {reason}" in run["stdout"], "a skipped check prints its reason"
        assert result["failed"] == {}, (run["launcher"], result["failed"])
        assert len(result["passed"]) + len(result["skipped"]) + len(result["failed"]) == 40
