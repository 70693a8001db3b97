"""Trainer benchmark: an epoch of qaccel's Trainer vs. the same epoch written by hand with qaccel (world 2, CPU, gloo).

All sides run in the same qaccel-launched ranks (Accelerator(nprocs=2, compute_setup="cpu")), taking turns, so
process start-up is out of the comparison and every side gets the same process group, threads and data. Same
model (an MLP 32->256->256->1), same in-memory TensorDataset, batch 32 per rank, Adam, the same batches per epoch:

  hand      an Accelerator of its own, acc.prepare(model, optimizer, loader), then per epoch: for batch in loader:
            acc.prepare_batch(batch), forward, MSE, loss.backward(), optimizer.step(), optimizer.zero_grad(), and
            the epoch's mean loss from the sum of loss.item(), as a user writes it
  csv       Trainer(model, optimizer, TrainConfig(nprocs=2, compute_setup="cpu", tracking_tool="csv",
            write_every=1, verbose=False), loss_fn="mse").fit(loader): no validation, no progress bar, the
            epoch's metrics written to the CSV file
  tb        the same with tracking_tool="tensorboard" and WriteMetrics(on="train_batch_end", called_every=1):
            the batch's metrics written to TensorBoard after every training step

Inside a rank the Trainer runs in place (a live process group: fit() starts no processes), as under torchrun.

What is timed: whole epochs, from a barrier at one epoch's start to the barrier at the next's (or at the end of
training), on rank 0; the barrier makes each interval count at the slower rank. The Trainer's marks are taken by a
callback of the benchmark's at train_epoch_start and train_end, so an interval holds all the Trainer does per
epoch (the batches, the epoch's means, writing them, the ranks' agreement on stopping, the next epoch's set-up).
Timing epochs inside the ranks, rather than whole fits of E and E+K epochs from outside, keeps launching,
prepare(), resume(), opening the tracker and the end of a fit (curves.png, the state dicts) out without having to
subtract two noisy multi-second figures. The same callback notes rank 0's time at every train_batch_start (the
hand-written loop does the same at the top of its loop), which costs a few comparisons and a list append per batch.
Every fit and hand-written run trains 1 warm-up epoch (dropped) and then --epochs timed ones; a sample is their
mean. The sides take turns one run at a time, in an order that rotates and flips every round (6 rounds cover the 6
orders), so a slow spell of the machine hits them alike.

The verdicts are on the median over launches of each launch's ratio of the medians (side / hand), as in
step_overhead.py: on the 2-core machine one launch's ratio scatters by several per cent. As info, the median
interval between two batch starts (rank 0, timed epochs) per side and its ratio, which ignores the moments another
process takes a core; and the CPU time rank 0's process (all its threads) used per timed epoch, which counts the
work each side does and not the time it waits for a core.

    python benchmarks/trainer.py             # 3 launches x 6 rounds of (hand, csv, tb), 1 + 2 epochs of 250
                                             # batches each (about 4 min on 2 cores)
    python benchmarks/trainer.py --quick     # 1 launch of 3 rounds, 1 + 1 epochs of 100 batches
    python benchmarks/trainer.py --profile   # also cProfile one more csv and tb fit per launch on rank 0

Prints per launch the samples, a table (seconds per epoch, ms per batch), the ratios to the hand-written loop with
the Trainer's overhead per batch; then the ratios per launch and PASS/MISS for the targets (csv <= 1.05 x hand,
tb <= 1.10 x hand), with the date. Always exits 0 unless a run crashes.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import datetime
import gc
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from report import mlp, regression_data, row, verdict
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator, TrainConfig, Trainer
from qaccel.callbacks import Callback, Stage, WriteMetrics

WORLD = 2
IN_FEATURES, HIDDEN = 32, 256
BATCH = 32  # per rank
BATCHES = 250  # per rank per epoch: about 1 s an epoch on the 2-core machine
EPOCHS = 2  # timed epochs per run, after 1 warm-up epoch
RUNS = 6  # rounds per launch: one run of each side per round
LAUNCHES = 3
LR = 1e-3
SIDES = ("hand", "csv", "tb")
TARGETS = {"csv": 1.05, "tb": 1.10}
ROWS = {
    "hand": "hand-written qaccel loop",
    "csv": "Trainer, csv, write_every=1",
    "tb": "Trainer, tensorboard + WriteMetrics/batch",
}


# ---- inside each rank ----


def make_dataset(batches: int) -> TensorDataset:
    """Synthetic regression data in memory: exactly ``batches`` batches per rank per epoch."""
    return regression_data(batches * BATCH * WORLD, IN_FEATURES)


def make_model() -> torch.nn.Module:
    """The MLP every side trains, from the same initial weights."""
    return mlp(IN_FEATURES, HIDDEN)


class Run(NamedTuple):
    """What one run of a side measured on this rank."""

    marks: list[tuple[float, float]]  # (wall, CPU) at each epoch's start and at the end, right after a barrier
    batch_starts: list[list[float]]  # per epoch, the time at the start of each batch
    loss: float  # the last epoch's mean loss


def mark(marks: list[tuple[float, float]]) -> None:
    """The time on this rank right after every rank reached this point, and the CPU time its process has used."""
    dist.barrier()
    marks.append((time.perf_counter(), time.process_time()))


class EpochClock(Callback):
    """The benchmark's timing callback: a mark at every train_epoch_start and at train_end, and this rank's time at
    every train_batch_start (a list per epoch)."""

    def __init__(self, marks: list[tuple[float, float]], batch_starts: list[list[float]]) -> None:
        super().__init__(Stage.TRAIN_EPOCH_START, 1)
        self.marks, self.batch_starts = marks, batch_starts

    def __call__(self, when: Stage, trainer: Any, config: Any, tracker: Any) -> None:
        if when == Stage.TRAIN_BATCH_START:
            self.batch_starts[-1].append(time.perf_counter())
        elif when == Stage.TRAIN_EPOCH_START or when == Stage.TRAIN_END:
            mark(self.marks)
            self.batch_starts.append([])


def run_hand(template: torch.nn.Module, dataset: TensorDataset, epochs: int) -> Run:
    """The loop written by hand with qaccel."""
    acc = Accelerator(nprocs=WORLD, compute_setup="cpu")
    model = copy.deepcopy(template)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(dataset, batch_size=BATCH, shuffle=True))
    marks: list[tuple[float, float]] = []
    batch_starts: list[list[float]] = []
    mean_loss = float("nan")
    for _ in range(epochs):
        mark(marks)
        batch_starts.append([])
        total, count = 0.0, 0
        for batch in loader:
            batch_starts[-1].append(time.perf_counter())
            x, y = acc.prepare_batch(batch)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item()
            count += 1
        mean_loss = total / count
    mark(marks)
    return Run(marks, batch_starts, mean_loss)


def run_trainer(side: str, template: torch.nn.Module, dataset: TensorDataset, epochs: int, folder: Path) -> Run:
    """One fit of the Trainer as ``side`` configures it, in a fresh folder."""
    model = copy.deepcopy(template)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    marks: list[tuple[float, float]] = []
    batch_starts: list[list[float]] = []
    callbacks: list[Callback] = []
    if side == "tb":
        callbacks.append(WriteMetrics(on="train_batch_end", called_every=1))
    callbacks.append(EpochClock(marks, batch_starts))  # last, so that it marks after the callbacks it times
    config = TrainConfig(
        nprocs=WORLD,
        compute_setup="cpu",
        max_iter=epochs,
        write_every=1,
        verbose=False,
        tracking_tool="csv" if side == "csv" else "tensorboard",
        callbacks=callbacks,
        log_folder=folder,
    )
    trainer = Trainer(model, optimizer, config, loss_fn="mse")
    trainer.fit(DataLoader(dataset, batch_size=BATCH, shuffle=True))
    return Run(marks, batch_starts[:-1], trainer.history[-1]["train_loss"])  # the last list: train_end's


def run_side(side: str, template: torch.nn.Module, dataset: TensorDataset, epochs: int, folder: Path) -> Run:
    if side == "hand":
        return run_hand(template, dataset, epochs)
    return run_trainer(side, template, dataset, epochs, folder)


def profiled(side: str, template: torch.nn.Module, dataset: TensorDataset, epochs: int, folder: Path) -> str:
    """One more fit of ``side`` with cProfile on (rank 0 prints what it found, the others just train)."""
    profiler = cProfile.Profile() if dist.get_rank() == 0 else None
    if profiler is not None:
        profiler.enable()
    run_side(side, template, dataset, epochs, folder)
    if profiler is None:
        return ""
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    return out.getvalue()


def rank_main(rounds: int, epochs: int, batches: int, root: str, profile: bool) -> dict[str, Any]:
    """``rounds`` rounds of one run per side, the order rotating and flipping every round. Per side and run: this
    rank's timed epochs (the warm-up dropped), the median interval between batch starts within them, and the last
    epoch's mean loss."""
    dataset = make_dataset(batches)
    template = make_model()
    out: dict[str, Any] = {side: [] for side in SIDES}
    out["batch"] = {side: [] for side in SIDES}
    out["cpu"] = {side: [] for side in SIDES}
    out["losses"] = {side: [] for side in SIDES}
    for i in range(rounds):
        order = SIDES[i % len(SIDES) :] + SIDES[: i % len(SIDES)]
        for side in order[::-1] if i // len(SIDES) % 2 else order:
            gc.collect()
            run = run_side(side, template, dataset, 1 + epochs, Path(root, f"{side}-{i}"))
            counts = [len(starts) for starts in run.batch_starts]
            if len(run.marks) != 2 + epochs or counts != [batches] * (1 + epochs):
                raise RuntimeError(
                    f"{side}: {len(run.marks)} epoch marks and batches per epoch {counts}; expected "
                    f"{2 + epochs} and {batches} each"
                )
            out[side].append([b[0] - a[0] for a, b in pairwise(run.marks[1:])])
            out["cpu"][side].append(statistics.fmean(b[1] - a[1] for a, b in pairwise(run.marks[1:])))
            out["batch"][side].append(
                statistics.median(b - a for starts in run.batch_starts[1:] for a, b in pairwise(starts))
            )
            out["losses"][side].append(run.loss)
    if profile:
        out["profiles"] = {
            side: profiled(side, template, dataset, 1 + epochs, Path(root, f"{side}-profile")) for side in ("csv", "tb")
        }
    out["threads"] = torch.get_num_threads()
    return out


