"""Per-step overhead benchmark: a training loop through qaccel vs. the same loop written by hand (world 2, CPU, gloo).

Three comparisons, each in launches of its own (one Accelerator per launch); in each, both loops run in the same
qaccel-launched ranks, taking turns, so process start-up is out of the comparison and both get the same
process group, threads and data:

  plain (Accelerator(nprocs=2, compute_setup="cpu"))
    qaccel    acc.prepare(model, optimizer, loader), then per step acc.prepare_batch(batch), forward, backward,
              optimizer.step()
    baseline  DistributedDataParallel(model) + DataLoader(sampler=DistributedSampler(...)), sampler.set_epoch
              per epoch, explicit .to(device) per batch

  resume (Accelerator(nprocs=2, compute_setup="cpu")), per step:
    qaccel    the plain qaccel loop after acc.resume(dir): its step boundaries are check points of the stop on a
              signal (a counter and a comparison; a thread per rank reads the store every half second)
    baseline  the plain baseline

  accumulate (Accelerator(..., gradient_accumulation_steps=2)), per micro-step:
    qaccel    with acc.accumulate(model): forward, acc.backward(loss), optimizer.step(), optimizer.zero_grad()
              (the prepared optimizer does nothing on accumulation micro-steps)
    baseline  the same DDP loop by hand: model.no_sync() on accumulation micro-steps, (loss / 2).backward(),
              optimizer.step() and zero_grad() only on micro-steps that sync (every 2nd and an epoch's last)

Only the loop is timed (iterating the DataLoader included; prepare() and building the baseline are not). In each
sample both loops are set up, then take turns every 20 steps (--block), the order flipping every turn, so a slow
spell of the machine hits both alike. Every turn starts at a barrier and counts at its slowest rank; a sample is
the sum of its turns. One warm-up sample comes first. Both sides of a comparison must do the same number of
optimizer updates per sample (checked).

    python benchmarks/step_overhead.py                     # all three comparisons, 5 launches x 8 samples per side
    python benchmarks/step_overhead.py --only accumulate   # one of them (plain, accumulate or resume)
    python benchmarks/step_overhead.py --launches 15       # a tighter median (~2.5 min per comparison)
    python benchmarks/step_overhead.py --quick             # 1 launch, 3 samples per side

Prints a table per launch and PASS/MISS for the targets (qaccel <= 1.03 x baseline): the median over launches
of each launch's ratio of the medians. Always exits 0 unless a run crashes. Why several launches: on this
2-core machine a launch's ratio scatters with a standard deviation of about 4.5 % around its mean (measured
over 30 launches), though samples within a launch agree far better; a single launch decides a 3 % target by
chance, and even a median of 5 launches moves by about +-2 %.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from report import mlp, regression_data, row, verdict
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from qaccel import Accelerator

WORLD = 2
IN_FEATURES, HIDDEN = 32, 256
BATCH = 32  # per rank
STEPS = 200
EPOCHS = 2  # STEPS are spread over this many epochs, so the per-epoch reshuffle is in the loop too
LR = 0.01
TARGET = 1.03
BLOCK = 20  # steps per timed section; the two loops take turns every BLOCK steps
ACCUMULATE = 2  # micro-steps per optimizer update in the accumulation comparison
_END = object()


# ---- inside each rank ----


def make_dataset(steps: int) -> TensorDataset:
    """Synthetic regression data: exactly steps / EPOCHS batches per rank per epoch."""
    return regression_data(steps // EPOCHS * BATCH * WORLD, IN_FEATURES)


def make_model() -> torch.nn.Module:
    """The small MLP both sides train, with the same initial weights."""
    return mlp(IN_FEATURES, HIDDEN)


def qaccel_setup(acc: Accelerator, template: torch.nn.Module, dataset: TensorDataset) -> tuple:
    """What both qaccel loops build: a copy of the model, its optimizer and a shuffled loader, prepared."""
    model = copy.deepcopy(template)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return acc.prepare(model, optimizer, DataLoader(dataset, batch_size=BATCH, shuffle=True))


def qaccel_steps(
    acc: Accelerator, template: torch.nn.Module, dataset: TensorDataset, resume_dir: str | None = None
) -> Iterator[bool | None]:
    """The qaccel loop as a generator: prepare() (and resume(resume_dir): no checkpoint there, nothing saved)
    before the first yield, then one training step per yield (yielding True: every step updates)."""
    model, optimizer, loader = qaccel_setup(acc, template, dataset)
    if resume_dir is not None:
        acc.resume(resume_dir)
    yield None  # set-up done
    for _ in range(EPOCHS):
        for batch in loader:
            x, y = acc.prepare_batch(batch)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            yield True


def qaccel_resume_steps(acc: Accelerator, template: torch.nn.Module, dataset: TensorDataset) -> Iterator[bool | None]:
    """The plain qaccel loop after ``resume()``: every step boundary is a check point of the stop on a signal. A
    fresh Accelerator per sample, so that its first prepared optimizer is this sample's and drives the count
    (acc.step) of the boundaries."""
    fresh = Accelerator(nprocs=WORLD, compute_setup="cpu")
    never_written = os.path.join(tempfile.gettempdir(), "qaccel-bench-no-checkpoints")  # resume() only reads it
    return qaccel_steps(fresh, template, dataset, resume_dir=never_written)


def hand_written_setup(device: torch.device, template: torch.nn.Module, dataset: TensorDataset) -> tuple:
    """What both baselines build by hand: a DDP copy of the model, its optimizer, a DistributedSampler and loader."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(copy.deepcopy(template).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    return model, optimizer, sampler, DataLoader(dataset, batch_size=BATCH, sampler=sampler)


