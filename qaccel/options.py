"""The Accelerator's options, declared once: checked and resolved in the caller, so mistakes fail at construction.

``Options`` is the one declaration: each option's name, type, default, allowed values and meaning. The
Accelerator's ``__init__`` writes the same parameters out, for type checkers and IDEs (tests/test_options.py keeps
the two equal); its docstring's argument list and the docs' option table are generated from it, ``TrainConfig`` and the resolved ``Config`` inherit its fields, and ``make_config`` checks
exactly its names. Closed sets of values are enums (``str`` enums, so ``acc.backend == "gloo"`` keeps working).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import importlib.util
import math
import os
import re
import textwrap
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from qaccel.environment import Environment, Kind, gpus
from qaccel.handlers import DDPCommunicationHookType, Handlers, KwargsHandler, TorchDynamoPlugin, compile_settings
from qaccel.handlers import resolve as resolve_handlers

FSDP_MIN_PARAMS = 1_000_000
C = TypeVar("C")
DEBUG_VARIABLE = "QACCEL_DEBUG"


class ComputeSetup(enum.StrEnum):
    AUTO = "auto"  # a GPU when there is one
    CPU = "cpu"
    GPU = "gpu"


class LogSetup(enum.StrEnum):
    AUTO = "auto"  # the compute device
    CPU = "cpu"


class StartMethod(enum.StrEnum):
    FORKSERVER = "forkserver"
    SPAWN = "spawn"


class MixedPrecision(enum.StrEnum):
    NO = "no"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def half(self) -> torch.dtype | None:
        """The dtype autocast computes in; None without mixed precision."""
        return {MixedPrecision.BF16: torch.bfloat16, MixedPrecision.FP16: torch.float16}.get(self)


class Strategy(enum.StrEnum):
    DDP = "ddp"
    FSDP = "fsdp"


class Backend(enum.StrEnum):
    GLOO = "gloo"
    NCCL = "nccl"
    MPI = "mpi"

    @classmethod
    def available(cls) -> tuple[Backend, ...]:
        return (cls.GLOO, cls.NCCL) + ((cls.MPI,) if dist.is_mpi_available() else ())


class JobOutput(enum.StrEnum):
    """Whose output a cluster job shows in the caller while it waits."""

    RANK0 = "rank0"
    ALL = "all"  # every rank's lines, each prefixed with [rank N]
    NONE = "none"


class DistributedType(enum.StrEnum):
    """How a rank trains with the others, by Accelerate's names: alone, data parallel on CPUs or GPUs, or
    sharded."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    XLA = "XLA"  # never a rank's: Accelerate's scripts compare with it (its examples' collate_fn)


# The closed sets as a type checker reads them: an option takes the enum's member or its value.
ComputeSetupName = Literal["auto", "cpu", "gpu"]
LogSetupName = Literal["auto", "cpu"]
BackendName = Literal["gloo", "nccl", "mpi"]
StartMethodName = Literal["forkserver", "spawn"]
MixedPrecisionName = Literal["no", "bf16", "fp16"]
StrategyName = Literal["ddp", "fsdp"]


