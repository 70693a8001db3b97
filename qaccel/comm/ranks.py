"""Coordinating ranks around a block of user code: who runs it first, and which share of the data each gets."""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from qaccel.comm import collectives
from qaccel.comm.session import RankContext

SPLITTABLE = (list, tuple, dict, torch.Tensor)


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
    """Yield this rank's contiguous share of a list, tuple, dict (by keys, in order) or tensor (dim 0).

    Shares are as even as possible: the first ``len % world`` ranks get one item more. ``apply_padding``
    repeats the input's last item until every share is as long as the longest, for code that needs equal
    shapes on every rank (a later gather, say); a dict cannot repeat a key, so it cannot be padded. In a
    single process the whole object is yielded.
    """
    if not isinstance(obj, SPLITTABLE):
        allowed = ", ".join(t.__name__ for t in SPLITTABLE)
        raise TypeError(f"split_between_processes() takes a {allowed}; got a {type(obj).__name__}")
    if apply_padding and isinstance(obj, dict):
        raise ValueError("split_between_processes: a dict cannot be padded (keys cannot repeat); "
                         "use apply_padding=False")
    if isinstance(obj, torch.Tensor) and obj.dim() == 0:
        raise ValueError("split_between_processes: a 0-dim tensor has no dim 0 to split")
    if not collectives.is_distributed():
        yield obj
        return
    yield _share(obj, ctx.rank, ctx.world_size, apply_padding)


def _share(obj: Any, rank: int, world: int, apply_padding: bool) -> Any:
    size, extra = divmod(len(obj), world)
    start = rank * size + min(rank, extra)
    end = start + size + (rank < extra)
    if isinstance(obj, dict):
        return dict(itertools.islice(obj.items(), start, end))
    share = obj[start:end]
    missing = size + (extra > 0) - (end - start)
    if not apply_padding or missing == 0:
        return share
    if isinstance(obj, torch.Tensor):
        return torch.cat([share, obj[-1:].expand(missing, *obj.shape[1:])])
    return share + type(share)([obj[-1]] * missing)
