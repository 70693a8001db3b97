"""Per-step overhead benchmark: a training loop through qaccel vs. the same loop written by hand (world 2, CPU, gloo).

Both loops run in the same qaccel-launched ranks, taking turns, so process start-up is out of the comparison
and both get the same process group, threads and data:

    qaccel    acc.prepare(model, optimizer, loader), then per step acc.prepare_batch(batch), forward, backward,
              optimizer.step()
    baseline  DistributedDataParallel(model) + DataLoader(sampler=DistributedSampler(...)), sampler.set_epoch
              per epoch, explicit .to(device) per batch

Only the loop is timed (iterating the DataLoader included; prepare() and building the baseline are not). In each
sample both loops are set up, then take turns every 20 steps (--block), the order flipping every turn, so a slow
spell of the machine hits both alike. Every turn starts at a barrier and counts at its slowest rank; a sample is
the sum of its turns. One warm-up sample comes first.

    python benchmarks/step_overhead.py            # 25 samples per side
    python benchmarks/step_overhead.py --quick    # 3 samples per side

Prints a table and PASS/MISS for the target (qaccel <= 1.03 x baseline, ratio of the medians); always exits 0
unless a run crashes. On a 2-core machine two copies of the same loop differ by up to about 2-4 % from one run to
the next, so read a ratio within a few % of 1 as "no measurable overhead".
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from typing import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from qaccel import Accelerator
from report import row, verdict

WORLD = 2
IN_FEATURES, HIDDEN = 32, 256
BATCH = 32  # per rank
STEPS = 200
EPOCHS = 2  # STEPS are spread over this many epochs, so the per-epoch reshuffle is in the loop too
LR = 0.01
TARGET = 1.03
INFO = {"Accelerate": 1.15, "qadence": 1.39}  # ratios measured elsewhere, printed for comparison only
BLOCK = 20  # steps per timed section; the two loops take turns every BLOCK steps
_END = object()


# ---- inside each rank ----


def make_dataset(steps: int) -> TensorDataset:
    """Synthetic regression data: exactly steps / EPOCHS batches per rank per epoch."""
    gen = torch.Generator().manual_seed(0)
    n = steps // EPOCHS * BATCH * WORLD
    x = torch.randn(n, IN_FEATURES, generator=gen)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=gen)
    return TensorDataset(x, y)


def make_model() -> torch.nn.Module:
    """The small MLP both sides train, with the same initial weights."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1),
    )


def qaccel_steps(acc: Accelerator, template: torch.nn.Module, dataset: TensorDataset) -> Iterator[None]:
    """The qaccel loop as a generator: prepare() before the first yield, then one training step per yield."""
    model = copy.deepcopy(template)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    yield  # set-up done
    for _ in range(EPOCHS):
        for batch in loader:
            x, y = acc.prepare_batch(batch)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            yield


