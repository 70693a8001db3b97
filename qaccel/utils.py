"""The names training scripts import from ``accelerate.utils``, from one module: ``from accelerate.utils import X``
becomes ``from qaccel.utils import X``. Each has Accelerate's signature and meaning (differences: the "Coming from
Accelerate" page). The functions act on the ranks of the running session (inside distribute(), or the ranks an
Accelerator joined under torchrun or srun) and, outside one, on this process alone."""

from __future__ import annotations

import functools
import importlib.util
import operator
from typing import Any

import torch
import torch.distributed as dist

from qaccel.comm import collectives
from qaccel.comm.session import RankContext
from qaccel.handlers import (
    AutocastKwargs,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    TorchDynamoPlugin,
)
from qaccel.launch import in_place
from qaccel.nested import map_leaves
from qaccel.options import (
    Backend,
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from qaccel.train import batch_size as _batch_size
from qaccel.train import seeding
from qaccel.train.batch_size import release_memory as _release

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "ProfileKwargs",
    "ProjectConfiguration",
    "TorchDynamoPlugin",
    "broadcast",
    "broadcast_object_list",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "is_bf16_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_mlflow_available",
    "is_mps_available",
    "is_npu_available",
    "is_schedulefree_available",
    "is_tensorboard_available",
    "is_timm_available",
    "is_torch_version",
    "is_transformers_available",
    "is_wandb_available",
    "is_xpu_available",
    "pad_across_processes",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_seed",
    "wait_for_everyone",
]


def _ranks(name: str) -> RankContext:
    """The running session's rank (under torchrun or srun, the ranks of this process's Accelerator, joined if they
    were not yet), or this process alone; a group the session did not make is not guessed at."""
    running = in_place.join_latest()
    if running is not None:
        return running
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            f"qaccel.utils.{name}() acts on the ranks of a distribute() call or of an Accelerator "
            "that joined its launcher's ranks; call it there (or torch.distributed's own here)"
        )
    return RankContext(0, 0, 0, 1, 1, torch.device("cpu"), Backend.GLOO)


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (CUDA too); ``device_specific`` adds the rank, so ranks differ;
    ``deterministic`` asks torch for deterministic algorithms."""
    seeding.set_seed(seed + _ranks("set_seed").rank if device_specific else seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Every rank gets rank ``from_process``'s tensors (any nested structure)."""
    return collectives.broadcast(tensor, from_process, _ranks("broadcast"))


def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    """``object_list`` made rank ``from_process``'s on every rank, in place; returned."""
    object_list[:] = collectives.broadcast(list(object_list), from_process, _ranks("broadcast_object_list"))
    return object_list


def gather(tensor: Any) -> Any:
    """All ranks' tensors concatenated on dim 0, in rank order (sizes along dim 0 may differ)."""
    return collectives.gather(tensor, _ranks("gather"))


def gather_object(object: Any) -> list[Any]:
    """The ranks' lists concatenated in rank order: ``gather_object([x])`` is every rank's ``x``."""
    return [item for part in collectives.gather_object(object, _ranks("gather_object")) for item in part]


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad tensors along ``dim`` with ``pad_index`` to the largest size any rank has."""
    return collectives.pad_across_processes(tensor, _ranks("pad_across_processes"), dim, pad_index, pad_first)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """All-reduce tensors: ``reduction`` "mean" (Accelerate's default here), "sum", "max" or "min", times
    ``scale``; returns new tensors."""
    reduced = collectives.reduce(tensor, reduction, _ranks("reduce"))
    return reduced if scale == 1.0 else map_leaves(reduced, lambda leaf: leaf * scale)


def send_to_device(
    tensor: Any, device: torch.device | str, non_blocking: bool = False, skip_keys: list[str] | str | None = None
) -> Any:
    """Every tensor of a nested structure moved to ``device``; in a dict, the values under ``skip_keys`` stay."""
    skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys or ())
    if isinstance(tensor, dict) and skip:
        return type(tensor)(
            {
                key: value if key in skip else send_to_device(value, device, non_blocking)
                for key, value in tensor.items()
            }
        )
    return map_leaves(
        tensor, lambda leaf: leaf.to(device, non_blocking=non_blocking) if isinstance(leaf, torch.Tensor) else leaf
    )


def wait_for_everyone() -> None:
    """Block until every rank gets here."""
    collectives.wait_for_everyone(_ranks("wait_for_everyone"))


def find_executable_batch_size(
    function: Any = None, starting_batch_size: int = 128, reduce_batch_size_fn: Any = None
) -> Any:
    """Call ``function(batch_size, ...)`` from ``starting_batch_size`` down until no rank runs out of memory (see
    qaccel.train.batch_size); under torchrun or srun the ranks of this process's Accelerator are joined first, so
    that they agree on every size even when the function prepares everything itself."""
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    searching = _batch_size.find_executable_batch_size(function, starting_batch_size, reduce_batch_size_fn)

    @functools.wraps(function)
    def joined(*args: Any, **kwargs: Any) -> Any:
        in_place.join_latest()
        return searching(*args, **kwargs)

    return joined


def release_memory(*objects: Any) -> list[None]:
    """Collect garbage and give the GPU's cached memory back; one None per object, to rebind the caller's names
    (``a, b = release_memory(a, b)``)."""
    _release()
    return [None] * len(objects)


# ---- what is installed, and which devices: Accelerate's is_*_available, which examples branch on ----


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def is_cuda_available() -> bool:
    """Whether torch sees a CUDA GPU."""
    return torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether torch sees Apple's MPS device (qaccel computes on CPUs and CUDA GPUs only, so prepare() does not use
    it)."""
    return is_torch_version(">=", min_version) and torch.backends.mps.is_available()


def is_xpu_available(check_device: bool = False) -> bool:
    """Whether torch sees an Intel XPU (qaccel does not compute on it)."""
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def is_npu_available(check_device: bool = False) -> bool:
    """Whether torch_npu (Ascend) is installed and sees a device (qaccel does not compute on it)."""
    if not _installed("torch_npu"):
        return False
    __import__("torch_npu")  # registers torch.npu

    # torch.npu is torch_npu's, which torch's hints do not know
    return hasattr(torch, "npu") and torch.npu.is_available()  # pyright: ignore[reportAttributeAccessIssue]


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bf16 mixed precision runs here: on the CPU always, on CUDA where the GPU supports it."""
    return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()


def is_torch_version(operation: str, version: str) -> bool:
    """Compare torch's version: ``is_torch_version(">=", "2.4")``."""
    compare = {
        "<": operator.lt,
        "<=": operator.le,
        "==": operator.eq,
        "!=": operator.ne,
        ">=": operator.ge,
        ">": operator.gt,
    }
    if operation not in compare:
        raise ValueError(f"operation must be one of {', '.join(compare)}; got {operation!r}")
    from torch.torch_version import TorchVersion  # imported by torch itself, which pyright does not see

    release = TorchVersion(torch.__version__.split("+")[0])  # torch's own version type
    return compare[operation](release, version)


def is_schedulefree_available() -> bool:
    return _installed("schedulefree")


def is_tensorboard_available() -> bool:
    return _installed("tensorboard") or _installed("tensorboardX")


def is_wandb_available() -> bool:
    return _installed("wandb")


def is_mlflow_available() -> bool:
    return _installed("mlflow")


def is_datasets_available() -> bool:
    return _installed("datasets")


def is_transformers_available() -> bool:
    return _installed("transformers")


def is_timm_available() -> bool:
    return _installed("timm")
