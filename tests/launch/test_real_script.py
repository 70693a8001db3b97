"""A real training script (tests/scripts/real_train.py: a Dataset class in the script with num_workers=2, logging
and seeds set at the top, a checkpoint every epoch, acc.resume()) behaves the same under python, torchrun and a real
srun: same ranks, same log lines, both DataLoader workers used, bitwise the same parameters.

Long runs that die end where an uninterrupted run does. Each launcher runs the script once or twice here, each run
checking several things at once:

- python: the uninterrupted run every other run is compared with; Accelerator(max_restarts=2) restarting after two
  crashes, and max_restarts used up; SIGTERM to 4 ranks in the middle of an epoch (the stop checked in full).
- torchrun: one run with --max-restarts 2 that crashes twice, the second time leaving its newest checkpoint damaged:
  it starts from scratch, skips the damaged checkpoint and ends bitwise as the plain launch, so it also stands for
  an uninterrupted torchrun run; and the rerun on 2 ranks of the 4 ranks' checkpoint.
- srun: slurm/requeue.sbatch warned with USR1 (scancel --signal=USR1 --batch): the job requeues itself and ends
  bitwise as the plain launch, every check of an uninterrupted run included; and a job requeued onto fewer tasks.

Mid-epoch stops resumed on the same number of ranks are bitwise here under srun (the USR1 test);
tests/train/test_stopping.py stops plain and torchrun runs of 2 ranks by SIGTERM and reruns them to the
uninterrupted result, so a SIGTERM to torchrun and a same-world rerun of a plain stop need no run of their own here.
tests/train/test_world_change.py resumes on other world sizes in-process, with every option that changes how an
epoch is shared out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from support.procs import (
    REPO,
    marked_pids,
    once_per_session,
    run_script,
    run_torchrun,
    signal_when,
    slurm_env,
    wait_dead,
    wait_for,
    wait_for_text,
)
from support.real_train import REAL, checked, real_env

pytestmark = pytest.mark.timeout(300)


def _plain_run(tmp_path_factory):
    """An uninterrupted plain launch, checked: its parameters' hash and the checkpoints it left."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = run_script(REAL, "--ckpt", str(tmp / "ckpt"), env=real_env(), cwd=tmp, timeout=200)
    return {"hash": checked(proc)["hash"], "checkpoints": sorted(os.listdir(tmp / "ckpt"))}


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The plain launch every other launcher must match, run once for all pytest-xdist workers."""
    return once_per_session(tmp_path_factory, "real_script_plain_run", lambda: _plain_run(tmp_path_factory))


@pytest.fixture(scope="module")
def reference(plain_run):
    """The parameters' hash of an uninterrupted plain launch."""
    return plain_run["hash"]


def test_plain_launch_runs_the_real_script(plain_run):
    # the launch itself ran (and passed checked) in the plain_run fixture, which the other tests compare with
    # a checkpoint after each of the 3 epochs (6 steps each), named by step; resume(keep=2) kept the last two
    assert plain_run["checkpoints"] == ["checkpoint_00000012", "checkpoint_00000018"]


def test_torchrun_restarts_past_a_damaged_newest_checkpoint_to_the_plain_launchs_parameters_bitwise(
    reference, tmp_path
):
    """torchrun --max-restarts 2: attempt 0 dies before the first checkpoint, so attempt 1 runs from scratch as an
    uninterrupted torchrun run does; it dies in epoch 2, its newest checkpoint (step 12) cut short as it died (a
    node lost while writing, a bad copy). Attempt 2 skips that one with one warning, resumes every rank from step 6
    and must end with the plain launch's parameters. Each restart must rendezvous anew: the dead attempt's
    addresses stay in torchrun's store (a restart that rendezvouses on them hangs or fails with 'Connection
    refused')."""
    damaged = tmp_path / "ckpt" / "checkpoint_00000012" / "optimizer_0.pt"
    proc = run_torchrun(
        REAL,
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--crash-at",
        "0:3,2:2",
        "--cut-before-crash",
        str(damaged.relative_to(tmp_path / "ckpt")),
        torchrun_args=("--max-restarts", "2"),
        env=real_env(),
        cwd=tmp_path,
        timeout=250,
    )
    result = checked(proc)
    assert (result["attempt"], result["resumed"], result["trained"]) == ("2", True, 12), "from step 6 to 18"
    assert "rank 1 crashes at epoch 0 batch 3 on purpose" in proc.stderr
    assert "rank 1 crashes at epoch 2 batch 2 on purpose" in proc.stderr
    assert proc.stderr.count("resume() skipped 1 damaged checkpoint(s)") == 1, proc.stderr
    assert f"{damaged.name} is 100 bytes long" in proc.stderr
    for rank in (0, 1):
        assert f"rank {rank} resumed from {tmp_path / 'ckpt' / 'checkpoint_00000006'} at epoch 1 step 6" in proc.stderr
    assert result["hash"] == reference


