"""Collectives over the current rank's group; each one is an identity in a single process."""

from __future__ import annotations

import builtins
import functools
import hashlib
import numbers
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from qaccel.comm import hangs, session
from qaccel.comm.session import RankContext
from qaccel.errors import CollectiveMismatchError
from qaccel.nested import map_leaves

REDUCE_OPS = ("mean", "sum", "max", "min")
_TORCH_OPS = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def tracked(
    name: str, describe: Callable[..., str] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make a function a qaccel collective named ``name``: counted and explained on a timeout (hangs.py),
    and in debug mode checked first to be the same call on every rank, with ``describe(*args)`` the same.

    Only the outermost tracked call counts: gather_for_metrics is one collective, not three.
    """

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            run = session.current_run()
            watch = None if run is None else run.watch
            if run is not None and run.alone is not None:
                raise RuntimeError(f"{name} cannot run here: {run.alone}")
            if run is None or watch is None or watch.calls.current is not None:
                return fn(*args, **kwargs)
            if run.debug:
                return watch.run(name, _agreed, run.ctx, name, describe, fn, args, kwargs)
            return watch.run(name, fn, *args, **kwargs)

        return call

    return wrap


def _agreed(
    ctx: RankContext,
    name: str,
    describe: Callable[..., str] | None,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict,
) -> Any:
    """Debug mode: compare this call with every rank's before making it; raise on every rank if they differ.

    One small all-reduce compares a digest of (name, shapes): MAX of (d, -d) gives max and -min, equal only when
    every rank's digest is. Only then, on a mismatch, do the ranks gather the details and call sites to report.
    """
    call = name.replace("()", f"({describe(*args, **kwargs)})" if describe is not None else "()")
    digest = int.from_bytes(hashlib.blake2b(call.encode(), digest_size=7).digest(), "big")
    extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=session.comm_device(ctx))
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    if extremes[0].item() != -extremes[1].item():
        everyone: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(everyone, (name, call, hangs.call_site(sys._getframe())))
        what = "different collectives" if len({n for n, _, _ in everyone}) > 1 else f"{name} with different arguments"
        lines = [f"rank {r}: {c} at {site}" for r, (_, c, site) in enumerate(everyone)]
        raise CollectiveMismatchError(
            f"[qaccel debug] the ranks called {what} (each must call the same collectives, "
            "in the same order, with the same shapes):\n  " + "\n  ".join(lines)
        )
    return fn(*args, **kwargs)


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _kind(value: Any) -> str:
    return f"{_dtype(value)}{list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _leaf_kinds(data: Any, kind: Callable[[torch.Tensor], str] = _kind) -> str:
    kinds: list[str] = []
    map_leaves(data, lambda leaf: kinds.append(kind(leaf) if isinstance(leaf, torch.Tensor) else _kind(leaf)))
    return f"[{', '.join(kinds)}]"


def _describe_dict(values: Mapping[str, Any], op: str = "mean", *rest: Any) -> str:
    return "{" + ", ".join(f"{k!r}: {_kind(v)}" for k, v in values.items()) + f"}}, op={op!r}"


def _describe_reduce(data: Any, op: str = "sum", *rest: Any) -> str:
    return f"{_leaf_kinds(data)}, op={op!r}"


def _describe_gather(data: Any, *rest: Any) -> str:  # dim 0 may differ by rank
    return _leaf_kinds(data, lambda t: f"{_dtype(t)}[*{''.join(f', {n}' for n in t.shape[1:])}]")


def _describe_pad(data: Any, ctx: RankContext, dim: int = 0, *rest: Any) -> str:
    return f"{_leaf_kinds(data, lambda t: f'{t.dim()}-dim {_dtype(t)}')}, dim={dim}"


def _describe_broadcast(obj: Any, src: int, *rest: Any) -> str:
    return f"src={src}"


def is_distributed() -> bool:
    """True where a process group exists, also a one-rank group the user made: its collectives are real."""
    return dist.is_available() and dist.is_initialized()


@tracked("all_reduce_dict()", _describe_dict)
def all_reduce_dict(values: Mapping[str, Any], op: str, ctx: RankContext, log_device: torch.device) -> dict[str, Any]:
    """Reduce a dict of numbers/tensors over all ranks with one collective per dtype, not one per key.

    Python numbers come back as Python numbers (a mean is a float), tensors as tensors of the same shape
    on ``log_device`` (a mean of an integer tensor is floating point). All ranks must pass the same keys.
    """
    _check_op(op)
    floats: dict[str, Any] = {}
    ints: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for key, value in values.items():
        if isinstance(value, float):  # the common case first: ABC checks cost more than the collective's packing
            floats[key] = value
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, (int, numbers.Integral)):
            ints[key] = value
        elif isinstance(value, numbers.Real):
            floats[key] = value
        else:
            raise TypeError(
                f"all_reduce_dict: value of {key!r} is {type(value).__name__}; expected a tensor, int or float"
            )
    # Numbers travel packed, one tensor per kind, and come back with one tolist(): no tensor per key.
    packs = [
        torch.tensor(list(group.values()), dtype=dtype)
        for group, dtype in ((floats, torch.float64), (ints, torch.int64))
        if group
    ]
    reduced = iter(_reduce_flat(packs + list(tensors.values()), op, ctx) if packs or tensors else [])
    out: dict[str, Any] = {}
    if floats:
        out.update(zip(floats, map(float, next(reduced).tolist())))
    if ints:
        out.update(zip(ints, next(reduced).tolist()))
    out.update((key, tensor.to(log_device)) for key, tensor in zip(tensors, reduced))
    return {key: out[key] for key in values}


def _check_op(op: str, name: str = "op") -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, REDUCE_OPS))}; got {op!r}")


def _reduce_flat(tensors: list[torch.Tensor], op: str, ctx: RankContext) -> list[torch.Tensor]:
    """Reduce tensors over ranks with one all_reduce per dtype: pack into a flat buffer, reduce, unpack.

    New tensors, on each input's device. Bool tensors travel as int64 (max/min come back as bool); a mean
    divides the buffer once and is floating point for integer inputs. Without a group, the same arithmetic
    on copies, so results do not depend on the world size.
    """
    world = ctx.world_size if is_distributed() else 1
    device = session.comm_device(ctx)
    groups: dict[torch.dtype, list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault(torch.int64 if tensor.dtype == torch.bool else tensor.dtype, []).append(i)
    out: list[Any] = [None] * len(tensors)
    for dtype, members in groups.items():
        flat = torch.cat([tensors[i].detach().reshape(-1).to(device=device, dtype=dtype) for i in members])
        if world > 1:
            dist.all_reduce(flat, op=_TORCH_OPS[op])
        if op == "mean":
            flat = flat / world
        for i, chunk in zip(members, flat.split([tensors[i].numel() for i in members])):
            result = chunk.view(tensors[i].shape)
            if tensors[i].dtype == torch.bool and op in ("max", "min"):
                result = result.bool()
            out[i] = result if result.device == tensors[i].device else result.to(tensors[i].device)
    return out


@tracked("broadcast()", _describe_broadcast)
def broadcast(obj: Any, src: int, ctx: RankContext) -> Any:
    """Every rank gets rank ``src``'s ``obj`` (any picklable object)."""
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < ctx.world_size:
        raise ValueError(f"src must be a rank in [0, {ctx.world_size - 1}]; got {src!r}")
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=session.comm_device(ctx))
    return box[0]


