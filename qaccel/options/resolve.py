"""``make_config``: every option checked, by the declared names, and the ``auto`` choices resolved, in the caller,
so that mistakes fail where the Accelerator is made."""

# pyright: reportUnnecessaryIsInstance=false
# (what users pass is checked at run time, whatever the annotations say)

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from typing import Any, cast

from qaccel.environment import Environment
from qaccel.handlers import DDPCommunicationHookType, Handlers, compile_settings
from qaccel.handlers import resolve as resolve_handlers
from qaccel.options.checks import choice, count, flag, folder, seconds
from qaccel.options.cluster import cluster_of
from qaccel.options.config import Config
from qaccel.options.declared import FSDP_MIN_PARAMS, NAMES, OPTIONS
from qaccel.options.devices import check_sharding, decide, left_to_the_nodes, log_device, mixed_precision_asked
from qaccel.options.kinds import ComputeSetup, LogSetup, StartMethod, Strategy
from qaccel.options.trackers import log_with

DEBUG_VARIABLE = "QACCEL_DEBUG"


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
    compute_setup = choice("compute_setup", values["compute_setup"], ComputeSetup)
    asked = (compute_setup, values["backend"], values["dtype"], mixed_precision_asked(values["mixed_precision"]))
    # a cluster job's ranks run on its nodes, which decide what depends on them; every other rank runs here
    devices = (
        left_to_the_nodes(*asked)
        if values["cluster"] is not None and not env.is_launched
        else decide(*asked, env, nprocs)
    )
    strategy = choice("strategy", values["strategy"], Strategy)
    log_setup = choice("log_setup", values["log_setup"], LogSetup)
    if devices.device_type is not None:
        check_sharding(strategy, devices.mixed_precision, devices.backend)
    return Config(
        nprocs=nprocs,
        compute_setup=compute_setup,
        log_setup=log_setup,
        device_type=devices.device_type,
        log_device_type=log_device(log_setup, devices),
        backend=devices.backend,
        dtype=devices.dtype,
        timeout=seconds(values["timeout"]),
        start_method=choice("start_method", values["start_method"], StartMethod),
        gradient_accumulation_steps=count("gradient_accumulation_steps", values["gradient_accumulation_steps"], 1),
        keep_global_batch=flag("keep_global_batch", values["keep_global_batch"]),
        sync_each_batch=flag("sync_each_batch", values["sync_each_batch"]),
        mixed_precision=devices.mixed_precision,
        split_batches=flag("split_batches", values["split_batches"]),
        even_batches=_even_batches(values, strategy),
        dispatch_batches=values["dispatch_batches"] is not None
        and flag("dispatch_batches", values["dispatch_batches"]),
        device_placement=flag("device_placement", values["device_placement"]),
        use_seedable_sampler=flag("use_seedable_sampler", values["use_seedable_sampler"]),
        data_seed=_data_seed(values["data_seed"], values["use_seedable_sampler"]),
        rng_types=_rng_types(values["rng_types"]),
        step_scheduler_with_optimizer=flag("step_scheduler_with_optimizer", values["step_scheduler_with_optimizer"]),
        max_restarts=count("max_restarts", values["max_restarts"], 0),
        strategy=strategy,
        fsdp_modules=_sharding_choices(strategy, values["fsdp_modules"], values["fsdp_min_params"]),
        fsdp_min_params=values["fsdp_min_params"],
        debug=_debug_choice(values["debug"]),
        project_dir=folder("project_dir", values["project_dir"]),
        log_with=log_with(values["log_with"], _logging_dir(values)),
        logging_dir=_logging_dir(values),
        keep_checkpoints=None
        if values["keep_checkpoints"] is None
        else count("keep_checkpoints", values["keep_checkpoints"], 1),
        rank_prefix=flag("rank_prefix", values["rank_prefix"]),
        handlers=_handlers_for(handlers, strategy),
        compile=compile_settings(values["dynamo_backend"]),
        cluster=cluster_of(values["cluster"], nprocs),
    )


def placements(device_placement: object, count: int) -> list[bool | None]:
    """prepare()'s ``device_placement``: one bool (or None, the option) per object."""
    if device_placement is None:
        return [None] * count
    given = cast("Sequence[object]", device_placement) if isinstance(device_placement, Sequence) else None
    if (
        given is None
        or isinstance(given, (str, bytes))
        or len(given) != count
        or not all(p is None or isinstance(p, bool) for p in given)
    ):
        raise ValueError(
            f"prepare(device_placement=...) must be a list of {count} bools, one per object passed; "
            f"got {device_placement!r}"
        )
    return list(cast("Sequence[bool | None]", given))


def _data_seed(seed: object, seedable: object) -> int | None:
    if seed is None:
        return None
    seed = count("data_seed", seed, 0, "or None")
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
    items = cast("Sequence[object]", value)
    names = tuple(item.value if isinstance(item, enum.Enum) else item for item in items)
    for name in names:
        if name not in RNG_TYPES:
            raise ValueError(
                f"rng_types holds {', '.join(map(repr, RNG_TYPES))} (Accelerate's xla, npu, ... are "
                f"not qaccel's); got {name!r}"
            )
    return tuple(dict.fromkeys(cast("tuple[str, ...]", names)))


def _from_handler(values: dict[str, Any], group_options: dict[str, Any]) -> dict[str, Any]:
    """The options an InitProcessGroupKwargs sets (timeout, backend), unless they contradict ones given."""
    chosen: dict[str, Any] = {}
    for name, value in group_options.items():
        default, given = next(o.default for o in OPTIONS if o.name == name), values[name]
        same = seconds(given) == seconds(value) if name == "timeout" else given == value
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


def _logging_dir(values: dict[str, Any]) -> str | None:
    return folder("logging_dir", values["logging_dir"]) or folder("project_dir", values["project_dir"])


def _even_batches(values: dict[str, Any], strategy: Strategy) -> bool:
    even = flag("even_batches", values["even_batches"])
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
    count("fsdp_min_params", min_params, 1, "parameters per sharded unit")
    if strategy is not Strategy.FSDP:
        if modules is not None or min_params != FSDP_MIN_PARAMS:
            raise ValueError(
                f"fsdp_modules and fsdp_min_params apply to strategy='fsdp' only; got strategy={strategy.value!r}"
            )
        return ()
    if modules is None:
        return ()
    if isinstance(modules, (str, type)) or not modules or not all(isinstance(m, (str, type)) for m in modules):
        raise TypeError(f"fsdp_modules must be a non-empty list of module classes (or class names); got {modules!r}")
    return tuple(m if isinstance(m, str) else m.__qualname__ for m in modules)
