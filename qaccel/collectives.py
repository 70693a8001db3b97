"""Collectives over the current rank's group; each one is an identity in a single process."""

from __future__ import annotations

import builtins
import numbers
from typing import Any, Mapping

import torch
import torch.distributed as dist

from qaccel import group
from qaccel.group import RankContext

REDUCE_OPS = ("mean", "sum", "max", "min")
_TORCH_OPS = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _distributed(ctx: RankContext) -> bool:
    return ctx.world_size > 1 and dist.is_available() and dist.is_initialized()


def _comm_device(ctx: RankContext) -> torch.device:
    return ctx.device if ctx.backend == "nccl" else torch.device("cpu")


def all_reduce_dict(
    values: Mapping[str, Any], op: str, ctx: RankContext, log_device: torch.device
) -> dict[str, Any]:
    """Reduce a dict of numbers/tensors over all ranks with one collective per dtype, not one per key.

    Python numbers come back as Python numbers (a mean is a float), tensors as tensors of the same shape
    on ``log_device`` (a mean of an integer tensor is floating point). All ranks must pass the same keys.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {', '.join(map(repr, REDUCE_OPS))}; got {op!r}")
    tensors: dict[str, torch.Tensor] = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
        elif isinstance(value, numbers.Integral):
            tensor = torch.tensor(int(value), dtype=torch.int64)
        elif isinstance(value, numbers.Real):
            tensor = torch.tensor(value, dtype=torch.float64)
        else:
            raise TypeError(
                f"all_reduce_dict: value of {key!r} is {type(value).__name__}; expected a tensor, int or float"
            )
        tensors[key] = tensor.to(torch.int64) if tensor.dtype == torch.bool else tensor

    world = ctx.world_size if _distributed(ctx) else 1
    reduced = _reduce_by_dtype(tensors, _TORCH_OPS[op], ctx) if world > 1 else {k: t.clone() for k, t in tensors.items()}
    out: dict[str, Any] = {}
    for key, value in values.items():
        tensor = reduced[key] / world if op == "mean" else reduced[key]
        if isinstance(value, torch.Tensor):
            out[key] = (tensor.bool() if value.dtype == torch.bool and op in ("max", "min") else tensor).to(log_device)
        else:
            keeps_int = isinstance(value, numbers.Integral) and op != "mean"
            out[key] = int(tensor.item()) if keeps_int else float(tensor.item())
    return out


def _reduce_by_dtype(tensors: dict[str, torch.Tensor], op: dist.ReduceOp, ctx: RankContext) -> dict[str, torch.Tensor]:
    """Pack the tensors of each dtype into one flat buffer, all-reduce it once, unpack."""
    device = _comm_device(ctx)
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key, tensor in tensors.items():
        by_dtype.setdefault(tensor.dtype, []).append(key)
    out: dict[str, torch.Tensor] = {}
    for keys in by_dtype.values():
        flat = torch.cat([tensors[k].reshape(-1).to(device) for k in keys])
        dist.all_reduce(flat, op=op)
        for key, chunk in zip(keys, flat.split([tensors[k].numel() for k in keys])):
            out[key] = chunk.reshape(tensors[key].shape)
    return out


def broadcast(obj: Any, src: int, ctx: RankContext) -> Any:
    """Every rank gets rank ``src``'s ``obj`` (any picklable object)."""
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < ctx.world_size:
        raise ValueError(f"src must be a rank in [0, {ctx.world_size - 1}]; got {src!r}")
    if not _distributed(ctx):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_comm_device(ctx))
    return box[0]


def gather_object(obj: Any, ctx: RankContext) -> list[Any]:
    """Every rank gets the list of all ranks' ``obj``, indexed by rank."""
    if not _distributed(ctx):
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(ctx: RankContext) -> None:
    """Block until every rank reaches this point."""
    if _distributed(ctx):
        group.barrier(ctx)


def main_print(ctx: RankContext, *args: Any, **kwargs: Any) -> None:
    """``print`` on the main process only, so N ranks do not print N copies."""
    if ctx.rank == 0:
        builtins.print(*args, **kwargs)