@tracked("gather_object()")
def gather_object(obj: Any, ctx: RankContext) -> list[Any]:
    """Every rank gets the list of all ranks' ``obj``, indexed by rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


@tracked("wait_for_everyone()")
def wait_for_everyone(ctx: RankContext) -> None:
    """Block until every rank reaches this point."""
    if is_distributed():
        session.group_barrier(ctx)


def main_print(ctx: RankContext, *args: Any, **kwargs: Any) -> None:
    """``print`` on the main process only, so N ranks do not print N copies."""
    if ctx.rank == 0:
        builtins.print(*args, **kwargs)


@tracked("gather()", _describe_gather)
def gather(data: Any, ctx: RankContext) -> Any:
    """All ranks' tensors concatenated on dim 0 in rank order, for every tensor of a nested structure.

    Sizes along dim 0 may differ by rank (a short last batch); the other dims must match. A 0-dim tensor
    becomes a 1-D tensor of one element per rank, in a single process too, so code runs the same both ways.
    Across ranks the results are new tensors without autograd history, on the input's device.
    """
    tensors = [t.reshape(1) if t.dim() == 0 else t for t in _tensor_leaves(data, "gather")]
    if not is_distributed():
        return _with_leaves(data, tensors)
    shapes = _shapes_by_rank(tensors, ctx, "gather")
    return _with_leaves(data, [_gather_tensor(t, [s[i] for s in shapes], ctx) for i, t in enumerate(tensors)])


def _gather_tensor(tensor: torch.Tensor, shapes: list[tuple[int, ...]], ctx: RankContext) -> torch.Tensor:
    if any(shape[1:] != shapes[0][1:] for shape in shapes):
        raise ValueError(f"gather: tensors must match in every dim but dim 0; got shapes {shapes} by rank")
    longest = max(shape[0] for shape in shapes)
    send = tensor.detach().to(session.comm_device(ctx))
    if send.shape[0] < longest:
        send = torch.cat([send, send.new_zeros((longest - send.shape[0], *send.shape[1:]))])
    chunks = [send.new_empty(send.shape) for _ in range(ctx.world_size)]
    dist.all_gather(chunks, send.contiguous())
    return torch.cat([chunk[: shape[0]] for chunk, shape in zip(chunks, shapes)]).to(tensor.device)


@tracked("pad_across_processes()", _describe_pad)
def pad_across_processes(data: Any, ctx: RankContext, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad every tensor along ``dim`` with ``pad_index`` to the largest size any rank has, so they can be gathered.

    Padding goes at the end, or at the start with ``pad_first``. 0-dim tensors and tensors already of the
    largest size come back as they are.
    """
    tensors = _tensor_leaves(data, "pad_across_processes")
    if not is_distributed():
        for tensor in tensors:
            _normalised_dim(dim, tensor)
        return _with_leaves(data, tensors)
    shapes = _shapes_by_rank(tensors, ctx, "pad_across_processes")
    padded = []
    for i, tensor in enumerate(tensors):
        ndims = {len(s[i]) for s in shapes}
        if len(ndims) > 1:
            by_rank = [s[i] for s in shapes]
            raise ValueError(f"pad_across_processes: tensors differ in ndim; got shapes {by_rank} by rank")
        # Checked after the shapes collective: every rank has this ndim now, so every rank raises alike.
        axis = _normalised_dim(dim, tensor)
        if tensor.dim() == 0:
            padded.append(tensor)
            continue
        longest = max(s[i][axis] for s in shapes)
        padded.append(_pad(tensor, axis, longest, pad_index, pad_first))
    return _with_leaves(data, padded)


