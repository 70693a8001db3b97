"""A Trainer script run as users run it: an uninterrupted plain launch; a SIGTERM (during a slow epoch-end
callback) or Ctrl-C mid-run that saves, then a rerun that ends bitwise where the uninterrupted run ends, with the
tracker (TensorBoard, MLflow) holding each epoch's metrics and each batch's loss once, equal to the uninterrupted
run's; a fit restarted by torchrun --max-restarts; Ctrl-C to ``srun -X``; and slurm/requeue.sbatch, where a USR1
warning requeues the job and the requeued job finds its own run folder.

Which launcher runs which stop: SIGTERM and Ctrl-C to a plain launch (the caller passes SIGTERM on to its ranks, and
turns Ctrl-C into a stop of every rank and a KeyboardInterrupt of its own), Ctrl-C's SIGINT to every task under
``srun -X``, SLURM's USR1 under sbatch, and a failed rank under torchrun --max-restarts, whose restarted ranks fit in
place. A stop under torchrun needs no Trainer run of its own: a rank stops through the same code armed by resume()
whichever stop signal it gets, and torchrun's agent handles SIGTERM and Ctrl-C's SIGINT alike (it passes the one it
got on to its workers); tests/train/test_stopping.py and tests/launch/test_real_script.py stop runs under torchrun
with SIGTERM and rerun them there, and a rank's own stop on Ctrl-C's SIGINT runs here under srun -X."""

from __future__ import annotations

import json
import re
import signal
import sys
import time
import uuid

import pytest
from support import component
from support.procs import (
    REPO,
    marked_pids,
    once_per_session,
    result_lines,
    run_script,
    run_torchrun,
    script_env,
    script_file,
    signal_when,
    slurm_env,
    wait_dead,
    wait_for,
    wait_for_text,
)

pytestmark = pytest.mark.timeout(300)
SCRIPT = script_file("trainer_run.py")
EPOCHS = "3"  # max_iter: epochs 0 to 3, 6 batches each
STOPPED = "qaccel: stopped by "


def _scalars(folder, tag, run="."):
    """(step, value) of ``tag`` in the run's TensorBoard run ``run``: "." for the epochs, "batches" for batches."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder / "tracking" / run), size_guidance={"scalars": 0})
    events.Reload()
    return [[e.step, e.value] for e in events.Scalars(tag)]


def _result(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = result_lines(proc.stdout)
    assert len(results) == 1, proc.stdout  # printed once
    return results[0]


def _took_the_rest(text, folder, log, start=0):
    """The run numbered ``start`` in ``log`` (BATCH_LOG) said it resumed from <folder>/checkpoints/checkpoint_S and
    trained batches S+1..24 only. A rerun that retrained from scratch would end with the same parameters (seeded)
    and, after TensorBoard drops the steps written again, the same events: what it trained is what tells."""
    found = re.findall(rf"qaccel: resumed {re.escape(str(folder / 'checkpoints'))}/checkpoint_(\d{{8}}) after", text)
    assert len(found) == 1, text
    saved = int(found[0])
    assert 0 < saved < 24, saved
    trained = [int(line.split()[1]) for line in log.read_text().splitlines() if int(line.split()[0]) == start]
    assert trained == list(range(saved + 1, 25)), f"resumed after batch {saved}, then trained {trained}"


def _reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    result = _result(run_script(SCRIPT, str(tmp / "run"), EPOCHS, cwd=tmp, timeout=200))
    scalars = {tag: _scalars(tmp / "run", tag) for tag in ("train_loss", "val_loss")}
    return [result, {**scalars, "batches": _scalars(tmp / "run", "train_loss", "batches")}]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted plain launch every other run must match, run once for all pytest-xdist workers."""
    return once_per_session(tmp_path_factory, "trainer_reference", lambda: _reference(tmp_path_factory))


def test_an_uninterrupted_fit_tracks_every_epoch_once(reference):
    result, scalars = reference
    assert [step for step, _ in scalars["train_loss"]] == [1, 2, 3], "epoch 0's is not written, as in qadence"
    assert [step for step, _ in scalars["val_loss"]] == [0, 1, 2, 3]
    assert [step for step, _ in scalars["batches"]] == list(range(1, 25)), (
        "96 samples, 8 a batch, 2 ranks: 6 an epoch, epochs 0 to 3"
    )
    assert result["lr"] == pytest.approx(0.01 * 0.9**4), "the scheduler stepped once per epoch, and came back"


