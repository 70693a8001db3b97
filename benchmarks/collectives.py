"""Metric-reduction benchmark: acc.all_reduce_dict vs. one bare dist.all_reduce (world 2, CPU, gloo).

For 1, 8, 32 and 128 keys of Python floats (what training metrics are), per call:

    qaccel    acc.all_reduce_dict(metrics)                      (mean; floats in, floats out)
    baseline  dist.all_reduce(buf) of ONE float64 tensor with as many values, made beforehand: the floor
    info      by hand: torch.tensor(list(metrics.values())), all_reduce, / world, .tolist() back into a dict
    info      naive, 32 keys: one all_reduce per key (torch.tensor(value), all_reduce, .item()), as qadence does
              (a quarter of the calls per sample: each call is already 32 collectives)

All run in the same qaccel-launched ranks. A sample is a block of calls timed from a barrier, divided by the
number of calls, on the slowest rank. After one warm-up block of each, the blocks alternate between the ways.

    python benchmarks/collectives.py            # 7 samples of 200 calls per way and key count
    python benchmarks/collectives.py --quick    # 3 samples of 100 calls

Prints a table and PASS/MISS for the target (qaccel <= 1.3 x baseline at 32 keys); always exits 0 unless a
run crashes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from report import timed, verdict

from qaccel import Accelerator

WORLD = 2
KEYS = (1, 8, 32, 128)
NAIVE_KEYS = 32
TARGET_KEYS, TARGET = 32, 1.3


# ---- inside each rank ----


def make_metrics(count: int, rank: int) -> dict[str, float]:
    """``count`` metric-like floats, different on each rank."""
    return {f"metric_{i}": 0.25 * i + rank + 0.5 for i in range(count)}


def qaccel_block(acc: Accelerator, metrics: dict[str, float]):
    """``calls`` x acc.all_reduce_dict(metrics)."""

    def block(calls: int) -> None:
        for _ in range(calls):
            acc.all_reduce_dict(metrics)

    return block


def bare_block(count: int):
    """``calls`` x one dist.all_reduce of a ready float64 tensor of ``count`` values (reset per block)."""

    def block(calls: int) -> None:
        buf = torch.ones(count, dtype=torch.float64)
        for _ in range(calls):
            dist.all_reduce(buf)

    return block


def by_hand_block(metrics: dict[str, float]):
    """``calls`` x the same job as all_reduce_dict written by hand: pack, one all_reduce, mean, unpack."""
    world = dist.get_world_size()

    def block(calls: int) -> None:
        for _ in range(calls):
            buf = torch.tensor(list(metrics.values()), dtype=torch.float64)
            dist.all_reduce(buf)
            dict(zip(metrics, (buf / world).tolist()))

    return block


def naive_block(metrics: dict[str, float]):
    """``calls`` x one all_reduce per key, as qadence reduces its metrics."""
    world = dist.get_world_size()

    def block(calls: int) -> None:
        for _ in range(calls):
            out = {}
            for key, value in metrics.items():
                tensor = torch.tensor(value, dtype=torch.float64)
                dist.all_reduce(tensor)
                out[key] = tensor.item() / world

    return block


def rank_main(acc: Accelerator, runs: int, calls: int) -> dict:
    """Warm-up block of each way, then ``runs`` interleaved samples of each; this rank's seconds per call."""
    rank = dist.get_rank()
    ways = {}
    for count in KEYS:
        metrics = make_metrics(count, rank)
        ways[("qaccel", count)] = qaccel_block(acc, metrics)
        ways[("bare", count)] = bare_block(count)
        ways[("by_hand", count)] = by_hand_block(metrics)
    ways[("naive", NAIVE_KEYS)] = naive_block(make_metrics(NAIVE_KEYS, rank))
    naive_calls = max(1, calls // 4)

    # Check once that qaccel reduces what the baselines reduce.
    expected = {
        k: statistics.mean(make_metrics(32, r)[k] for r in range(dist.get_world_size())) for k in make_metrics(32, rank)
    }
    if acc.all_reduce_dict(make_metrics(32, rank)) != expected:
        raise RuntimeError("all_reduce_dict gave a different mean")

    out: dict[str, list[float]] = {f"{way}/{count}": [] for way, count in ways}
    for i in range(runs + 1):
        for (way, count), block in ways.items():
            seconds = timed(block, naive_calls if way == "naive" else calls)
            if i > 0:  # sample 0 is the warm-up
                out[f"{way}/{count}"].append(seconds)
    return out


# ---- the driver ----


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="samples per way and key count (default 7)")
    parser.add_argument("--calls", type=int, default=200, help="calls per sample (default 200)")
    parser.add_argument("--quick", action="store_true", help="3 samples of 100 calls")
    opts = parser.parse_args()
    runs, calls = (3, 100) if opts.quick else (opts.runs, opts.calls)
    if runs < 1 or calls < 1:
        parser.error("--runs and --calls must be at least 1")
    started = time.perf_counter()

    acc = Accelerator(nprocs=WORLD, compute_setup="cpu")
    print(
        f"(1 warm-up + {runs}) x {calls} calls per way and key count ({max(1, calls // 4)} for the naive loop), "
        f"interleaved, in one launch of {WORLD} ranks ...",
        flush=True,
    )
    per_rank = acc.distribute(rank_main, all_results=True)(acc, runs, calls)
    # A sample is the slowest rank's block; figures in microseconds per call.
    us = {name: [1e6 * max(ts) for ts in zip(*(r[name] for r in per_rank))] for name in per_rank[0]}
    med = {name: statistics.median(samples) for name, samples in us.items()}

    print(f"\nworld {WORLD}, CPU, gloo; {runs} samples of {calls} calls; microseconds per call (slowest rank)")
    print(f"{'':44s} {'median':>8s} {'min':>8s} {'max':>8s} {'ratio':>7s}")
    for count in KEYS:
        base = med[f"bare/{count}"]
        for way, label in (
            ("bare", f"dist.all_reduce, 1 tensor of {count}"),
            ("qaccel", f"acc.all_reduce_dict, {count} float keys"),
            ("by_hand", "  info: pack + all_reduce + unpack by hand"),
        ):
            samples = us[f"{way}/{count}"]
            ratio = "" if way == "bare" else f"{med[f'{way}/{count}'] / base:6.2f}x"
            print(f"{label:44s} {med[f'{way}/{count}']:8.1f} {min(samples):8.1f} {max(samples):8.1f} {ratio:>7s}")
    naive = us[f"naive/{NAIVE_KEYS}"]
    label = f"  info: naive, {NAIVE_KEYS} all_reduces (one per key)"
    print(
        f"{label:44s} {med[f'naive/{NAIVE_KEYS}']:8.1f} {min(naive):8.1f} {max(naive):8.1f} "
        f"{med[f'naive/{NAIVE_KEYS}'] / med[f'bare/{NAIVE_KEYS}']:6.2f}x"
    )

    print()
    print(
        "ratio acc.all_reduce_dict / one bare all_reduce (medians): "
        + ", ".join(f"{count} keys {med[f'qaccel/{count}'] / med[f'bare/{count}']:.2f}x" for count in KEYS)
    )
    target_ratio = med[f"qaccel/{TARGET_KEYS}"] / med[f"bare/{TARGET_KEYS}"]
    print()
    print("targets")
    print(
        f"  {verdict(target_ratio <= TARGET)}  all_reduce_dict, {TARGET_KEYS} keys <= {TARGET} x one all_reduce: "
        f"{target_ratio:.2f} x ({med[f'qaccel/{TARGET_KEYS}']:.1f} vs {med[f'bare/{TARGET_KEYS}']:.1f} us)"
    )
    print(
        f"  info  by hand, {TARGET_KEYS} keys: {med[f'by_hand/{TARGET_KEYS}'] / med[f'bare/{TARGET_KEYS}']:.2f} x; "
        f"naive one-per-key: {med[f'naive/{NAIVE_KEYS}'] / med[f'bare/{NAIVE_KEYS}']:.2f} x "
        f"= {med[f'naive/{NAIVE_KEYS}'] / med[f'qaccel/{NAIVE_KEYS}']:.1f} x qaccel"
    )
    print(f"\ntotal benchmark time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
