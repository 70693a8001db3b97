"""Coordinating ranks around a block of user code: who runs it first, and which share of the data each gets."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from qaccel.comm import collectives
from qaccel.comm.session import RankContext

SPLITTABLE = (list, tuple, torch.Tensor)
R = TypeVar("R")


@contextmanager
def main_process_first(ctx: RankContext, local: bool) -> Iterator[None]:
    """Run the block on the main rank (each node's, when ``local``) before the others, e.g. to fill a cache.

    The main rank releases the others even if its block raises, so they are never left waiting on a
    barrier it skipped; the launcher then reports its exception. After the block every rank waits for
    all the others to finish it. An identity in a single process.
    """
    first = (ctx.local_rank if local else ctx.rank) == 0
    if not first:
        collectives.wait_for_everyone(ctx)
    try:
        yield
    finally:
        if first:
            collectives.wait_for_everyone(ctx)
    collectives.wait_for_everyone(ctx)


@contextmanager
def split_between_processes(obj: Any, ctx: RankContext, apply_padding: bool) -> Iterator[Any]:
    """Yield this rank's contiguous share of a list, tuple or tensor (dim 0), of every value of a dict, or of a
    dataset with ``select`` (Hugging Face datasets), as Accelerate does.

    Shares are as even as possible: the first ``len % world`` ranks get one item more; a rank past the end gets an
    empty share. ``apply_padding`` repeats the input's last item until every share is as long as the longest, for
    code that needs equal shapes on every rank (a later gather, say). A dict's values must have one length; the
    caller's dict is left as it was. In a single process the whole object is yielded.
    """
    if isinstance(obj, torch.Tensor) and obj.dim() == 0:
        raise ValueError("split_between_processes: a 0-dim tensor has no dim 0 to split")
    if isinstance(obj, dict):
        lengths = {key: _length(value) for key, value in obj.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"split_between_processes splits every value of a dict, so they need one length; got {lengths}"
            )
    else:
        _length(obj)
    if not collectives.is_distributed():
        yield obj
        return
    yield _share(obj, ctx.rank, ctx.world_size, apply_padding)


def _length(obj: Any) -> int:
    if not isinstance(obj, SPLITTABLE) and not hasattr(obj, "select"):
        allowed = ", ".join(t.__name__ for t in SPLITTABLE)
        raise TypeError(
            f"split_between_processes() takes a {allowed}, a dict of those, or a dataset with select(); "
            f"got a {type(obj).__name__}"
        )
    return len(obj)


def _share(obj: Any, rank: int, world: int, apply_padding: bool) -> Any:
    if isinstance(obj, dict):
        return {key: _share(value, rank, world, apply_padding) for key, value in obj.items()}
    length = len(obj)
    size, extra = divmod(length, world)
    start = rank * size + min(rank, extra)
    end = start + size + (rank < extra)
    missing = size + (extra > 0) - (end - start) if apply_padding and length else 0
    if hasattr(obj, "select") and not isinstance(obj, SPLITTABLE):  # a datasets.Dataset
        return obj.select(list(range(start, end)) + [length - 1] * missing)
    share: Any = obj[start:end]
    if missing == 0:
        return share
    if isinstance(obj, torch.Tensor):
        return torch.cat([share, obj[-1:].expand(missing, *obj.shape[1:])])
    return share + type(share)([obj[-1]] * missing)


def run_on(fn: Callable[..., R], chosen: Callable[[], bool]) -> Callable[..., R | None]:
    """``fn``, run only where ``chosen()`` (asked at each call), and everywhere in a single process; elsewhere a
    call does nothing and returns None."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> R | None:
        return fn(*args, **kwargs) if chosen() or not collectives.is_distributed() else None

    return run


def any_rank(flag: bool, ctx: RankContext) -> bool:
    """Whether ``flag`` is True on any rank; every rank gets the same answer (one all-reduce)."""
    return collectives.all_reduce_dict({"flag": float(flag)}, "max", ctx, torch.device("cpu"))["flag"] > 0
