"""The Accelerator's options, declared once: each option's name, type, default, allowed values and meaning.

The Accelerator's ``__init__`` writes the same parameters out, for type checkers and IDEs (tests/test_options.py
keeps the two equal); its docstring's argument list and the docs' option table are generated from here
(``docs.py``), ``TrainConfig`` inherits the fields, and ``make_config`` checks exactly these names."""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qaccel.handlers import KwargsHandler, TorchDynamoPlugin
from qaccel.options.cluster import SlurmCluster
from qaccel.options.kinds import (
    Backend,
    BackendName,
    ComputeSetup,
    ComputeSetupName,
    LogSetup,
    LogSetupName,
    MixedPrecision,
    MixedPrecisionName,
    StartMethod,
    StartMethodName,
    Strategy,
    StrategyName,
)

FSDP_MIN_PARAMS = 1_000_000


def option(default: Any, values: str, meaning: str, *, positional: bool = False) -> Any:
    """One option's entry in ``Options``: its default, its allowed values (for people) and what it does;
    ``positional``: the Accelerator takes it by position too (the first few)."""
    return dataclasses.field(
        default=default, kw_only=True, metadata={"values": values, "meaning": meaning, "positional": positional}
    )


@dataclass
class Options:
    """The Accelerator's options, declared once. The Accelerator's signature and docstring, ``TrainConfig`` (which
    inherits them as fields), the resolved ``Config`` (a subclass) and the docs' option table all come from these
    fields: a new option is one entry here, and its checks in ``make_config``."""

    nprocs: int = option(
        1,
        "int ≥ 1",
        "ranks to start when run as a plain `python script.py`; under torchrun or srun the launcher's world size wins",
        positional=True,
    )
    compute_setup: ComputeSetupName | ComputeSetup = option(
        "auto",
        "`auto`, `cpu`, `gpu`",
        "`auto`: a GPU per rank if the ranks see GPUs, else the CPU, decided where the ranks run (a cluster job's "
        "nodes)",
        positional=True,
    )
    log_setup: LogSetupName | LogSetup = option(
        "cpu", "`cpu`, `auto`", "where reduced metrics land: `cpu`, or `auto` (the compute device)", positional=True
    )
    backend: BackendName | Backend | None = option(
        None,
        "`None`, `gloo`, `nccl`, `mpi`",
        "`None`: nccl for GPU, gloo for CPU; `mpi` only if torch was built with it",
        positional=True,
    )
    dtype: torch.dtype | None = option(
        None,
        "a floating-point or complex `torch.dtype`, or `None`",
        "cast models and the floating-point tensors of batches to it; complex tensors stay complex at its precision",
        positional=True,
    )
    timeout: float | datetime.timedelta = option(
        1800.0,
        "seconds or a `timedelta`",
        "how long a collective or the rendezvous may wait before failing (and saying where each rank is)",
    )
    start_method: StartMethodName | StartMethod = option(
        "forkserver",
        "`forkserver`, `spawn`",
        "how a plain launch starts ranks: forked from a server with torch imported (fast, CUDA-safe), or a fresh "
        "interpreter each",
    )
    gradient_accumulation_steps: int = option(1, "int ≥ 1", "micro-steps per optimizer update under `accumulate()`")
    keep_global_batch: bool = option(
        False,
        "`True`, `False`",
        "on resuming a checkpoint written by another number of ranks, keep its global batch (batch per rank x ranks"
        " x micro-steps) by scaling gradient accumulation (4 ranks to 2: twice the micro-steps); a world that "
        "cannot keep it fails at resume. Needs the step inside `accumulate()`; split batches keep the global batch "
        "without it",
    )
    sync_each_batch: bool = option(
        False,
        "`True`, `False`",
        "under `accumulate()`, synchronise (reduce) gradients on every micro-step instead of holding them unreduced"
        " until the update: more communication, less memory (FSDP keeps only gradient shards)",
    )
    mixed_precision: MixedPrecisionName | MixedPrecision | None = option(
        None,
        "`None`, `no`, `bf16`, `fp16`",
        "autocast of prepared models' forward; `bf16` on CPU and CUDA, `fp16` on CUDA with a gradient scaler. "
        "`None`: `ACCELERATE_MIXED_PRECISION` if set (what Accelerate's launchers and "
        "`notebook_launcher(mixed_precision=...)` tell the ranks), else `no`",
    )
    split_batches: bool = option(
        False,
        "`True`, `False`",
        "prepared DataLoaders' batch size is the batch of all ranks together, of which each rank takes its slice "
        "(Accelerate's `split_batches`); it must divide by the world size",
    )
    even_batches: bool = option(
        True,
        "`True`, `False`",
        "`True`: a prepared DataLoader's last step is padded with the epoch's first samples, so that every rank "
        "takes the same number of full batches; `False`: no padding, ranks may take different numbers of steps "
        "(Accelerate's `even_batches`; DDP only, and with gradient accumulation only with `sync_each_batch`)",
    )
    dispatch_batches: bool | None = option(
        None,
        "`None`, `True`, `False`",
        "`True`: only rank 0 reads a prepared DataLoader (its dataset, sampler and workers) and sends every rank "
        "its batch, the same batch it would have read itself; `None`/`False`: each rank reads its own (Accelerate's"
        " `None` dispatches an `IterableDataset`)",
    )
    device_placement: bool = option(
        True,
        "`True`, `False`",
        "`prepare()` puts models, optimizer state and the batches of DataLoaders on this rank's device; `False` "
        "leaves them where they are (Accelerate's `device_placement`; `prepare(..., device_placement=[...])` "
        "chooses per object)",
    )
    use_seedable_sampler: bool = option(
        False,
        "`True`, `False`",
        "how a prepared DataLoader's shuffled order is drawn, as Accelerate's: `False`, from the sampler's "
        "generator (your DataLoader's `generator`, or one seeded from torch's global RNG), given rank 0's state as "
        "each epoch starts and advanced by it, so that re-seeding your generator re-orders; `True`, epoch `e` from "
        "the seed `data_seed + e` (`data_seed` unset: torch's initial seed on rank 0). Either way a checkpoint "
        "holds what the order needs: a resumed run goes on in it",
    )
    data_seed: int | None = option(
        None,
        "`None` or an int ≥ 0",
        "with `use_seedable_sampler=True`, the shuffling seed (Accelerate's `DataLoaderConfiguration(data_seed=...)`)",
    )
    rng_types: Sequence[str] | None = option(
        None,
        "`None` or a list of `torch`, `cuda`, `generator`",
        "the generators every rank gets rank 0's state of as each epoch of a prepared DataLoader starts, as "
        "Accelerate's `rng_types`: `generator` is the one its shuffled order is drawn from, `torch` and `cuda` the "
        "global ones; `None`: `generator`",
    )
    step_scheduler_with_optimizer: bool = option(
        False,
        "`True`, `False`",
        "`True`: a prepared LR scheduler's `step()` does nothing on accumulation micro-steps or when fp16 skipped "
        "the update, and steps once per rank on an update (once with `split_batches`), as Accelerate's does by "
        "default: for a schedule sized on the unprepared DataLoader's length; `False`: prepared schedulers are "
        "yours, step them once per update",
    )
    max_restarts: int = option(
        0,
        "int ≥ 0",
        "in a plain launch, how many times to restart all ranks after a rank fails (with `resume()` they continue "
        "from the newest checkpoint); under torchrun and srun the launcher's own restarts and requeues apply "
        "instead",
    )
    strategy: StrategyName | Strategy = option(
        "ddp",
        "`ddp`, `fsdp`",
        "`ddp`: every rank holds the whole model, gradients are all-reduced; `fsdp`: torch's FSDP2, parameters, "
        "gradients and optimizer state sharded over the ranks",
    )
    fsdp_modules: Sequence[type | str] | None = option(
        None,
        "module classes or class names, or `None`",
        "with `fsdp`, the classes sharded as units of their own (e.g. your transformer block); `None`: every "
        "submodule holding `fsdp_min_params` parameters not already in a unit",
    )
    fsdp_min_params: int = option(
        FSDP_MIN_PARAMS, "int ≥ 1", "the size rule's threshold (parameters) when `fsdp_modules` is `None`"
    )
    debug: bool | None = option(
        None,
        "`None`, `True`, `False`",
        "before each qaccel collective, check that every rank calls the same one with the same shapes, and fail on "
        "every rank naming each rank's call site if not; `None`: the `QACCEL_DEBUG` variable (`1`/`0`; unset: off)",
    )
    project_dir: str | os.PathLike[str] | None = option(
        None,
        "a folder, or `None`",
        "where `save_state()`, `load_state()` and `resume()` without a folder keep checkpoints: "
        "`<project_dir>/checkpoints/checkpoint_<step>`",
    )
    keep_checkpoints: int | None = option(
        None,
        "`None` or int ≥ 1",
        "how many of those `save_state()` without a folder keeps, the newest (`None`: all); Accelerate's "
        "`ProjectConfiguration(total_limit=...)`",
    )
    log_with: Any = option(
        None,
        "`None`, `tensorboard`, `wandb`, `mlflow`, `csv`, `all`, a tracker object, or a list of them",
        "Accelerate's experiment trackers: `init_trackers()` starts them and `log()` writes to them, on the main "
        "process only; `all`: those of tensorboard, wandb and mlflow that are installed; a tracker object is one "
        "with Accelerate's `GeneralTracker` methods (`name`, `log`, `finish`, ...)",
    )
    logging_dir: str | os.PathLike[str] | None = option(
        None,
        "a folder, or `None`",
        "where trackers write: TensorBoard and CSV into `<logging_dir>/<project_name>`, MLflow into "
        "`<logging_dir>/mlruns` (unless `MLFLOW_TRACKING_URI` is set); `None`: `project_dir` (Accelerate's "
        "`ProjectConfiguration(logging_dir=...)`)",
    )
    rank_prefix: bool = option(
        False,
        "`True`, `False`",
        "in a plain launch, start each line the ranks print with `[rank N] ` (under torchrun or srun ask the "
        "launcher: `--tee` with `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`, `srun --label`)",
    )
    kwargs_handlers: Sequence[KwargsHandler] | None = option(
        None,
        "`None` or a list of `qaccel.utils` handlers (or Accelerate's)",
        "settings for torch objects qaccel makes, as Accelerate's `kwargs_handlers`: "
        "`DistributedDataParallelKwargs` (the DDP wrapper's arguments and a communication hook), "
        "`InitProcessGroupKwargs` (`timeout`, `backend`), `GradScalerKwargs`, `AutocastKwargs`, `ProfileKwargs` "
        "(for `profile()`)",
    )
    dynamo_backend: str | TorchDynamoPlugin | None = option(
        None,
        "`None`, `no`, a `torch.compile` backend (`inductor`, `aot_eager`, `eager`, ...), or a `TorchDynamoPlugin`",
        "compile prepared models' forward with `torch.compile`, in place and under their DDP or FSDP2 wrapper (the "
        "prepared object stays the same; `unwrap_model` gives your module); `None`: the `ACCELERATE_DYNAMO_*` "
        "variables Accelerate's launcher exports, else `no`",
    )
    cluster: SlurmCluster | None = option(
        None,
        "`None` or a `qaccel.SlurmCluster`",
        "`distribute()` from a plain process submits one SLURM job (through submitit) whose tasks are the ranks, "
        "waits, and returns the result; nprocs must be its nodes x tasks per node",
    )


@dataclass(frozen=True)
class Option:
    """One option as the docs and the signature read it: name, default, allowed values, meaning, annotation."""

    name: str
    default: Any
    values: str
    meaning: str
    keyword_only: bool = True
    annotation: Any = None


OPTIONS: tuple[Option, ...] = tuple(
    Option(f.name, f.default, f.metadata["values"], f.metadata["meaning"], not f.metadata["positional"], f.type)
    for f in dataclasses.fields(Options)
)


NAMES = tuple(option.name for option in OPTIONS)
