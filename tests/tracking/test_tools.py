"""The Trainer's experiment trackers (TensorBoard, MLflow, CSV) and its curves PNG: what they write is read back with
each tool's own reader, while the run lives and after it, and a resumed run continues with every step once; qadence's
writer methods (write, plot, log_hyperparams, log_model, print_metrics) on every tracker, NullTracker's included."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from support import component
from support.wandb_records import curve, offline_runs

from qaccel.tracking.tools import (
    Axis,
    CsvTracker,
    MlflowTracker,
    NullTracker,
    TensorBoardTracker,
    Tracker,
    TrackingTool,
    WandbTracker,
    make_tracker,
)
from qaccel.trainer import plots

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _mlflow_env(monkeypatch):
    """MLflow tracks to the folder's own store, and sends no telemetry from a test."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def _figure():
    from matplotlib.figure import Figure

    figure = Figure(figsize=(2, 1.5), dpi=50)
    figure.subplots().plot([1, 3, 2])
    return figure


def _needs(tool):
    component.module(tool)
    component.module("matplotlib")


def _read(tool, folder, state):
    """What the tool's own reader sees: {metric: [(step, value), ...]}, the hyperparameters, the figures' steps."""
    if tool == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from tensorboard.plugins.hparams import plugin_data_pb2

        events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
        events.Reload()
        metrics = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
        hparams = {}
        try:
            content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        except KeyError:  # none logged
            content = None
        if content is not None:
            start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
            hparams = {
                k: v.number_value if v.HasField("number_value") else v.string_value for k, v in start.hparams.items()
            }
        images = {}
        for tag in events.Tags()["images"]:
            images |= {(tag, i.step): i.encoded_image_string for i in events.Images(tag)}
        return metrics, hparams, images
    if tool == "mlflow":
        from mlflow.tracking import MlflowClient

        client = MlflowClient((folder / "mlruns").absolute().as_uri())
        run = client.get_run(state["run_id"])
        metrics = {
            name: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
            for name in run.data.metrics
        }
        artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
        images = {
            (p.stem.rsplit("_", 1)[0], int(p.stem.rsplit("_", 1)[1])): p.read_bytes() for p in artifacts.glob("*.png")
        }
        return metrics, dict(run.data.params), images
    with open(folder / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    metrics = {}
    for row in rows:
        for name, value in row.items():
            if name != "step" and value != "":
                metrics.setdefault(name, []).append((int(row["step"]), float(value)))
    hyperparams = folder / "hyperparams.json"
    hparams = json.loads(hyperparams.read_text())["hyperparams"] if hyperparams.exists() else {}
    images = {
        (p.stem.rsplit("_", 1)[0], int(p.stem.rsplit("_", 1)[1])): p.read_bytes()
        for p in (folder / "plots").glob("*.png")
    }
    return metrics, hparams, images


def _write(tracker, steps, offset):
    for step in steps:
        tracker.log_metrics({"train_loss": offset + step, "train_accuracy": offset + step + 0.5}, step)


@pytest.mark.parametrize("tool", ["tensorboard", "mlflow", "csv"])
def test_metrics_hyperparams_and_a_figure_read_back_while_the_run_lives_and_after(tool, tmp_path):
    _needs(tool)
    tracker = make_tracker(tool)
    tracker.open(tmp_path, "first", None, 1)
    _write(tracker, range(1, 6), 10)
    tracker.log_hyperparams({"lr": 0.25, "layers": [4, 4], "optimizer": "adam"}, {"train_loss": 15.0})
    tracker.log_figure("curve", _figure(), 3)
    expected = {
        "train_loss": [(s, 10.0 + s) for s in range(1, 6)],
        "train_accuracy": [(s, 10.5 + s) for s in range(1, 6)],
    }

    for moment in ("open", "closed"):
        metrics, hparams, images = _read(tool, tmp_path, tracker.state())
        assert metrics == expected, moment
        assert hparams == {"lr": 0.25 if tool != "mlflow" else "0.25", "layers": "[4, 4]", "optimizer": "adam"}
        assert list(images) == [("curve", 3)] and images["curve", 3].startswith(PNG)
        tracker.close()
    tracker.close()  # twice: nothing happens


def _read_batches(tool, folder, state):
    """The per-batch curves as the tool's reader shows them: {metric: [(batch, value), ...]}."""
    if tool == "tensorboard":
        return _read(tool, folder / "batches", state)[0]
    if tool == "mlflow":
        return {
            name.removeprefix("batch/"): values
            for name, values in _read(tool, folder, state)[0].items()
            if name.startswith("batch/")
        }
    with open(folder / "batches.csv", newline="") as f:
        return {
            name: [
                (int(row["step"]), float(row[name])) for row in csv.DictReader(io.StringIO(f.read())) if row[name] != ""
            ]
            for name in ["train_loss"]
        }


@pytest.mark.parametrize("tool", ["tensorboard", "mlflow", "csv"])
def test_batches_have_a_curve_of_their_own_that_a_resumed_run_continues_without_a_batch_twice(tool, tmp_path):
    _needs(tool)
    first = make_tracker(tool)
    first.open(tmp_path, "run", None, 0, 0)
    for batch in range(1, 31):  # 10 batches an epoch; the checkpoint is after epoch 2 (batch 20)
        first.log_metrics({"train_loss": batch}, batch, Axis.BATCH)
        if batch % 10 == 0:
            first.log_metrics({"train_loss": batch / 10}, batch // 10)
    first.close()
    state = json.loads(json.dumps(first.state()))

    second = make_tracker(tool)
    second.open(tmp_path, "run", state, 3, 21)
    for batch in range(21, 41):
        second.log_metrics({"train_loss": 1000 + batch}, batch, Axis.BATCH)
        if batch % 10 == 0:
            second.log_metrics({"train_loss": 100 + batch / 10}, batch // 10)
    second.close()

    epochs = _read(tool, tmp_path, state)[0]
    assert epochs["train_loss"] == [(1, 0.1 * 10), (2, 2.0), (3, 103.0), (4, 104.0)]
    assert _read_batches(tool, tmp_path, state)["train_loss"] == (
        [(b, float(b)) for b in range(1, 21)] + [(b, 1000.0 + b) for b in range(21, 41)]
    )


@pytest.mark.parametrize("tool", ["tensorboard", "mlflow", "csv"])
def test_a_resumed_run_has_every_step_once_the_later_steps_from_the_resumed_run(tool, tmp_path):
    _needs(tool)
    first = make_tracker(tool)
    first.open(tmp_path, "run", None, 1)
    _write(first, range(1, 6), 10)  # steps 4 and 5 are lost with the crash: the checkpoint was at step 3
    first.close()
    state = json.loads(json.dumps(first.state()))  # what a checkpoint keeps

    second = make_tracker(tool)
    second.open(tmp_path, "run", state, 4)
    _write(second, range(4, 7), 100)
    assert second.state() == state  # MLflow: the same run
    second.close()

    metrics, _, _ = _read(tool, tmp_path, state)
    assert metrics["train_loss"] == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 104.0), (5, 105.0), (6, 106.0)]
    assert metrics["train_accuracy"] == [(s, 10.5 + s) for s in (1, 2, 3)] + [(s, 100.5 + s) for s in (4, 5, 6)]
    if tool == "mlflow":
        from mlflow.tracking import MlflowClient

        runs = MlflowClient((tmp_path / "mlruns").absolute().as_uri()).search_runs(["0"])
        assert [(r.info.run_id, r.info.status) for r in runs] == [(state["run_id"], "FINISHED")]


def test_mlflow_sets_nothing_global_and_follows_the_tracking_uri_and_experiment(tmp_path, monkeypatch):
    _needs("mlflow")
    import mlflow
    from mlflow.tracking import MlflowClient

    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the user's own file store: theirs to allow
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "sweep")
    tracker = make_tracker(TrackingTool.MLFLOW)
    tracker.open(tmp_path / "run", "named", None, 0)
    tracker.log_metrics({"val_loss": 0.5}, 0)
    assert mlflow.active_run() is None and not (tmp_path / "run" / "mlruns").exists()
    tracker.close()

    client = MlflowClient(store.as_uri())
    run = client.get_run(tracker.state()["run_id"])
    assert run.info.run_name == "named" and client.get_experiment(run.info.experiment_id).name == "sweep"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val_loss")] == [(0, 0.5)]

    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    own = make_tracker("mlflow")
    own.open(tmp_path / "own", "own", None, 0)  # qaccel's own file store opens without the user allowing it
    own.close()
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ and (tmp_path / "own" / "mlruns").is_dir()