def test_plain_max_restarts_resume_bitwise(reference, tmp_path):
    """Accelerator(max_restarts=2) does for a plain launch what torchrun --max-restarts does, with the same
    attempt numbers (acc.restart_count) and the failure printed before each restart."""
    proc = run_script(
        REAL,
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--crash-at",
        "0:3,1:2",
        "--max-restarts",
        "2",
        env=real_env(),
        cwd=tmp_path,
        timeout=250,
    )
    result = checked(proc)
    assert (result["attempt"], result["resumed"], result["trained"]) == ("2", True, 12), "from step 6 to 18"
    assert "RuntimeError: rank 1 crashes at epoch 0 batch 3 on purpose" in proc.stderr
    assert "RuntimeError: rank 1 crashes at epoch 1 batch 2 on purpose" in proc.stderr
    assert "qaccel: rank 1 failed (RuntimeError); restarting all 2 ranks (restart 1 of 2)" in proc.stderr
    assert "(restart 2 of 2)" in proc.stderr
    assert result["hash"] == reference


def test_plain_max_restarts_used_up_raises_the_last_failure(tmp_path):
    proc = run_script(
        REAL,
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--crash-at",
        "0:1,0:2",
        "--max-restarts",
        "1",
        env=real_env(),
        cwd=tmp_path,
        timeout=200,
    )
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.rsplit("Traceback (most recent call last)", 1)[1]
    assert "RuntimeError: rank 1 crashes at epoch 0 batch 2 on purpose" in last
    assert "the failure of the last attempt, after 1 restart(s)" in last
    assert proc.stderr.count("restarting all 2 ranks") == 1


SLOW = ("--step-sleep", "0.25")  # 0.25 s a step, so that a signal lands mid-run


