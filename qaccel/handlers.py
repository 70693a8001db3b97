"""Accelerate's kwargs handlers: the settings a script passes for torch objects qaccel makes for it (the DDP
wrapper, the process group, fp16's gradient scaler, autocast, the profiler).

``Accelerator(kwargs_handlers=[...])`` takes these classes or Accelerate's own objects of the same names (read by
their fields), resolves them once in the caller into ``Handlers`` (small and picklable, it travels to the ranks)
and fails there on a mistake: an unknown handler, two of one kind, a field qaccel cannot honour.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import enum
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

PROFILE_FILE = "profile_{rank}.json"  # Accelerate's PROFILE_PATTERN_NAME, one trace per rank


class KwargsHandler:
    """Accelerate's base of the handler dataclasses: ``to_kwargs()`` gives the fields set to other than their
    defaults, which is what reaches torch."""

    if TYPE_CHECKING:  # every subclass is a dataclass (dataclasses.fields() reads them)
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> dict[str, Any]:
        default = type(self)().to_dict()
        return {key: value for key, value in self.to_dict().items() if default[key] != value}


class DDPCommunicationHookType(enum.StrEnum):
    """torch's DDP communication hooks by Accelerate's names: gradients all-reduced as they are (``no``),
    compressed to fp16 or bf16, or with PowerSGD."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments of the ``DistributedDataParallel`` that ``prepare()`` wraps models in, and a communication hook
    (``comm_hook``, optionally inside an fp16/bf16 ``comm_wrapper``; ``comm_state_option`` for PowerSGD's state)."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_state_option: dict[str, Any] = field(default_factory=dict)

    def to_dict(
        self, ignore_keys: Sequence[str] = ("comm_hook", "comm_wrapper", "comm_state_option")
    ) -> dict[str, Any]:
        return {key: value for key, value in super().to_dict().items() if key not in ignore_keys}

    def register_comm_hook(self, model: DistributedDataParallel) -> None:
        """Register the hook on a DDP ``model`` (nothing for ``comm_hook="no"``)."""
        register_comm_hook(model, self.comm_hook, self.comm_wrapper, self.comm_state_option)


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """The process group's ``timeout`` and ``backend``: qaccel's options of those names (``init_method`` is
    qaccel's rendezvous, so only None is taken)."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: datetime.timedelta | None = None

    def __post_init__(self) -> None:
        if self.timeout is None:  # Accelerate's defaults, which to_kwargs() then leaves out
            self.timeout = datetime.timedelta(seconds=1800 if self.backend != "nccl" else 600)


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments of fp16's ``torch.amp.GradScaler``."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments of the ``torch.autocast`` that mixed precision runs prepared models' forward (and
    ``accelerator.autocast()``) under."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class ProfileKwargs(KwargsHandler):
    """``accelerator.profile()``'s ``torch.profiler.profile``: ``activities`` (``"cpu"``, ``"cuda"``),
    ``schedule_option`` (``torch.profiler.schedule``'s arguments), ``on_trace_ready`` and the recording flags; with
    ``output_trace_dir`` each rank writes its Chrome trace there as ``profile_<rank>.json``."""

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable[..., Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self) -> torch.profiler.profile:
        """The profiler these settings describe."""
        activities = None if self.activities is None else [_activity(a) for a in self.activities]
        schedule = None if self.schedule_option is None else torch.profiler.schedule(**self.schedule_option)
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


# torch.compile's backends by Accelerate's DynamoBackend names (torch's name is the lower-case one); "no": none
DYNAMO_BACKENDS = (
    "no",
    "eager",
    "aot_eager",
    "inductor",
    "aot_ts_nvfuser",
    "nvprims_nvfuser",
    "cudagraphs",
    "ofi",
    "fx2trt",
    "onnxrt",
    "tensorrt",
    "aot_torchxla_trace_once",
    "torchxla_trace_once",
    "tvm",
    "hpu_backend",
    "neuron",
)
DYNAMO_PREFIX = "ACCELERATE_DYNAMO_"  # what Accelerate's launcher exports, read as Accelerate's plugin reads it


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """How ``prepare()`` compiles models with ``torch.compile``: Accelerate's plugin, read as Accelerate reads it
    (unset fields from the ``ACCELERATE_DYNAMO_*`` variables its launcher exports)."""

    backend: str | enum.Enum | None = None  # Accelerate's DynamoBackend too; a lower-case name after __post_init__
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        if self.backend is None:
            self.backend = os.environ.get(DYNAMO_PREFIX + "BACKEND", "no")
        raw = self.backend.value if isinstance(self.backend, enum.Enum) else self.backend
        if not isinstance(raw, str) or raw.lower() not in DYNAMO_BACKENDS:
            raise ValueError(f"dynamo_backend must be one of {', '.join(map(repr, DYNAMO_BACKENDS))}; got {raw!r}")
        self.backend = raw.lower()
        if self.mode is None:
            self.mode = os.environ.get(DYNAMO_PREFIX + "MODE", "default")
        if self.fullgraph is None:
            self.fullgraph = _true(os.environ.get(DYNAMO_PREFIX + "USE_FULLGRAPH", "false"))
        if self.use_regional_compilation is None:
            self.use_regional_compilation = _true(os.environ.get(DYNAMO_PREFIX + "USE_REGIONAL_COMPILATION", "false"))
        if self.dynamic is None and DYNAMO_PREFIX + "USE_DYNAMIC" in os.environ:
            self.dynamic = _true(os.environ[DYNAMO_PREFIX + "USE_DYNAMIC"])

    def to_kwargs(self) -> dict[str, Any]:
        """torch.compile's arguments (the backend always; the others where they differ from torch's defaults)."""
        kwargs: dict[str, Any] = {"backend": self.backend}
        if self.mode not in (None, "default"):
            kwargs["mode"] = self.mode
        for name in ("fullgraph", "disable"):
            if getattr(self, name):
                kwargs[name] = True
        for name in ("dynamic", "options"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return kwargs


def _true(value: str) -> bool:
    if value.strip().lower() in ("1", "true", "yes", "y", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "n", "off", ""):
        return False
    raise ValueError(f"{DYNAMO_PREFIX}* variables must be true or false; got {value!r}")


def compile_settings(dynamo_backend: object) -> dict[str, Any] | None:
    """torch.compile's arguments for the ``dynamo_backend`` option (a backend name, a TorchDynamoPlugin, or None:
    the ``ACCELERATE_DYNAMO_*`` variables), None for no compilation."""
    if dynamo_backend is None or isinstance(dynamo_backend, (str, enum.Enum)):
        plugin = TorchDynamoPlugin(backend=dynamo_backend)
    elif type(dynamo_backend).__name__ == "TorchDynamoPlugin" and dataclasses.is_dataclass(dynamo_backend):
        names = {f.name for f in dataclasses.fields(TorchDynamoPlugin)}
        plugin = TorchDynamoPlugin(
            **{f.name: getattr(dynamo_backend, f.name) for f in dataclasses.fields(dynamo_backend) if f.name in names}
        )
    else:
        raise TypeError(
            f"dynamo_backend must be a backend name ({', '.join(map(repr, DYNAMO_BACKENDS))}), a "
            f"TorchDynamoPlugin or None; got {dynamo_backend!r}"
        )
    if plugin.use_regional_compilation:
        raise ValueError(
            "TorchDynamoPlugin(use_regional_compilation=True) is not in qaccel: compile the repeated "
            "blocks yourself (block.compile() for each) before prepare(), and leave the plugin's "
            "backend at 'no'"
        )
    return None if plugin.backend == "no" else plugin.to_kwargs()


def _activity(name: str) -> torch.profiler.ProfilerActivity:
    known = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
    if name not in known:
        raise ValueError(f"ProfileKwargs.activities: {name!r} is not one of {', '.join(map(repr, known))}")
    return known[name]


HANDLER_CLASSES: tuple[type[KwargsHandler], ...] = (
    DistributedDataParallelKwargs,
    InitProcessGroupKwargs,
    GradScalerKwargs,
    AutocastKwargs,
    ProfileKwargs,
)
# Accelerate's other handlers, and why qaccel has none
_NOT_HERE = {
    "FP8RecipeKwargs": "qaccel has no fp8 training",
    "AORecipeKwargs": "qaccel has no fp8 training",
    "TERecipeKwargs": "qaccel has no fp8 training",
    "MSAMPRecipeKwargs": "qaccel has no fp8 training",
}


@dataclass(frozen=True)
class Handlers:
    """The handlers resolved: what the ranks pass to torch (only the fields set to other than their defaults)."""

    ddp: Mapping[str, Any] = field(default_factory=dict)
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: Mapping[str, Any] = field(default_factory=dict)
    scaler: Mapping[str, Any] = field(default_factory=dict)
    autocast: Mapping[str, Any] = field(default_factory=dict)
    profile: ProfileKwargs | None = None


def resolve(handlers: object) -> tuple[Handlers, dict[str, Any]]:
    """``kwargs_handlers`` as ``Handlers``, and the options that an ``InitProcessGroupKwargs`` sets (``timeout``,
    ``backend``); TypeError/ValueError naming the handler otherwise."""
    if handlers is None:
        return Handlers(), {}
    if isinstance(handlers, (str, bytes, Mapping)) or not isinstance(handlers, Sequence):
        raise TypeError(
            f"kwargs_handlers must be a list of handlers ({', '.join(c.__name__ for c in HANDLER_CLASSES)}); "
            f"got {handlers!r}"
        )
    found: dict[type[KwargsHandler], KwargsHandler] = {}
    for handler in handlers:
        ours = _as_ours(handler)
        if type(ours) in found:
            raise ValueError(f"kwargs_handlers holds two {type(ours).__name__}s; pass one")
        found[type(ours)] = ours
    resolved, chosen = Handlers(), {}
    if (ddp := _one(found, DistributedDataParallelKwargs)) is not None:
        resolved = dataclasses.replace(
            resolved,
            ddp=ddp.to_kwargs(),
            comm_state_option=dict(ddp.comm_state_option),
            comm_hook=_hook("comm_hook", ddp.comm_hook, tuple(DDPCommunicationHookType)),
            comm_wrapper=_hook(
                "comm_wrapper",
                ddp.comm_wrapper,
                (DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16, DDPCommunicationHookType.BF16),
            ),
        )
    if (scaler := _one(found, GradScalerKwargs)) is not None:
        resolved = dataclasses.replace(resolved, scaler=scaler.to_kwargs())
    if (autocast := _one(found, AutocastKwargs)) is not None:
        resolved = dataclasses.replace(resolved, autocast=autocast.to_kwargs())
    if (profile := _one(found, ProfileKwargs)) is not None:
        for activity in profile.activities or ():
            _activity(activity)
        resolved = dataclasses.replace(resolved, profile=profile)
    if (group := _one(found, InitProcessGroupKwargs)) is not None:
        chosen = group.to_kwargs()
        if chosen.pop("init_method", None) is not None:
            raise ValueError(
                "InitProcessGroupKwargs(init_method=...) is not in qaccel: the ranks meet through "
                "qaccel's store (or the launcher's MASTER_ADDR/MASTER_PORT); leave init_method at None"
            )
    return resolved, chosen


_Handler = TypeVar("_Handler", bound=KwargsHandler)


def _one(found: Mapping[type[KwargsHandler], KwargsHandler], kind: type[_Handler]) -> _Handler | None:
    """The handler of class ``kind`` in ``found`` (each handler keyed by its own class), or None."""
    handler = found.get(kind)
    return handler if isinstance(handler, kind) else None


def _as_ours(handler: object) -> KwargsHandler:
    """A handler as qaccel's class of its name (Accelerate's objects read field by field)."""
    name = type(handler).__name__
    if name in _NOT_HERE:
        raise ValueError(f"kwargs_handlers: {name} is Accelerate's; {_NOT_HERE[name]}")
    ours = {c.__name__: c for c in HANDLER_CLASSES}.get(name)
    if ours is None or not dataclasses.is_dataclass(handler):
        raise TypeError(
            f"kwargs_handlers takes {', '.join(c.__name__ for c in HANDLER_CLASSES)} (qaccel's, from "
            f"qaccel.utils, or Accelerate's); got {handler!r}"
        )
    if isinstance(handler, ours):
        return handler
    names = {f.name for f in dataclasses.fields(ours)}
    values = {f.name: getattr(handler, f.name) for f in dataclasses.fields(handler) if f.name in names}
    for key in ("comm_hook", "comm_wrapper"):  # Accelerate's enum: its value is the name
        if isinstance(values.get(key), enum.Enum):
            values[key] = values[key].value
    return ours(**values)


def _hook(name: str, value: object, allowed: tuple[DDPCommunicationHookType, ...]) -> DDPCommunicationHookType:
    raw = value.value if isinstance(value, enum.Enum) else value
    if raw not in [a.value for a in allowed]:
        raise ValueError(
            f"DistributedDataParallelKwargs.{name} must be one of "
            f"{', '.join(repr(a.value) for a in allowed)}; got {value!r}"
        )
    return DDPCommunicationHookType(raw)


def register_comm_hook(
    model: DistributedDataParallel,
    hook: DDPCommunicationHookType | str,
    wrapper: DDPCommunicationHookType | str,
    state_option: Mapping[str, Any],
) -> None:
    """torch's hook of that name on a DDP ``model``, inside the wrapper; PowerSGD gets its state (Accelerate's
    mapping)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hook, wrapper = DDPCommunicationHookType(hook), DDPCommunicationHookType(wrapper)
    hooks = {
        DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
        DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
        DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
        DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook,
    }
    wrappers = {
        DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
        DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper,
    }
    chosen = hooks.get(hook)
    if chosen is None:
        return
    if wrapper in wrappers:
        chosen = wrappers[wrapper](chosen)
    power = hook in (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD)
    state = powerSGD_hook.PowerSGDState(None, **state_option) if power else None
    model.register_comm_hook(state=state, hook=chosen)


def trace_path(profile: ProfileKwargs, rank: int) -> str | None:
    """Where rank ``rank`` writes its Chrome trace, or None without ``output_trace_dir``."""
    if profile.output_trace_dir is None:
        return None
    return os.path.join(profile.output_trace_dir, PROFILE_FILE.format(rank=rank))