def baseline_steps(acc: Accelerator, template: torch.nn.Module, dataset: TensorDataset) -> Iterator[bool | None]:
    """The hand-written loop as a generator: DDP + DistributedSampler built before the first yield, then one
    training step per yield, with set_epoch and .to(device) by hand."""
    device = acc.device
    model, optimizer, sampler, loader = hand_written_setup(device, template, dataset)
    yield None  # set-up done
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            yield True


def qaccel_accumulate_steps(
    acc: Accelerator, template: torch.nn.Module, dataset: TensorDataset
) -> Iterator[bool | None]:
    """The qaccel accumulation loop (``acc`` built with gradient_accumulation_steps=ACCUMULATE): prepare() before
    the first yield, then one micro-step per yield, yielding whether it updated."""
    model, optimizer, loader = qaccel_setup(acc, template, dataset)
    yield None  # set-up done
    for _ in range(EPOCHS):
        for batch in loader:
            x, y = acc.prepare_batch(batch)
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            yield acc.sync_gradients


def baseline_accumulate_steps(
    acc: Accelerator, template: torch.nn.Module, dataset: TensorDataset
) -> Iterator[bool | None]:
    """The hand-written accumulation loop: DDP + DistributedSampler built before the first yield, then one
    micro-step per yield, yielding whether it updated. Gradients stay local (no_sync) except on every
    ACCUMULATE-th micro-step of an epoch and on its last batch, where the optimizer steps and zeroes them."""
    device = acc.device
    model, optimizer, sampler, loader = hand_written_setup(device, template, dataset)
    yield None  # set-up done
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        last = len(loader) - 1
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            sync = (i + 1) % ACCUMULATE == 0 or i == last
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = torch.nn.functional.mse_loss(model(x), y)
                (loss / ACCUMULATE).backward()
            if sync:
                optimizer.step()
                optimizer.zero_grad()
            yield sync


Loop = Callable[[Accelerator, torch.nn.Module, TensorDataset], Iterator[bool | None]]
COMPARISONS: dict[str, tuple[tuple[str, Loop], tuple[str, Loop]]] = {
    "plain": (("qaccel", qaccel_steps), ("baseline", baseline_steps)),
    "accumulate": (("qaccel", qaccel_accumulate_steps), ("baseline", baseline_accumulate_steps)),
    "resume": (("qaccel", qaccel_resume_steps), ("baseline", baseline_steps)),
}


def timed_section(
    steps: Iterator[bool | None], count: int, last: bool, step_times: dict[bool, list[float]]
) -> tuple[float, int]:
    """Seconds this rank spends on the next ``count`` steps, from a barrier on, and how many of them updated;
    the ``last`` section also runs the loop to its end (the DataLoader's final StopIteration), and checks that no
    step was left over. Each step's own duration is appended to ``step_times[updated]``."""
    updates = 0
    dist.barrier()
    start = previous = time.perf_counter()
    for _ in range(count):
        updated = next(steps, _END)
        if updated is _END:
            raise RuntimeError("the loop has fewer steps than expected")
        now = time.perf_counter()
        step_times[bool(updated)].append(now - previous)
        previous = now
        updates += bool(updated)
    if last and next(steps, _END) is not _END:
        raise RuntimeError("the loop has more steps than expected")
    return time.perf_counter() - start, updates