def test_mlflow_resumed_with_a_changed_hyperparameter_keeps_the_first_and_warns(tmp_path):
    _needs("mlflow")
    first = make_tracker("mlflow")
    first.open(tmp_path, "run", None, 0)
    first.log_hyperparams({"epochs": 10, "lr": 0.1})
    first.close()
    second = make_tracker("mlflow")
    second.open(tmp_path, "run", first.state(), 5)
    with pytest.warns(UserWarning, match=r"epochs stays '10' \(now '20'\)"):
        second.log_hyperparams({"epochs": 20, "lr": 0.1, "batch": 8})
    second.close()
    _, hparams, _ = _read("mlflow", tmp_path, first.state())
    assert hparams == {"epochs": "10", "lr": "0.1", "batch": "8"}


def test_csv_adds_a_column_for_a_new_metric_and_drops_a_line_cut_short(tmp_path):
    tracker = make_tracker("csv")
    tracker.open(tmp_path, "run", None, 1)
    tracker.log_metrics({"train_loss": 1.5}, 1)
    tracker.log_metrics({"train_loss": 1.25, "val_loss": 2.5}, 2)  # a new name: the file is rewritten with it
    tracker.log_metrics({"train_loss": float("nan")}, 3)
    tracker.close()
    assert (tmp_path / "metrics.csv").read_text() == "step,train_loss,val_loss\n1,1.5,\n2,1.25,2.5\n3,nan,\n"

    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("4,0.")  # a crash in the middle of a row
    again = make_tracker("csv")
    again.open(tmp_path, "run", {}, 3)
    again.log_metrics({"train_loss": 0.75}, 3)
    again.close()
    assert (tmp_path / "metrics.csv").read_text() == "step,train_loss,val_loss\n1,1.5,\n2,1.25,2.5\n3,0.75,\n"
    with pytest.raises(ValueError, match="cannot be named 'step'"):
        make_tracker("csv").log_metrics({"step": 1.0}, 1)