def baseline_steps(acc: Accelerator, template: torch.nn.Module, dataset: TensorDataset) -> Iterator[None]:
    """The hand-written loop as a generator: DDP + DistributedSampler built before the first yield, then one
    training step per yield, with set_epoch and .to(device) by hand."""
    device = acc.device
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(copy.deepcopy(template).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    yield  # set-up done
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            yield


def timed_section(steps: Iterator[None], count: int, last: bool, step_times: list[float]) -> float:
    """Seconds this rank spends on the next ``count`` steps, from a barrier on; the ``last`` section also runs
    the loop to its end (the DataLoader's final StopIteration), and checks that no step was left over.
    Each step's own duration is appended to ``step_times``."""
    dist.barrier()
    start = previous = time.perf_counter()
    for _ in range(count):
        if next(steps, _END) is _END:
            raise RuntimeError("the loop has fewer steps than expected")
        now = time.perf_counter()
        step_times.append(now - previous)
        previous = now
    if last and next(steps, _END) is not _END:
        raise RuntimeError("the loop has more steps than expected")
    return time.perf_counter() - start


def rank_main(acc: Accelerator, runs: int, steps: int, block: int) -> dict:
    """One warm-up of each side, then ``runs`` samples of each; this rank's seconds per section and per step.

    Within a sample both loops are set up, then run ``block`` steps at a time in turn, the order flipping every
    section (A B, B A, A B, ...), so that a slow spell of the machine hits both sides alike.
    """
    dataset = make_dataset(steps)
    template = make_model()
    out: dict[str, list] = {"qaccel": [], "baseline": [], "qaccel_steps": [], "baseline_steps": []}
    makers = (("qaccel", qaccel_steps), ("baseline", baseline_steps))
    sections = [min(block, steps - start) for start in range(0, steps, block)]
    for i in range(runs + 1):
        loops = {name: make(acc, template, dataset) for name, make in makers}
        for loop in loops.values():
            next(loop)  # set-up, untimed
        gc.collect()
        times: dict[str, list[float]] = {name: [] for name in loops}
        for j, count in enumerate(sections):
            order = list(loops) if (i + j) % 2 == 0 else list(loops)[::-1]
            for name in order:
                step_times = out[f"{name}_steps"] if i > 0 else []  # sample 0 is the warm-up
                times[name].append(timed_section(loops[name], count, j == len(sections) - 1, step_times))
        if i > 0:
            for name, sample in times.items():
                out[name].append(sample)
        del loops
    out["threads"] = torch.get_num_threads()
    return out


# ---- the driver ----






def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=25, help="samples per side after one warm-up each (default 25)")
    parser.add_argument("--quick", action="store_true", help="3 samples per side")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps per sample (default {STEPS})")
    parser.add_argument("--block", type=int, default=BLOCK,
                        help=f"steps per timed section before the other loop takes its turn (default {BLOCK}); "
                             "--block equal to --steps alternates whole loops")
    opts = parser.parse_args()
    runs = 3 if opts.quick else opts.runs
    if runs < 1 or opts.block < 1:
        parser.error("--runs and --block must be at least 1")
    if opts.steps < EPOCHS or opts.steps % EPOCHS:
        parser.error(f"--steps must be a positive multiple of {EPOCHS}")
    started = time.perf_counter()

    acc = Accelerator(nprocs=WORLD, compute_setup="cpu")
    print(f"{opts.steps} steps x (1 warm-up + {runs}) per side, taking turns every {opts.block} steps, in one launch "
          f"of {WORLD} ranks ...", flush=True)
    per_rank = acc.distribute(rank_main, all_results=True)(acc, runs, opts.steps, opts.block)

    # Each timed section counts at its slowest rank; a sample is the sum of its sections.
    def samples(name: str) -> list[float]:
        return [sum(max(section) for section in zip(*by_rank)) for by_rank in zip(*(r[name] for r in per_rank))]

    qaccel, baseline = samples("qaccel"), samples("baseline")
    paired = [q / b for q, b in zip(qaccel, baseline)]
    for i, (q, b) in enumerate(zip(qaccel, baseline)):
        print(f"  {i + 1}: qaccel {q:.3f} s, baseline {b:.3f} s, ratio {q / b:.3f}", flush=True)

    print(f"\nworld {WORLD}, CPU, gloo, {per_rank[0]['threads']} torch thread(s) per rank; MLP "
          f"{IN_FEATURES}->{HIDDEN}->{HIDDEN}->1, batch {BATCH} per rank, {opts.steps} steps over {EPOCHS} epochs; "
          f"{runs} samples per row; seconds per {opts.steps} steps (slowest rank per section)")
    print(f"{'':40s} {'median':>8s} {'min':>8s} {'max':>8s} {'ms/step':>8s}")
    for name, med, lo, hi in (row("baseline DDP+DistributedSampler loop", baseline),
                              row("qaccel prepare+prepare_batch loop", qaccel)):
        print(f"{name:40s} {med:8.3f} {lo:8.3f} {hi:8.3f} {1e3 * med / opts.steps:8.3f}")

    base_med, q_med = statistics.median(baseline), statistics.median(qaccel)
    ratio = q_med / base_med
    print()
    print(f"ratio qaccel / baseline (medians):          {ratio:.3f}")
    print(f"ratio qaccel / baseline (median of pairs):  {statistics.median(paired):.3f}   "
          f"(pairs range {min(paired):.3f} .. {max(paired):.3f})")
    print(f"qaccel overhead per step (medians):         {1e6 * (q_med - base_med) / opts.steps:+.1f} us")
    # Robust to the rare slow step (a late wake-up in gloo): the median single step, at the slower rank.
    step_q = max(statistics.median(r["qaccel_steps"]) for r in per_rank)
    step_b = max(statistics.median(r["baseline_steps"]) for r in per_rank)
    print(f"info: median single step: qaccel {1e6 * step_q:.0f} us, baseline {1e6 * step_b:.0f} us, "
          f"ratio {step_q / step_b:.3f} ({1e6 * (step_q - step_b):+.1f} us)")
    print()
    print("targets")
    print(f"  {verdict(ratio <= TARGET)}  qaccel loop <= {TARGET} x baseline: {ratio:.3f} x")
    for name, value in INFO.items():
        print(f"  info  {name} on its own benchmark: {value:.2f} x")
    print(f"\ntotal benchmark time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
