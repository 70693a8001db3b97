"""Launch-latency benchmark: qaccel vs. a hand-written torch.multiprocessing.spawn + gloo world of 2 CPU ranks.

Latency of one launch = (latest time.time() any rank records right after its first barrier) minus (the
parent's time.time() when it calls the distributed function). Every "first launch" sample runs in a fresh
interpreter (this script re-run with --child), so qaccel's forkserver start is paid each time, as a user pays it.
Each kind of launch is timed bare (barrier only) and with real work: the model prepared (DDP) and one training
step taken before the barrier, against the same written by hand (DistributedDataParallel).

    python benchmarks/launch.py            # 7 samples per row
    python benchmarks/launch.py --quick    # 3 samples per row

Prints a table and PASS/MISS per target; always exits 0 unless a run crashes.
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

from report import row, verdict

WORLD = 2
LATER_LAUNCHES = 10
CHILD_TIMEOUT_S = 120
# Same work as `import qaccel` (qaccel imports torch first), and also prints qaccel's own share on top of torch.
IMPORT_QACCEL = "import time, torch; t = time.perf_counter(); import qaccel; print(time.perf_counter() - t)"


# ---- children: each runs in a fresh interpreter and prints one JSON line ----


def _baseline_worker(rank: int, port: int, out_dir: str) -> None:
    """One rank of the hand-written baseline: join the gloo group, barrier, write the time, tear down."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    dist.barrier()
    ready = time.time()
    Path(out_dir, f"rank-{rank}").write_text(repr(ready))
    dist.destroy_process_group()


