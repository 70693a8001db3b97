"""The experiment trackers the Trainer (and the Accelerator's ``log_with``, see qaccel/tracking/trackers.py) writes
metrics, hyperparameters and figures through (rank 0 only): TensorBoard (the Trainer's default), MLflow, Weights &
Biases, or a CSV file.

qaccel requires only torch, cloudpickle and numpy: TensorBoard, MLflow and wandb are optional extras
(``tensorboard``, ``mlflow`` and ``wandb`` in setup.cfg; ``pip install tensorboard`` does it), imported when a
tracker of theirs opens, so the other ranks and a run tracking to CSV never import them; a missing one raises an
ImportError naming the extra. Every write of TensorBoard, MLflow and CSV is on disk (or with the tracking server)
when the call returns, so the files can be read while the run lives; wandb hands its records to its own service
process, which writes them to the run's ``.wandb`` file (and uploads them, unless ``WANDB_MODE=offline``).

Metrics have one of two axes: the epoch (qadence's step, what the Trainer's fields write) or the training batch (a
per-batch curve, e.g. WriteMetrics at ``train_batch_end``), kept apart so neither's steps mix with the other's:
TensorBoard writes batches to a run of its own (the ``batches`` subfolder), CSV to ``batches.csv``, MLflow under
names starting ``batch/``.

Every tracker also has the methods of qadence's writer (BaseWriter), with qadence's meaning, so that a qadence
callback calling ``writer.write(...)``, ``writer.plot(...)`` or ``writer.log_model(...)`` runs unchanged on the tracker
the Trainer passes it; ranks other than 0 get a NullTracker, which writes nothing.

A resumed run continues the one it resumes: ``open`` takes what ``state()`` returned there, and the first step (and
batch) it will write; what the previous attempt wrote at that step or later is dropped, so the curves have no step
twice.
"""

from __future__ import annotations

import contextlib
import csv
import enum
import importlib
import io
import itertools
import json
import os
import socket
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from qaccel.options import TrackingTool
from qaccel.storage import save, write_bytes

if TYPE_CHECKING:
    import matplotlib.figure
    import torch

    PlottingFunction = Callable[[torch.nn.Module, int], tuple[str, matplotlib.figure.Figure]]


class Axis(enum.StrEnum):
    """What a metric's step counts."""

    EPOCH = "epoch"
    """Epochs (the Trainer's ``iteration``, qadence's step)."""
    BATCH = "batch"
    """Training batches since the fit began (1 for the first)."""


BATCH_PREFIX = "batch/"  # MLflow: the names of per-batch metrics start with it
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".svg", ".pdf")  # a figure named with one is stored under that name


class Tracker(Protocol):
    """What the Trainer writes through; make_tracker gives the one for a TrackingTool."""

    def open(
        self, folder: Path, run_name: str, resume: dict[str, Any] | None, start_step: int, start_batch: int = 0
    ) -> None:
        """Start (or continue) the run whose files live in ``folder`` (created if missing).

        ``run_name`` names the run where the tool names runs (MLflow). ``resume``: what state() returned in the run
        this one continues (None: a new run). ``start_step`` and ``start_batch``: the first epoch and batch this run
        will write; anything a previous attempt wrote at that step or later is dropped, so a resumed run has no
        duplicated or out-of-order steps (TensorBoard and CSV, whose run is the folder, do so for a new run too:
        what the folder held from earlier steps stays).
        """

    def log_metrics(self, metrics: dict[str, float], step: int, axis: Axis = Axis.EPOCH) -> None:
        """Write ``metrics`` (name -> number) at ``step`` of ``axis``."""

    def log_hyperparams(self, hyperparams: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        """Write the run's hyperparameters, and ``metrics``: the results that go with them (the final losses); one
        that log_metrics has not written in this session is written at the last step."""

    def log_figure(self, name: str, figure: matplotlib.figure.Figure, step: int) -> None:
        """Write ``figure`` named ``name`` at ``step``; the figure stays open (the caller's to close).

        TensorBoard: a PNG image whose tag is ``name``. MLflow and CSV store a file: a ``name`` ending with an image
        suffix (.png, .jpg, .jpeg, .svg, .pdf) is the file's name as it is, in that format (a later figure of the
        same name replaces it); any other gets the step and .png: f"{name}_{step}.png" (MLflow),
        f"{name}_{step:08d}.png" (CSV)."""

    def state(self) -> dict[str, Any]:
        """What a resumed run needs to continue this one (e.g. {"run_id": ...}); JSON-serialisable."""
        ...

    def close(self) -> None:
        """Flush and close; safe to call twice."""

    # qadence's writer (BaseWriter), for qadence callbacks that call the tracker they get as ``writer``:

    def write(self, iteration: int, metrics: dict[str, Any]) -> None:
        """qadence's ``writer.write``: ``metrics`` at epoch ``iteration`` (log_metrics); numbers or 0-dim tensors."""

    def print_metrics(self, result: Any) -> None:
        """qadence's ``writer.print_metrics``: print the OptimizeResult's rank, device, iteration and metrics in
        qadence's line format (on any rank)."""

    def plot(self, model: torch.nn.Module, iteration: int, plotting_functions: Iterable[PlottingFunction]) -> None:
        """qadence's ``writer.plot``: ``name, figure = fn(model, iteration)`` for each function, the figure written
        by log_figure at ``iteration`` and then closed if pyplot made it."""

    def log_model(
        self,
        model: torch.nn.Module,
        train_dataloader: Any = None,
        val_dataloader: Any = None,
        test_dataloader: Any = None,
    ) -> None:
        """qadence's ``writer.log_model``: keep the model's weights with the run (the data loaders are not used).
        MLflow: its state_dict as the artifact model/state_dict.pt; CSV: model.pt in the folder; TensorBoard cannot
        and warns."""


def make_tracker(tool: TrackingTool | str) -> Tracker:
    """A tracker for ``tool``: a TrackingTool, its value, or a member of another enum with one of those values
    (qadence's ExperimentTrackingTool); ValueError naming the allowed values otherwise."""
    raw = tool.value if isinstance(tool, enum.Enum) else tool
    try:
        kind = TrackingTool(str(raw))
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in TrackingTool)
        raise ValueError(f"tracking tool must be one of {allowed}; got {tool!r}") from None
    return {
        TrackingTool.TENSORBOARD: TensorBoardTracker,
        TrackingTool.MLFLOW: MlflowTracker,
        TrackingTool.WANDB: WandbTracker,
        TrackingTool.CSV: CsvTracker,
    }[kind]()


def _optional(tool: TrackingTool) -> Any:
    """The module ``tool`` needs, imported; an ImportError naming the package and extra that install it."""
    try:
        return importlib.import_module(str(tool.module))
    except ImportError as exc:
        raise ImportError(
            f"tracking to {tool} needs the {tool.package} package: pip install {tool.package} (from qaccel's "
            f"checkout: pip install -e '.[{tool}]'); or track to csv, which needs nothing"
        ) from exc


def _png(figure: matplotlib.figure.Figure, image_format: str = "png") -> bytes:
    """The figure as PNG bytes (or another ``image_format`` of savefig's). savefig draws on a canvas of its own for
    the file and leaves the figure's canvas (an interactive backend's, in a notebook) as it was."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format=image_format)
    return buffer.getvalue()


def _figure_file(name: str, step: str) -> str:
    """The file a figure named ``name`` is stored in: ``name`` itself when it ends with an image suffix (qadence's
    plotting functions name theirs e.g. "error_epoch_2.png"), else ``name`` with the step (as written) and .png."""
    return name if name.lower().endswith(IMAGE_SUFFIXES) else f"{name}_{step}.png"


def close_figure(figure: Any) -> None:
    """Close ``figure`` if pyplot made it: a pyplot figure stays open (and they pile up, each holding its memory)
    until closed; one made as matplotlib.figure.Figure(), or by anything else, is left alone."""
    pyplot = sys.modules.get("matplotlib.pyplot")  # not imported: pyplot made no figure
    if pyplot is not None:
        pyplot.close(figure)


def print_metrics(result: Any) -> None:
    """qadence's BaseWriter.print_metrics, line for line: the first metric whose name contains "loss" (any case)
    first, titled, then the others."""
    loss_key = next((k for k in result.metrics if "loss" in k.lower()), None)
    initial = f"P {result.rank: >2}|{result.device: <7}| Iteration {result.iteration: >7}| "
    if loss_key:
        loss_value = result.metrics[loss_key]
        msg = initial + f"{loss_key.title()}: {loss_value:.7f} -"
    else:
        msg = initial + "Loss: None -"
    msg += " ".join([f"{k}: {v:.7f}" for k, v in result.metrics.items() if k != loss_key])
    print(msg)


def _whole_module(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module (inside a DDP wrapper), to log whole. A model sharded by strategy='fsdp' holds only this
    rank's shards: TypeError."""
    from qaccel.wrapping import inner_module, is_sharded

    model = inner_module(model)
    if is_sharded(model):
        raise TypeError(
            f"log_model cannot log a model sharded by strategy='fsdp' ({type(model).__name__}): rank 0 "
            "holds only its shards; save a checkpoint instead (SaveCheckpoint, trainer.save_checkpoint())"
        )
    return model


