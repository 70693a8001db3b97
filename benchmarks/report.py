"""Table rows and verdicts shared by the benchmarks (imported by name: benchmarks run as scripts from here)."""

from __future__ import annotations

import statistics


def row(name: str, samples: list[float]) -> tuple[str, float, float, float]:
    """A table row: name, median, min, max."""
    return name, statistics.median(samples), min(samples), max(samples)


def verdict(ok: bool) -> str:
    """PASS or MISS: benchmarks report against their targets, they do not gate."""
    return "PASS" if ok else "MISS"