class DeviceType(enum.StrEnum):
    """Where a rank computes, resolved from ``compute_setup``: torch's device type names."""

    CPU = "cpu"
    CUDA = "cuda"


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
    project_dir: str | os.PathLike | None = option(
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
    logging_dir: str | os.PathLike | None = option(
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


@dataclass(kw_only=True)
class Config(Options):
    """The options resolved (checked, closed sets as enums, ``auto`` decided), and what they decide: what every
    rank needs to set itself up; small and picklable so it travels. Made by make_config only, and never changed."""

    device_type: DeviceType | None = DeviceType.CPU  # from compute_setup; None: decided on a cluster job's nodes
    log_device_type: DeviceType | None = DeviceType.CPU  # from log_setup; None: as device_type
    handlers: Handlers = Handlers()  # from kwargs_handlers
    compile: Mapping[str, Any] | None = None  # torch.compile's arguments, from dynamo_backend


def document(cls: type[C]) -> type[C]:
    """Append the options' ``Args:`` section to ``cls``'s docstring, from the one declaration."""
    lines = ["", "    Args:"]
    for option in OPTIONS:
        text = f"{option.name}: {option.meaning.replace('`', '``')}."
        lines += textwrap.wrap(text, 116, initial_indent=" " * 8, subsequent_indent=" " * 12)
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + "\n".join(lines) + "\n"
    return cls


def option_table() -> str:
    """The options for the docs, in Markdown: the call with every default written out, then a table."""
    positional = sum(not o.keyword_only for o in OPTIONS)
    arguments = ", ".join(f"{o.name}={o.default!r}" for o in OPTIONS)
    call = textwrap.fill(f"acc = Accelerator({arguments})", 112, subsequent_indent=" " * 18, break_on_hyphens=False)
    rows = [
        "```python",
        call,
        "```",
        "",
        f"The first {positional} may be given by position; the others are keyword-only.",
        "",
        "| option | default | values | what it does |",
        "| --- | --- | --- | --- |",
    ]
    for option in OPTIONS:
        rows.append(f"| `{option.name}` | `{option.default!r}` | {option.values} | {option.meaning} |")
    return "\n".join(rows) + "\n"


def cuda_device_count() -> int:
    """GPUs visible here, counted through NVML where possible so the caller's CUDA stays uninitialised."""
    return torch.cuda.device_count()


def make_config(env: Environment, **options: Any) -> Config:
    """Check every option (by the declared names) and resolve the 'auto' choices; raises ValueError/TypeError/
    RuntimeError naming the option and what is allowed."""
    unknown = set(options) - set(NAMES)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}; the options are {', '.join(NAMES)}")
    values = {option.name: options.get(option.name, option.default) for option in OPTIONS}
    handlers, group_options = resolve_handlers(values["kwargs_handlers"])
    values.update(_from_handler(values, group_options))
    nprocs = count("nprocs", values["nprocs"], 1)
    compute_setup = _choice("compute_setup", values["compute_setup"], ComputeSetup)
    asked = (compute_setup, values["backend"], values["dtype"], _mixed_precision(values["mixed_precision"]))
    # a cluster job's ranks run on its nodes, which decide what depends on them; every other rank runs here
    devices = (
        _on_the_nodes(*asked)
        if values["cluster"] is not None and not env.is_launched
        else _devices(*asked, env, nprocs)
    )
    strategy = _choice("strategy", values["strategy"], Strategy)
    log_setup = _choice("log_setup", values["log_setup"], LogSetup)
    if devices.device_type is not None:
        _check_sharding(strategy, devices.mixed_precision, devices.backend)
    return Config(
        nprocs=nprocs,
        compute_setup=values["compute_setup"],
        log_setup=log_setup,
        device_type=devices.device_type,
        log_device_type=_log_device(log_setup, devices),
        backend=devices.backend,
        dtype=devices.dtype,
        timeout=_timeout(values["timeout"]),
        start_method=_choice("start_method", values["start_method"], StartMethod),
        gradient_accumulation_steps=count("gradient_accumulation_steps", values["gradient_accumulation_steps"], 1),
        keep_global_batch=_flag("keep_global_batch", values["keep_global_batch"]),
        sync_each_batch=_flag("sync_each_batch", values["sync_each_batch"]),
        mixed_precision=devices.mixed_precision,
        split_batches=_flag("split_batches", values["split_batches"]),
        even_batches=_even_batches(values, strategy),
        dispatch_batches=values["dispatch_batches"] is not None
        and _flag("dispatch_batches", values["dispatch_batches"]),
        device_placement=_flag("device_placement", values["device_placement"]),
        use_seedable_sampler=_flag("use_seedable_sampler", values["use_seedable_sampler"]),
        data_seed=_data_seed(values["data_seed"], values["use_seedable_sampler"]),
        rng_types=_rng_types(values["rng_types"]),
        step_scheduler_with_optimizer=_flag("step_scheduler_with_optimizer", values["step_scheduler_with_optimizer"]),
        max_restarts=count("max_restarts", values["max_restarts"], 0),
        strategy=strategy,
        fsdp_modules=_sharding_choices(strategy, values["fsdp_modules"], values["fsdp_min_params"]),
        fsdp_min_params=values["fsdp_min_params"],
        debug=_debug_choice(values["debug"]),
        project_dir=_folder("project_dir", values["project_dir"]),
        log_with=_log_with(values["log_with"], _logging_dir(values)),
        logging_dir=_logging_dir(values),
        keep_checkpoints=None
        if values["keep_checkpoints"] is None
        else count("keep_checkpoints", values["keep_checkpoints"], 1),
        rank_prefix=_flag("rank_prefix", values["rank_prefix"]),
        handlers=_handlers_for(handlers, strategy),
        compile=compile_settings(values["dynamo_backend"]),
        kwargs_handlers=None,  # resolved into handlers
        dynamo_backend=None,  # resolved into compile
        cluster=_cluster(values["cluster"], nprocs),
    )


def placements(device_placement: object, count: int) -> list[bool | None]:
    """prepare()'s ``device_placement``: one bool (or None, the option) per object."""
    if device_placement is None:
        return [None] * count
    if (
        isinstance(device_placement, (str, bytes))
        or not isinstance(device_placement, Sequence)
        or len(device_placement) != count
        or not all(p is None or isinstance(p, bool) for p in device_placement)
    ):
        raise ValueError(
            f"prepare(device_placement=...) must be a list of {count} bools, one per object passed; "
            f"got {device_placement!r}"
        )
    return list(device_placement)


def _data_seed(seed: object, seedable: object) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"data_seed must be an int >= 0 or None; got {seed!r}")
    if seedable is not True:
        raise ValueError(
            "data_seed seeds the order of use_seedable_sampler=True (as in Accelerate, where it does "
            "nothing otherwise): set use_seedable_sampler=True, or seed your DataLoader's generator"
        )
    return seed


