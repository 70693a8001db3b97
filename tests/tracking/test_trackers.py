"""Accelerate's trackers on the Accelerator (log_with, init_trackers, log, get_tracker, trackers, end_training) on 2
real ranks: only rank 0 writes, each tool's own reader finds the values, the config and the run, and a run stopped
after its checkpoint and resumed continues the same run without a step twice, through distribute() and under
torchrun (a rank killed there)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from support import component
from support.procs import result_lines, run_torchrun, script_env, script_file
from support.wandb_records import a_wandb_service, curve, offline_runs

from qaccel import Accelerator, ProjectConfiguration

TOOLS = ["tensorboard", "wandb", "mlflow", "csv"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    """wandb offline into tmp_path, MLflow to the logging folder's own store, no telemetry."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    for tool in ("tensorboard", "wandb", "mlflow"):
        component.module(tool)


def _attempt(folder: str, attempt: int, stop_at: int) -> dict:
    """One attempt of a job: trackers started before resume() (Accelerate's order), a step logged per update with
    10 * attempt + step, a checkpoint at step 2 only, and a stop after ``stop_at``."""
    acc = Accelerator(
        compute_setup="cpu",
        log_with=TOOLS,
        project_config=ProjectConfiguration(project_dir=folder, logging_dir=os.path.join(folder, "logs")),
    )
    acc.init_trackers("proj", config={"lr": 0.5, "attempt": attempt})
    model = torch.nn.Linear(2, 1)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    acc.resume()
    seen = {"rank": acc.rank, "pid": os.getpid(), "trackers": [t.name for t in acc.trackers]}
    if acc.step == 0:
        acc.log({"first": 1.0, "note": "start"})  # no step: the first step, 0
    while acc.step <= stop_at:
        step = acc.step
        optimizer.zero_grad()
        acc.backward(model(torch.ones(4, 2)).sum())
        optimizer.step()
        acc.log(
            {"loss": 10.0 * attempt + step, "loss_tensor": torch.tensor(float(step)), "pair": {"a": 1, "b": 2}},
            step=step,
        )
        if step == 2:
            acc.save_state()
    acc.log({"last": float(attempt)})  # no step: the step after the last one logged
    writer = acc.get_tracker("tensorboard", unwrap=True)
    writer.add_scalar("by_writer", 7.0, 100 + attempt)
    run = acc.get_tracker("wandb", unwrap=True)
    seen.update(
        writer=type(writer).__name__,
        run=type(run).__module__ + "." + type(run).__name__,
        mlflow=type(acc.get_tracker("mlflow", unwrap=True)).__name__,
        wandb_id=run.id if acc.is_main_process else None,
        wrapped=type(acc.get_tracker("csv")).__name__,
    )
    run.watch  # noqa: B018 - rank 1's does nothing, and has every attribute
    acc.end_training()
    return seen