def test_a_tool_by_its_value_or_another_enums_member_and_a_bad_name_listed(tmp_path):
    import enum

    class ExperimentTrackingTool(str, enum.Enum):  # qadence's, with the same values
        TENSORBOARD = "tensorboard"
        MLFLOW = "mlflow"

    assert type(make_tracker(ExperimentTrackingTool.MLFLOW)) is type(make_tracker("mlflow"))
    assert type(make_tracker(TrackingTool.CSV)) is type(make_tracker("csv"))
    assert type(make_tracker("wandb")) is WandbTracker
    with pytest.raises(ValueError, match="must be one of 'tensorboard', 'mlflow', 'wandb', 'csv'; got 'comet_ml'"):
        make_tracker("comet_ml")


def _without(blocked, code, tmp_path):
    """``code`` run in a fresh interpreter where importing any of ``blocked`` fails as if it were not installed."""
    lines = ["import sys", *(f"sys.modules[{name!r}] = None" for name in blocked), code]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", "\n".join(lines), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("tool", ["tensorboard", "mlflow", "wandb"])
def test_a_missing_optional_dependency_names_the_extra_to_install(tool, tmp_path):
    out = _without(
        [tool],
        "\n".join(
            [
                "from pathlib import Path",
                "from qaccel.tracking.tools import make_tracker",
                f"tracker = make_tracker({tool!r})",
                "try:",
                "    tracker.open(Path(sys.argv[1]), 'run', None, 0)",
                "except ImportError as exc:",
                "    print(exc)",
            ]
        ),
        tmp_path,
    )
    package = {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny", "wandb": "wandb"}[tool]
    assert f"pip install {package} (from qaccel's checkout: pip install -e '.[{tool}]')" in out, out


HISTORY = [
    {"step": s, "train_loss": 2.0 / s, "train_accuracy": s / 10} | ({"val_loss": 2.5 / s} if s % 3 == 0 else {})
    for s in range(1, 21)
]


def test_curves_writes_a_png_of_losses_and_metrics(tmp_path):
    image = component.module("matplotlib.image")
    path = plots.curves(HISTORY, tmp_path / "plots" / "curves.png")
    assert path == tmp_path / "plots" / "curves.png" and path.read_bytes().startswith(PNG)
    pixels = image.imread(path)
    assert pixels.shape[0] > 300 and pixels.shape[1] > 500 and pixels.std() > 0  # two panels, something drawn
    assert [p.name for p in path.parent.iterdir()] == ["curves.png"]  # no temporary file left beside it


def test_curves_without_matplotlib_is_none_and_writes_nothing(tmp_path):
    out = _without(
        ["matplotlib"],
        "\n".join(
            [
                "from pathlib import Path",
                "from qaccel.trainer import plots",
                f"print(plots.curves({HISTORY!r}, Path(sys.argv[1]) / 'curves.png'))",
            ]
        ),
        tmp_path,
    )
    assert out == "None\n" and not (tmp_path / "curves.png").exists()


def test_tensorboard_resumed_within_the_same_second_still_reads_the_new_file_last(tmp_path):
    """TensorBoard reads event files in name order (creation second, host, pid): a file of the previous attempt
    created in the same second by a process whose name sorts later must not hide the purge."""
    _needs("tensorboard")
    import time

    first = make_tracker("tensorboard")
    first.open(tmp_path, "run", None, 1)
    _write(first, range(1, 6), 10)
    first.close()
    (old,) = tmp_path.glob("events.out.tfevents.*")
    old.rename(tmp_path / f"events.out.tfevents.{int(time.time()):010d}.~host.1.0")  # sorts after this host's

    second = make_tracker("tensorboard")
    second.open(tmp_path, "run", {}, 4)
    _write(second, range(4, 7), 100)
    second.close()
    assert _read("tensorboard", tmp_path, {})[0]["train_loss"] == [
        (1, 11.0),
        (2, 12.0),
        (3, 13.0),
        (4, 104.0),
        (5, 105.0),
        (6, 106.0),
    ]


def _qadence_plots(figures):
    """Two plotting functions as qadence's examples write them: one names its figure with the epoch and .png, made
    with pyplot; the other a plain name. ``figures`` collects what they made."""
    pyplot = component.module("matplotlib.pyplot")

    def error(model, iteration):
        figure = pyplot.figure(figsize=(2, 1.5), dpi=50)
        figure.gca().plot([float(p.detach().sum()) for p in model.parameters()])
        figures.append(figure)
        return f"error_epoch_{iteration}.png", figure

    def curve(model, iteration):
        figures.append(_figure())
        return "curve", figures[-1]

    return error, curve


@pytest.mark.parametrize("tool", ["tensorboard", "mlflow", "csv"])
def test_a_qadence_callbacks_writer_calls_read_back_with_each_tools_reader(tool, tmp_path):
    """What qadence's callbacks call on their ``writer``: the metrics at the epoch given (tensors accepted), each
    figure under the name its function gave (no step added to a name with an image suffix), the hyperparameters,
    the model (MLflow: an MLflow model that mlflow.pytorch.load_model reads, its signature from the training data;
    CSV: its weights; TensorBoard: a warning in qadence's words, nothing logged); pyplot's figures closed once
    written."""
    _needs(tool)
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    pyplot = component.module("matplotlib.pyplot")
    model = torch.nn.Linear(3, 2)
    tracker = make_tracker(tool)
    tracker.open(tmp_path, "run", None, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tensor that requires grad, as qadence passes it: no warning either
        tracker.write(3, {"train_loss": torch.tensor(0.25, requires_grad=True) * 2})
    figures = []
    tracker.plot(model, 2, _qadence_plots(figures))
    tracker.log_hyperparams({"lr": 0.1})
    if tool == "tensorboard":
        with pytest.warns(
            UserWarning, match=r"Model logging is not supported by tensorboard\. No model will be logged\."
        ):
            tracker.log_model(model)
    else:
        tracker.log_model(model, DataLoader(TensorDataset(torch.randn(5, 3), torch.randn(5, 2)), batch_size=2))
    tracker.close()

    assert not pyplot.fignum_exists(figures[0].number)  # pyplot's closed; the other is left to its maker
    metrics, hparams, _ = _read(tool, tmp_path, tracker.state())
    assert metrics == {"train_loss": [(3, 0.5)]}
    assert hparams == {"lr": "0.1" if tool == "mlflow" else 0.1}
    if tool == "tensorboard":
        images = _read(tool, tmp_path, {})[2]
        assert sorted(images) == [("curve", 2), ("error_epoch_2.png", 2)]
        assert all(png.startswith(PNG) for png in images.values())
        assert not (tmp_path / "batches").exists()  # write() is on the epochs' axis
        assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("events.out.tfevents.")] == []
        return
    if tool == "mlflow":
        from mlflow.tracking import MlflowClient

        client = MlflowClient((tmp_path / "mlruns").absolute().as_uri())
        run_id = tracker.state()["run_id"]
        assert sorted(a.path for a in client.list_artifacts(run_id)) == ["curve_2.png", "error_epoch_2.png", "model"]
        assert "model/MLmodel" in [a.path for a in client.list_artifacts(run_id, "model")]
        files = {
            name: Path(client.download_artifacts(run_id, name, str(tmp_path / "download")))
            for name in ("curve_2.png", "error_epoch_2.png")
        }
        assert all(path.read_bytes().startswith(PNG) for path in files.values())
        import mlflow.pytorch

        # MLflow's own reader, on the run's artifact downloaded (runs:/<id>/model would need mlflow.set_tracking_uri,
        # which also sets MLFLOW_TRACKING_URI for every later test of this process)
        uri = client.download_artifacts(run_id, "model", str(tmp_path / "download"))
        loaded = mlflow.pytorch.load_model(uri)
        assert type(loaded) is torch.nn.Linear and torch.equal(loaded.weight, model.weight)
        signature = mlflow.models.get_model_info(uri).signature.to_dict()
        assert '"shape": [-1, 3]' in signature["inputs"] and '"shape": [-1, 2]' in signature["outputs"]
        return
    else:
        files = {p.name: p for p in (tmp_path / "plots").iterdir()}
        assert sorted(files) == ["curve_00000002.png", "error_epoch_2.png"]
        weights = tmp_path / "model.pt"
    assert all(path.read_bytes().startswith(PNG) for path in files.values())
    loaded = torch.load(weights, weights_only=True)
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[name], value) for name, value in model.state_dict().items())