@pytest.mark.slurm
def test_srun_in_a_job_warned_by_usr1_saves_requeues_resumes_and_ends_as_the_plain_launch_bitwise(
    reference, slurm_cluster, tmp_path
):
    """slurm/requeue.sbatch as submitted, its 2 ranks started by srun: USR1 to the batch shell (what
    --signal=B:USR1@180 sends before the time limit) reaches every rank; they save, rank 0 requeues the job once,
    and the requeued job resumes. Its ranks start from scratch as any srun run's, so the requeued run must end as
    the plain launch does and pass every check of an uninterrupted run, output arriving without
    PYTHONUNBUFFERED."""
    env = slurm_env(slurm_cluster)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTHONUNBUFFERED", None)
    out = tmp_path / "job.out"
    job = slurm_cluster.sbatch(
        REPO / "slurm" / "requeue.sbatch",
        ["--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={out}"],
        env=env,
        cwd=tmp_path,
        script_args=[str(REAL), "--ckpt", str(tmp_path / "ckpt"), *SLOW],
    )
    wait_for_text(out, "rank 1 epoch 1 loss", timeout=120)
    assert slurm_cluster.run(["scancel", "--signal=USR1", "--batch", str(job)]).returncode == 0
    # SLURM holds a requeued job ~2 minutes (BeginTime) before it may start; as the cluster's admin, start it now
    wait_for(
        lambda: (
            slurm_cluster.job_info(job).get("Restarts") == "1"
            and slurm_cluster.job_info(job).get("JobState") == "PENDING"
        ),
        60,
        lambda: f"the requeued job to be pending; job output:\n{out.read_text()}",
        interval=0.2,
    )
    # slurmd refuses a launch whose credential is not newer, in whole seconds, than the kill of the job's previous
    # start ("Job N already killed, do not launch batch job": slurm_cred_revoked): a requeued job started in the
    # same second ends FAILED 1:0 (about 1 run in 6 here). SLURM's own hold never meets this; wait it out.
    time.sleep(2)
    slurm_cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    slurm_cluster.wait_job(job, timeout=150)
    info = slurm_cluster.job_info(job)
    text = out.read_text()
    assert (info.get("JobState"), info.get("ExitCode"), info.get("Restarts")) == ("COMPLETED", "0:0", "1"), (
        info,
        text,
        slurm_cluster.log_tails(),
    )  # a requeued start that failed at once says why there
    assert text.count("requeue.sbatch: job") == 2, text
    stopped = [line for line in text.splitlines() if line.startswith("qaccel: stopped by SIGUSR1")]
    assert len(stopped) == 1 and stopped[0].endswith("; the SLURM job was requeued and will resume from it"), text
    saved = stopped[0].split(" after saving state to ")[1].split(";")[0]
    assert f"rank 0 resumed from {saved} at epoch" in text and f"rank 1 resumed from {saved} at epoch" in text
    stdout = "\n".join(line for line in text.splitlines() if line.startswith("RESULT "))
    result = checked(subprocess.CompletedProcess([], 0, stdout, text))
    assert result["hash"] == reference and result["resumed"], result
    assert result["trained"] == 18 - int(saved[-8:]), "the requeued run took only the steps left"


def _ids_by_epoch(record):
    """Every rank's recorded sample ids, by epoch, over every run that wrote into ``record``."""
    seen = {}
    for path in record.iterdir():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            seen.setdefault(entry["epoch"], []).extend(entry["ids"])
    return seen


def _split_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("split_reference")
    (tmp / "record").mkdir()
    proc = run_script(
        REAL,
        "--ckpt",
        str(tmp / "ckpt"),
        "--split-batches",
        "--record",
        str(tmp / "record"),
        "--nprocs",
        "1",
        env=real_env(),
        cwd=tmp,
        timeout=200,
    )
    return checked(proc, world=1)["params"]


@pytest.fixture(scope="module")
def split_params(tmp_path_factory):
    """The parameters of an uninterrupted run with split_batches, the same at any world size: on 1 rank, the
    cheapest launch."""
    return once_per_session(tmp_path_factory, "real_script_split_run", lambda: _split_run(tmp_path_factory))


def _resumed_on_2(second, record, split_params):
    """A run of 4 ranks was stopped and ``second`` resumed on 2: every sample of every epoch once across them, the
    line resume() printed, and the parameters of an uninterrupted run."""
    result = checked(second)
    resumed = [line for line in second.stderr.splitlines() if line.startswith("qaccel: resumed ")]
    assert len(resumed) == 1 and "(written by 4 ranks) on 2 ranks at epoch " in resumed[0], second.stderr
    assert resumed[0].endswith("; global batch 8 kept (split_batches)")
    seen = _ids_by_epoch(record)
    assert {epoch: sorted(ids) for epoch, ids in seen.items()} == {epoch: list(range(96)) for epoch in range(3)}, (
        "every sample of every epoch once, across the two worlds"
    )
    assert max(abs(a - b) for a, b in zip(result["params"], split_params)) < 1e-5


