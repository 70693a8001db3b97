"""The session's registry of what an Accelerator prepared, and the step state the prepared objects share.

One per Accelerator per session: prepared optimizers read from it whether this step updates, prepared loaders
write where the loop is, and save_state()/load_state() walk its lists (models, optimizers, schedulers, loaders,
registered objects).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from qaccel.tracking.trackers import Trackers
from qaccel.train.shards import BatchShard

if TYPE_CHECKING:
    import weakref

    from torch.distributed.checkpoint.stateful import Stateful  # 0.6 s to import: for the annotation only
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils.data import DataLoader

    from qaccel.train.stopping import Stopper


class Loader(Protocol):
    """What is asked of a prepared DataLoader (data.PreparedDataLoader) through the registry: declared here so that
    the registry, which the loaders write to, does not import them back."""

    worker_init_fn: Any
    batch_size: int | None

    @property
    def shard(self) -> BatchShard | None:
        """This rank's share of the batches (None: a stream or a loader left as it is)."""
        ...

    @property
    def remainder(self) -> int:
        """Samples in the short last step of all ranks together (-1: none, or a stream)."""
        ...

    @property
    def epoch(self) -> int: ...

    @property
    def batches_to_skip(self) -> int: ...

    def __len__(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...

    def check_state_dict(self, state: dict[str, int]) -> None: ...

    def release(self) -> None:
        """Stop its workers: the session ends."""
        ...


class Optimizer(Protocol):
    """What is asked of a prepared optimizer (gradients.PreparedOptimizer) through the registry."""

    optimizer: torch.optim.Optimizer  # the user's
    step_was_skipped: bool  # fp16's scaler skipped this step's update

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class BackgroundSaves(Protocol):
    """What the training step and the session's end ask of the background saves (checkpoints.background.Saves)."""

    def poll(self) -> None:
        """At a step: raise the failure of a save that ended on every rank."""
        ...

    def close(self) -> None:
        """The session ends: its staging memory goes."""
        ...


class LoopMarks:
    """Where the innermost running prepared loop is; one per session's Accelerator, written by its loaders.

    ``end_of_epoch``: the loop body runs on the last batch of an epoch (accumulation syncs there).
    ``remainder``: real samples in this step's gathered batch when it is a padded last step, else None
    (gather_for_metrics keeps only that many leading rows).
    ``padding``: how many samples at the end of this rank's batch repeat the epoch's first ones, evening out the
    padded last step (0 for every other batch).
    ``loader``: the loop's loader (None outside any loop).
    ``steps``: every rank's number of steps this epoch when they differ (even_batches=False), else None.
    """

    __slots__ = ("end_of_epoch", "loader", "padding", "remainder", "steps")

    def __init__(self) -> None:
        self.steps: list[int] | None = None
        self.end_of_epoch = False
        self.remainder: int | None = None
        self.padding = 0
        self.loader: Loader | None = None


@dataclass
class Registry:
    """What one Accelerator prepared in this session, and where its training step is."""

    accumulation_steps: int
    scaler: torch.amp.GradScaler | None
    sync_each_batch: bool = False  # reduce gradients on every micro-step (the option of that name)
    keep_global_batch: bool = False  # the option: a resume scales accumulation_steps to the checkpoint's world
    accumulation_set_by: str = ""  # what set accumulation_steps, when not the option (a resume keeping the batch)
    accumulating_loop: bool = False  # accumulate() was called: the loop counts micro-steps
    micro_step: int = 0
    sync_gradients: bool = True
    optimizers: list[Optimizer] = field(default_factory=list)
    models: list[torch.nn.Module] = field(default_factory=list)
    schedulers: list[torch.optim.lr_scheduler.LRScheduler] = field(default_factory=list)
    loaders: list[Loader] = field(default_factory=list)
    registered: list[Stateful] = field(default_factory=list)
    marks: LoopMarks = field(default_factory=LoopMarks)
    updates: int = 0  # steps of the first prepared optimizer, over resumes too (the Accelerator's ``step``)
    checkpoints: tuple[str, int | None] | None = None  # resume()'s folder and keep: save_state()'s default
    stopper: Stopper | None = None  # once resume() armed the stop on a signal
    mesh: DeviceMesh | None = None  # strategy="fsdp": the device mesh the models are sharded on
    # strategy="fsdp": replaced parameter's id -> (weak reference to it, its shard), for optimizers built before
    replaced: dict[int, tuple[weakref.ref[torch.nn.Parameter], torch.nn.Parameter]] = field(default_factory=dict)
    accumulating: bool = False  # strategy="fsdp": sharded models hold unsharded gradients over micro-steps
    trigger: bool = False  # set_trigger() was called on this rank since the last check_trigger() that saw one
    trackers: Trackers = field(default_factory=Trackers)  # log_with's, once init_trackers() started them
    saves: BackgroundSaves | None = None  # the background saves (checkpoints/background.py), from the first

    def release(self, finished: bool = True) -> None:
        """Forget the session's objects as it ends. Prepared optimizers and loaders point back here, so these lists
        would make cycles that keep the session's models alive for the garbage collector to find later. The loaders'
        workers are stopped first (see PreparedDataLoader.release)."""
        self.trackers.close(failed=not finished)  # a session that ends without end_training() closes them too
        for loader in self.loaders:
            loader.release()
        for kept in (self.optimizers, self.models, self.schedulers, self.loaders, self.registered):
            kept.clear()
        self.replaced.clear()
        if self.saves is not None:
            self.saves.close()
        self.stopper = self.mesh = self.checkpoints = None


class GradientState:
    """Accelerate's ``gradient_state``: where the training step is, for code written against it. Read-only; the
    values are the session's at the moment they are read."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-step synchronises gradients and updates (False on accumulation steps)."""
        return self._registry.sync_gradients

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared DataLoader's loop is running."""
        return self._registry.marks.loader is not None

    @property
    def active_dataloader(self) -> DataLoader[Any] | None:
        """The prepared DataLoader whose loop is running (the innermost), or None."""
        return cast("DataLoader[Any] | None", self._registry.marks.loader)  # a PreparedDataLoader

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the loop's current batch is its epoch's last."""
        return self.in_dataloader and self._registry.marks.end_of_epoch

    @property
    def remainder(self) -> int:
        """Accelerate's count: the dataset's length modulo the batch of all ranks together (samples in a short last
        step), -1 outside a loop, with ``drop_last`` or for a stream."""
        loader = self._registry.marks.loader
        return -1 if loader is None else loader.remainder

    @property
    def num_steps(self) -> int:
        """Micro-steps per optimizer update (``gradient_accumulation_steps``)."""
        return self._registry.accumulation_steps

    @property
    def sync_each_batch(self) -> bool:
        """Whether gradients are reduced on every micro-step (the option of that name)."""
        return self._registry.sync_each_batch

    @property
    def sync_with_dataloader(self) -> bool:
        """Always True: an epoch's last batch always synchronises and updates."""
        return True

    def __repr__(self) -> str:
        return (
            f"GradientState(sync_gradients={self.sync_gradients}, end_of_dataloader={self.end_of_dataloader}, "
            f"remainder={self.remainder}, num_steps={self.num_steps}, sync_each_batch={self.sync_each_batch})"
        )