@pytest.mark.parametrize("tool", ["mlflow", "csv"])
def test_a_figure_named_with_an_image_suffix_is_stored_in_that_format_under_that_name(tool, tmp_path):
    _needs(tool)
    tracker = make_tracker(tool)
    tracker.open(tmp_path, "run", None, 0)
    for name in ("a.svg", "b.PDF", "c.jpg", "d.jpeg", "e"):
        tracker.log_figure(name, _figure(), 7)
    tracker.close()
    if tool == "mlflow":
        from mlflow.tracking import MlflowClient

        client = MlflowClient((tmp_path / "mlruns").absolute().as_uri())
        run_id = tracker.state()["run_id"]
        names = sorted(a.path for a in client.list_artifacts(run_id))
        files = {name: Path(client.download_artifacts(run_id, name, str(tmp_path / "download"))) for name in names}
    else:
        files = {p.name: p for p in (tmp_path / "plots").iterdir()}
    starts = {
        "a.svg": b"<?xml",
        "b.PDF": b"%PDF",
        "c.jpg": b"\xff\xd8\xff",
        "d.jpeg": b"\xff\xd8\xff",
        "e_7.png" if tool == "mlflow" else "e_00000007.png": PNG,
    }
    assert {name: path.read_bytes()[: len(starts[name])] for name, path in files.items()} == starts