RNG_TYPES = ("torch", "cuda", "generator")


def _rng_types(value: object) -> tuple[str, ...]:
    """rng_types as a tuple of Accelerate's names (its RNGType members taken by value)."""
    if value is None:
        return ("generator",)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"rng_types must be a list of {', '.join(map(repr, RNG_TYPES))} or None; got {value!r}")
    names = tuple(item.value if isinstance(item, enum.Enum) else item for item in value)
    for name in names:
        if name not in RNG_TYPES:
            raise ValueError(
                f"rng_types holds {', '.join(map(repr, RNG_TYPES))} (Accelerate's xla, npu, ... are "
                f"not qaccel's); got {name!r}"
            )
    return tuple(dict.fromkeys(names))


def _from_handler(values: dict[str, Any], group_options: dict[str, Any]) -> dict[str, Any]:
    """The options an InitProcessGroupKwargs sets (timeout, backend), unless they contradict ones given."""
    chosen = {}
    for name, value in group_options.items():
        default, given = next(o.default for o in OPTIONS if o.name == name), values[name]
        same = _timeout(given) == _timeout(value) if name == "timeout" else given == value
        if not same and given != default:
            raise ValueError(f"InitProcessGroupKwargs({name}={value!r}) contradicts {name}={given!r}")
        chosen[name] = value
    return chosen


def _handlers_for(handlers: Handlers, strategy: Strategy) -> Handlers:
    """DDP's settings are for the DDP wrapper, which strategy='fsdp' does not make."""
    if strategy is Strategy.FSDP and (handlers.ddp or handlers.comm_hook is not DDPCommunicationHookType.NO):
        raise ValueError(
            "DistributedDataParallelKwargs applies to strategy='ddp' (the DDP wrapper); "
            "strategy='fsdp' shards the model with FSDP2 instead: leave it out"
        )
    return handlers


def _choice(
    name: str, value: object, allowed: type[enum.StrEnum], members: Sequence[enum.StrEnum] | None = None
) -> Any:
    """``value`` as a member of ``allowed`` (of ``members``, when only some are available here)."""
    members = tuple(allowed) if members is None else tuple(members)
    if not isinstance(value, str) or value not in members:
        raise ValueError(f"{name} must be one of {', '.join(repr(m.value) for m in members)}; got {value!r}")
    return allowed(value)


def count(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        kind = "a positive int" if least == 1 else "a non-negative int"
        raise ValueError(f"{name} must be {kind}; got {value!r}")
    return value


# log_with's names: the trackers qaccel writes to (qaccel/train/tracking.py), each with its module and pip package
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "csv": (None, None),
}
ALL_TRACKERS = ("tensorboard", "wandb", "mlflow")  # what log_with="all" takes, those installed (Accelerate's "all")
_FOLDER_TRACKERS = ("tensorboard", "csv")  # they write into <logging_dir>/<project_name>


def _logging_dir(values: dict[str, Any]) -> str | None:
    return _folder("logging_dir", values["logging_dir"]) or _folder("project_dir", values["project_dir"])


def _log_with(value: object, logging_dir: str | None) -> tuple[Any, ...]:
    """log_with as a tuple of tracker names and tracker objects: a name, an enum member whose value is one
    (Accelerate's LoggerType), a tracker object, or a list of them; "all" is the installed ones of ALL_TRACKERS."""
    if value is None:
        return ()
    chosen: list[Any] = []
    allowed = ", ".join(repr(name) for name in (*TRACKERS, "all"))
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if _is_tracker_object(item):
            if getattr(item, "requires_logging_directory", False) and logging_dir is None:
                raise ValueError(
                    f"log_with's tracker {item.name!r} requires a logging directory: give project_dir=..., "
                    "logging_dir=... or project_config=ProjectConfiguration(project_dir=...)"
                )
            chosen.append(item)
            continue
        raw = item.value if isinstance(item, enum.Enum) else item
        name = raw.lower() if isinstance(raw, str) else raw
        if name not in (*TRACKERS, "all"):
            raise ValueError(
                f"log_with must be one of {allowed}, a tracker object with Accelerate's GeneralTracker "
                f"methods, or a list of them; got {item!r}"
            )
        for one in [n for n in ALL_TRACKERS if importlib.util.find_spec(TRACKERS[n][0])] if name == "all" else [name]:
            if one not in chosen:
                chosen.append(one)
    for name in chosen:
        if not isinstance(name, str):
            continue
        module, package = TRACKERS[name]
        if module is not None and importlib.util.find_spec(module) is None:
            raise ImportError(
                f"log_with={name!r} needs the {package} package: pip install {package} (from qaccel's "
                f"checkout: pip install -e '.[{name}]')"
            )
        if name in _FOLDER_TRACKERS and logging_dir is None:
            raise ValueError(
                f"log_with={name!r} writes into <logging_dir>/<project_name>: give project_dir=..., "
                "logging_dir=... or project_config=ProjectConfiguration(project_dir=..., logging_dir=...)"
            )
    return tuple(chosen)


