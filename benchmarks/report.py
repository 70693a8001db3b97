"""Table rows and verdicts shared by the benchmarks (imported by name: benchmarks run as scripts from here)."""

from __future__ import annotations

import gc
import resource
import statistics
import time


def row(name: str, samples: list[float]) -> tuple[str, float, float, float]:
    """A table row: name, median, min, max."""
    return name, statistics.median(samples), min(samples), max(samples)


def verdict(ok: bool) -> str:
    """PASS or MISS: benchmarks report against their targets, they do not gate."""
    return "PASS" if ok else "MISS"


def resident() -> int:
    """This process's resident set, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def timed(block, calls: int) -> float:
    """Seconds per call of ``block(calls)`` on this rank, from a barrier on (garbage collected first)."""
    import torch.distributed as dist  # here: the launch benchmark's driver imports this module before torch

    gc.collect()
    dist.barrier()
    start = time.perf_counter()
    block(calls)
    return (time.perf_counter() - start) / calls


def regression_data(n: int, in_features: int):
    """``n`` samples of the synthetic regression the training benchmarks learn, in memory, the same every run."""
    import torch  # here, as in timed()
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, in_features, generator=gen)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=gen)
    return TensorDataset(x, y)


def mlp(in_features: int, hidden: int):
    """The MLP the training benchmarks train, from the same initial weights every time."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(in_features, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )
