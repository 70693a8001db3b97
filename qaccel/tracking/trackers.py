"""Accelerate's experiment tracking on the Accelerator: ``Accelerator(log_with=...)``, ``init_trackers``, ``log``,
``get_tracker``, ``trackers``, closed by ``end_training``, written through qaccel's trackers
(qaccel/tracking/tools.py) on the main process only; the other ranks get trackers that do nothing.

Where each writes is Accelerate's: TensorBoard into ``<logging_dir>/<project_name>``, wandb through
``wandb.init(project=project_name, **init_kwargs)``, MLflow to the experiment ``project_name`` (unless
``MLFLOW_EXPERIMENT_NAME`` is set), tracked in ``MLFLOW_TRACKING_URI`` or else a file store in
``<logging_dir>/mlruns`` (``./mlruns`` without a logging_dir); qaccel's CSV into ``<logging_dir>/<project_name>``.

One run per job: save_state() records each tracker's run and the last step it logged (in the checkpoint's marker),
and load_state()/resume() make the trackers continue that run, dropping what was logged after that step
(TensorBoard, CSV and a local MLflow store; W&B keeps what it has, see WandbTracker). A tracker opens its run at its
first use (a log, ``.tracker``, the config it stores is held until then), so that a script calling
``init_trackers()`` before ``load_state()``, as Accelerate's examples do, starts no run it then leaves.

``step=None`` logs at the step after the last one this tracker logged (0 first), on every tracker: W&B's own
counting; Accelerate's TensorBoard and MLflow trackers write such values at step 0.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from qaccel.options import TrackingTool
from qaccel.tracking.tools import (
    CsvTracker,
    MlflowTracker,
    TensorBoardTracker,
    WandbTracker,
    _after_existing_event_files,
)

_MLFLOW_INIT = ("run_name", "tags", "description")  # the init_kwargs the mlflow tracker takes


class AcceleratorTracker:
    """One of ``log_with``'s trackers on the main process, with Accelerate's GeneralTracker methods (``name``,
    ``requires_logging_directory``, ``start``, ``store_init_configuration``, ``log``, ``finish``, ``tracker``: the
    tool's own object, the run opened if it was not)."""

    main_process_only = True

    def __init__(self, name: str, project_name: str, logging_dir: str | None, init_kwargs: dict[str, Any]) -> None:
        self.name = name
        self.project_name, self._logging_dir = project_name, logging_dir
        self._init_kwargs = dict(init_kwargs)
        if name == "mlflow" and set(init_kwargs) - set(_MLFLOW_INIT):
            raise TypeError(
                f"init_kwargs['mlflow'] takes {', '.join(_MLFLOW_INIT)}; got "
                f"{', '.join(sorted(set(init_kwargs) - set(_MLFLOW_INIT)))}"
            )
        self._inner = self._make()
        self._opened = False
        self._resume: dict[str, Any] | None = None  # the run to continue (what the checkpoint recorded)
        self.last_step = -1  # the last step logged (-1: none)
        self._config: dict[str, Any] = {}  # stored at the opening
        self._writer: Any = None  # TensorBoard: the SummaryWriter .tracker gives
        self._warned: set[str] = set()

    @property
    def requires_logging_directory(self) -> bool:
        return TrackingTool(self.name).writes_folder

    def _make(self) -> Any:
        if self.name == "tensorboard":
            return TensorBoardTracker()
        if self.name == "csv":
            return CsvTracker()
        if self.name == "mlflow":
            return MlflowTracker(self.project_name, self._init_kwargs.get("tags"), self._init_kwargs.get("description"))
        return WandbTracker(self.project_name, self._init_kwargs, own_dir=False)

    def _folder(self) -> Path:
        if self.name == "mlflow":
            return Path(self._logging_dir or os.getcwd())
        assert self._logging_dir is not None  # checked by the option
        return Path(self._logging_dir) / self.project_name

    def start(self) -> None:
        """Open the run (continuing the checkpoint's when load_state() gave one); the first use does it anyway."""
        if self._opened:
            return
        self._inner.open(
            self._folder(),
            self._init_kwargs.get("run_name", "") if self.name == "mlflow" else "",
            self._resume,
            self.last_step + 1,
        )
        self._opened = True
        if self._config:
            self._store(self._config)

    def continue_run(self, saved: dict[str, Any] | None) -> None:
        """Continue the run a checkpoint recorded (``saved``: what state() gave there; None: no run, but the steps
        after the checkpoint's are still dropped): reopened at once if open, else at the first use."""
        saved = saved or {}
        self._resume, self.last_step = saved.get("run") or None, int(saved.get("last_step", -1))
        if not self._opened:
            return
        fresh = self._inner
        fresh.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if isinstance(fresh, MlflowTracker) and fresh.run_id != (self._resume or {}).get("run_id"):
            fresh._client.delete_run(fresh.run_id)  # made by this attempt before the checkpoint was loaded
        self._inner, self._opened = self._make(), False
        self.start()

    def state(self) -> dict[str, Any]:
        run = self._inner.state() if self._opened else self._resume
        return {"run": run or {}, "last_step": self.last_step}

    @property
    def tracker(self) -> Any:
        """The tool's own object, as Accelerate's: TensorBoard's SummaryWriter (writing into the same folder), the
        wandb Run, an ``mlflow.ActiveRun`` of the run (logged to through this tracker's own MlflowClient: it is not
        MLflow's global active run), the CSV tracker itself."""
        self.start()
        if self.name == "tensorboard":
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter

                folder = self._folder()
                _after_existing_event_files(folder)  # its file sorts after the purge marker of a resumed run
                self._writer = SummaryWriter(str(folder), **self._init_kwargs)
            return self._writer
        if self.name == "wandb":
            return self._inner.run
        if self.name == "mlflow":
            import mlflow

            return mlflow.ActiveRun(self._inner._client.get_run(self._inner.run_id))
        return self._inner

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """``values`` as the run's hyperparameters (wandb's config, MLflow's parameters, TensorBoard's HPARAMS)."""
        if not isinstance(values, dict):
            raise TypeError(f"config must be a dict of hyperparameters; got {type(values).__name__}")
        self._config = {**self._config, **values}
        if self._opened:
            self._store(values)

    def _store(self, values: dict[str, Any]) -> None:
        if self.name == "wandb":
            self._inner.run.config.update(values, allow_val_change=True)
        else:
            self._inner.log_hyperparams(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``values`` at ``step`` (None: the step after the last one logged). Numbers and one-element tensors are
        metrics everywhere; wandb takes whatever ``run.log`` takes, with ``kwargs``; TensorBoard writes a string as
        text and a dict of numbers as ``name/key`` scalars; what a tracker cannot write is left out with a warning."""
        if not isinstance(values, dict):
            raise TypeError(f"log() takes a dict of values; got {type(values).__name__}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise TypeError(f"step must be an int or None; got {step!r}")
        if kwargs and self.name != "wandb":
            raise TypeError(
                f"log_kwargs[{self.name!r}] is not taken by qaccel's {self.name} tracker (only wandb's "
                f"run.log takes keyword arguments); got {', '.join(kwargs)}"
            )
        self.start()
        step = self.last_step + 1 if step is None else step
        if self.name == "wandb":
            self._inner.log_values({k: _scalar(v) for k, v in values.items()}, step, **kwargs)
        else:
            metrics, texts = self._split(values)
            if metrics:
                self._inner.log_metrics(metrics, step)
            for name, text in texts.items():
                self._inner.log_text(name, text, step)
        self.last_step = max(self.last_step, step)

    def _split(self, values: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
        metrics: dict[str, float] = {}
        texts: dict[str, str] = {}
        for name, value in values.items():
            value = _scalar(value)
            if isinstance(value, (int, float)):
                metrics[name] = value
            elif isinstance(value, str) and self.name == "tensorboard":
                texts[name] = value
            elif (
                isinstance(value, dict)
                and self.name == "tensorboard"
                and all(isinstance(_scalar(v), (int, float)) for v in value.values())
            ):
                metrics.update({f"{name}/{key}": _scalar(v) for key, v in value.items()})
            elif name not in self._warned:
                self._warned.add(name)
                warnings.warn(
                    f"the {self.name} tracker logs numbers{' and text' * (self.name == 'tensorboard')}: "
                    f"{name!r} ({type(value).__name__}) is left out",
                    stacklevel=4,
                )
        return metrics, texts

    def finish(self) -> None:
        """Close the run (wandb's finish, MLflow's run ended as FINISHED, the files closed); once."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._opened:
            self._inner.close()


class NoTracker:
    """What the ranks other than the main process get from get_tracker(): every method, and every attribute
    called as one (``get_tracker("wandb", unwrap=True).watch(model)``), does nothing (Accelerate's blank tracker)."""

    name = "none"
    requires_logging_directory = False
    tracker = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


class Trackers:
    """The trackers of one Accelerator in one session (its Registry's), and the runs a loaded checkpoint recorded
    for the trackers still to start."""

    def __init__(self) -> None:
        self.trackers: list[Any] = []  # the main process's; empty elsewhere, as Accelerate's
        self.started = False
        self._saved: dict[str, Any] | None = None  # from the checkpoint load_state() read

    def init(
        self,
        log_with: tuple[Any, ...],
        project_name: str,
        config: dict[str, Any] | None,
        init_kwargs: dict[str, Any] | None,
        logging_dir: str | None,
        main: bool,
    ) -> None:
        if not isinstance(project_name, str) or not project_name:
            raise TypeError(f"init_trackers(project_name=...) takes a non-empty str; got {project_name!r}")
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"init_trackers(config=...) takes a dict of hyperparameters or None; got {config!r}")
        init_kwargs = {} if init_kwargs is None else init_kwargs
        if not isinstance(init_kwargs, dict) or not all(isinstance(v, dict) for v in init_kwargs.values()):
            raise TypeError(
                "init_trackers(init_kwargs=...) takes a dict of dicts, one per tracker name, e.g. "
                f"{{'wandb': {{'tags': ['a']}}}}; got {init_kwargs!r}"
            )
        if not log_with:
            raise ValueError(
                "init_trackers() has no tracker to start: make the Accelerator with log_with=... "
                "('tensorboard', 'wandb', 'mlflow', 'csv', 'all' or a tracker object)"
            )
        if self.started:
            raise RuntimeError("init_trackers() was called already in this session; end_training() closes the trackers")
        self.started = True
        if not main:
            return
        for item in log_with:
            tracker = (
                item
                if not isinstance(item, str)
                else AcceleratorTracker(item, project_name, logging_dir, init_kwargs.get(item, {}))
            )
            self.trackers.append(tracker)
            if isinstance(tracker, AcceleratorTracker) and self._saved is not None and tracker.name in self._saved:
                tracker.continue_run(self._saved[tracker.name])
            elif not isinstance(tracker, AcceleratorTracker) and callable(getattr(tracker, "start", None)):
                tracker.start()
        if config is not None:
            for tracker in self.trackers:
                if callable(getattr(tracker, "store_init_configuration", None)):
                    tracker.store_init_configuration(config)

    def log(self, values: dict[str, Any], step: int | None, log_kwargs: dict[str, Any] | None) -> None:
        log_kwargs = log_kwargs or {}
        if not isinstance(log_kwargs, dict):
            raise TypeError(f"log(log_kwargs=...) takes a dict of dicts, one per tracker name; got {log_kwargs!r}")
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def get(self, name: str, unwrap: bool) -> Any:
        if not self.trackers:
            return NoTracker()
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(
            f"{name!r} is not one of the Accelerator's trackers: {', '.join(repr(t.name) for t in self.trackers)}"
        )

    def state(self) -> dict[str, Any] | None:
        """What save_state() records (rank 0's): each tracker's run and last step, by name; None without any."""
        ours = {t.name: t.state() for t in self.trackers if isinstance(t, AcceleratorTracker)}
        return {**(self._saved or {}), **ours} or None

    def restore(self, saved: dict[str, Any] | None) -> None:
        """load_state() read a checkpoint: the trackers (started or still to start) continue its runs."""
        if not saved:  # a checkpoint saved without trackers: the runs go on as they are
            return
        self._saved = dict(saved)
        for tracker in self.trackers:
            if isinstance(tracker, AcceleratorTracker) and tracker.name in self._saved:
                tracker.continue_run(self._saved[tracker.name])

    def close(self, failed: bool = False) -> None:
        """Finish every tracker, each even when one before it fails (so that none is left unflushed); the first
        failure is raised then, or, when the session already failed (``failed``), only warned about, so that the
        error that ended it stays the one reported (a tracker's own service may have gone first at exit)."""
        trackers, self.trackers, self.started = self.trackers, [], False
        errors = []
        for tracker in trackers:
            try:
                tracker.finish()
            except Exception as exc:  # noqa: BLE001 - every tracker gets its finish; the first error is raised below
                exc.add_note(f"[qaccel] while finishing the {tracker.name} tracker")
                errors.append(exc)
        if errors and failed:
            warnings.warn(
                f"qaccel: after the failure, the {', '.join(str(e).splitlines()[0] for e in errors)} "
                "(finishing the trackers)",
                stacklevel=2,
            )
        elif errors:
            raise errors[0]


def _scalar(value: Any) -> Any:
    """A one-element tensor or numpy value as its Python number (Accelerate's values are numbers); others as
    they are."""
    numel = getattr(value, "numel", None)  # a torch tensor
    if callable(numel) and numel() == 1:
        return value.item()
    if type(value).__module__ == "numpy" and getattr(value, "size", 0) == 1:
        return value.item()
    return value