def _is_tracker_object(item: object) -> bool:
    """A tracker of the user's own, as Accelerate's GeneralTracker: a name, log() and finish()."""
    return (
        not isinstance(item, (str, enum.Enum))
        and isinstance(getattr(item, "name", None), str)
        and callable(getattr(item, "log", None))
        and callable(getattr(item, "finish", None))
    )


def _folder(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"{name} must be a folder (a str or path) or None; got {value!r}")
    return os.path.abspath(os.fspath(value))  # ranks may start elsewhere (torchrun --chdir, a SLURM job)


# Arguments of Accelerate's Accelerator that qaccel does not take, and the qaccel way to get what they do.
ACCELERATE_ONLY = {
    "deepspeed_plugin": "qaccel has no DeepSpeed; strategy='fsdp' shards parameters, gradients and optimizer state",
    "deepspeed_plugins": "qaccel has no DeepSpeed; strategy='fsdp' shards parameters, gradients and optimizer state",
    "fsdp_plugin": "strategy='fsdp' with fsdp_modules=... or fsdp_min_params=...",
    "torch_tp_plugin": "qaccel has no tensor parallelism",
    "megatron_lm_plugin": "qaccel has no Megatron-LM",
    "parallelism_config": "qaccel has data parallelism (strategy='ddp') and FSDP (strategy='fsdp')",
}


ACCELERATE_NAMES = ("cpu", "dataloader_config", "gradient_accumulation_plugin", "project_config", "dynamo_plugin")


def from_accelerate(arguments: dict[str, Any], chosen: dict[str, Any]) -> dict[str, Any]:
    """``chosen`` with the Accelerate arguments qaccel understands translated (``cpu=True``: compute_setup="cpu");
    any other refused with the qaccel way to do what it does."""
    chosen = dict(chosen)
    for name, value in arguments.items():
        if name == "cpu":
            if _flag("cpu", value):
                if chosen.get("compute_setup", "auto") not in ("auto", "cpu"):
                    raise ValueError(f"cpu=True contradicts compute_setup={chosen['compute_setup']!r}")
                chosen["compute_setup"] = "cpu"
        elif name == "dataloader_config":
            chosen = _dataloader_config(value, chosen)
        elif name == "gradient_accumulation_plugin":
            chosen = _accumulation_plugin(value, chosen)
        elif name == "project_config":
            chosen = _project_config(value, chosen)
        elif name == "dynamo_plugin":
            if value is not None and chosen.get("dynamo_backend") is not None:
                raise ValueError("pass dynamo_backend or dynamo_plugin, not both (as Accelerate)")
            chosen["dynamo_backend"] = value
        elif name in ACCELERATE_ONLY:
            raise TypeError(f"Accelerator({name}=...) is Accelerate's; in qaccel: {ACCELERATE_ONLY[name]}")
        else:
            raise TypeError(
                f"Accelerator() got an unexpected argument {name!r}; the options are "
                f"{', '.join(NAMES)} (and Accelerate's cpu=True, dataloader_config=..., "
                "gradient_accumulation_plugin=... and project_config=...)"
            )
    return chosen


_TIME = re.compile(r"^(?:(\d+)-)?(\d+(?::\d+){0,2})$")


