"""Cost of starting an epoch's DataLoader workers inside a rank: qaccel vs a hand-written torch world (world 2, CPU).

Each epoch of a DataLoader with num_workers=2 (not persistent) starts two worker processes in every rank. The time
from ``iter(loader)`` to the first batch is that start-up; it is measured on every rank for every epoch, and a
sample is the slowest rank's. The Dataset class is defined in this script, as users write it. The sides run in
the same invocation, alternating runs:

1. baseline: the loop written by hand (env:// gloo group, ``DataLoader(sampler=DistributedSampler(...))``,
   ``set_epoch``), run under ``torchrun --standalone --nproc_per_node 2``: workers are forked from the rank;
2. qaccel: ``Accelerator(nprocs=2).distribute`` of the same loop over ``acc.prepare(loader)``;
3. info: the hand-written loop under ``torch.multiprocessing.spawn``, whose ranks default to the spawn start
   method for their own children, so every epoch's workers start a fresh interpreter.

    python benchmarks/loader_workers.py            # 5 runs x 8 epochs per side
    python benchmarks/loader_workers.py --quick    # 2 runs x 5 epochs

Prints medians, the ratio qaccel / torchrun and PASS/MISS for qaccel <= 1.5 x torchrun; exits 0 even on a MISS.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from report import row, verdict
from torch.utils.data import DataLoader, Dataset, DistributedSampler

WORLD = 2
TARGET = 1.5


class Samples(Dataset):
    """Defined in the script: workers that cannot reach ``__main__`` cannot load it."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((16,), float(i))


def _epoch_starts(loader, epochs: int, set_epoch=None) -> list[float]:
    """Seconds from iter() to the first batch, per epoch; the rest of each epoch is consumed untimed."""
    starts = []
    for epoch in range(epochs):
        if set_epoch is not None:
            set_epoch(epoch)
        t = time.perf_counter()
        batches = iter(loader)
        next(batches)
        starts.append(time.perf_counter() - t)
        for _ in batches:
            pass
    return starts


def _hand_written(rank: int, epochs: int) -> list[float] | None:
    """The loop by hand in an initialised gloo group; rank 0 gets the slowest rank's time per epoch."""
    sampler = DistributedSampler(Samples(), num_replicas=WORLD, rank=rank, shuffle=True)
    loader = DataLoader(Samples(), batch_size=8, sampler=sampler, num_workers=2)
    starts = _epoch_starts(loader, epochs, sampler.set_epoch)
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, starts)
    dist.destroy_process_group()
    return [max(per_epoch) for per_epoch in zip(*everyone)] if rank == 0 else None


def _spawned_rank(rank: int, port: int, epochs: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    starts = _hand_written(rank, epochs)
    if starts is not None:
        Path(out).write_text(json.dumps(starts))


def spawned(epochs: int) -> list[float]:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "starts"))
        mp.spawn(_spawned_rank, args=(port, epochs, out), nprocs=WORLD, join=True)
        return json.loads(Path(out).read_text())


def torchrun(epochs: int) -> list[float]:
    """This script's --torchrun-rank mode under torchrun; rank 0 prints the times as its last line."""
    with tempfile.TemporaryDirectory() as log_dir:  # else torchrun leaves a torchelastic_* dir in the temp dir
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--log-dir",
                log_dir,
                "--standalone",
                "--nproc_per_node",
                str(WORLD),
                os.path.abspath(__file__),
                "--torchrun-rank",
                str(epochs),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            check=False,
        )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise RuntimeError(f"torchrun exited with code {proc.returncode}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("[")][-1])


def _qaccel_rank(acc, epochs: int) -> list[float]:
    loader = acc.prepare(DataLoader(Samples(), batch_size=8, shuffle=True, num_workers=2))
    starts = _epoch_starts(loader, epochs)
    return [max(per_epoch) for per_epoch in zip(*acc.gather_object([starts]))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs per side (default 5)")
    parser.add_argument("--epochs", type=int, default=8, help="epochs per run (default 8)")
    parser.add_argument("--quick", action="store_true", help="2 runs of 5 epochs")
    parser.add_argument("--torchrun-rank", type=int, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.torchrun_rank is not None:
        dist.init_process_group("gloo")
        starts = _hand_written(dist.get_rank(), opts.torchrun_rank)
        if starts is not None:
            print(json.dumps(starts), flush=True)
        return 0
    runs, epochs = (2, 5) if opts.quick else (opts.runs, opts.epochs)

    from qaccel import Accelerator

    acc = Accelerator(nprocs=WORLD, compute_setup="cpu")
    run_qaccel = acc.distribute(_qaccel_rank)
    run_qaccel(acc, 1)  # the forkserver's one torch import is launch cost, measured by launch.py
    base, ours, spawn = [], [], []
    for i in range(runs):
        base += torchrun(epochs)
        ours += run_qaccel(acc, epochs)
        spawn += spawned(epochs)
        print(
            f"  run {i + 1}: torchrun {statistics.median(base[-epochs:]):.4f} s, qaccel "
            f"{statistics.median(ours[-epochs:]):.4f} s, mp.spawn {statistics.median(spawn[-epochs:]):.4f} s "
            f"(medians over {epochs} epochs)",
            flush=True,
        )

    print(
        f"\nworld {WORLD}, CPU, gloo, num_workers=2; iter(loader) -> first batch, slowest rank; "
        f"{runs} runs x {epochs} epochs per side; seconds"
    )
    print(f"{'':48s} {'median':>8s} {'min':>8s} {'max':>8s}")
    rows = (
        row("hand-written loop under torchrun (baseline)", base),
        row("qaccel prepare(), python script.py", ours),
        row("hand-written loop under mp.spawn (info)", spawn),
    )
    for name, med, lo, hi in rows:
        print(f"{name:48s} {med:8.4f} {lo:8.4f} {hi:8.4f}")
    ratio = statistics.median(ours) / statistics.median(base)
    print(
        f"\nratio qaccel / torchrun (medians): {ratio:.2f};  mp.spawn / torchrun: "
        f"{statistics.median(spawn) / statistics.median(base):.1f}"
    )
    print(f"  {verdict(ratio <= TARGET)}  an epoch's workers start in <= {TARGET} x the time under torchrun")
    return 0


if __name__ == "__main__":
    sys.exit(main())