def test_sigterm_to_a_plain_launch_of_4_saves_mid_epoch_and_a_torchrun_of_2_takes_every_sample_once_to_a_straight_run(
    tmp_path, split_params
):
    """The global batch kept (split_batches, 12 steps an epoch): SIGTERM to a plain launch of 4 ranks in the middle
    of its second epoch; it must exit as a stop (Preempted: a SystemExit) after saving mid-epoch, say so once and
    leave no process behind. torchrun's 2 ranks resume that checkpoint and take only the steps left."""
    (tmp_path / "record").mkdir()
    common = [str(REAL), "--ckpt", str(tmp_path / "ckpt"), "--split-batches", "--record", str(tmp_path / "record")]
    mark = f"QACCEL_TEST_MARK_{uuid.uuid4().hex}"
    first = signal_when(
        [sys.executable, *common, "--nprocs", "4", *SLOW],
        signal.SIGTERM,
        "rank 1 epoch 1 loss",
        env=real_env(**{mark: "1"}),
        cwd=tmp_path,
        timeout=150,
        delay=1.5,  # half of the second epoch's 3 s
    )
    assert first.returncode == 128 + signal.SIGTERM, first.stderr
    assert wait_dead(marked_pids(mark), timeout=10) == []
    stopped = [line for line in first.stderr.splitlines() if line.startswith("qaccel: stopped by ")]
    assert len(stopped) == 1, first.stderr  # said once, by rank 0
    saved = stopped[0].split(" after saving state to ")[1]
    assert saved.startswith(str(tmp_path / "ckpt" / "checkpoint_")) and os.path.isdir(saved), stopped
    assert 12 < int(saved[-8:]) < 24, "stopped in the middle of the second epoch (steps 13 to 24)"
    second = run_torchrun(common[0], *common[1:], env=real_env(), cwd=tmp_path, timeout=200)
    _resumed_on_2(second, tmp_path / "record", split_params)
    for rank in range(2):
        assert f"rank {rank} resumed from {saved} at epoch" in second.stderr, second.stderr
    assert checked(second)["trained"] == 36 - int(saved[-8:]), "the second run took only the steps left"


@pytest.mark.slurm
def test_slurm_job_requeued_onto_fewer_tasks_takes_every_sample_once_and_ends_as_a_straight_run(
    slurm_cluster, split_params, tmp_path
):
    """slurm/requeue.sbatch, asking for 1 or 2 nodes of 2 tasks, starts on 2 (both free), gets the USR1 warning and
    requeues itself; while it is pending, its request is lowered to 1 node of 2 tasks (as a user does to start
    sooner on what is free): the requeued job's 2 ranks resume the 4 ranks' checkpoint."""
    env = slurm_env(slurm_cluster)
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / "job.out"
    (tmp_path / "record").mkdir()
    job = slurm_cluster.sbatch(
        REPO / "slurm" / "requeue.sbatch",
        ["--nodes=1-2", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={out}"],
        env=env,
        cwd=tmp_path,
        script_args=[
            str(REAL),
            "--ckpt",
            str(tmp_path / "ckpt"),
            "--split-batches",
            "--record",
            str(tmp_path / "record"),
            *SLOW,
        ],
    )
    wait_for_text(out, "rank 3 epoch 1 loss", timeout=120)
    assert slurm_cluster.run(["scancel", "--signal=USR1", "--batch", str(job)]).returncode == 0
    wait_for(
        lambda: (
            slurm_cluster.job_info(job).get("Restarts") == "1"
            and slurm_cluster.job_info(job).get("JobState") == "PENDING"
        ),
        60,
        lambda: f"the requeued job to be pending; job output:\n{out.read_text()}",
        interval=0.2,
    )
    assert slurm_cluster.job_info(job).get("NumTasks") == "4"  # fixed by the first start
    for update in ("NumTasks=2", "NumNodes=1-1"):  # in this order: 4 tasks need 2 nodes
        assert slurm_cluster.run(["scontrol", "update", f"JobId={job}", update]).returncode == 0
    time.sleep(2)  # a start in the same second as the kill of the previous one fails (see the test above)
    slurm_cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    slurm_cluster.wait_job(job, timeout=150)
    info = slurm_cluster.job_info(job)
    text = out.read_text()
    assert (info.get("JobState"), info.get("ExitCode"), info.get("NumTasks")) == ("COMPLETED", "0:0", "2"), (
        info,
        text,
        slurm_cluster.log_tails(),
    )
    stdout = "\n".join(line for line in text.splitlines() if line.startswith("RESULT "))
    second = subprocess.CompletedProcess([], 0, stdout, text)
    _resumed_on_2(second, tmp_path / "record", split_params)