@pytest.fixture(scope="module")
def qadence_writer():
    """qadence's own TensorBoardWriter (its print_metrics is BaseWriter's) and OptimizeResult: imported once for
    the module (about 5 s)."""
    writers = component.module("qadence.ml_tools.callbacks.writer_registry")
    return writers.TensorBoardWriter(), component.module("qadence.ml_tools.data").OptimizeResult


def test_print_metrics_prints_qadences_line_on_every_tracker_opened_or_not(qadence_writer, capsys, tmp_path):
    import torch

    from qaccel.trainer.callbacks import OptimizeResult

    writer, QadenceResult = qadence_writer
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        (12, {"train_accuracy": 0.875, "train_loss": 0.123456789, "val_loss": 2.5}, 0, "cpu"),
        (1234567, {"val_mse": 3.0, "val_r2": -0.5}, 3, "cuda:1"),
        (0, {}, 1, "cuda:0"),
        (5, {"Train_Loss": torch.tensor(0.25), "grad_norm": torch.tensor(1.5)}, 12, "mps"),  # qadence's tensors
    ]
    opened = make_tracker("csv")
    opened.open(tmp_path, "run", None, 0)
    trackers = [TensorBoardTracker(), MlflowTracker(), CsvTracker(), opened, NullTracker()]
    for iteration, metrics, rank, device in cases:
        qadence_result = QadenceResult(iteration, model, optimizer, metrics=metrics, rank=rank, device=device)
        writer.print_metrics(qadence_result)
        expected = capsys.readouterr().out
        assert expected.count("\n") == 1 and f"Iteration {iteration: >7}|" in expected
        for tracker in trackers:
            for result in (
                qadence_result,
                OptimizeResult(iteration, model, optimizer, metrics=metrics, rank=rank, device=device),
            ):
                tracker.print_metrics(result)
                assert capsys.readouterr().out == expected, (type(tracker).__name__, type(result).__module__)
    opened.close()


