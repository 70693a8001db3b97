"""What debug mode costs: qaccel collectives and a training step with Accelerator(debug=True) vs. off (world 2, CPU).

Debug mode all-reduces a digest of each qaccel collective's name and shapes before making it. Per call, in the
same qaccel-launched ranks:

    baseline  by hand with torch: pack 8 floats, dist.all_reduce, unpack (what all_reduce_dict does)
    off       acc.all_reduce_dict of 8 floats, debug off (the default): its tracking costs ~1 us
    on        the same with debug on
    step      a DDP training step of a small MLP plus acc.all_reduce_dict({"loss": ...}), off and on
    barrier   acc.wait_for_everyone(), off and on

Debug is switched by the session's flag between blocks (``session.current_run().debug``, what ``debug=True`` sets),
so the ways alternate in the same ranks instead of in two launches. A sample is a block of calls timed from a
barrier, per call, on the slowest rank; medians over the samples.

    python benchmarks/debug_mode.py            # 7 samples of 200 calls (50 steps)
    python benchmarks/debug_mode.py --quick    # 3 samples of 100 calls (25 steps)

Prints a table and PASS/MISS for the targets (debug off <= 1.3 x the hand-written baseline; debug on adds at
most 50% to the training step); always exits 0 unless a run crashes.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.distributed as dist
from report import row, timed, verdict

from qaccel import Accelerator
from qaccel.comm import session

WORLD = 2
OFF_TARGET, STEP_TARGET = 1.3, 1.5


def rank_main(acc: Accelerator, runs: int, calls: int) -> dict[str, list[float]]:
    run = session.current_run()
    metrics = {f"m{i}": 0.5 * i + acc.rank for i in range(8)}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = acc.prepare(model, optimizer)
    x, y = torch.randn(32, 64), torch.randn(32, 1)

    def by_hand(n: int) -> None:
        for _ in range(n):
            buf = torch.tensor(list(metrics.values()), dtype=torch.float64)
            dist.all_reduce(buf)
            dict(zip(metrics, (buf / WORLD).tolist()))

    def reduce(n: int) -> None:
        for _ in range(n):
            acc.all_reduce_dict(metrics)

    def barrier(n: int) -> None:
        for _ in range(n):
            acc.wait_for_everyone()

    def step(n: int) -> None:
        for _ in range(n):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            optimizer.step()
            acc.all_reduce_dict({"loss": loss.item()})

    ways = {
        "baseline": (by_hand, False, calls),
        "off": (reduce, False, calls),
        "on": (reduce, True, calls),
        "step off": (step, False, calls // 4),
        "step on": (step, True, calls // 4),
        "barrier off": (barrier, False, calls),
        "barrier on": (barrier, True, calls),
    }
    out: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(runs + 1):
        for name, (block, debug, n) in ways.items():
            run.debug = debug
            seconds = timed(block, n)
            if i > 0:  # sample 0 warms up
                out[name].append(seconds)
    run.debug = False
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="3 samples of 100 calls")
    opts = parser.parse_args()
    runs, calls = (3, 100) if opts.quick else (opts.runs, opts.calls)
    acc = Accelerator(nprocs=WORLD, compute_setup="cpu")
    per_rank = acc.distribute(rank_main, all_results=True)(acc, runs, calls)
    slowest = {name: [max(r[name][i] for r in per_rank) for i in range(runs)] for name in per_rank[0]}
    print(
        f"debug mode, world {WORLD}, CPU/gloo, torch {torch.__version__}: {runs} samples, us per call (median, min, max)"
    )
    for name, samples in slowest.items():
        label, median, low, high = row(name, [s * 1e6 for s in samples])
        print(f"  {label:12s} {median:9.1f} {low:9.1f} {high:9.1f}")
    med = {name: statistics.median(samples) for name, samples in slowest.items()}
    off, on, step = med["off"] / med["baseline"], med["on"] / med["off"], med["step on"] / med["step off"]
    print(f"all_reduce_dict, debug off / by hand: {off:.2f} x  (target <= {OFF_TARGET}) {verdict(off <= OFF_TARGET)}")
    print(f"all_reduce_dict, debug on / off:      {on:.2f} x  (info: one 2-number all_reduce more per call)")
    print(f"barrier, debug on / off:              {med['barrier on'] / med['barrier off']:.2f} x  (info)")
    print(
        f"training step, debug on / off:        {step:.2f} x  (target <= {STEP_TARGET}) {verdict(step <= STEP_TARGET)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