@dataclass(frozen=True)
class SlurmCluster:
    """Where ``distribute()`` submits its job: ``nodes`` x ``tasks_per_node`` SLURM tasks, one rank each.

    Args:
        nodes: the job's nodes.
        tasks_per_node: ranks per node (one per GPU).
        partition: sbatch's ``--partition``; None leaves the cluster's default.
        time: the time limit, ``"HH:MM:SS"``, ``"D-HH:MM:SS"`` or minutes.
        account: sbatch's ``--account``; None leaves the default.
        gpus_per_node: sbatch's ``--gpus-per-node``; None leaves the default.
        cpus_per_task: sbatch's ``--cpus-per-task``; None leaves the default.
        setup: shell lines run in the job before the ranks start (``module load ...``, ``source venv/bin/activate``).
        sbatch: any other sbatch option, e.g. ``{"qos": "high", "signal": "USR1@300"}`` (the default ``signal`` is
            ``USR1@180``: the warning ``resume()`` saves and requeues on).
        folder: where each job gets a folder of its own (the pickled function, results and logs); it must be on a
            file system that the submitting machine and the compute nodes share.
        output: whose output appears in the caller while it waits: ``"rank0"``, ``"all"`` (every rank's lines,
            prefixed with ``[rank N]``) or ``"none"``; the job's state changes appear always.
    """

    nodes: int = 1
    tasks_per_node: int = 1
    partition: str | None = None
    time: str | int = "01:00:00"
    account: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    setup: Sequence[str] = ()
    sbatch: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    folder: str | os.PathLike = "qaccel_jobs"
    output: JobOutput | str = JobOutput.RANK0

    def __post_init__(self) -> None:
        for name in ("nodes", "tasks_per_node"):
            _positive(name, getattr(self, name))
        for name in ("gpus_per_node", "cpus_per_task"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name), zero=name == "gpus_per_node")
        minutes(self.time)
        if isinstance(self.setup, str) or not all(isinstance(line, str) for line in self.setup):
            raise TypeError(f"SlurmCluster.setup must be a list of shell lines; got {self.setup!r}")
        if not isinstance(self.sbatch, Mapping):
            raise TypeError(f"SlurmCluster.sbatch must be a dict of sbatch options; got {self.sbatch!r}")
        object.__setattr__(self, "output", _choice("SlurmCluster.output", self.output, JobOutput))
        object.__setattr__(self, "setup", tuple(self.setup))
        object.__setattr__(self, "sbatch", dict(self.sbatch))

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    def __hash__(self) -> int:
        return hash((self.nodes, self.tasks_per_node, self.partition, str(self.folder)))