@pytest.mark.timeout(120)
def test_two_ranks_write_once_from_rank_0_and_a_resumed_job_continues_its_runs_without_a_step_twice(
    tmp_path, monkeypatch
):
    folder = str(tmp_path / "project")
    first = Accelerator(nprocs=2, compute_setup="cpu").distribute(_attempt, all_results=True)(folder, 1, 4)
    second = Accelerator(nprocs=2, compute_setup="cpu").distribute(_attempt, all_results=True)(folder, 2, 5)
    for seen in (first, second):
        assert seen[0]["trackers"] == TOOLS and seen[1]["trackers"] == [], "rank 0's trackers only, as Accelerate's"
        assert (seen[0]["writer"], seen[0]["run"], seen[0]["mlflow"], seen[0]["wrapped"]) == (
            "SummaryWriter",
            "wandb.sdk.wandb_run.Run",
            "ActiveRun",
            "AcceleratorTracker",
        )
        assert seen[1]["writer"] == "NoTracker" and seen[1]["wandb_id"] is None
    assert first[0]["wandb_id"] == second[0]["wandb_id"], "one W&B run for the job"
    logs = Path(folder) / "logs"
    # the expected curve: steps 0-2 from the first attempt (its 3 and 4 came after the checkpoint), 3-5 from the second
    loss = [(s, 10.0 + s) for s in range(3)] + [(s, 20.0 + s) for s in range(3, 6)]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logs / "proj"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["loss"] == loss
    assert scalars["loss_tensor"] == [(s, float(s)) for s in range(6)]
    assert scalars["pair/a"] == [(s, 1.0) for s in range(6)]
    assert scalars["first"] == [(0, 1.0)] and scalars["last"] == [(6, 2.0)], "no step: after the last one"
    assert scalars["by_writer"] == [(102, 7.0)], "the SummaryWriter writes into the same run (101 came after step 2)"
    assert "note/text_summary" in events.Tags()["tensors"], "a string is TensorBoard text (add_text's tag)"
    files = [p.name for p in (logs / "proj").iterdir() if p.name.startswith("events")]
    assert {name.split(".")[5] for name in files} == {str(first[0]["pid"]), str(second[0]["pid"])}, "rank 0 only"

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 opens a file store only so
    client = MlflowClient((logs / "mlruns").absolute().as_uri())
    experiment = client.get_experiment_by_name("proj")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", "one MLflow run, in the experiment project_name"
    assert sorted((m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, "loss")) == loss
    assert runs[0].data.params == {"lr": "0.5", "attempt": "1"}, "MLflow keeps a run's first parameters"

    import csv

    with open(logs / "proj" / "metrics.csv", newline="") as f:
        assert [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f) if r["loss"]] == loss

    wandb_runs = offline_runs(tmp_path / "wandb")
    assert [(r["id"], r["resume"]) for r in wandb_runs] == [(first[0]["wandb_id"], False), (first[0]["wandb_id"], True)]
    assert wandb_runs[0]["config"] == {"lr": 0.5, "attempt": 1} and wandb_runs[1]["config"]["attempt"] == 2
    assert curve(wandb_runs[0], "loss") == [(s, 10 + s) for s in range(5)], "W&B keeps what it was sent"
    assert curve(wandb_runs[1], "loss") == [(s, 20 + s) for s in range(3, 6)], "the resumed run from the checkpoint"
    assert curve(wandb_runs[1], "last") == [(6, 2)]


@pytest.mark.timeout(200)
def test_a_torchrun_job_killed_after_its_checkpoint_continues_its_runs_when_run_again(tmp_path):
    """Accelerate's script order under torchrun: the rank killed after step 4 (checkpoint after step 3); the job
    run again continues the TensorBoard run from step 4 and the same W&B run. Both jobs start from a shell whose
    W&B service (a notebook's, say) they share, as wandb has child processes do: the killed rank's run stays open
    there, and the job run again still resumes it."""
    script, folder = script_file("accelerate_trackers.py"), tmp_path / "project"
    env = script_env(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path))
    with a_wandb_service() as token:
        env["WANDB_SERVICE"] = token
        killed = run_torchrun(script, str(folder), "4", cwd=tmp_path, env=env, timeout=150)
        assert killed.returncode != 0 and not result_lines(killed.stdout), killed.stderr[-2000:]
        again = run_torchrun(script, str(folder), "-1", cwd=tmp_path, env=env, timeout=150)
    said = [line for line in again.stderr.splitlines() if line.startswith("[rank0]")]  # the root cause's own lines
    assert again.returncode == 0, "\n".join(said[-40:]) + "\n" + again.stderr[-3000:]
    [result] = result_lines(again.stdout)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder / "job"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == (
        [(s, 100.0 + s) for s in range(4)] + [(s, float(s)) for s in (4, 5)]
    ), "steps 0-3 of the killed job, once"
    runs = offline_runs(tmp_path / "wandb")
    assert [(r["id"], r["resume"]) for r in runs] == [(result["wandb_id"], False), (result["wandb_id"], True)]
    assert curve(runs[1], "loss") == [(4, 4), (5, 5)] and runs[1]["config"] == {"lr": 0.1}