def rank_main(acc: Accelerator, comparison: str, runs: int, steps: int, block: int) -> dict:
    """One warm-up of each side of ``comparison``, then ``runs`` samples of each; this rank's seconds per section
    and per step, and the optimizer updates per sample (the same on both sides, or an error).

    Within a sample both loops are set up, then run ``block`` steps at a time in turn, the order flipping every
    section (A B, B A, A B, ...), so that a slow spell of the machine hits both sides alike.
    """
    dataset = make_dataset(steps)
    template = make_model()
    out: dict[str, Any] = {"qaccel": [], "baseline": []}
    # per side, single-step durations: [True] steps that updated, [False] accumulation micro-steps
    out.update({f"{name}_steps": {True: [], False: []} for name, _ in COMPARISONS[comparison]})
    makers = COMPARISONS[comparison]
    sections = [min(block, steps - start) for start in range(0, steps, block)]
    for i in range(runs + 1):
        loops = {name: make(acc, template, dataset) for name, make in makers}
        for loop in loops.values():
            next(loop)  # set-up, untimed
        gc.collect()
        times: dict[str, list[float]] = {name: [] for name in loops}
        updates = dict.fromkeys(loops, 0)
        for j, count in enumerate(sections):
            order = list(loops) if (i + j) % 2 == 0 else list(loops)[::-1]
            for name in order:
                step_times = out[f"{name}_steps"] if i > 0 else {True: [], False: []}  # sample 0: warm-up
                seconds, done = timed_section(loops[name], count, j == len(sections) - 1, step_times)
                times[name].append(seconds)
                updates[name] += done
        if len(set(updates.values())) != 1:
            raise RuntimeError(f"{comparison}: the two loops did different numbers of optimizer updates: {updates}")
        out["updates"] = updates["qaccel"]
        if i > 0:
            for name, sample in times.items():
                out[name].append(sample)
        del loops
    out["threads"] = torch.get_num_threads()
    return out


# ---- the driver ----

# Per comparison: what the Accelerator gets, the table's row names, what one step is called.
SETUPS = {
    "plain": {
        "accelerator": {},
        "title": "plain loop",
        "rows": ("baseline DDP+DistributedSampler loop", "qaccel prepare+prepare_batch loop"),
        "step": "step",
    },
    "accumulate": {
        "accelerator": {"gradient_accumulation_steps": ACCUMULATE},
        "title": f"gradient accumulation, {ACCUMULATE} micro-steps per update",
        "rows": ("baseline DDP+no_sync loop", "qaccel accumulate+backward loop"),
        "step": "micro-step",
    },
    "resume": {
        "accelerator": {},
        "title": "plain loop after acc.resume(): armed to stop on SIGTERM/USR1",
        "rows": ("baseline DDP+DistributedSampler loop", "qaccel loop after resume()"),
        "step": "step",
    },
}