def test_sigterm_during_a_slow_epoch_end_callback_stops_the_fit_after_that_epoch_and_a_rerun_ends_bitwise(
    reference, tmp_path
):
    """The fit's train_epoch_end callback takes 0.4 s (plots, say): SIGTERM as epoch 1's callback starts (12 batches
    done) stops the fit within that time and the ranks' agreement, after saving step 12, before epoch 2's first batch,
    leaving nothing running (the DataLoader workers neither). The rerun trains batches 13 to 24 only and ends where
    the uninterrupted fit ends, TensorBoard holding each epoch and each batch once, as the uninterrupted run's."""
    mark = f"QACCEL_TEST_MARK_{uuid.uuid4().hex}"
    folder = tmp_path / "run"
    first = signal_when(
        [sys.executable, str(SCRIPT), str(folder), EPOCHS],
        signal.SIGTERM,
        "epoch 1 done",
        env=script_env(EPOCH_END_S="0.4", **{mark: "1"}),
        cwd=tmp_path,
        timeout=200,
        then=STOPPED,
    )
    assert first.returncode == 128 + signal.SIGTERM, first.stdout + first.stderr
    stops = [line for line in first.stderr.splitlines() if line.startswith(STOPPED)]
    assert stops == [f"{STOPPED}SIGTERM after saving state to {folder / 'checkpoints' / 'checkpoint_00000012'}"], (
        first.stderr
    )
    assert first.then_s is not None and first.then_s < 0.4 + 2.0, f"stopped {first.then_s:.2f} s after the signal"
    assert "epoch 2 done" not in first.stderr, "stopped mid-run"
    assert wait_dead(marked_pids(mark), timeout=10) == []
    second = run_script(
        SCRIPT, str(folder), EPOCHS, cwd=tmp_path, timeout=200, env=script_env(BATCH_LOG=str(tmp_path / "batches"))
    )
    resumed = (
        f"qaccel: resumed {folder / 'checkpoints' / 'checkpoint_00000012'} after epoch 1 (training epochs 2-3 next)"
    )
    assert resumed in second.stderr, second.stderr
    _took_the_rest(second.stderr, folder, tmp_path / "batches")
    result, scalars = reference
    assert _result(second) == result
    for tag in ("train_loss", "val_loss"):
        assert _scalars(folder, tag) == scalars[tag], f"{tag}: each epoch once, as the uninterrupted run"
    assert _scalars(folder, "train_loss", "batches") == scalars["batches"], "each batch once"


