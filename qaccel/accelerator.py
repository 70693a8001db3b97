"""The facade users hold: validates arguments, reports where this rank runs, and delegates the work."""

# pyright: reportUnnecessaryIsInstance=false
# (what users pass is checked at run time, whatever the annotations say)

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Never, TypeVar, cast

import torch

from qaccel import handlers, options
from qaccel.checkpoints import background
from qaccel.checkpoints import state as checkpoint
from qaccel.comm import collectives, ranks, session
from qaccel.environment import Environment, detect
from qaccel.errors import warn_once
from qaccel.handlers import AutocastKwargs, KwargsHandler, ProfileKwargs, TorchDynamoPlugin
from qaccel.launch import cluster, in_place, runners
from qaccel.launch.protocol import HandBack, Runner
from qaccel.nested import map_leaves
from qaccel.options import (
    Backend,
    BackendName,
    ComputeSetup,
    ComputeSetupName,
    DeviceType,
    DistributedType,
    LogSetup,
    LogSetupName,
    MixedPrecision,
    MixedPrecisionName,
    SlurmCluster,
    StartMethod,
    StartMethodName,
    Strategy,
    StrategyName,
)
from qaccel.train import (
    batch,
    gradients,
    precision,
    prepare,
    profiling,
    progress,
    seeding,
    sharding,
    stopping,
    strategies,
)
from qaccel.train.batch_size import release_memory
from qaccel.train.registry import GradientState, Registry
from qaccel.train.uneven import overridden as uneven_batches

R = TypeVar("R")
_HAND_BACK = HandBack(in_place=prepare.plain_result, pickled=prepare.plain_object)