def _state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The user's module's state_dict, its tensors on the CPU so that the file loads without the GPU."""
    import torch

    model = _whole_module(model)
    return {
        name: value.detach().cpu() if isinstance(value, torch.Tensor) else value
        for name, value in model.state_dict().items()
    }


def _number(value: Any) -> float:
    """A metric's value as a float: a number, or a one-element tensor (qadence's metrics are 0-dim tensors), through
    item(), which, unlike float(), takes one that requires grad without a warning."""
    return float(value.item() if hasattr(value, "item") else value)


def _param(value: Any) -> bool | int | float | str:
    """A hyperparameter as a tracker stores it: a bool, number or string as it is, anything else as its str()."""
    return value if isinstance(value, (bool, int, float, str)) else str(value)


class _Opened:
    """What every tracker does alike: the step last written, the check that open() came first, the files of a
    tracker whose run is its folder (one per axis), closed by close(), and qadence's writer methods but log_model,
    each through the tracker's own methods."""

    def __init__(self) -> None:
        self._opened = False
        self._closed = False
        self._step = 0
        self._written: set[str] = set()  # metric names this session wrote
        self._files: dict[Axis, Any] = {}  # axis -> an open file with close()

    def state(self) -> dict[str, Any]:
        return {}  # the run is the folder: nothing to carry over

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._closed = True

    def _check_open(self) -> None:
        if not self._opened or self._closed:
            raise RuntimeError(
                f"{type(self).__name__} is {'closed' if self._closed else 'not open'}: call open() before writing"
            )

    def _wrote(self, metrics: dict[str, float], step: int, axis: Axis) -> dict[str, float]:
        self._check_open()
        values = {name: _number(value) for name, value in metrics.items()}
        if axis is Axis.EPOCH:  # log_hyperparams's results go on the epochs' curves
            self._step = step
            self._written.update(values)
        return values

    def _unwritten(self, metrics: dict[str, float] | None) -> dict[str, float]:
        """The results of log_hyperparams this session has no curve for: they are written at the last step."""
        return {name: _number(value) for name, value in (metrics or {}).items() if name not in self._written}

    # qadence's writer methods (the Tracker protocol says what each does), written through the tracker's own.

    def write(self, iteration: int, metrics: dict[str, Any]) -> None:
        self.log_metrics(metrics, iteration)  # type: ignore[attr-defined]

    def print_metrics(self, result: Any) -> None:
        print_metrics(result)

    def plot(self, model: torch.nn.Module, iteration: int, plotting_functions: Iterable[PlottingFunction]) -> None:
        self._check_open()
        for function in plotting_functions:
            name, figure = function(model, iteration)
            try:
                self.log_figure(name, figure, iteration)  # type: ignore[attr-defined]
            finally:
                close_figure(figure)


class TensorBoardTracker(_Opened):
    """TensorBoard event files in the folder (the epochs' run) and in folder/"batches" (the batches' run, opened at
    the first batch written, or at once when a previous attempt left one).

    Each call's values go into one event, written and flushed before the call returns, through TensorBoard's own
    record writer. torch's SummaryWriter hands each value to a writer thread instead, which costs far more per call
    in a busy rank (docs/benchmarks.md gives the figures and how they were taken), and that matters when every batch
    is written.
    """

    def __init__(self) -> None:
        super().__init__()
        self._folder = Path()
        self._start_batch = 0

    def open(
        self, folder: Path, run_name: str, resume: dict[str, Any] | None, start_step: int, start_batch: int = 0
    ) -> None:
        _optional(TrackingTool.TENSORBOARD)
        self._folder, self._start_batch = Path(folder), start_batch
        self._files[Axis.EPOCH] = _EventFile(self._folder, start_step)
        if (self._folder / "batches").is_dir():
            self._files[Axis.BATCH] = _EventFile(self._folder / "batches", start_batch)
        self._opened, self._step = True, start_step

    def log_metrics(self, metrics: dict[str, float], step: int, axis: Axis = Axis.EPOCH) -> None:
        values = self._wrote(metrics, step, axis)
        if axis not in self._files:
            self._files[axis] = _EventFile(self._folder / "batches", self._start_batch)
        self._files[axis].scalars(values, step)

    def log_hyperparams(self, hyperparams: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        self._check_open()
        from torch.utils.tensorboard.summary import hparams

        # Into this run's own file (torch's add_hparams would start a run of its own in a subfolder): the HPARAMS
        # dashboard shows the folder's run with its hyperparameters and the last values of the metrics named here.
        epochs = self._files[Axis.EPOCH]
        for summary in hparams(
            {k: _param(v) for k, v in hyperparams.items()}, {k: _number(v) for k, v in (metrics or {}).items()}
        ):
            epochs.write(summary=summary)
        epochs.scalars(self._unwritten(metrics), self._step)

    def log_text(self, name: str, text: str, step: int) -> None:
        """``text`` at ``step`` in TensorBoard's TEXT dashboard (what SummaryWriter.add_text writes)."""
        self._check_open()
        from torch.utils.tensorboard.summary import text as text_summary

        self._files[Axis.EPOCH].write(step, text_summary(name, text))

    def log_figure(self, name: str, figure: matplotlib.figure.Figure, step: int) -> None:
        self._check_open()
        # protobuf makes its classes at import: pyright cannot see them
        from tensorboard.compat.proto.summary_pb2 import Summary  # pyright: ignore[reportAttributeAccessIssue]

        # The PNG as it is, in an image summary (what add_figure writes, without replacing the figure's canvas by
        # an Agg one and closing it through pyplot as add_figure does).
        png = _png(figure)
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")  # the IHDR chunk
        image = Summary.Image(height=height, width=width, colorspace=4, encoded_image_string=png)
        self._files[Axis.EPOCH].write(step, Summary(value=[Summary.Value(tag=name, image=image)]))

    def log_model(
        self,
        model: torch.nn.Module,
        train_dataloader: Any = None,
        val_dataloader: Any = None,
        test_dataloader: Any = None,
    ) -> None:
        """TensorBoard has nowhere to keep a model: nothing is logged, and a warning says so in qadence's and
        perceptrain's words, which scripts look for."""
        self._check_open()
        warnings.warn(
            "Model logging is not supported by tensorboard. No model will be logged. Track to mlflow (an MLflow "
            "model) or csv (model.pt in the tracking folder), or save a checkpoint (SaveCheckpoint, "
            "trainer.save_checkpoint())",
            stacklevel=2,
        )


_FILE_NUMBERS = itertools.count()  # as TensorBoard numbers a process's event files


class _EventFile:
    """One event file, named as TensorBoard names them, starting with a restart marker at ``purge_step``:
    TensorBoard's reader drops what the folder's earlier files hold at that step or later (as SummaryWriter's
    purge_step does)."""

    def __init__(self, folder: Path, purge_step: int) -> None:
        # protobuf makes its classes at import: pyright cannot see them
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog  # pyright: ignore[reportAttributeAccessIssue]
        from tensorboard.summary.writer.record_writer import RecordWriter

        folder.mkdir(parents=True, exist_ok=True)
        _after_existing_event_files(folder)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_NUMBERS)}"
        self._event = Event
        self._file = open(folder / name, "wb")  # noqa: SIM115 - open until close()
        self._records = RecordWriter(self._file)
        self.write(purge_step, file_version="brain.Event:2")
        self.write(purge_step, session_log=SessionLog(status=SessionLog.START))

    def write(self, step: int = 0, summary: Any = None, **fields: Any) -> None:
        self._records.write(
            self._event(wall_time=time.time(), step=step, summary=summary, **fields).SerializeToString()
        )
        self._file.flush()

    def scalars(self, values: dict[str, float], step: int) -> None:
        if values:
            # protobuf makes its classes at import: pyright cannot see them
            from tensorboard.compat.proto.summary_pb2 import Summary  # pyright: ignore[reportAttributeAccessIssue]

            self.write(
                step, Summary(value=[Summary.Value(tag=name, simple_value=value) for name, value in values.items()])
            )

    def close(self) -> None:
        self._file.close()