def _mlflow_history(folder):
    """{metric: [(step, value), ...]} of the run's only MLflow run, read through MLflow's own client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(folder / "tracking" / "mlruns").absolute().as_uri())
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return {
        name: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        for name in run.data.metrics
    }


def test_sigterm_and_a_rerun_with_mlflow_continue_one_run_with_every_epoch_and_batch_once(
    reference, tmp_path, monkeypatch
):
    component.module("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this process's client, which reads the store back
    env = script_env(TRACKING="mlflow", MLFLOW_DISABLE_TELEMETRY="true")
    cmd = [sys.executable, str(SCRIPT), str(tmp_path / "run"), EPOCHS, "0.1"]
    first = signal_when(cmd, signal.SIGTERM, "epoch 1 done", env=env, cwd=tmp_path, timeout=200)
    assert first.returncode == 128 + signal.SIGTERM, first.stdout + first.stderr
    assert "epoch 3 done" not in first.stderr, "stopped mid-run"
    second = run_script(
        SCRIPT,
        str(tmp_path / "run"),
        EPOCHS,
        cwd=tmp_path,
        timeout=200,
        env={**env, "BATCH_LOG": str(tmp_path / "batches")},
    )
    _took_the_rest(second.stderr, tmp_path / "run", tmp_path / "batches")
    result, scalars = reference
    assert _result(second) == result
    history = _mlflow_history(tmp_path / "run")
    for name, tensorboard in [
        ("train_loss", scalars["train_loss"]),
        ("val_loss", scalars["val_loss"]),
        ("batch/train_loss", scalars["batches"]),
    ]:
        assert [step for step, _ in history[name]] == [step for step, _ in tensorboard], f"{name}: each step once"
        assert [v for _, v in history[name]] == pytest.approx([v for _, v in tensorboard], rel=1e-6), name


def test_torchrun_max_restarts_restarts_a_failed_fit_whose_ranks_fit_in_place_to_the_same_result(reference, tmp_path):
    """Rank 1 raises in epoch 2 of the first attempt; torchrun restarts both ranks, which fit in place (each rank
    its own torchrun worker), continue the checkpoint of epoch 1 and end where the uninterrupted fit ends, with each
    epoch and batch tracked once."""
    proc = run_torchrun(
        SCRIPT,
        str(tmp_path / "run"),
        EPOCHS,
        "0",
        "9",
        cwd=tmp_path,
        timeout=200,
        torchrun_args=("--max-restarts", "1"),
        env=script_env(BATCH_LOG=str(tmp_path / "batches")),
    )
    assert "failing on purpose at batch 9" in proc.stderr, proc.stderr
    _took_the_rest(proc.stderr, tmp_path / "run", tmp_path / "batches", start=1)
    result, scalars = reference
    assert _result(proc) == result
    assert _scalars(tmp_path / "run", "train_loss") == scalars["train_loss"]
    assert _scalars(tmp_path / "run", "train_loss", "batches") == scalars["batches"], "each batch once"


def test_ctrl_c_saves_every_rank_and_a_rerun_ends_bitwise_where_the_uninterrupted_fit_ends(reference, tmp_path):
    cmd = [sys.executable, str(SCRIPT), str(tmp_path / "run"), EPOCHS, "0.1"]
    first = signal_when(cmd, signal.SIGINT, "epoch 1 done", env=script_env(), cwd=tmp_path, timeout=200)
    assert first.returncode == -signal.SIGINT, first.stdout + first.stderr  # a KeyboardInterrupt, as Ctrl-C gives
    assert "qaccel: Ctrl-C: every rank finishes what it is doing, saves its state and stops" in first.stderr
    assert first.stderr.count("KeyboardInterrupt") == 1 and "the ranks saved their state to" in first.stderr
    assert "epoch 3 done" not in first.stderr, "stopped mid-run"
    second = run_script(
        SCRIPT,
        str(tmp_path / "run"),
        EPOCHS,
        cwd=tmp_path,
        timeout=200,
        env=script_env(BATCH_LOG=str(tmp_path / "batches")),
    )
    _took_the_rest(second.stderr, tmp_path / "run", tmp_path / "batches")
    assert _result(second) == reference[0]
    assert _scalars(tmp_path / "run", "train_loss") == reference[1]["train_loss"]


@pytest.mark.slurm
def test_ctrl_c_to_srun_with_disable_status_saves_every_rank_and_a_rerun_ends_bitwise(
    reference, tmp_path, slurm_cluster
):
    """With ``srun -X`` (--disable-status) one Ctrl-C reaches every task as SIGINT, and the step runs on: resume()
    armed it, so the ranks save after the same step and stop; the same srun again ends where the uninterrupted fit
    ends. (Without -X, srun's two Ctrl-C send SIGINT and kill the step at once: nothing can save then.)"""
    srun = ["srun", "-X", "-N1", "-n2", sys.executable, str(SCRIPT), str(tmp_path / "run"), EPOCHS]
    first = signal_when(
        [*srun, "0.1"], signal.SIGINT, "epoch 1 done", env=slurm_env(slurm_cluster), cwd=tmp_path, timeout=150
    )
    assert first.returncode != 0, first.stderr
    assert first.stderr.count("qaccel: stopped by SIGINT after saving state to") == 1, first.stderr
    assert "epoch 3 done" not in first.stderr, "stopped mid-run"
    second = slurm_cluster.srun(
        srun[1:], timeout=150, env={**slurm_env(slurm_cluster), "BATCH_LOG": str(tmp_path / "batches")}, cwd=tmp_path
    )
    _took_the_rest(second.stderr, tmp_path / "run", tmp_path / "batches")
    assert _result(second) == reference[0]


@pytest.mark.slurm
def test_a_slurm_warning_requeues_and_the_requeued_job_finds_its_run_folder_and_ends_bitwise(
    reference, tmp_path, slurm_cluster
):
    """slurm/requeue.sbatch running the Trainer script with qadence's default folders (a new subfolder of the root
    per run): USR1 mid-run saves and requeues; the requeued job finds its own subfolder (named after the job),
    continues its checkpoint and tracker, and ends where the uninterrupted fit ends."""
    env = {**slurm_env(slurm_cluster), "BATCH_LOG": str(tmp_path / "batches")}
    out = tmp_path / "job.out"
    job = slurm_cluster.sbatch(
        REPO / "slurm" / "requeue.sbatch",
        ["--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={out}"],
        env=env,
        cwd=tmp_path,
        script_args=[str(SCRIPT), f"root={tmp_path / 'runs'}", EPOCHS, "0.1"],
    )
    wait_for_text(out, "epoch 1 done", timeout=120)
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
    time.sleep(2)  # a requeued start in the same second as the kill is refused (see test_real_script.py)
    slurm_cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    slurm_cluster.wait_job(job, timeout=150)
    text = out.read_text()
    assert slurm_cluster.job_info(job).get("JobState") == "COMPLETED", (text, slurm_cluster.log_tails())
    assert text.count("qaccel: stopped by SIGUSR1") == 1 and "the SLURM job was requeued" in text, text
    [folder] = (tmp_path / "runs").iterdir()
    assert folder.name.endswith(f"_{job}"), "the job's own subfolder"
    _took_the_rest(text, folder, tmp_path / "batches", start=1)
    assert [json.loads(line[len("RESULT ") :]) for line in text.splitlines() if line.startswith("RESULT ")] == [
        reference[0]
    ]
    scalars = reference[1]
    assert _scalars(folder, "train_loss") == scalars["train_loss"]
    assert _scalars(folder, "train_loss", "batches") == scalars["batches"], "each batch once"


def test_ranks_whose_loaders_keep_their_workers_end_with_the_fit(tmp_path):
    """persistent_workers=True: the workers live past the epoch, ignoring the signals resume() armed; the session's
    end stops them, or the rank would wait for them forever at exit."""
    script = script_file("persistent_workers.py")
    for attempt in range(2):  # a fresh folder each time: a fit that trains (one that resumes at its end trains not)
        proc = run_script(script, str(tmp_path / f"run{attempt}"), cwd=tmp_path, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        [result] = result_lines(proc.stdout)
        assert set(result) == {"test_loss", "test_mse"}