class _Custom:
    """A tracker of the user's own, as Accelerate's GeneralTracker subclasses are."""

    name, requires_logging_directory = "mine", False

    def __init__(self):
        self.calls = []

    def start(self):
        self.calls.append("start")

    def store_init_configuration(self, values):
        self.calls.append(("config", values))

    def log(self, values, step=None, **kwargs):
        self.calls.append(("log", values, step, kwargs))

    def finish(self):
        self.calls.append("finish")

    @property
    def tracker(self):
        return self


def test_log_with_takes_accelerates_logger_types_and_tracker_objects_and_names_what_it_allows(tmp_path):
    from accelerate.utils import LoggerType

    custom = _Custom()
    acc = Accelerator(compute_setup="cpu", log_with=["csv", custom], project_dir=tmp_path)
    acc.init_trackers("p", config={"lr": 1}, init_kwargs={"mine": {}})
    acc.log({"loss": 1.5}, log_kwargs={"mine": {"commit": True}})
    assert acc.get_tracker("mine", unwrap=True) is custom and acc.trackers[1] is custom
    with pytest.raises(ValueError, match="'nothing' is not one of the Accelerator's trackers: 'csv', 'mine'"):
        acc.get_tracker("nothing")
    with pytest.raises(TypeError, match=r"log_kwargs\['csv'\] is not taken"):
        acc.log({"loss": 1.0}, log_kwargs={"csv": {"commit": True}})
    acc.end_training()
    assert custom.calls == ["start", ("config", {"lr": 1}), ("log", {"loss": 1.5}, None, {"commit": True}), "finish"]
    assert (tmp_path / "p" / "metrics.csv").read_text() == "step,loss\n0,1.5\n"
    assert Accelerator(log_with=LoggerType.MLFLOW)._config.log_with == ("mlflow",)
    assert set(Accelerator(log_with="all", project_dir=tmp_path)._config.log_with) == {"tensorboard", "wandb", "mlflow"}
    with pytest.raises(ValueError, match="log_with must be one of 'tensorboard', 'wandb', 'mlflow', 'csv', 'all'"):
        Accelerator(log_with=LoggerType.COMETML)
    with pytest.raises(
        ValueError,
        match=r"log_with='tensorboard' writes into <logging_dir>/<project_name>: give "
        r"project_dir=\.\.\., logging_dir=\.\.\.",
    ):
        Accelerator(log_with="tensorboard")
    with pytest.raises(ValueError, match="init_trackers\\(\\) has no tracker to start"):
        Accelerator().init_trackers("p")


def test_a_missing_tracker_package_names_the_pip_command(tmp_path):
    code = (
        "import sys\nsys.modules['wandb'] = None\nimport importlib.util\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'wandb' else _find(name, *a)\n"
    )
    code = (
        "import importlib.util\n_find = importlib.util.find_spec\n"
        + code
        + "from qaccel import Accelerator\ntry:\n    Accelerator(log_with='wandb')\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=script_env(),
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert (
        "log_with='wandb' needs the wandb package: pip install wandb (from qaccel's checkout: pip install -e "
        "'.[wandb]')" in done.stdout
    ), done.stderr


class _Finishing:
    def __init__(self, name, error=None):
        self.name, self.error, self.finished = name, error, False

    def finish(self):
        self.finished = True
        if self.error is not None:
            raise self.error


def test_closing_finishes_every_tracker_even_after_one_fails():
    from qaccel.tracking.trackers import Trackers

    for failed in (False, True):
        trackers = Trackers()
        broken, flushed = _Finishing("wandb", ConnectionResetError("Connection lost")), _Finishing("tensorboard")
        trackers.trackers = [broken, flushed]
        if failed:  # the session failed already: its error stays the one reported
            with pytest.warns(UserWarning, match="after the failure, the Connection lost"):
                trackers.close(failed=True)
        else:
            with pytest.raises(ConnectionResetError) as raised:
                trackers.close()
            assert "[qaccel] while finishing the wandb tracker" in raised.value.__notes__
        assert broken.finished and flushed.finished and trackers.trackers == []