def compare(comparison: str, runs: int, steps: int, block: int, launch: tuple[int, int]) -> float:
    """Launch the ranks for one comparison with its own Accelerator, print its pairs and table; the ratio of the
    medians (qaccel / baseline). ``launch`` is (this launch, of how many), for the heading."""
    setup = SETUPS[comparison]
    step = setup["step"]
    acc = Accelerator(nprocs=WORLD, compute_setup="cpu", **setup["accelerator"])
    print(f"== {comparison}: {setup['title']} (launch {launch[0]} of {launch[1]})", flush=True)
    print(
        f"{steps} {step}s x (1 warm-up + {runs}) per side, taking turns every {block} {step}s, in one launch "
        f"of {WORLD} ranks ...",
        flush=True,
    )
    per_rank = acc.distribute(rank_main, all_results=True)(acc, comparison, runs, steps, block)

    # Each timed section counts at its slowest rank; a sample is the sum of its sections.
    def samples(name: str) -> list[float]:
        return [sum(max(section) for section in zip(*by_rank)) for by_rank in zip(*(r[name] for r in per_rank))]

    qaccel, baseline = samples("qaccel"), samples("baseline")
    paired = [q / b for q, b in zip(qaccel, baseline)]
    for i, (q, b) in enumerate(zip(qaccel, baseline)):
        print(f"  {i + 1}: qaccel {q:.3f} s, baseline {b:.3f} s, ratio {q / b:.3f}", flush=True)

    print(
        f"\n{comparison}: world {WORLD}, CPU, gloo, {per_rank[0]['threads']} torch thread(s) per rank; MLP "
        f"{IN_FEATURES}->{HIDDEN}->{HIDDEN}->1, batch {BATCH} per rank, {steps} {step}s over {EPOCHS} epochs, "
        f"{per_rank[0]['updates']} optimizer updates (both sides); {runs} samples per row; "
        f"seconds per {steps} {step}s (slowest rank per section)"
    )
    per_step = "ms/" + ("step" if step == "step" else "micro")
    print(f"{'':40s} {'median':>8s} {'min':>8s} {'max':>8s} {per_step:>8s}")
    for name, med, lo, hi in (row(setup["rows"][0], baseline), row(setup["rows"][1], qaccel)):
        print(f"{name:40s} {med:8.3f} {lo:8.3f} {hi:8.3f} {1e3 * med / steps:8.3f}")

    base_med, q_med = statistics.median(baseline), statistics.median(qaccel)
    ratio = q_med / base_med
    print()
    print(f"ratio qaccel / baseline (medians):          {ratio:.3f}")
    print(
        f"ratio qaccel / baseline (median of pairs):  {statistics.median(paired):.3f}   "
        f"(pairs range {min(paired):.3f} .. {max(paired):.3f})"
    )
    print(f"qaccel overhead per {step + ' (medians):':24s}{1e6 * (q_med - base_med) / steps:+.1f} us")
    # Robust to the rare slow step (a late wake-up in gloo): the median single step, at the slower rank.
    # With accumulation the two kinds of micro-step (all-reduce or not) differ ~3 x, so each gets its own line.
    accumulating = bool(per_rank[0]["qaccel_steps"][False])
    kinds = ((True, f"{step} that updates" if accumulating else step), (False, f"{step} that accumulates"))
    for updated, kind in kinds:
        if not per_rank[0]["qaccel_steps"][updated]:
            continue
        step_q = max(statistics.median(r["qaccel_steps"][updated]) for r in per_rank)
        step_b = max(statistics.median(r["baseline_steps"][updated]) for r in per_rank)
        print(
            f"info: median single {kind}: qaccel {1e6 * step_q:.0f} us, baseline {1e6 * step_b:.0f} us, "
            f"ratio {step_q / step_b:.3f} ({1e6 * (step_q - step_b):+.1f} us)"
        )
    print(f"info: this launch's ratio {ratio:.3f}", flush=True)
    print(flush=True)
    return ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--runs", type=int, default=8, help="samples per side and launch, after one warm-up each (default 8)"
    )
    parser.add_argument("--launches", type=int, default=5, help="launches per comparison (default 5)")
    parser.add_argument("--quick", action="store_true", help="1 launch, 3 samples per side")
    parser.add_argument(
        "--only",
        choices=tuple(COMPARISONS),
        help="run one comparison: plain (the plain loop) or accumulate (gradient accumulation, "
        f"k={ACCUMULATE}); default both, plain first",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=STEPS,
        help=f"training steps (micro-steps when accumulating) per sample (default {STEPS})",
    )
    parser.add_argument(
        "--block",
        type=int,
        default=BLOCK,
        help=f"steps per timed section before the other loop takes its turn (default {BLOCK}); "
        "--block equal to --steps alternates whole loops",
    )
    opts = parser.parse_args()
    runs, launches = (3, 1) if opts.quick else (opts.runs, opts.launches)
    if min(runs, launches, opts.block) < 1:
        parser.error("--runs, --launches and --block must be at least 1")
    if opts.steps < EPOCHS or opts.steps % EPOCHS:
        parser.error(f"--steps must be a positive multiple of {EPOCHS}")
    started = time.perf_counter()

    ratios = {}
    for name in COMPARISONS:
        if opts.only in (None, name):
            per_launch = [compare(name, runs, opts.steps, opts.block, (i + 1, launches)) for i in range(launches)]
            ratios[name] = statistics.median(per_launch)
            print(
                f"{name}: ratio per launch {', '.join(f'{r:.3f}' for r in per_launch)}; median {ratios[name]:.3f}\n",
                flush=True,
            )

    print("targets (median over launches)")
    for name, ratio in ratios.items():
        print(f"  {verdict(ratio <= TARGET)}  {name}: qaccel loop <= {TARGET} x baseline: {ratio:.3f} x")
    print(f"\ntotal benchmark time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