def _positive(name: str, value: Any, zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise ValueError(f"SlurmCluster.{name} must be an int >= {0 if zero else 1}; got {value!r}")


def minutes(limit: str | int) -> int:
    """A SLURM time limit in whole minutes (rounded up), from minutes or SLURM's forms: ``MM``, ``MM:SS``,
    ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``."""
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        return limit
    match = _TIME.match(limit) if isinstance(limit, str) else None
    if match is None or limit in ("0", "00"):
        raise ValueError(
            f"SlurmCluster.time must be minutes > 0 or a SLURM time limit ('HH:MM:SS', 'D-HH:MM:SS', "
            f"...); got {limit!r}"
        )
    days, fields = match.group(1), [int(f) for f in match.group(2).split(":")]
    if days is not None:  # D-HH[:MM[:SS]]
        hours, mins, secs = (fields + [0, 0])[:3]
        hours += int(days) * 24
    else:  # MM, MM:SS or HH:MM:SS
        hours, mins, secs = ([0, 0] + fields)[-3:] if len(fields) == 3 else (0, *(fields + [0])[:2])
    return max(1, math.ceil(hours * 60 + mins + secs / 60))


def _cluster(cluster: Any, nprocs: int) -> SlurmCluster | None:
    """A SlurmCluster of ``nprocs`` ranks, with submitit installed (it submits the job), or None."""
    if cluster is None:
        return None
    if not isinstance(cluster, SlurmCluster):
        raise TypeError(f"cluster must be a qaccel.SlurmCluster or None; got {type(cluster).__name__}")
    if cluster.world_size != nprocs:
        raise ValueError(
            f"nprocs={nprocs} but the cluster has nodes x tasks_per_node = {cluster.nodes} x "
            f"{cluster.tasks_per_node} = {cluster.world_size} ranks: make them equal"
        )
    try:
        import submitit  # noqa: F401 - the job goes through it
    except ImportError:
        raise ImportError(
            "cluster= submits through submitit, which is not installed: pip install submitit (from "
            "qaccel's checkout: pip install -e '.[slurm]')"
        ) from None
    return cluster


@dataclass
class DataLoaderConfiguration:
    """Accelerate's grouping of the prepared loaders' options, for scripts that pass one: ``split_batches``,
    ``even_batches``, ``dispatch_batches``, ``use_seedable_sampler`` and ``data_seed`` are qaccel's options of those
    names; ``non_blocking`` is what prepared loaders do anyway; ``use_stateful_dataloader`` is refused (qaccel's
    way is named then)."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class ProjectConfiguration:
    """Accelerate's grouping of where a project keeps its files, for scripts that pass one: ``project_dir`` is the
    option of that name and ``total_limit`` is ``keep_checkpoints``. Checkpoints saved without a folder are always
    numbered, by step; ``logging_dir`` is the option of that name, where trackers write (by default project_dir)."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False


@dataclass
class GradientAccumulationPlugin:
    """Accelerate's grouping of the accumulation options, for scripts that pass one: ``num_steps`` is
    ``gradient_accumulation_steps``, ``sync_each_batch`` the option of that name; an epoch's last batch always
    synchronises (``sync_with_dataloader``), and ``adjust_scheduler`` is what step_scheduler_with_optimizer does."""

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


def _accumulation_plugin(plugin: Any, chosen: dict[str, Any]) -> dict[str, Any]:
    """An Accelerate GradientAccumulationPlugin (any object with its fields) as qaccel's options."""
    if plugin is None:
        return chosen
    if getattr(plugin, "sync_with_dataloader", True) is not True:
        raise ValueError(
            "GradientAccumulationPlugin(sync_with_dataloader=False) is not in qaccel: an epoch's last "
            "batch always synchronises and updates"
        )
    steps = getattr(plugin, "num_steps", None)
    each = _flag("GradientAccumulationPlugin.sync_each_batch", getattr(plugin, "sync_each_batch", False))
    chosen = {**chosen, "sync_each_batch": each or chosen.get("sync_each_batch", False)}
    if steps is not None:
        if chosen.get("gradient_accumulation_steps", 1) not in (1, steps):
            raise ValueError(
                f"GradientAccumulationPlugin(num_steps={steps}) contradicts "
                f"gradient_accumulation_steps={chosen['gradient_accumulation_steps']}"
            )
        chosen["gradient_accumulation_steps"] = steps
    return chosen


# DataLoaderConfiguration fields and the values that describe qaccel's prepared loaders (other values are refused).
_LOADER_VALUES = {"use_stateful_dataloader": (False,)}


_LOADER_WAYS = {
    "use_stateful_dataloader": "save_state() records where every prepared loader is, and load_state() continues "
    "there, mid-epoch included",
}


def _project_config(config: Any, chosen: dict[str, Any]) -> dict[str, Any]:
    """An Accelerate ProjectConfiguration (any object with its fields): ``project_dir`` is the option of that name,
    ``total_limit`` is ``keep_checkpoints``; checkpoints saved without a folder are numbered whatever
    ``automatic_checkpoint_naming`` says (by step: ``iteration`` must stay 0); ``save_on_each_node`` is refused."""
    if config is None:
        return chosen
    if getattr(config, "save_on_each_node", False):
        raise ValueError(
            "ProjectConfiguration(save_on_each_node=True) is not in qaccel: a checkpoint's files go to "
            "one folder every node reaches (a shared file system); leave save_on_each_node at False"
        )
    if getattr(config, "iteration", 0):
        raise ValueError(
            f"ProjectConfiguration(iteration={config.iteration}) is not in qaccel: numbered "
            "checkpoints are named by the optimizer step (checkpoint_<step>), which a resumed run "
            "continues; leave iteration at 0"
        )
    chosen = dict(chosen)
    for field, option in (
        ("project_dir", "project_dir"),
        ("logging_dir", "logging_dir"),
        ("total_limit", "keep_checkpoints"),
    ):
        value = getattr(config, field, None)
        if value is None:
            continue
        if chosen.get(option) is not None and chosen[option] != value:
            raise ValueError(f"ProjectConfiguration({field}={value!r}) contradicts {option}={chosen[option]!r}")
        chosen[option] = value
    return chosen


def _dataloader_config(config: Any, chosen: dict[str, Any]) -> dict[str, Any]:
    """An Accelerate DataLoaderConfiguration (any object with its fields): ``split_batches``, ``even_batches``,
    ``dispatch_batches``, ``use_seedable_sampler`` and ``data_seed`` are the options of those names; ``non_blocking`` is what
    prepared loaders do anyway; the others must keep their defaults."""
    if config is None:
        return chosen
    for field, allowed in _LOADER_VALUES.items():
        value = getattr(config, field, allowed[0])
        if not any(value is a for a in allowed):
            raise ValueError(
                f"DataLoaderConfiguration({field}={value!r}) is not in qaccel: {_LOADER_WAYS[field]}; "
                f"leave {field} at {allowed[0]!r}"
            )
    split = _flag("DataLoaderConfiguration.split_batches", getattr(config, "split_batches", False))
    even = _flag("DataLoaderConfiguration.even_batches", getattr(config, "even_batches", True))
    dispatch = getattr(config, "dispatch_batches", None)
    if dispatch is not None:
        _flag("DataLoaderConfiguration.dispatch_batches", dispatch)
    seedable = _flag("DataLoaderConfiguration.use_seedable_sampler", getattr(config, "use_seedable_sampler", False))
    data_seed = getattr(config, "data_seed", None)
    if data_seed is not None and chosen.get("data_seed") not in (None, data_seed):
        raise ValueError(
            f"DataLoaderConfiguration(data_seed={data_seed!r}) contradicts data_seed={chosen['data_seed']!r}"
        )
    return {
        **chosen,
        "split_batches": split or chosen.get("split_batches", False),
        "use_seedable_sampler": seedable or chosen.get("use_seedable_sampler", False),
        "data_seed": data_seed if data_seed is not None else chosen.get("data_seed"),
        "even_batches": even and chosen.get("even_batches", True),
        "dispatch_batches": dispatch if dispatch is not None else chosen.get("dispatch_batches"),
    }


def _even_batches(values: dict[str, Any], strategy: Strategy) -> bool:
    even = _flag("even_batches", values["even_batches"])
    if not even:
        check_uneven(strategy, values["gradient_accumulation_steps"], values["sync_each_batch"] is True)
    return even


def check_uneven(strategy: Strategy, accumulation_steps: int, sync_each_batch: bool) -> None:
    """even_batches=False lets ranks take different numbers of steps: DDP shadows the missing ones (torch's Join),
    which FSDP cannot do, and a rank's unsynchronised accumulated gradients would be lost on the steps it misses."""
    if strategy is Strategy.FSDP:
        raise ValueError(
            "even_batches=False needs strategy='ddp': FSDP cannot let ranks take different numbers of "
            "steps; keep even_batches=True (the last step is padded)"
        )
    if accumulation_steps != 1 and not sync_each_batch:
        raise ValueError(
            "even_batches=False with gradient_accumulation_steps > 1 needs sync_each_batch=True: a rank "
            "that runs out of batches first would otherwise drop the gradients it holds unreduced"
        )


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return value


def _timeout(timeout: object) -> float:
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta; got {timeout!r}")
    return float(timeout)


def _device_type(compute_setup: ComputeSetup, env: Environment, nprocs: int, asked: str | None = None) -> DeviceType:
    """Where this process's ranks compute, decided with the GPUs visible here: they must fit how the ranks take
    them (environment/gpus.py). ``asked``: the GPUs the job asked for, which must be here (a launcher's allocation
    counts too)."""
    if compute_setup is ComputeSetup.CPU:
        return DeviceType.CPU
    visible, asked = cuda_device_count(), asked or gpus.allocated()
    if visible == 0:
        if asked is not None:
            raise gpus.none_seen(asked)
        if compute_setup is ComputeSetup.GPU:
            raise RuntimeError(
                f"compute_setup='gpu' but CUDA is not available here ({gpus.where()}, "
                f"{gpus.visible_devices()}); use 'auto' or 'cpu'"
            )
        return DeviceType.CPU
    if env.is_launched:
        gpus.choose(env.local_rank, env.local_world_size, visible, gpus.node_gpus())
    elif nprocs > visible:  # a plain launch's ranks all see the GPUs this process sees
        raise RuntimeError(
            f"{nprocs} GPU ranks on this node but only {visible} visible GPU(s) "
            f"({gpus.visible_devices()}); lower nprocs or use compute_setup='cpu'"
        )
    return DeviceType.CUDA


def on_node(config: Config, env: Environment) -> Config:
    """``config`` with what make_config left to the nodes (a cluster job's device, backend and precision) decided
    here, where this rank runs; a configuration decided already comes back as it is."""
    if config.device_type is not None:
        return config
    asked_gpus = config.cluster.gpus_per_node if config.cluster is not None else None
    asked = (
        f"the job asked for {asked_gpus} GPU(s) per node (SlurmCluster(gpus_per_node={asked_gpus}))"
        if asked_gpus
        else None
    )
    devices = _devices(
        ComputeSetup(config.compute_setup),
        config.backend,
        config.dtype,
        config.mixed_precision,
        env,
        config.nprocs,
        asked,
    )
    _check_sharding(config.strategy, devices.mixed_precision, devices.backend)
    return dataclasses.replace(config, **devices._asdict(), log_device_type=_log_device(config.log_setup, devices))


class _Devices(NamedTuple):
    device_type: DeviceType | None
    backend: Backend | None
    dtype: torch.dtype | None
    mixed_precision: MixedPrecision


def _devices(
    compute_setup: ComputeSetup,
    backend: object,
    dtype: object,
    mixed_precision: object,
    env: Environment,
    nprocs: int,
    asked: str | None = None,
) -> _Devices:
    """The device type, backend and precision, decided together here."""
    device_type = _device_type(compute_setup, env, nprocs, asked)
    backend = _backend(backend, device_type)
    return _Devices(device_type, backend, *_precision(dtype, mixed_precision, device_type))


def _on_the_nodes(compute_setup: ComputeSetup, backend: object, dtype: object, mixed_precision: object) -> _Devices:
    """For ranks that run elsewhere (a cluster job from a login node): only what needs no node is checked here;
    the device type and the backend left to choose (None) are decided on the nodes (on_node)."""
    if compute_setup is ComputeSetup.CPU:  # nothing about the nodes can change it
        return _devices(compute_setup, backend, dtype, mixed_precision, Environment(Kind.PLAIN), 1)
    chosen = None if backend is None else _choice("backend", backend, Backend)
    return _Devices(None, chosen, *_precision(dtype, mixed_precision, None))


def _log_device(log_setup: LogSetup, devices: _Devices) -> DeviceType | None:
    return devices.device_type if log_setup is LogSetup.AUTO else DeviceType.CPU


ON_THE_NODES = "decided on the nodes"


def _backend(backend: object, device_type: DeviceType) -> Backend:
    if backend is None:
        return Backend.NCCL if device_type is DeviceType.CUDA else Backend.GLOO
    chosen = _choice("backend", backend, Backend, Backend.available())
    if chosen is Backend.NCCL and device_type is DeviceType.CPU:
        raise ValueError("backend='nccl' needs GPU compute; use backend='gloo' (or None) with compute_setup='cpu'")
    if chosen is Backend.NCCL and not dist.is_nccl_available():
        raise RuntimeError("backend='nccl' but this torch build has no NCCL; use backend='gloo'")
    return chosen


MIXED_PRECISION_VARIABLE = "ACCELERATE_MIXED_PRECISION"


def _mixed_precision(value: object) -> object:
    """The option as given, or (None) what a launcher exported for Accelerators made without it, as Accelerate
    reads it."""
    if value is not None:
        return value
    exported = os.environ.get(MIXED_PRECISION_VARIABLE)
    if exported is None:
        return MixedPrecision.NO.value
    if exported.lower() not in tuple(MixedPrecision):
        raise ValueError(
            f"{MIXED_PRECISION_VARIABLE}={exported!r} (read for mixed_precision=None) must be one of "
            f"{', '.join(repr(m.value) for m in MixedPrecision)}"
        )
    return exported.lower()


def _precision(
    dtype: object, mixed_precision: object, device_type: DeviceType | None
) -> tuple[torch.dtype | None, MixedPrecision]:
    """The models' dtype and the mixed precision, checked together (on a device decided on the nodes: None)."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.float64) or None; got {dtype!r}")
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(
            f"dtype must be a floating-point or complex torch.dtype (it casts models and inputs); got {dtype}"
        )
    mixed = _choice("mixed_precision", mixed_precision, MixedPrecision)
    if mixed is MixedPrecision.FP16 and device_type is DeviceType.CPU:  # as Accelerate, said out loud
        warnings.warn(
            "mixed_precision='fp16' without GPU compute trains in float32 (no autocast, no gradient "
            "scaler; Accelerate does the same): use 'bf16' for half precision on CPU",
            stacklevel=5,
        )
        mixed = MixedPrecision.NO
    if mixed is not MixedPrecision.NO and dtype is not None and dtype != torch.float32:
        raise ValueError(
            f"mixed_precision={mixed.value!r} runs float32 models in half precision; with dtype={dtype} use "
            "mixed_precision='no' (or dtype=None/torch.float32)"
        )
    return dtype, mixed


def _check_sharding(strategy: Strategy, mixed_precision: MixedPrecision, backend: Backend | None) -> None:
    """What FSDP2 needs of the backend and the precision, once they are decided."""
    if strategy is not Strategy.FSDP:
        return
    if backend not in (Backend.GLOO, Backend.NCCL):
        raise ValueError(f"strategy='fsdp' runs on backend 'gloo' (CPU) or 'nccl' (GPU); got backend={backend.value!r}")
    if mixed_precision is MixedPrecision.FP16:
        raise ValueError(
            "strategy='fsdp' supports mixed_precision 'no' or 'bf16' (FSDP2's MixedPrecisionPolicy); "
            "fp16 needs a sharded gradient scaler qaccel does not provide"
        )


def _debug_choice(debug: object) -> bool:
    """``debug``, or with None the QACCEL_DEBUG variable ("1"/"0", "true"/"false", ...; unset: off)."""
    if debug is not None:
        if not isinstance(debug, bool):
            raise TypeError(f"debug must be True, False or None (None: the {DEBUG_VARIABLE} variable); got {debug!r}")
        return debug
    value = os.environ.get(DEBUG_VARIABLE, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{DEBUG_VARIABLE} must be 1/true/yes/on or 0/false/no/off (or unset); got {value!r}")


def _sharding_choices(strategy: Strategy, modules: Sequence[type | str] | None, min_params: object) -> tuple[str, ...]:
    """Check the strategy's arguments; fsdp_modules as class names."""
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 1:
        raise ValueError(f"fsdp_min_params must be a positive int (parameters per sharded unit); got {min_params!r}")
    if strategy is not Strategy.FSDP:
        if modules is not None or min_params != FSDP_MIN_PARAMS:
            raise ValueError(
                f"fsdp_modules and fsdp_min_params apply to strategy='fsdp' only; got strategy={strategy.value!r}"
            )
        return ()
    if modules is None:
        return ()
    if isinstance(modules, (str, type)) or not all(isinstance(m, (str, type)) for m in modules) or not modules:
        raise TypeError(f"fsdp_modules must be a non-empty list of module classes (or class names); got {modules!r}")
    return tuple(m if isinstance(m, str) else m.__qualname__ for m in modules)