def _after_existing_event_files(folder: Path) -> None:
    """TensorBoard reads a folder's event files in the order of their names, which start with the second each was
    created, and its purge drops only events it has read: the new file must sort after the previous attempt's. A
    run resumed within the same second (or on a host whose clock is slightly behind) waits for the next second."""
    latest = -1
    for name in os.listdir(folder):
        parts = name.split(".")
        if name.startswith("events.out.tfevents.") and len(parts) > 3 and parts[3].isdigit():
            latest = max(latest, int(parts[3]))
    wait = latest + 1 - time.time()
    if 0 < wait <= 5:
        time.sleep(wait)


class MlflowTracker(_Opened):
    """An MLflow run, through an MlflowClient of the tracker's own: nothing global is set (the tracking URI, the
    active run), so a notebook's own MLflow runs, or a second Trainer in the process, are left alone.

    The tracking URI is MLFLOW_TRACKING_URI's, else a file store under folder/"mlruns" (``mlflow ui
    --backend-store-uri <folder>/mlruns`` shows it). MLflow 3 has its file store in maintenance mode and opens one
    only with MLFLOW_ALLOW_FILE_STORE=true, which the tracker sets while it opens its own; mlflow-skinny has no
    database store (that needs SQLAlchemy, which the full mlflow package brings). The
    experiment is MLFLOW_EXPERIMENT_ID's or MLFLOW_EXPERIMENT_NAME's (created if missing), else ``experiment`` (the
    Accelerator's project name), else "Default"; ``tags`` are set on a new run (``description`` as MLflow's note). A resumed
    run continues the same run id. MLflow cannot delete logged values, so the steps a previous attempt wrote at
    start_step or later are dropped from a local file store's files; a tracking server or database keeps them beside
    the new ones (the newer has the later timestamp).

    Importing mlflow adds handlers to its own loggers and, unless MLFLOW_DISABLE_TELEMETRY or DO_NOT_TRACK is set
    (or a CI variable), MLflow's usage telemetry starts a daemon thread at the first tracking call.
    """

    def __init__(
        self, experiment: str | None = None, tags: dict[str, Any] | None = None, description: str | None = None
    ) -> None:
        super().__init__()
        self._client: Any = None
        self._run_id: str | None = None
        self._experiment = experiment
        self._tags = {str(k): str(v) for k, v in (tags or {}).items()}
        if description is not None:
            self._tags["mlflow.note.content"] = str(description)
        self.uri = ""  # the tracking URI, once open

    def open(
        self, folder: Path, run_name: str, resume: dict[str, Any] | None, start_step: int, start_batch: int = 0
    ) -> None:
        _optional(TrackingTool.MLFLOW)
        from mlflow.tracking import MlflowClient

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (folder / "mlruns").absolute().as_uri()
        with _file_store_allowed(not os.environ.get("MLFLOW_TRACKING_URI")):
            self._client = client = MlflowClient(tracking_uri=uri)
        run_id = (resume or {}).get("run_id")
        if run_id is not None and not self._exists(run_id):
            warnings.warn(
                f"the MLflow run {run_id} to resume is not in {uri}: the resumed training writes to a new run",
                stacklevel=2,
            )
            run_id = None
        if run_id is None:
            run_id = client.create_run(
                self._experiment_id(), run_name=run_name or None, tags=self._tags or None
            ).info.run_id
        else:
            client.update_run(run_id, status="RUNNING")
            self._drop_from(uri, run_id, start_step, start_batch)
        self._run_id, self._opened, self._step, self.uri = run_id, True, start_step, uri

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id, once open."""
        return self._run_id

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self._client.get_run(run_id)
        except MlflowException:
            return False
        return True

    def _experiment_id(self) -> str:
        if os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or self._experiment or "Default"
        experiment = self._client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment is not None else self._client.create_experiment(name)

    def _drop_from(self, uri: str, run_id: str, start_step: int, start_batch: int) -> None:
        """In a local file store, each metric is a file of lines "timestamp value step" (a name with "/" in it is
        a path): the lines of steps from start_step on (start_batch for the batch/ names) go, so the resumed run's
        values are the only ones there."""
        root = _local_path(uri)
        if root is None:
            return
        metrics = root / self._client.get_run(run_id).info.experiment_id / run_id / "metrics"
        for path in metrics.rglob("*") if metrics.is_dir() else ():
            if path.is_file() and not path.name.startswith("."):
                per_batch = path.relative_to(metrics).as_posix().startswith(BATCH_PREFIX)
                start = start_batch if per_batch else start_step
                lines = path.read_text().splitlines(keepends=True)
                kept = [line for line in lines if not _step_at_or_after(line, start)]
                if not kept:  # a metric first logged after the checkpoint: MLflow cannot read an empty file
                    path.unlink()
                elif len(kept) != len(lines):
                    write_bytes("".join(kept).encode(), path, durable=False)

    def log_metrics(self, metrics: dict[str, float], step: int, axis: Axis = Axis.EPOCH) -> None:
        values = self._wrote(metrics, step, axis)
        if axis is Axis.BATCH:
            values = {BATCH_PREFIX + name: value for name, value in values.items()}
        self._log(values, step)

    def _log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        points = [Metric(name, value, now, step) for name, value in values.items()]
        for start in range(0, len(points), 1000):  # MLflow's limit for one batch
            self._client.log_batch(self._run_id, metrics=points[start : start + 1000], synchronous=True)

    def log_hyperparams(self, hyperparams: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        self._check_open()
        from mlflow.entities import Param

        # A run's parameters cannot change in MLflow: a resumed run logging a changed one (more epochs) keeps the
        # first value, and says so, rather than failing the training.
        logged = self._client.get_run(self._run_id).data.params
        params, changed = [], []
        for name, value in hyperparams.items():
            text = str(_param(value))[:6000]  # MLflow's limit for a parameter's value
            if name not in logged:
                params.append(Param(name, text))
            elif logged[name] != text:
                changed.append(f"{name} stays {logged[name]!r} (now {text!r})")
        for start in range(0, len(params), 100):  # MLflow's limit for one batch
            self._client.log_batch(self._run_id, params=params[start : start + 100], synchronous=True)
        if changed:
            warnings.warn(
                f"MLflow keeps a run's parameters fixed: in run {self._run_id}, {'; '.join(changed)}", stacklevel=2
            )
        self._log(self._unwritten(metrics), self._step)

    def log_figure(self, name: str, figure: matplotlib.figure.Figure, step: int) -> None:
        self._check_open()
        self._client.log_figure(self._run_id, figure, _figure_file(name, str(step)))  # savefig: the suffix's format

    def log_model(
        self,
        model: torch.nn.Module,
        train_dataloader: Any = None,
        val_dataloader: Any = None,
        test_dataloader: Any = None,
    ) -> None:
        """The model as an MLflow model, the run's artifact ``model``, so that
        ``mlflow.pytorch.load_model("runs:/<run id>/model")`` gives it back, as qadence and perceptrain intend; its
        signature is inferred from the training data's first sample, as theirs from the first batch. MLflow's own
        ``save_model`` writes it, pickled (cloudpickle, MLflow's default module), since MLflow 3's default pt2
        format needs a model ``torch.export`` can trace; ``mlflow.pytorch.log_model`` itself would log to MLflow's
        global active run, which this tracker leaves alone. Its requirements are MLflow's for PyTorch (torch,
        cloudpickle): MLflow's inference of them, which imports the model in a new process, took 18 s here and
        listed every package this process happened to import."""
        self._check_open()
        import mlflow.pytorch

        module = _whole_module(model)
        with tempfile.TemporaryDirectory(prefix="qaccel-model-") as folder:
            path = Path(folder) / "model"
            signature = _signature(module, train_dataloader)
            mlflow.pytorch.save_model(
                module,
                str(path),
                signature=signature,
                serialization_format="pickle",
                pip_requirements=mlflow.pytorch.get_default_pip_requirements(),
            )
            self._client.log_artifacts(self._run_id, str(path), "model")

    def state(self) -> dict[str, Any]:
        return {} if self._run_id is None else {"run_id": self._run_id}

    def close(self) -> None:
        if self._run_id is not None and not self._closed:
            self._client.set_terminated(self._run_id)
        self._closed = True


def _signature(module: torch.nn.Module, loader: Any) -> Any:
    """MLflow's signature of ``module`` on the first sample of ``loader``'s dataset (its first item, when a sample
    is a tuple), or None when that is no tensor. The loader itself is not iterated: that would move a prepared
    loader's place in its epochs. The module runs once, without gradients, in eval mode."""
    import torch
    from mlflow.models import infer_signature

    dataset = getattr(loader, "dataset", None)
    try:
        sample = dataset[0] if dataset is not None and len(dataset) > 0 else None
    except (TypeError, NotImplementedError, IndexError, KeyError):  # an iterable dataset, or one with no 0
        sample = None
    x = sample[0] if isinstance(sample, tuple | list) and sample else sample
    if not isinstance(x, torch.Tensor):
        return None
    device = next((p.device for p in module.parameters()), x.device)
    training = module.training
    try:
        module.eval()
        with torch.no_grad():
            y = module(x.unsqueeze(0).to(device))
    finally:
        module.train(training)
    if not isinstance(y, torch.Tensor):
        return None
    return infer_signature(x.unsqueeze(0).cpu().numpy(), y.detach().cpu().numpy())