def _train_one_step(model, optimizer) -> None:
    import torch

    loss = model(torch.ones(8, 32)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _baseline_ddp_worker(rank: int, port: int, out_dir: str) -> None:
    """One rank of the hand-written baseline with real work: gloo group, DDP model, one step, barrier."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 1))
    _train_one_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    dist.barrier()
    Path(out_dir, f"rank-{rank}").write_text(repr(time.time()))
    dist.destroy_process_group()


def _free_port() -> int:
    """A port the kernel says is free now (it may be taken before use; good enough for a benchmark)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_baseline(prepared: int = 0) -> dict:
    """What a user writes by hand: mp.spawn two workers that each init a gloo group over TCP (and, with
    ``prepared``, wrap a model in DDP and take one step)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench-baseline-") as out_dir:
        port = _free_port()
        t_call = time.time()
        mp.spawn(_baseline_ddp_worker if prepared else _baseline_worker, args=(port, out_dir), nprocs=WORLD, join=True)
        ready = max(float(Path(out_dir, f"rank-{r}").read_text()) for r in range(WORLD))
    return {"call": ready - t_call}


def _make_probe(acc):
    """The distributed function: barrier, then report when this rank got past it."""

    def probe() -> float:
        acc.wait_for_everyone()
        return time.time()

    return probe


def _make_prepared_probe(acc):
    """The distributed function with real work: prepare a model and optimizer (DDP), one step, barrier."""

    def probe() -> float:
        import torch

        model = torch.nn.Linear(32, 1)
        model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        _train_one_step(model, optimizer)
        acc.wait_for_everyone()
        return time.time()

    return probe


def _timed_launch(run) -> float:
    """Seconds from calling ``run`` to the last rank passing its barrier."""
    t_call = time.time()
    return max(run()) - t_call


def child_first(prepared: int = 0) -> dict:
    """qaccel's first launch in this interpreter, timed from the call and from the Accelerator's construction."""
    from qaccel import Accelerator

    t_construct = time.time()
    acc = Accelerator(nprocs=WORLD, compute_setup="cpu")
    run = acc.distribute((_make_prepared_probe if prepared else _make_probe)(acc), all_results=True)
    t_call = time.time()
    ready = max(run())
    return {"call": ready - t_call, "construct": ready - t_construct}


def child_later(count: int) -> dict:
    """One launch to warm up, then ``count`` more of each kind, alternating bare and prepared; their latencies."""
    from qaccel import Accelerator

    acc = Accelerator(nprocs=WORLD, compute_setup="cpu")
    bare = acc.distribute(_make_probe(acc), all_results=True)
    prepared = acc.distribute(_make_prepared_probe(acc), all_results=True)
    first = _timed_launch(bare)
    later, later_prepared = [], []
    for _ in range(count):
        later.append(_timed_launch(bare))
        later_prepared.append(_timed_launch(prepared))
    return {"first": first, "later": later, "later_prepared": later_prepared}


# ---- the driver ----


def run_child(*args: str) -> dict:
    """Run this script with --child ARGS in a fresh interpreter and return the JSON it prints last."""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", *args],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise RuntimeError(f"child {' '.join(args)} exited with code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def time_command(code: str) -> tuple[float, str]:
    """Wall-clock seconds of ``python -c CODE`` in a fresh interpreter, and what it printed."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S)
    return time.perf_counter() - start, proc.stdout






def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="samples per row (default 7)")
    parser.add_argument("--quick", action="store_true", help="3 samples per row")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    opts = parser.parse_args()

    if opts.child:
        mode, *rest = opts.child
        result = {"baseline": child_baseline, "first": child_first, "later": child_later}[mode](*map(int, rest))
        print(json.dumps(result))
        return 0

    runs = 3 if opts.quick else opts.runs
    if runs < 1:
        parser.error("--runs must be at least 1")
    started = time.perf_counter()

    print(f"import time: {runs} x (torch, qaccel), interleaved ...", flush=True)
    imp_torch, imp_qaccel, imp_own = [], [], []
    for i in range(runs):
        imp_torch.append(time_command("import torch")[0])
        wall, own = time_command(IMPORT_QACCEL)
        imp_qaccel.append(wall)
        imp_own.append(float(own))
        print(f"  {i + 1}: torch {imp_torch[-1]:.3f} s, qaccel {imp_qaccel[-1]:.3f} s", flush=True)

    print(f"first launch: {runs} x (baseline, qaccel, baseline DDP, qaccel prepare), interleaved, fresh interpreter "
          "each ...", flush=True)
    baseline, first_call, first_construct, baseline_ddp, first_prepared = [], [], [], [], []
    for i in range(runs):
        baseline.append(run_child("baseline")["call"])
        sample = run_child("first")
        first_call.append(sample["call"])
        first_construct.append(sample["construct"])
        baseline_ddp.append(run_child("baseline", "1")["call"])
        first_prepared.append(run_child("first", "1")["call"])
        print(f"  {i + 1}: baseline {baseline[-1]:.3f} s, qaccel {first_call[-1]:.3f} s; with DDP + 1 step: "
              f"baseline {baseline_ddp[-1]:.3f} s, qaccel {first_prepared[-1]:.3f} s", flush=True)

    print(f"later launches: 1 + {LATER_LAUNCHES} of each kind in one interpreter ...", flush=True)
    later_runs = run_child("later", str(LATER_LAUNCHES))
    later, later_prepared = later_runs["later"], later_runs["later_prepared"]
    print("  bare:     " + ", ".join(f"{t:.3f}" for t in later) + " s", flush=True)
    print("  prepared: " + ", ".join(f"{t:.3f}" for t in later_prepared) + " s", flush=True)

    rows = [
        row("import torch (python -c)", imp_torch),
        row("import qaccel (python -c)", imp_qaccel),
        row("  qaccel's own share (after torch)", imp_own),
        row("baseline mp.spawn+gloo, call->ready", baseline),
        row("qaccel first launch, call->ready", first_call),
        row("qaccel first launch, construct->ready", first_construct),
        row(f"qaccel later launches (2..{LATER_LAUNCHES + 1})", later),
        row("baseline mp.spawn+DDP+1 step, call->ready", baseline_ddp),
        row("qaccel first launch, prepare+1 step", first_prepared),
        row("qaccel later launches, prepare+1 step", later_prepared),
    ]
    print(f"\nworld {WORLD}, CPU, gloo; {runs} samples per row ({LATER_LAUNCHES} for later launches); seconds")
    print(f"{'':40s} {'median':>8s} {'min':>8s} {'max':>8s}")
    for name, med, lo, hi in rows:
        print(f"{name:40s} {med:8.3f} {lo:8.3f} {hi:8.3f}")

    base_med = statistics.median(baseline)
    call_med = statistics.median(first_call)
    construct_med = statistics.median(first_construct)
    later_med = statistics.median(later)
    later_prepared_med = statistics.median(later_prepared)
    ddp_ratio = statistics.median(first_prepared) / statistics.median(baseline_ddp)
    import_diff = statistics.median(imp_qaccel) - statistics.median(imp_torch)
    min_diff = min(imp_qaccel) - min(imp_torch)
    print()
    print(f"import qaccel - import torch (medians): {import_diff:+.3f} s   (minimums: {min_diff:+.3f} s)")
    print(f"ratio qaccel first / baseline, call->ready:      {call_med / base_med:.2f}")
    print(f"ratio qaccel first / baseline, construct->ready: {construct_med / base_med:.2f}")
    print(f"ratio qaccel first / baseline, with DDP + 1 step: {ddp_ratio:.2f}")
    print()
    print("targets")
    print(f"  {verdict(call_med <= 0.6 * base_med)}  first launch (call->ready) <= 0.6 x baseline: "
          f"{call_med:.3f} vs {0.6 * base_med:.3f} s")
    print(f"  {verdict(later_med <= 0.1)}  later launches <= 0.1 s: {later_med:.3f} s")
    print(f"  {verdict(later_prepared_med <= 0.15)}  later launches with prepare (DDP) + 1 step <= 0.15 s: "
          f"{later_prepared_med:.3f} s")
    print(f"  info  first launch with DDP + 1 step: {ddp_ratio:.2f} x the hand-written DDP baseline")
    own_med = statistics.median(imp_own)
    print(f"  {verdict(own_med <= 0.1)}  import qaccel <= import torch + 0.1 s: qaccel's own import {own_med:.3f} s")
    print(f"  info  difference of whole-interpreter medians (noisy): {import_diff:+.3f} s")
    print(f"  info  first launch (construct->ready): {construct_med:.3f} s = {construct_med / base_med:.2f} x baseline")
    print(f"\ntotal benchmark time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