# ---- the driver ----


def launch(
    acc: Accelerator, runs: int, epochs: int, batches: int, profile: bool, which: tuple[int, int]
) -> dict[str, float]:
    """One launch of the ranks: print its samples and table; its ratios of the medians (side / hand). ``which`` is
    (this launch, of how many), for the heading."""
    print(
        f"== launch {which[0]} of {which[1]}: {runs} rounds of ({', '.join(SIDES)}), each run 1 warm-up + {epochs} "
        f"timed epochs of {batches} batches, {WORLD} ranks ...",
        flush=True,
    )
    load_before = os.getloadavg()[0]
    root = tempfile.mkdtemp(prefix="qaccel-bench-trainer-")
    try:
        per_rank = acc.distribute(rank_main, all_results=True)(runs, epochs, batches, root, profile)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()[0]
    result = per_rank[0]  # rank 0's marks: each interval ends at a barrier, so it is the slower rank's
    samples = {side: [statistics.fmean(epoch_times) for epoch_times in result[side]] for side in SIDES}

    for i in range(runs):
        print(
            f"  {i + 1}: "
            + ", ".join(f"{side} {samples[side][i]:.3f} s" for side in SIDES)
            + "; ratios "
            + ", ".join(f"{side} {samples[side][i] / samples['hand'][i]:.3f}" for side in SIDES[1:]),
            flush=True,
        )
    losses = {side: statistics.median(values) for side, values in result["losses"].items()}
    print("  last epoch's mean loss (median): " + ", ".join(f"{side} {loss:.4f}" for side, loss in losses.items()))

    print(
        f"\nworld {WORLD}, CPU, gloo, {result['threads']} torch thread(s) per rank; MLP "
        f"{IN_FEATURES}->{HIDDEN}->{HIDDEN}->1, Adam, batch {BATCH} per rank, {batches} batches per epoch; "
        f"{runs} samples per row, each the mean of {epochs} epoch(s); seconds per epoch (slower rank); load "
        f"average (1 min) {load_before:.2f} before, {load_after:.2f} after (2 of it this benchmark's ranks), "
        f"{os.cpu_count()} cores"
    )
    print(f"{'':44s} {'median':>8s} {'min':>8s} {'max':>8s} {'ms/batch':>8s}")
    for side in SIDES:
        name, med, lo, hi = row(ROWS[side], samples[side])
        print(f"{name:44s} {med:8.3f} {lo:8.3f} {hi:8.3f} {1e3 * med / batches:8.3f}")

    hand = statistics.median(samples["hand"])
    ratios = {}
    for side in SIDES[1:]:
        med = statistics.median(samples[side])
        ratios[side] = med / hand
        paired = [s / h for s, h in zip(samples[side], samples["hand"])]
        print(
            f"{side}: ratio to hand (medians) {ratios[side]:.3f}; median of pairs {statistics.median(paired):.3f} "
            f"(pairs {min(paired):.3f} .. {max(paired):.3f}); overhead per batch "
            f"{1e6 * (med - hand) / batches:+.1f} us"
        )
    # Robust to the moments another process takes the core: the median interval between two batch starts (rank 0).
    single = {side: statistics.median(result["batch"][side]) for side in SIDES}
    for side in SIDES[1:]:
        ratios[f"{side} batch"] = single[side] / single["hand"]
        print(
            f"info: median single batch: {side} {1e6 * single[side]:.0f} us, hand {1e6 * single['hand']:.0f} us, "
            f"ratio {single[side] / single['hand']:.3f} ({1e6 * (single[side] - single['hand']):+.1f} us)"
        )
    # What rank 0's process (its threads included) spent on the CPU per epoch: waiting for a core another process
    # holds does not count, so this shows the work each side does with little of the machine's noise.
    cpu = {side: statistics.median(result["cpu"][side]) for side in SIDES}
    for side in SIDES[1:]:
        ratios[f"{side} cpu"] = cpu[side] / cpu["hand"]
        print(
            f"info: rank 0's CPU time per epoch: {side} {cpu[side]:.3f} s, hand {cpu['hand']:.3f} s, ratio "
            f"{cpu[side] / cpu['hand']:.3f} ({1e6 * (cpu[side] - cpu['hand']) / batches:+.1f} us per batch)"
        )
    for side, text in result.get("profiles", {}).items():
        print(f"\n== cProfile of one {side} fit on rank 0 (1 + {epochs} epochs; set-up and end of fit included)")
        print(text)
    print(flush=True)
    return ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=RUNS, help=f"rounds per launch: samples per side (default {RUNS})")
    parser.add_argument("--launches", type=int, default=LAUNCHES, help=f"launches (default {LAUNCHES})")
    parser.add_argument(
        "--epochs", type=int, default=EPOCHS, help=f"timed epochs per run, after 1 warm-up epoch (default {EPOCHS})"
    )
    parser.add_argument("--batches", type=int, default=BATCHES, help=f"batches per rank per epoch (default {BATCHES})")
    parser.add_argument("--quick", action="store_true", help="1 launch of 3 rounds, 1 timed epoch of 100 batches")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after each launch's rounds, cProfile one csv and one tb fit on rank 0 and print the top functions",
    )
    opts = parser.parse_args()
    runs, launches, epochs, batches = (
        (3, 1, 1, 100) if opts.quick else (opts.runs, opts.launches, opts.epochs, opts.batches)
    )
    if min(runs, launches, epochs, batches) < 1:
        parser.error("--runs, --launches, --epochs and --batches must be at least 1")
    started = time.perf_counter()
    today = datetime.date.today().isoformat()

    acc = Accelerator(nprocs=WORLD, compute_setup="cpu")
    per_launch = [launch(acc, runs, epochs, batches, opts.profile, (i + 1, launches)) for i in range(launches)]
    ratios = {key: statistics.median(r[key] for r in per_launch) for key in per_launch[0]}
    for key in per_launch[0]:
        print(
            f"{key}: ratio to hand per launch {', '.join(f'{r[key]:.3f}' for r in per_launch)}; "
            f"median {ratios[key]:.3f}"
        )

    print(f"\ntargets ({today}, median over {launches} launch(es) of the ratio of medians)")
    for side, target in TARGETS.items():
        print(
            f"  {verdict(ratios[side] <= target)}  {ROWS[side]} <= {target:.2f} x hand-written loop: "
            f"{ratios[side]:.3f} x"
        )
        print(
            f"  info  the same, median single batch: {ratios[f'{side} batch']:.3f} x; rank 0's CPU time per epoch: "
            f"{ratios[f'{side} cpu']:.3f} x"
        )
    print(f"\ntotal benchmark time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