@contextlib.contextmanager
def _file_store_allowed(allow: bool) -> Iterator[None]:
    """MLFLOW_ALLOW_FILE_STORE=true (unless set otherwise) while the client opens the store qaccel chose; MLflow keeps
    an opened store for the process, so the setting is not needed afterwards and the process's environment is left
    as it was."""
    if not allow or "MLFLOW_ALLOW_FILE_STORE" in os.environ:
        yield
        return
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)


def _local_path(uri: str) -> Path | None:
    """The folder of a local file store's URI (file:... or a plain path), or None for a server or database."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "file":
        return Path(urllib.request.url2pathname(parsed.path))
    return Path(uri) if parsed.scheme == "" else None


def _step_at_or_after(line: str, start_step: int) -> bool:
    fields = line.split()
    return len(fields) >= 3 and fields[2].lstrip("-").isdigit() and int(fields[2]) >= start_step


def _init_wandb(wandb: Any, kwargs: dict[str, Any]) -> Any:
    """``wandb.init(**kwargs)``. A process started by one that runs a W&B service (a notebook's kernel, a script
    that called ``wandb.init``) talks to that service (``WANDB_SERVICE``). A rank killed with its run open leaves
    the run in that service, which then refuses to resume it ("run ID ... is in use") for as long as its owner
    lives: this process then starts a service of its own, as one with no owner to inherit from does."""
    try:
        return wandb.init(**kwargs)
    except Exception as error:
        if "is in use" not in str(error):
            raise
        token = os.environ.get("WANDB_SERVICE", "")
        owner = token.split("-")[1] if token.count("-") >= 2 else ""
        if not owner.isdigit() or int(owner) == os.getpid() or wandb.run is not None:
            raise RuntimeError(
                f"W&B run {kwargs.get('id')!r} is open already in the W&B service this process uses "
                f"(WANDB_SERVICE={token or 'unset'}): finish it there first ({error})"
            ) from error
    wandb.teardown()  # closes this process's connection only: the service is its owner's
    os.environ.pop("WANDB_SERVICE")
    return wandb.init(**kwargs)


class WandbTracker(_Opened):
    """A Weights & Biases run, made by ``wandb.init(project=project, **init_kwargs)``; wandb's own variables apply
    (``WANDB_MODE=offline``, ``WANDB_DIR``, ``WANDB_PROJECT``, ``WANDB_API_KEY``, ...). The run's local files go to
    ``folder`` (wandb makes its ``wandb`` subfolder there) unless ``WANDB_DIR`` or ``init_kwargs["dir"]`` says
    otherwise, or ``own_dir`` is False (the Accelerator's, as Accelerate's: wandb's default, ``./wandb``). A new run is
    named ``run_name`` unless ``init_kwargs`` names it.

    Epoch metrics are plotted against the metric ``epoch``, batch metrics (named ``batch/<name>``) against ``batch``
    (wandb's define_metric); the Accelerator's values go in at the step it gives (``log_values``).

    A resumed run continues the same run id (``resume="allow"``). W&B cannot delete logged values and a run's steps
    only go forward: what the previous attempt logged after the checkpoint stays in the run (online, W&B ignores
    the resumed run's values at a step it already has, with a warning). Offline, each attempt is a folder of its own
    (``offline-run-*-<id>``, the later ones suffixed), all with the same run id: ``wandb sync`` them in order.
    """

    def __init__(
        self, project: str | None = None, init_kwargs: dict[str, Any] | None = None, own_dir: bool = True
    ) -> None:
        super().__init__()
        self._project, self._init_kwargs, self._own_dir = project, dict(init_kwargs or {}), own_dir
        self.run: Any = None  # the wandb Run, once open
        self._defined: set[str] = set()

    def open(
        self, folder: Path, run_name: str, resume: dict[str, Any] | None, start_step: int, start_batch: int = 0
    ) -> None:
        wandb = _optional(TrackingTool.WANDB)
        kwargs = {"project": self._project, **self._init_kwargs}
        if self._own_dir and "dir" not in kwargs and not os.environ.get("WANDB_DIR"):
            Path(folder).mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(folder)
        run_id = (resume or {}).get("run_id")
        if run_id is not None:
            kwargs["id"] = run_id
            if not any(kwargs.get(name) for name in ("resume", "resume_from", "fork_from")):
                kwargs["resume"] = "allow"
        elif run_name and "name" not in kwargs:
            kwargs["name"] = run_name
        self.run = _init_wandb(wandb, kwargs)
        self.run.define_metric("batch")
        self.run.define_metric("batch/*", step_metric="batch")
        self._opened, self._step = True, start_step

    def log_metrics(self, metrics: dict[str, float], step: int, axis: Axis = Axis.EPOCH) -> None:
        values = self._wrote(metrics, step, axis)
        if axis is Axis.BATCH:
            self.run.log({**{BATCH_PREFIX + name: value for name, value in values.items()}, "batch": step})
        else:
            self._epoch_axis(values)
            self.run.log({**values, "epoch": step})

    def _epoch_axis(self, names: Iterable[str]) -> None:
        for name in names:
            if name not in self._defined:
                self.run.define_metric(name, step_metric="epoch")
                self._defined.add(name)

    def log_values(self, values: dict[str, Any], step: int | None, **kwargs: Any) -> None:
        """Accelerate's ``log``: ``run.log(values, step=step, **kwargs)``, any value wandb takes."""
        self._check_open()
        self.run.log(values, step=step, **kwargs)

    def log_hyperparams(self, hyperparams: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        """The run's config (a resumed run's changed value replaces the first), and ``metrics`` in its summary."""
        self._check_open()
        self.run.config.update({k: _param(v) for k, v in hyperparams.items()}, allow_val_change=True)
        unwritten = self._unwritten(metrics)
        if unwritten:
            self._epoch_axis(unwritten)
            self.run.log({**unwritten, "epoch": self._step})
        if metrics:
            self.run.summary.update({k: _number(v) for k, v in metrics.items()})

    def log_figure(self, name: str, figure: matplotlib.figure.Figure, step: int) -> None:
        """The figure as a wandb Image (a PNG) named ``name``, at epoch ``step``."""
        self._check_open()
        import wandb
        from PIL import Image

        self._epoch_axis([name])
        self.run.log({name: wandb.Image(Image.open(io.BytesIO(_png(figure)))), "epoch": step})

    def log_model(
        self,
        model: torch.nn.Module,
        train_dataloader: Any = None,
        val_dataloader: Any = None,
        test_dataloader: Any = None,
    ) -> None:
        """The model's state_dict (torch.save) as the run's file ``model/state_dict.pt`` (uploaded with the run's
        files); the data loaders are not used."""
        self._check_open()
        path = Path(self.run.dir) / "model" / "state_dict.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        save(_state_dict(model), path)

    def state(self) -> dict[str, Any]:
        return {} if self.run is None else {"run_id": self.run.id}

    def close(self) -> None:
        if self.run is not None and not self._closed:
            self.run.finish()
        self._closed = True


class CsvTracker(_Opened):
    """folder/"metrics.csv" for the epochs and folder/"batches.csv" for the batches (made at the first batch
    written): a column ``step`` and one per metric name (a new name adds a column, and the file is rewritten with
    it); a row per log_metrics call, blank where that call had no value. Rows are appended and flushed; a rewrite
    replaces the file atomically. Hyperparameters go to folder/"hyperparams.json", figures to
    folder/"plots"/f"{name}_{step:08d}.png" (folder/"plots"/name for a name ending with an image suffix), the model of
    log_model to folder/"model.pt" (its state_dict)."""

    def __init__(self) -> None:
        super().__init__()
        self._folder = Path()

    def open(
        self, folder: Path, run_name: str, resume: dict[str, Any] | None, start_step: int, start_batch: int = 0
    ) -> None:
        self._folder = Path(folder)
        self._folder.mkdir(parents=True, exist_ok=True)
        self._files = {
            Axis.EPOCH: _CsvFile(self._folder / "metrics.csv", start_step),
            Axis.BATCH: _CsvFile(self._folder / "batches.csv", start_batch),
        }
        self._opened, self._step = True, start_step

    def log_metrics(self, metrics: dict[str, float], step: int, axis: Axis = Axis.EPOCH) -> None:
        if "step" in metrics:
            raise ValueError("a metric cannot be named 'step' in a CSV tracker: the file's first column is the step")
        self._files[axis].write(self._wrote(metrics, step, axis), step)

    def log_hyperparams(self, hyperparams: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        self._check_open()
        path = self._folder / "hyperparams.json"
        content = json.loads(path.read_text()) if path.exists() else {}
        content = {
            "hyperparams": content.get("hyperparams", {}) | {k: _param(v) for k, v in hyperparams.items()},
            "metrics": content.get("metrics", {}) | {k: _number(v) for k, v in (metrics or {}).items()},
        }
        write_bytes(json.dumps(content, indent=2).encode() + b"\n", path, durable=False)

    def log_figure(self, name: str, figure: matplotlib.figure.Figure, step: int) -> None:
        self._check_open()
        path = self._folder / "plots" / _figure_file(name, f"{step:08d}")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(_png(figure, path.suffix[1:].lower()), path, durable=False)

    def log_model(
        self,
        model: torch.nn.Module,
        train_dataloader: Any = None,
        val_dataloader: Any = None,
        test_dataloader: Any = None,
    ) -> None:
        """The model's state_dict (torch.save) in folder/"model.pt", replaced atomically; the data loaders are not
        used."""
        self._check_open()
        save(_state_dict(model), self._folder / "model.pt")


class NullTracker(_Opened):
    """The tracker of the ranks that do not write (all but rank 0): every method does nothing, opened or not (plot
    does not call the plotting functions), but print_metrics, which prints as on rank 0. A qadence callback calling
    ``writer.write(...)`` on every rank runs there too."""

    def open(
        self, folder: Path, run_name: str, resume: dict[str, Any] | None, start_step: int, start_batch: int = 0
    ) -> None:
        self._opened = True

    def log_metrics(self, metrics: dict[str, float], step: int, axis: Axis = Axis.EPOCH) -> None:
        pass

    def log_hyperparams(self, hyperparams: dict[str, Any], metrics: dict[str, float] | None = None) -> None:
        pass

    def log_figure(self, name: str, figure: matplotlib.figure.Figure, step: int) -> None:
        pass

    def plot(self, model: torch.nn.Module, iteration: int, plotting_functions: Iterable[PlottingFunction]) -> None:
        pass

    def log_model(
        self,
        model: torch.nn.Module,
        train_dataloader: Any = None,
        val_dataloader: Any = None,
        test_dataloader: Any = None,
    ) -> None:
        pass


class _CsvFile:
    """One CSV file of steps and metrics; the previous attempt's rows before ``start_step`` stay, later ones (and a
    row cut short) go."""

    def __init__(self, path: Path, start_step: int) -> None:
        self._path = path
        self._columns: list[str] = []
        self._file: Any = None
        if path.exists():
            columns, rows = _read_csv(path)
            self._columns = columns
            _write_csv(path, columns, [row for row in rows if int(row["step"]) < start_step])

    def write(self, values: dict[str, float], step: int) -> None:
        row = {"step": str(step)} | {name: repr(value) for name, value in values.items()}
        new = [name for name in values if name not in self._columns]
        if new or not self._path.exists():
            self.close()
            self._columns += new
            rows = _read_csv(self._path)[1] if self._path.exists() else []
            _write_csv(self._path, self._columns, rows + [row])
            return
        if self._file is None:
            self._file = open(self._path, "a", newline="")  # noqa: SIM115 - open until close()
        csv.DictWriter(self._file, ["step"] + self._columns, lineterminator="\n").writerow(row)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The metric columns and the rows of a metrics.csv. A last line without its newline (cut short by a crash) is
    left out, and so is a row without a whole-number step or with another number of fields than the header."""
    text = path.read_text()
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(io.StringIO(text, newline=""))
    columns = [name for name in reader.fieldnames or () if name != "step"]
    rows = [
        row
        for row in reader
        if (row.get("step") or "").lstrip("-").isdigit() and None not in row and None not in row.values()
    ]
    return columns, rows


def _write_csv(path: Path, columns: list[str], rows: list[dict[str, str]]) -> None:
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, ["step"] + columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_bytes(text.getvalue().encode(), path, durable=False)
