"""accelerator.profile(): torch's profiler around a block, each rank's Chrome trace written where it was asked."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from qaccel.comm import collectives
from qaccel.comm.session import RankContext
from qaccel.handlers import ProfileKwargs, trace_path


@contextlib.contextmanager
def profile(settings: ProfileKwargs, ctx: RankContext) -> Iterator[torch.profiler.profile]:
    """Profile the block; with ``output_trace_dir``, write this rank's trace there and wait for every rank, so that
    all traces exist when any rank goes on (as Accelerate's profile() does)."""
    with settings.build() as profiler:
        yield profiler
    path = trace_path(settings, ctx.rank)
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        profiler.export_chrome_trace(path)
    except Exception as exc:
        exc.add_note(f"[qaccel] rank {ctx.rank}, writing the profiler's trace {path}")
        raise
    collectives.wait_for_everyone(ctx)