@options.document
class Accelerator:
    """Run a training function on ``nprocs`` ranks, or on the ranks torchrun / SLURM already started.

    Options are checked when the Accelerator is made: a bad value fails here, naming the option and what is
    allowed, before any rank starts.
    """

    def __init__(
        self,
        nprocs: int = 1,
        compute_setup: ComputeSetupName | ComputeSetup = "auto",
        log_setup: LogSetupName | LogSetup = "cpu",
        backend: BackendName | Backend | None = None,
        dtype: torch.dtype | None = None,
        *,
        timeout: float | datetime.timedelta = 1800.0,
        start_method: StartMethodName | StartMethod = "forkserver",
        gradient_accumulation_steps: int = 1,
        keep_global_batch: bool = False,
        sync_each_batch: bool = False,
        mixed_precision: MixedPrecisionName | MixedPrecision | None = None,
        split_batches: bool = False,
        even_batches: bool = True,
        dispatch_batches: bool | None = None,
        device_placement: bool = True,
        use_seedable_sampler: bool = False,
        data_seed: int | None = None,
        rng_types: Sequence[str] | None = None,
        step_scheduler_with_optimizer: bool = False,
        max_restarts: int = 0,
        strategy: StrategyName | Strategy = "ddp",
        fsdp_modules: Sequence[type | str] | None = None,
        fsdp_min_params: int = 1_000_000,
        debug: bool | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        keep_checkpoints: int | None = None,
        log_with: Any = None,
        logging_dir: str | os.PathLike[str] | None = None,
        rank_prefix: bool = False,
        kwargs_handlers: Sequence[KwargsHandler] | None = None,
        dynamo_backend: str | TorchDynamoPlugin | None = None,
        cluster: SlurmCluster | None = None,
        cpu: bool = False,
        dataloader_config: Any = None,
        gradient_accumulation_plugin: Any = None,
        project_config: Any = None,
        dynamo_plugin: Any = None,
        **accelerate_only: Never,
    ) -> None:
        """The options as declared in qaccel.options (tests/test_options.py keeps them equal), then Accelerate's
        arguments qaccel translates; any other keyword is refused at run time, naming what to do in qaccel, and
        typed ``Never`` so that a type checker reports it too."""
        given = locals()
        chosen = {name: given[name] for name in options.NAMES}
        accelerate = {name: given[name] for name in options.ACCELERATE_NAMES if given[name] not in (None, False)}
        env = detect()
        self._config = options.make_config(env, **options.from_accelerate({**accelerate, **accelerate_only}, chosen))
        nprocs, max_restarts, rank_prefix = chosen["nprocs"], chosen["max_restarts"], chosen["rank_prefix"]
        self._own_registry: Registry | None = None
        self._runner: Runner | None = runners.choose(self._config, env, _HAND_BACK)
        if env.kind.started_by_launcher and nprocs > 1 and nprocs != env.world(nprocs).size and env.rank == 0:
            _warn_world_mismatch(nprocs, env)  # once per job, not once per rank
        if env.kind.started_by_launcher and max_restarts and env.rank == 0:
            warnings.warn(
                f"Accelerator(max_restarts={max_restarts}) restarts the ranks of a plain launch only; under {env.kind} "
                "use torchrun --max-restarts, or SLURM's requeue (slurm/requeue.sbatch)",
                stacklevel=3,
            )
        if env.kind.started_by_launcher and rank_prefix and env.rank == 0:
            warnings.warn(
                f"Accelerator(rank_prefix=True) prefixes the output of a plain launch only; under {env.kind} ask the "
                "launcher: torchrun --tee 3 with TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank ${rank}] ' in its "
                "environment, or srun --label",
                stacklevel=3,
            )

    # ---- where this rank runs (valid in the caller and in every rank) ----

    def _where(self) -> Runner:
        """How fn runs from this process, chosen once per process (an Accelerator unpickled in a rank chooses
        again there)."""
        if self._runner is None:
            self._runner = runners.choose(self._config, detect(), _HAND_BACK)
        return self._runner

    @property
    def starts_ranks(self) -> bool:
        """Whether ``distribute()`` called here starts (or submits) the ranks: a plain process with ``nprocs`` > 1 or
        a ``cluster``, inside no rank. False where the ranks exist already (torchrun, srun, ..., a rank) and with
        one rank: fn then runs in place, in this process."""
        return self._where().starts_ranks

    def _ctx(self) -> session.RankContext:
        return session.current() or self._where().planned()

    def _live(self) -> session.RankContext:
        """This rank's context for what needs the ranks' group. Under torchrun or srun, code that uses the
        Accelerator outside distribute() (a script written for Accelerate) is run as this process's rank: the
        first such call joins the ranks for the rest of the process."""
        return session.current() or self._where().join() or self._where().planned()

    @property
    def rank(self) -> int:
        """This process's rank in the world (0 in the caller of a plain launch)."""
        return self._ctx().rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node; picks its GPU."""
        return self._ctx().local_rank

    @property
    def node_rank(self) -> int:
        """The index of this process's node (0 on one machine)."""
        return self._ctx().node_rank

    @property
    def world_size(self) -> int:
        """How many ranks run fn: nprocs in a plain launch, the launcher's world under torchrun or srun."""
        return self._ctx().world_size

    @property
    def device(self) -> torch.device:
        """The device this rank computes on: the GPU it sees, or ``cuda:<local_rank>`` when it sees its node's GPUs,
        or ``cpu``. A cluster job's is decided on its nodes: asked in the caller, this raises."""
        if self._config.device_type is None:
            raise self._decided("device")
        return self._ctx().device

    @property
    def log_device(self) -> torch.device:
        """Where reduced metrics land (log_setup): the compute device or the CPU."""
        return self.device if self._config.log_device_type is not DeviceType.CPU else torch.device("cpu")

    @property
    def is_main_process(self) -> bool:
        """True on rank 0: the rank that prints, saves and logs."""
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on each node's local rank 0."""
        return self.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        """True on the last rank (``world_size - 1``)."""
        return self.rank == self.world_size - 1

    @property
    def num_processes(self) -> int:
        """Accelerate's name for world_size."""
        return self.world_size

    @property
    def process_index(self) -> int:
        """Accelerate's name for rank."""
        return self.rank

    @property
    def local_process_index(self) -> int:
        """Accelerate's name for local_rank."""
        return self.local_rank

    @property
    def backend(self) -> Backend:
        """The process group's backend, resolved: ``gloo``, ``nccl`` or ``mpi`` (a cluster job's, left to choose:
        decided on its nodes)."""
        if self._config.backend is None:
            raise self._decided("backend")
        return self._config.backend

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype models and floating-point batches are cast to, or None."""
        return self._config.dtype

    @property
    def nprocs(self) -> int:
        """The ranks a plain launch starts (as given)."""
        return self._config.nprocs

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer update under ``accumulate()``: the option, or what a resume with
        ``keep_global_batch`` set to keep the checkpoint's global batch."""
        run = session.current_run()
        registry = run.state_for(self, lambda: self._new_registry(run)) if run is not None else self._own_registry
        return self._config.gradient_accumulation_steps if registry is None else registry.accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        """Change the micro-steps per update from here on, as Accelerate's setter does (its automatic gradient
        accumulation example sets it after a smaller batch size was found)."""
        steps = options.count("gradient_accumulation_steps", steps, 1)
        self._config = dataclasses.replace(self._config, gradient_accumulation_steps=steps)
        run = session.current_run()
        registry = run.state_for(self, lambda: self._new_registry(run)) if run is not None else self._own_registry
        if registry is not None:
            registry.accumulation_steps = steps

    @property
    def split_batches(self) -> bool:
        """Whether a prepared DataLoader's batch is the batch of all ranks together, sliced per rank."""
        return self._config.split_batches

    @property
    def even_batches(self) -> bool:
        """Whether prepared DataLoaders pad the last step so that every rank takes the same number of batches."""
        return self._config.even_batches

    @property
    def dispatch_batches(self) -> bool:
        """Whether only rank 0 reads prepared DataLoaders and sends every rank its batch."""
        return self._config.dispatch_batches

    @property
    def mixed_precision(self) -> MixedPrecision:
        """``no``, ``bf16`` or ``fp16``."""
        return self._config.mixed_precision

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's name for how this rank trains: ``NO`` alone, ``FSDP`` sharded, else ``MULTI_GPU`` or
        ``MULTI_CPU``."""
        if self.world_size == 1:
            return DistributedType.NO
        kind = strategies.of(self.strategy).distributed_type(self.device)
        assert kind is not None  # a rank's device is known
        return kind

    @property
    def use_distributed(self) -> bool:
        """Accelerate's: whether more than one rank trains."""
        return self.world_size > 1

    @property
    def project_dir(self) -> str | None:
        """The folder given as ``project_dir`` (absolute), where save_state() and resume() without a folder keep
        ``checkpoints``."""
        return self._config.project_dir

    @property
    def logging_dir(self) -> str | None:
        """Where the trackers of ``log_with`` write (absolute): the option ``logging_dir``, else ``project_dir``."""
        return self._config.logging_dir

    @property
    def state(self) -> AcceleratorState:
        """Accelerate's ``state``: where this rank runs, by Accelerate's names, as of now. In a cluster job's caller,
        what its nodes decide says ``"decided on the nodes"``."""
        if self._config.device_type is not None:
            return AcceleratorState(
                self.distributed_type,
                self.num_processes,
                self.process_index,
                self.local_process_index,
                self.device,
                self.mixed_precision,
                self.backend,
                self.debug,
            )
        on_nodes = options.ON_THE_NODES
        return AcceleratorState(
            strategies.of(self.strategy).distributed_type(None) or on_nodes,
            self.num_processes,
            self.process_index,
            self.local_process_index,
            on_nodes,
            self.mixed_precision,
            self._config.backend or on_nodes,
            self.debug,
        )

    def _decided(self, what: str) -> RuntimeError:
        """The error for ``what``, read where a cluster job's nodes decide it, not here."""
        return RuntimeError(
            f"Accelerator.{what} is {options.ON_THE_NODES}: this Accelerator's ranks are the tasks of a SLURM job "
            "(cluster=...), and each decides its device, backend and precision where it runs, from the GPUs it "
            f"sees there; read acc.{what} inside the function you distribute"
        )

    @property
    def strategy(self) -> Strategy:
        """``ddp`` or ``fsdp``."""
        return self._config.strategy

    @property
    def debug(self) -> bool:
        """Whether qaccel collectives check first that every rank calls the same one: in a running session, what
        the session was started with (the launching Accelerator's option); elsewhere this Accelerator's option."""
        run = session.current_run()
        return run.debug if run is not None else self._config.debug

    @property
    def max_restarts(self) -> int:
        """How many times a plain launch restarts all ranks after a failure."""
        return self._config.max_restarts

    @property
    def restart_count(self) -> int:
        """How many times the ranks were restarted after a failure: torchrun's, or qaccel's own in a plain launch
        (``TORCHELASTIC_RESTART_COUNT`` in both). 0 in the first attempt and in the caller."""
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (of the first prepared optimizer), counting those before a resume."""
        return self._registry().updates

    def __getstate__(self) -> dict[str, Any]:
        # step state (scaler, counters) and the runner chosen belong to one process
        return {**self.__dict__, "_own_registry": None, "_runner": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._config.device_type is None and session.current() is not None:
            self._config = options.on_node(self._config, detect())  # a cluster job's rank: the node decides

    def __repr__(self) -> str:
        ctx, state = self._ctx(), self.state
        return (
            f"Accelerator(rank={ctx.rank}, world_size={ctx.world_size}, device={str(state.device)!r}, "
            f"backend={str(state.backend)!r}, dtype={self.dtype})"
        )

    # ---- running a function ----

    def distribute(self, fn: Callable[..., R], *, all_results: bool = False) -> Callable[..., Any]:
        """Wrap ``fn`` so that calling it runs it on every rank; returns rank 0's result (or all, by rank).

        Usable as ``acc.distribute(fn)(*args)`` or as a decorator. In a plain process with nprocs > 1 it
        starts the ranks; under torchrun, srun or an initialised group it runs here, as this process's rank.
        """
        if not callable(fn):
            raise TypeError(f"distribute() needs a callable; got {type(fn).__name__}")

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            return self._run(fn, args, kwargs, all_results)

        return run

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> cluster.SlurmJob:
        """Submit ``fn(*args, **kwargs)`` to the ``cluster`` as one SLURM job and return at once a handle to it
        (``job_id``, ``state``, ``result()``, ``results()``, ``cancel()``, ``logs()``)."""
        if self._config.cluster is None:
            raise ValueError(
                "submit() needs Accelerator(cluster=qaccel.SlurmCluster(...)); without a cluster use distribute()"
            )
        return cluster.submit(fn, args, kwargs, self._config, self._config.cluster, _HAND_BACK.in_place)

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], all_results: bool) -> Any:
        return self._where().run(fn, args, kwargs, all_results)

    # ---- collectives (identity in a single process) ----

    def all_reduce_dict(self, values: Mapping[str, Any], op: str = "mean") -> dict[str, Any]:
        """Reduce metrics over ranks: "mean", "sum", "max" or "min"; one collective per dtype."""
        return collectives.all_reduce_dict(values, op, self._live(), self.log_device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Every rank gets rank ``src``'s object."""
        return collectives.broadcast(obj, src, self._live())

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank gets the ranks' lists (or other iterables) concatenated in rank order, as in Accelerate:
        ``gather_object([x])`` is every rank's ``x``, indexed by rank."""
        if isinstance(obj, (str, bytes)) or not isinstance(obj, Iterable):
            raise TypeError(
                f"gather_object() concatenates the ranks' lists, as Accelerate's does; got a "
                f"{type(obj).__name__}: gather_object([obj]) gives one entry per rank"
            )
        return [item for part in collectives.gather_object(obj, self._live()) for item in part]

    def wait_for_everyone(self) -> None:
        """Barrier: block until every rank gets here."""
        collectives.wait_for_everyone(self._live())

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        collectives.main_print(self._ctx(), *args, **kwargs)

    def progress(
        self, iterable: Iterable[R], desc: str | None = None, total: int | None = None, **options: Any
    ) -> Iterable[R]:
        """A progress bar over ``iterable`` on the main process only (tqdm if installed, else a status line)."""
        return progress.progress(iterable, self._ctx(), desc, total, **options)

    def gather(self, data: Any) -> Any:
        """All ranks' tensors concatenated on dim 0 (sizes may differ by rank); nested structures too."""
        return collectives.gather(data, self._live())

    def gather_for_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        """Like gather, minus the samples duplicated to even out the last batches: exact counts. A list of other
        objects than tensors (or ``use_gather_object=True``) goes through gather_object, as in Accelerate.
        Not in the loop of a loader whose ranks take different numbers of steps (even_batches=False)."""
        marks = self._registry().marks
        if marks.steps is not None:
            raise RuntimeError(
                f"gather_for_metrics() needs every rank in every step of the loop; with "
                f"even_batches=False this epoch's ranks take {marks.steps} steps: collect per rank "
                "and gather_object() after the loop, or keep even_batches=True (its padding is "
                "left out of gather_for_metrics)"
            )
        remainder = marks.remainder
        if use_gather_object or (
            isinstance(data, list) and not all(isinstance(x, torch.Tensor) for x in cast("list[object]", data))
        ):
            gathered = self.gather_object(data)
            return gathered if remainder is None else gathered[:remainder]
        return collectives.gather_for_metrics(data, self._live(), remainder)

    def pad_across_processes(self, data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad tensors along ``dim`` to the largest size any rank has."""
        return collectives.pad_across_processes(data, self._live(), dim, pad_index, pad_first)

    def reduce(self, data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """All-reduce tensors (Accelerate's signature): ``reduction`` "sum", "mean", "max" or "min", the results
        multiplied by ``scale``; returns new tensors."""
        reduced = collectives.reduce(data, reduction, self._live())
        return reduced if scale == 1.0 else map_leaves(reduced, lambda tensor: tensor * scale)

    # ---- rank coordination, seeds, saving ----

    def set_seed(self, seed: int, device_specific: bool = False) -> None:
        """Seed python, numpy and torch (CUDA too); ``device_specific`` adds the rank so ranks differ."""
        seeding.set_seed(seed + self.rank if device_specific else seed)

    def main_process_first(self) -> Any:
        """Context: the main process runs the block first (e.g. to download or cache), then the others."""
        return ranks.main_process_first(self._live(), local=False)

    def local_main_process_first(self) -> Any:
        """Context: each node's local main process runs the block first, then that node's others."""
        return ranks.main_process_first(self._live(), local=True)

    def split_between_processes(self, obj: Any, apply_padding: bool = False) -> Any:
        """Context yielding this rank's contiguous share of a list, tuple or tensor (dim 0), or of every value of
        a dict; ``apply_padding`` repeats the last item so that every share has the longest share's length."""
        return ranks.split_between_processes(obj, self._live(), apply_padding)

    def on_main_process(self, fn: Callable[..., R]) -> Callable[..., R | None]:
        """Decorator: run ``fn`` on the main process only (elsewhere a call returns None)."""
        return ranks.run_on(fn, lambda: self.is_main_process)

    def on_local_main_process(self, fn: Callable[..., R]) -> Callable[..., R | None]:
        """Decorator: run ``fn`` on each node's local main process only."""
        return ranks.run_on(fn, lambda: self.is_local_main_process)

    def on_last_process(self, fn: Callable[..., R]) -> Callable[..., R | None]:
        """Decorator: run ``fn`` on the last rank only."""
        return ranks.run_on(fn, lambda: self.is_last_process)

    def on_process(self, fn: Callable[..., R] | None = None, process_index: int | None = None) -> Any:
        """Decorator: run ``fn`` on rank ``process_index`` only; ``@acc.on_process(process_index=1)`` too."""
        if fn is None:
            return functools.partial(self.on_process, process_index=process_index)
        _check_rank("process_index", process_index)
        return ranks.run_on(fn, lambda: self.rank == process_index)

    def on_local_process(self, fn: Callable[..., R] | None = None, local_process_index: int | None = None) -> Any:
        """Decorator: run ``fn`` on local rank ``local_process_index`` of each node only."""
        if fn is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        _check_rank("local_process_index", local_process_index)
        return ranks.run_on(fn, lambda: self.local_rank == local_process_index)

    def set_trigger(self) -> None:
        """Raise this rank's flag; the next check_trigger() returns True on every rank (early stopping, say)."""
        self._registry().trigger = True

    def check_trigger(self) -> bool:
        """Whether any rank called set_trigger() since the last check that saw one; every rank gets the same answer
        (one all-reduce: every rank must call it) and the flags are lowered when it is True."""
        registry = self._registry()
        if not ranks.any_rank(registry.trigger, self._live()):
            return False
        registry.trigger = False
        return True

    def synchronize_rng_states(
        self, rng_types: Iterable[str] = ("torch", "cuda"), generator: torch.Generator | None = None
    ) -> None:
        """Give every rank rank 0's state of the generators in ``rng_types``: ``"torch"`` (the global CPU one),
        ``"cuda"`` (this rank's device; skipped on CPU), ``"generator"`` (``generator``)."""
        seeding.synchronize_rng_states(rng_types, generator, self._live())

    def save(self, obj: Any, path: str | os.PathLike[str]) -> None:
        """``torch.save`` on the main process only, atomically (a crash never leaves a half-written file)."""
        checkpoint.save(obj, path, self._live())

    def save_state(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        keep: int | None = None,
        background: bool = False,
        safe_serialization: bool = True,
    ) -> str:
        """Checkpoint prepared models, optimizers, LR schedulers and loaders, the fp16 scaler, every rank's RNG
        states, registered objects and the step count, atomically; returns the checkpoint's path. Call it on
        every rank. ``safe_serialization`` (Accelerate's) changes nothing: the files are qaccel's, checksummed.

        ``keep=K`` makes ``directory`` a folder of checkpoints named by step (``checkpoint_<step>``) of which the
        K newest stay. Without a directory, it saves into the folder given to resume(), keeping as many as it said,
        or else numbered into ``<project_dir>/checkpoints``.

        ``background=True`` returns once the state is copied aside (one copy of it in CPU memory, kept for the next
        background save to copy into until free_memory() or the end of the call) and writes the files while
        training goes on: the checkpoint is complete when its marker is written, as any. One save at a time: the
        next save, a load and the end of the call wait for it. A failure is raised on every rank at a prepared
        optimizer's step() once every rank's save ended, or by the next save, load, wait_for_checkpoint() or the
        end of the distribute() call. Any other failure of a save or a load is raised on every rank at once, the
        same exception with a note naming the rank and where it failed.
        """
        if not isinstance(background, bool):
            raise TypeError(f"background must be True or False; got {background!r}")
        registry = self._registry()
        numbered = keep is not None
        if directory is None:
            directory, resume_keep = self._checkpoints("save_state()")
            keep, numbered = resume_keep if keep is None else keep, True
        return checkpoint.save_state(directory, registry, self._live(), _keep(keep), numbered, background)

    def wait_for_checkpoint(self) -> str | None:
        """Wait for the save_state(background=True) in flight: its checkpoint's path, complete now (None when no
        save is in flight), or the save's failure raised. Call it on every rank."""
        return background.wait(self._registry())

    def load_state(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        missing_ok: bool = False,
        allow_pickle: bool | None = None,
    ) -> str | None:
        """Restore a save_state() checkpoint into the objects prepared (and registered) in this run, in order.

        ``directory`` is a checkpoint, or a folder of them whose newest complete one is read (a half-written
        one never is). Returns the path read; with ``missing_ok``, None if there is none yet. A damaged checkpoint
        (a file cut short, changed or missing), or one written for other objects, raises CheckpointError on every
        rank, and nothing is loaded.

        Files are read as plain data (``torch.load(weights_only=True)``). What needs full unpickling, which can run
        code (a registered object's state holding objects of your classes, a sharded checkpoint's metadata), is
        read only from a folder no one but you can write, unless ``allow_pickle=True``; ``False``: never.
        """
        registry = self._registry()
        if directory is None:
            directory = self._checkpoints("load_state()")[0]
        return checkpoint.load_state(directory, registry, self._live(), missing_ok, allow_pickle=allow_pickle)

    def _checkpoints(self, caller: str) -> tuple[str, int | None]:
        """Where save_state() and load_state() without a folder go: resume()'s folder and keep, else the project's
        checkpoints folder (all kept)."""
        registry = self._registry()
        if registry.checkpoints is not None:
            return registry.checkpoints
        if self._config.project_dir is not None:
            return os.path.join(self._config.project_dir, "checkpoints"), self._config.keep_checkpoints
        raise ValueError(
            f"{caller} needs a directory, a resume(directory) call before it, or Accelerator(project_dir=...)"
        )

    def resume(
        self,
        directory: str | os.PathLike[str] | None = None,
        keep: int | None = 3,
        *,
        requeue_signal: int | str | None = "SIGUSR1",
        allow_pickle: bool | None = None,
    ) -> str | None:
        """Make ``directory`` this run's checkpoint folder, continue from its newest intact checkpoint if there is
        one, and stop cleanly on a signal. Returns the checkpoint loaded (None on a first start).

        Damaged checkpoints are skipped, with a warning naming them; if every one is damaged, CheckpointError.
        Without a directory: ``<project_dir>/checkpoints``. ``allow_pickle``: see load_state().

        Afterwards save_state() with no argument saves into ``directory`` as ``checkpoint_<step>``, keeping the
        ``keep`` newest (None: all). On SIGTERM, Ctrl-C (a second one stops at once) or ``requeue_signal`` every rank
        finishes the work under way (a step, an evaluation, a checkpoint) and stops before its next step, or as fn
        returns: the state is saved there, and Preempted (a SystemExit) is raised; after ``requeue_signal`` in a SLURM
        job, rank 0 also requeues the job (``scontrol requeue``), which then resumes here. The stop ends with the
        distribute() call this runs in. Call it on every rank, after prepare() and register_for_checkpointing(),
        before the loop; iterate ``range(loader.epoch, epochs)``.
        """
        self._inside_ranks("resume()", "the ranks would neither load its checkpoint nor stop together on a signal")
        keep = _keep(keep)
        if directory is None:
            if self._config.project_dir is None:
                raise ValueError("resume() needs a directory, or Accelerator(project_dir=...)")
            directory = os.path.join(self._config.project_dir, "checkpoints")
        requeue = None if requeue_signal is None else stopping.as_signal(requeue_signal, "requeue_signal")
        registry, ctx = self._registry(), self._live()
        registry.checkpoints = (os.fspath(directory), keep)
        loaded = checkpoint.load_state(
            directory, registry, ctx, missing_ok=True, fall_back=True, allow_pickle=allow_pickle
        )
        if loaded is not None and ctx.rank == 0:
            # one write: the ranks of torchrun or srun may share this stream
            sys.stderr.write(checkpoint.resumed_line(loaded, registry, ctx) + "\n")
            sys.stderr.flush()
        if registry.stopper is None:
            registry.stopper = stopping.Stopper(ctx, self._save_at_stop, requeue, self._config.timeout)
            for loader in registry.loaders:
                stopping.shield_workers(loader)
            run = session.current_run()
            if run is not None:
                run.at_call_end(functools.partial(_end_stop, registry))
        return loaded

    def _save_at_stop(self) -> str:
        """A stop's save: blocking, after the background save in flight, whose failure is said, not raised (the
        state at the stop is what the next run needs)."""
        background.settle(self._registry())
        return self.save_state()

    def register_for_checkpointing(self, *objs: Any) -> None:
        """Add objects with state_dict()/load_state_dict() to what save_state() writes."""
        for obj in objs:
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(
                    f"register_for_checkpointing needs state_dict() and load_state_dict(); {type(obj).__name__} lacks them"
                )
        self._registry().registered.extend(objs)

    def skip_first_batches(self, dataloader: Any, num_batches: int) -> Any:
        """The prepared ``dataloader``, set to pass over its first ``num_batches`` next epoch (to resume)."""
        if not hasattr(dataloader, "skip_first_batches"):
            raise TypeError("skip_first_batches() takes a DataLoader returned by prepare()")
        dataloader.skip_first_batches(num_batches)
        return dataloader

    def end_training(self) -> None:
        """Close the trackers init_trackers() started (wandb's finish, MLflow's run ended) and wait for every
        rank to finish. Outside distribute() under torchrun or srun, also end the ranks' session (the process
        group), as Accelerate's does; in distribute() the session ends with fn."""
        self._registry().trackers.close()
        self.wait_for_everyone()
        in_place.end_ambient()

    # ---- Accelerate's experiment trackers (log_with; qaccel/tracking/trackers.py) ----

    def init_trackers(
        self,
        project_name: str,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Start the trackers of ``log_with`` for ``project_name`` on the main process, ``config`` stored as the
        run's hyperparameters; ``init_kwargs`` gives, by tracker name, wandb.init's arguments, the SummaryWriter's
        of ``get_tracker("tensorboard", unwrap=True)``, or MLflow's ``run_name``, ``tags`` and ``description``.
        Call it on every rank. After load_state() or resume(), or before them, the trackers continue the runs the
        checkpoint recorded (save_state() records them), without the steps logged after it."""
        self._registry().trackers.init(
            self._config.log_with, project_name, config, init_kwargs, self._config.logging_dir, self.is_main_process
        )

    def log(
        self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, dict[str, Any]] | None = None
    ) -> None:
        """Write ``values`` at ``step`` to every tracker, on the main process only (None: the step after the last
        one logged); ``log_kwargs`` gives, by tracker name, more arguments (wandb's ``run.log`` takes them)."""
        self._registry().trackers.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker named ``name`` (``unwrap``: the tool's own object: SummaryWriter, wandb Run,
        ``mlflow.ActiveRun``); on the other ranks one whose every method does nothing."""
        return self._registry().trackers.get(name, unwrap)

    @property
    def trackers(self) -> list[Any]:
        """The trackers init_trackers() started, on the main process (an empty list elsewhere)."""
        return self._registry().trackers.trackers

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget what this Accelerator prepared in the session (its step count restarts) and the background saves'
        copy of the state, collect garbage and give the GPU's cached memory back; returns one None per object, to rebind the caller's names (Accelerate's).
        Call it before preparing anew, e.g. in a function retried by find_executable_batch_size."""
        run = session.current_run()
        if run is not None:
            run.forget(self)
        elif self._own_registry is not None:
            self._own_registry.release()
            self._own_registry = None
        release_memory()
        return [None] * len(objects)

    clear = free_memory

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The model's state dict without DDP's ``module.`` prefixes, loadable into the plain model. Under
        strategy="fsdp" it gathers the shards: call it on every rank; the main process gets the dict, others {}."""
        return checkpoint.get_state_dict(model)

    def save_model(self, model: torch.nn.Module, directory: str | os.PathLike[str]) -> None:
        """Write ``get_state_dict(model)`` to ``directory/model.pt`` from the main process, atomically (call it on
        every rank under strategy="fsdp": the shards are gathered first)."""
        checkpoint.save_model(model, directory, self._live())

    # ---- preparation ----

    def prepare(self, *objs: Any, device_placement: Sequence[bool] | None = None) -> Any:
        """Models to device/dtype (DDP-wrapped, or sharded with FSDP2 under strategy="fsdp"), optimizers
        alongside, DataLoaders sharded; one in, one out.

        Several objects come back as a tuple in the same order; anything else passes through unchanged.
        LR schedulers come back as they are: step them as before, once per optimizer step. Accelerate steps
        prepared schedulers for you instead; ``step_scheduler_with_optimizer=True`` wraps them to do the same.
        ``device_placement``: one bool per object (None: the option), as Accelerate's.
        """
        places = options.placements(device_placement, len(objs))
        self._inside_ranks("prepare()", "every rank would get rank 0's shard")
        ctx = self._live()
        registry = self._registry()
        out = tuple(prepare.prepare_one(obj, ctx, self._config, registry, place) for obj, place in zip(objs, places))
        return out[0] if len(out) == 1 else out

    def _inside_ranks(self, what: str, why: str) -> None:
        """Raise if ``what`` (the method called) runs in the caller of a launch that starts ranks: it would act for
        rank 0 only (``why``: what would go wrong)."""
        if session.current() is None and self.starts_ranks:
            raise RuntimeError(
                f"{what} must run inside the function you distribute: here, in the caller, it would act for rank 0 "
                f"only ({why})"
            )

    # ---- the training step ----

    def _registry(self) -> Registry:
        """This Accelerator's step state in the running session (its own outside any session)."""
        if session.current() is None:
            self._where().join()
        run = session.current_run()
        if run is not None:
            return run.state_for(self, lambda: self._new_registry(run))
        if self._own_registry is None:
            self._own_registry = self._new_registry()
        return self._own_registry

    def _new_registry(self, run: session.Run | None = None) -> Registry:
        registry = Registry(
            self._config.gradient_accumulation_steps,
            precision.make_scaler(self.mixed_precision, self._config.handlers.scaler),
            self._config.sync_each_batch,
            keep_global_batch=self._config.keep_global_batch,
        )
        if run is not None:
            run.closers.append(registry.release)
        return registry

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided over gradient accumulation steps and scaled under fp16."""
        gradients.backward(loss, self._registry(), **kwargs)

    def accumulate(self, *models: torch.nn.Module) -> Any:
        """Context for one micro-step: gradients sync (and optimizers step) every
        ``gradient_accumulation_steps`` micro-steps and on the last batch of an epoch; DDP ``no_sync`` otherwise."""
        return gradients.accumulate(models, self._registry())

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-step synchronises gradients and updates (False on accumulation steps)."""
        return self._registry().sync_gradients

    @property
    def gradient_state(self) -> GradientState:
        """Accelerate's ``gradient_state``: ``sync_gradients``, ``end_of_dataloader``, ``remainder``,
        ``in_dataloader``, ``num_steps``, ``sync_each_batch``."""
        return GradientState(self._registry())

    def join_uneven_inputs(self, joinables: Iterable[Any] = (), even_batches: bool | None = None) -> Any:
        """Accelerate's: inside the block, prepared DataLoaders take ``even_batches`` (default False: no padding,
        ranks may take different numbers of steps). Their steps are made safe as the option ``even_batches=False``
        makes them, the prepared DDP models joined for you, so ``joinables`` is not needed."""
        return uneven_batches(
            self._registry(), self._config, self._config.even_batches if even_batches is None else even_batches
        )

    def no_sync(self, *models: torch.nn.Module) -> Any:
        """Context: the block's backward passes keep gradients local (DDP ``no_sync``; FSDP: no reduce-scatter);
        the first backward outside it synchronises what was accumulated."""
        return gradients.no_sync(models)

    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Any:
        """Context: inside ``no_sync()``, make the block's backward synchronise this DDP model's gradients
        anyway."""
        return gradients.sync_in_backward(model)

    @property
    def padding_in_batch(self) -> int:
        """How many samples at the end of this rank's current batch of a prepared DataLoader are padding: repeats
        of the epoch's first samples that give every rank a full batch in the last step (0 for every other
        batch). They train like any sample; leave them out of what counts samples (evaluation sums;
        gather_for_metrics does so itself)."""
        return self._registry().marks.padding

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the fp16 scaler skipped the last optimizer step (inf/nan gradients)."""
        return any(opt.step_was_skipped for opt in self._registry().optimizers)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """fp16's gradient scaler (saved by save_state); None without fp16."""
        return self._registry().scaler

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Any:
        """Context running its block in the configured mixed precision (a no-op for "no"), with the
        ``AutocastKwargs`` given here or in ``kwargs_handlers``.

        Prepared models already run their forward under it; use this for other computations.
        """
        settings = (
            self._config.handlers.autocast
            if autocast_handler is None
            else handlers.resolve([autocast_handler])[0].autocast
        )
        return precision.autocast(self.mixed_precision, self.device, settings)

    def profile(self, profile_handler: ProfileKwargs | None = None) -> Any:
        """Context profiling its block with ``torch.profiler`` (the ``ProfileKwargs`` given here or in
        ``kwargs_handlers``); yields the profiler. With ``output_trace_dir`` every rank writes its Chrome trace
        there (``profile_<rank>.json``) and the ranks wait for each other at the end."""
        chosen = (
            self._config.handlers.profile if profile_handler is None else handlers.resolve([profile_handler])[0].profile
        )
        return profiling.profile(chosen or ProfileKwargs(), self._live())

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip gradients by total norm (unscaled first under fp16); the norm, or None on accumulation steps."""
        return gradients.clip(sharding.clip_grad_norm_, parameters, self._registry(), max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clip gradients elementwise (unscaled first under fp16); skipped on accumulation steps."""
        gradients.clip(torch.nn.utils.clip_grad_value_, parameters, self._registry(), clip_value)

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        """The user's module inside the DDP wrapper prepare() added. ``keep_fp32_wrapper=False`` takes mixed
        precision's autocast off its forward, ``keep_torch_compile=False`` the compilation of ``dynamo_backend``
        (in place, as Accelerate's: the prepared model loses them too); a module you compiled yourself
        (``torch.compile(module)``) then gives the module inside."""
        return prepare.unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def prepare_batch(self, data: Any) -> Any:
        """Move a batch to this rank's device, casting floating-point tensors to ``dtype``; labels keep theirs. A list
        (what a DataLoader gives for a TensorDataset) comes back as a tuple, as from qadence's and perceptrain's;
        the containers inside keep their types."""
        prepared = batch.prepare_batch(data, self.device, self.dtype)
        return tuple(prepared) if type(data) is list else prepared


@dataclasses.dataclass(frozen=True)
class AcceleratorState:
    """What Accelerate's ``accelerator.state`` tells about a rank, under its names (a snapshot)."""

    distributed_type: DistributedType | str
    num_processes: int
    process_index: int
    local_process_index: int
    device: torch.device | str  # str: in a cluster job's caller, options.ON_THE_NODES
    mixed_precision: MixedPrecision
    backend: Backend | str
    debug: bool

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1


def _end_stop(registry: Registry, finished: bool) -> None:
    """End the stop on a signal that resume() armed, with the distribute() call it was armed in."""
    stopper, registry.stopper = registry.stopper, None
    if stopper is not None:
        stopper.close(finished)


def _keep(keep: int | None) -> int | None:
    return None if keep is None else options.count("keep", keep, 1, "checkpoints to keep; None keeps all")


def _warn_world_mismatch(nprocs: int, env: Environment) -> None:
    warn_once(
        ("world mismatch", str(env.kind), str(nprocs), str(env.world_size)),
        f"Accelerator(nprocs={nprocs}) but {env.kind} started {env.world_size} ranks; following {env.kind}",
        stacklevel=3,
    )


def _check_rank(name: str, index: Any) -> None:
    options.count(name, index, 0, "a rank")