def test_null_tracker_does_nothing_opened_or_not_and_calls_no_plotting_function(tmp_path, capsys):
    import torch

    def plotting_function(model, iteration):
        raise AssertionError("NullTracker called a plotting function")

    model = torch.nn.Linear(1, 1)
    for opened in (False, True):
        tracker = NullTracker()
        if opened:
            tracker.open(tmp_path / "run", "run", None, 0)
        tracker.write(1, {"train_loss": torch.tensor(0.5)})
        tracker.log_metrics({"train_loss": 0.5}, 2, Axis.BATCH)
        tracker.plot(model, 1, (plotting_function,))
        tracker.log_figure("curve", object(), 1)
        tracker.log_hyperparams({"lr": 0.1}, {"train_loss": 0.5})
        tracker.log_model(model, None, None, None)
        assert tracker.state() == {}
        tracker.close()
        tracker.close()
    assert list(tmp_path.iterdir()) == [] and capsys.readouterr().out == ""


def test_every_tracker_has_every_method_of_the_protocol_qadences_writer_methods_included():
    methods = {name for name in vars(Tracker) if not name.startswith("_")}
    assert {"write", "print_metrics", "plot", "log_hyperparams", "log_model"} <= methods
    for tracker in (TensorBoardTracker, MlflowTracker, WandbTracker, CsvTracker, NullTracker):
        assert all(callable(getattr(tracker, name, None)) for name in methods), tracker.__name__


def test_wandb_writes_epochs_batches_config_and_a_figure_and_a_resumed_run_keeps_its_id(tmp_path, monkeypatch):
    """Offline, read back with wandb's own reader: epochs against the metric ``epoch``, batches (``batch/<name>``)
    against ``batch``, the hyperparameters as the run's config, a figure as an image; a resumed run is the same id."""
    _needs("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    first = make_tracker("wandb")
    first.open(tmp_path, "first", None, 1)
    _write(first, range(1, 4), 10)
    first.log_metrics({"train_loss": 5.0}, 7, Axis.BATCH)
    first.log_hyperparams({"lr": 0.25, "layers": [4, 4]}, {"val_loss": 1.5})
    first.log_figure("curve", _figure(), 2)
    first.close()
    first.close()  # twice: nothing happens
    state = json.loads(json.dumps(first.state()))
    second = make_tracker("wandb")
    second.open(tmp_path, "first", state, 4)
    _write(second, [4], 100)
    assert second.state() == state
    second.close()

    runs = offline_runs(tmp_path / "wandb")  # the tracker's folder holds wandb's
    assert [(r["id"], r["resume"]) for r in runs] == [(state["run_id"], False), (state["run_id"], True)]
    assert curve(runs[0], "train_loss", "epoch") == [(s, 10 + s) for s in range(1, 4)]
    assert curve(runs[0], "batch/train_loss", "batch") == [(7, 5)]
    assert curve(runs[0], "val_loss", "epoch") == [(3, 1.5)], "a result without a curve, at the last epoch"
    assert runs[0]["config"] == {"lr": 0.25, "layers": "[4, 4]"}
    assert [(row["epoch"], row["curve._type"]) for row in runs[0]["history"] if "curve._type" in row] == [
        (2, "image-file")
    ]
    assert curve(runs[1], "train_loss", "epoch") == [(4, 104)]