def _normalised_dim(dim: int, tensor: torch.Tensor) -> int:
    if tensor.dim() == 0:
        return 0
    if not -tensor.dim() <= dim < tensor.dim():
        raise IndexError(f"pad_across_processes: dim {dim} is out of range for a tensor of shape {tuple(tensor.shape)}")
    return dim % tensor.dim()


def _pad(tensor: torch.Tensor, dim: int, size: int, pad_index: int, pad_first: bool) -> torch.Tensor:
    missing = size - tensor.shape[dim]
    if missing == 0:
        return tensor
    fill = tensor.new_full((*tensor.shape[:dim], missing, *tensor.shape[dim + 1 :]), pad_index)
    return torch.cat([fill, tensor] if pad_first else [tensor, fill], dim=dim)


@tracked("reduce()", _describe_reduce)
def reduce(data: Any, op: str, ctx: RankContext) -> Any:
    """All-reduce every tensor of a nested structure: "sum", "mean", "max" or "min"; one collective per dtype.

    Returns new tensors on each input's device, never the inputs modified. A mean of an integer or bool
    tensor is floating point; max/min of a bool tensor stay bool. All ranks must pass the same structure and
    shapes. In a single process it returns copies.
    """
    _check_op(op, "reduction")
    return _with_leaves(data, _reduce_flat(_tensor_leaves(data, "reduce"), op, ctx))


@tracked("gather_for_metrics()", _describe_gather)
def gather_for_metrics(data: Any, ctx: RankContext, remainder: int | None) -> Any:
    """``gather``, minus the duplicate samples that evened out the last round of a prepared DataLoader.

    The gathered rows are in global sample order with the duplicates last, so keeping the first ``remainder``
    rows (the real samples of a padded step, as the loader marks it; None otherwise) leaves exactly the
    dataset's samples.
    """
    gathered = gather(data, ctx)
    if remainder is None:
        return gathered
    return map_leaves(gathered, lambda tensor: tensor[:remainder])


def _tensor_leaves(data: Any, caller: str) -> list[torch.Tensor]:
    """The tensors of a nested structure, in the order map_leaves visits them; anything else is a TypeError."""
    leaves: list[torch.Tensor] = []

    def take(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{caller}() takes tensors (nested in dicts, lists or tuples); got a "
                f"{type(leaf).__name__}; use gather_object() for other objects"
            )
        leaves.append(leaf)
        return leaf

    map_leaves(data, take)
    return leaves


def _with_leaves(data: Any, tensors: list[torch.Tensor]) -> Any:
    """``data`` with its tensor leaves replaced, in order, by ``tensors``."""
    replacements = iter(tensors)
    return map_leaves(data, lambda _: next(replacements))


def _shapes_by_rank(tensors: list[torch.Tensor], ctx: RankContext, caller: str) -> list[list[tuple[int, ...]]]:
    """Every rank's leaf shapes, from one collective for the whole structure.

    Every rank sees the same answer, so a mismatch raises the same error on every rank instead of leaving
    the others blocked in the next collective.
    """
    mine = [(tuple(t.shape), str(t.dtype)) for t in tensors]
    everyone = gather_object(mine, ctx)
    if any(len(theirs) != len(mine) for theirs in everyone):
        raise ValueError(f"{caller}: ranks passed different numbers of tensors: {[len(t) for t in everyone]} by rank")
    for i in range(len(mine)):
        dtypes = [theirs[i][1] for theirs in everyone]
        if len(set(dtypes)) > 1:
            raise ValueError(f"{caller}: tensor {i} has dtypes {dtypes} by rank; all ranks must pass the same dtype")
    return [[shape for shape, _ in theirs] for theirs in everyone]
