"""Table rows and verdicts shared by the benchmarks (imported by name: benchmarks run as scripts from here)."""

from __future__ import annotations

import gc
import statistics
import time


def row(name: str, samples: list[float]) -> tuple[str, float, float, float]:
    """A table row: name, median, min, max."""
    return name, statistics.median(samples), min(samples), max(samples)


def verdict(ok: bool) -> str:
    """PASS or MISS: benchmarks report against their targets, they do not gate."""
    return "PASS" if ok else "MISS"


def timed(block, calls: int) -> float:
    """Seconds per call of ``block(calls)`` on this rank, from a barrier on (garbage collected first)."""
    import torch.distributed as dist  # here: the launch benchmark's driver imports this module before torch

    gc.collect()
    dist.barrier()
    start = time.perf_counter()
    block(calls)
    return (time.perf_counter() - start) / calls
