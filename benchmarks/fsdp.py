"""FSDP2 benchmark: memory held per rank (DDP vs. FSDP2) and step time of a qaccel FSDP2 loop vs. a hand-written
fully_shard loop (CPU, gloo).

The model is a stack of --layers x (Linear(--width, --width), ReLU), by default 24 x 2048 = 100.7 M parameters,
384 MiB in fp32, trained with AdamW (state: two moments and a step count per parameter) on synthetic data (batch
--batch per rank, the same data on every side). Every side starts from the same weights.

  memory (one launch per strategy and world, default worlds 2 and 4)
    Accelerator(nprocs=N, compute_setup="cpu", strategy="ddp" | "fsdp"); the AdamW optimizer is built on the
    unsharded model before acc.prepare(model, optimizer) (qaccel points it at the shards). Per step:
    loss, acc.backward(loss), optimizer.step(), optimizer.zero_grad(). After the last optimizer.step(), before
    zero_grad(), each rank adds up the bytes it holds locally: parameters, their .grad and every tensor in the
    optimizer's state (of a DTensor, its local shard). The ratio is fsdp / (ddp / N): 1.00 is the ideal 1/N.
    The process's RSS at that moment, again after glibc's malloc_trim(0) (the heap's free memory given back:
    what is live), and its peak (getrusage) are printed as info: they hold everything (torch, DDP's gradient
    buckets, FSDP's all-gathered units and communication buffers, freed memory the allocator keeps, the full
    model each rank builds before it is sharded; a forked rank's peak starts at its forkserver's).

  step time (world 2, in launches of Accelerator(nprocs=2, compute_setup="cpu", strategy="fsdp"))
    qaccel    model and AdamW built, acc.prepare(model, optimizer); per step: loss, acc.backward(loss),
              optimizer.step(), optimizer.zero_grad()
    baseline  by hand in the same ranks: init_device_mesh("cpu", (2,)), fully_shard on every Linear, then on the
              root; AdamW on the sharded parameters; per step: loss, loss.backward(), optimizer.step(),
              optimizer.zero_grad()
    Both loops are built in the same ranks (same process group, same torch threads: qaccel's cores // ranks),
    take --warmup untimed steps each, then take turns every --block steps, the order flipping every turn, so a
    slow spell of the machine hits both alike; which side is built first and goes first alternates between
    launches (an A/A check, the baseline on both sides, gave the side always built first 1.013 x over 6 launches
    of 0.967-1.040 x: within the scatter, but the alternation takes even that out). Every turn starts at a
    barrier and counts at its slowest rank. A launch's ratio is qaccel's summed turns / the baseline's; the
    verdict, PASS/MISS for qaccel <= 1.05 x baseline, is on the median over launches. Both loops must see the
    same losses and make as many FSDP units (a WARNING otherwise); their held bytes are printed side by side.

World 4 is measured for memory only: on 2 cores its 4 ranks share 2 cores, so its step times say little.

    python benchmarks/fsdp.py                  # memory at worlds 2 and 4, step time: 3 launches (~4.5 min)
    python benchmarks/fsdp.py --quick          # 8 x Linear(1024, 1024), 1 launch (~30 s)
    python benchmarks/fsdp.py --only memory    # or --only time
    python benchmarks/fsdp.py --layers 12 --width 4096 --launches 5

Always exits 0 unless a run crashes (a loss or unit mismatch between the two loops is printed as a WARNING).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import platform
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from report import resident, row, verdict
from step_overhead import timed_section
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from qaccel import Accelerator

LAYERS, WIDTH, BATCH = 24, 2048, 8
LR = 1e-4
TIME_WORLD = 2
MEMORY_WORLDS = (2, 4)
MEMORY_STEPS = 2  # optimizer steps before counting (AdamW's state exists from the first; counted after the second)
TARGET = 1.05
LOSS_RTOL = 1e-4  # the two loops' losses must agree this closely (they run the same sharded arithmetic)
MIB = 2**20
QUICK = {"layers": 8, "width": 1024, "launches": 1, "steps": 10}


# ---- inside each rank ----


def make_model(layers: int, width: int) -> torch.nn.Sequential:
    """The same initial weights on every rank and every side."""
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks)


def make_batch(step: int, width: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for ``step``: the same on every side, different on every rank."""
    gen = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds for ``tensor``: of a DTensor, its local shard."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters, gradients and optimizer state held by this rank. The optimizer's state must belong to the
    model's parameters (what it steps), or the count would be of something else: checked."""
    params = list(model.parameters())
    if {id(p) for p in optimizer.state} != {id(p) for p in params}:
        raise RuntimeError("the optimizer's state is not keyed by the model's parameters")
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
    }


def memory_probe(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Held bytes, and this process's resident set: now, after giving the allocator's free memory back to the
    system (glibc's malloc_trim, where there is one) and its peak (Linux)."""
    held, now = held_bytes(model, optimizer), resident()
    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the kernel updates it lazily: at least now
    return {"bytes": held, "rss": now, "trimmed": resident(), "peak": max(now, peak)}


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    backward,
    shape: dict,
    steps: int,
    out: dict,
    probe=memory_probe,
) -> Iterator[bool | None]:
    """The training loop as a generator: yields None first (set-up done), then True after each of ``steps``
    steps. Records each step's loss in out["losses"], the FSDP units in out["units"], and what ``probe`` finds
    after the last optimizer.step() (before zero_grad) in out["held"]."""
    out.update(losses=[], units=sum(isinstance(m, FSDPModule) for m in model.modules()))
    yield None
    for step in range(steps):
        x, y = make_batch(step, shape["width"], shape["batch"])
        loss = torch.nn.functional.mse_loss(model(x), y)
        backward(loss)
        optimizer.step()
        if step == steps - 1:
            out["held"] = probe(model, optimizer)
        optimizer.zero_grad()
        out["losses"].append(loss.detach())
        yield True


def qaccel_loop(acc: Accelerator, shape: dict, steps: int, out: dict, probe=memory_probe) -> Iterator[bool | None]:
    """qaccel's way: model and AdamW built, then acc.prepare(model, optimizer); acc.backward(loss)."""
    model = make_model(shape["layers"], shape["width"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # before prepare: qaccel remaps it to the shards
    model, optimizer = acc.prepare(model, optimizer)
    return train(model, optimizer, acc.backward, shape, steps, out, probe)


def baseline_loop(shape: dict, steps: int, out: dict) -> Iterator[bool | None]:
    """By hand with torch's fully_shard (every Linear, then the root), AdamW on the shards; loss.backward()."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model(shape["layers"], shape["width"])
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return train(model, optimizer, torch.Tensor.backward, shape, steps, out, held_bytes)


def memory_rank(acc: Accelerator, shape: dict, steps: int) -> dict:
    """MEMORY_STEPS qaccel steps of the acc's strategy; this rank's held bytes, RSS, losses and FSDP units."""
    out: dict[str, Any] = {}
    start = resident()
    for _ in qaccel_loop(acc, shape, steps, out):
        pass
    losses = [loss.item() for loss in out["losses"]]
    return out["held"] | {"start": start, "units": out["units"], "losses": losses}


def time_rank(acc: Accelerator, shape: dict, warmup: int, steps: int, block: int, launch: int) -> dict:
    """Both loops built, ``warmup`` untimed steps each, then ``steps`` timed steps each in turns of ``block``
    steps, the order flipping every turn; the side built first (it also allocates first) and the first turn's
    order alternate between launches. This rank's seconds per turn, single steps, losses and held bytes per
    side."""
    outs: dict[str, dict] = {"qaccel": {}, "baseline": {}}
    build = {
        "qaccel": lambda: qaccel_loop(acc, shape, warmup + steps, outs["qaccel"], held_bytes),
        "baseline": lambda: baseline_loop(shape, warmup + steps, outs["baseline"]),
    }
    first = ("qaccel", "baseline") if launch % 2 == 0 else ("baseline", "qaccel")  # who allocates first, too
    loops = {name: build[name]() for name in first}
    for loop in loops.values():
        next(loop)  # set-up, untimed
    for _ in range(warmup):
        for loop in loops.values():
            next(loop)
    gc.collect()
    turns: dict[str, list[float]] = {name: [] for name in loops}
    single: dict[str, dict[bool, list[float]]] = {name: {True: [], False: []} for name in loops}
    sections = [min(block, steps - start) for start in range(0, steps, block)]
    for j, count in enumerate(sections):
        order = list(loops) if j % 2 == 0 else list(loops)[::-1]  # loops: in the order built
        for name in order:
            seconds, _ = timed_section(loops[name], count, j == len(sections) - 1, single[name])
            turns[name].append(seconds)
    return {
        name: {
            "turns": turns[name],
            "steps": single[name][True],
            "bytes": outs[name]["held"],
            "units": outs[name]["units"],
            "losses": [loss.item() for loss in outs[name]["losses"]],
        }
        for name in loops
    } | {"threads": torch.get_num_threads()}


# ---- the driver ----


def describe(shape: dict) -> str:
    params = shape["layers"] * (shape["width"] ** 2 + shape["width"])
    return (
        f"{shape['layers']} x Linear({shape['width']}, {shape['width']}) + ReLU, {params / 1e6:.1f} M params "
        f"= {4 * params / MIB:.0f} MiB fp32, AdamW, batch {shape['batch']} per rank"
    )


def measure_memory(shape: dict, worlds: tuple[int, ...], min_params: int) -> dict[int, float]:
    """One launch per strategy and world; prints a row per rank and the ratios; returns world -> ratio."""
    results: dict[tuple[str, int], list[dict]] = {}
    for world in worlds:
        for strategy in ("ddp", "fsdp"):
            print(f"memory: strategy={strategy!r}, world {world} ...", flush=True)
            acc = Accelerator(nprocs=world, compute_setup="cpu", strategy=strategy, fsdp_min_params=min_params)
            started = time.perf_counter()
            results[strategy, world] = acc.distribute(memory_rank, all_results=True)(acc, shape, MEMORY_STEPS)
            print(f"  {time.perf_counter() - started:.1f} s", flush=True)

    print(f"\nmemory: {describe(shape)}; held after optimizer step {MEMORY_STEPS}, before zero_grad (MiB per rank)")
    columns = ("params", "grads", "optimizer", "total", "RSS start", "RSS", "trimmed", "peak")
    print(f"{'strategy':9s} {'world':>5s} {'rank':>4s} {'units':>5s} " + " ".join(f"{c:>9s}" for c in columns))
    for (strategy, world), per_rank in results.items():
        for rank, r in enumerate(per_rank):
            held = r["bytes"]
            figures = (
                held["params"],
                held["grads"],
                held["optimizer"],
                sum(held.values()),
                r["start"],
                r["rss"],
                r["trimmed"],
                r["peak"],
            )
            print(
                f"{strategy:9s} {world:5d} {rank:4d} {r['units']:5d} "
                + " ".join(f"{value / MIB:9.1f}" for value in figures)
            )
    print(
        "(units: FSDP modules, the root included. RSS start, RSS, trimmed, peak: the whole process's resident "
        "set when the rank began, when counting, then after malloc_trim(0), and its peak: see the docstring)\n"
    )

    ratios = {}
    for world in worlds:
        ddp = max(sum(r["bytes"].values()) for r in results["ddp", world])
        fsdp = max(sum(r["bytes"].values()) for r in results["fsdp", world])
        ratios[world] = fsdp / (ddp / world)
        ddp_loss, fsdp_loss = (results[s, world][0]["losses"] for s in ("ddp", "fsdp"))
        print(
            f"world {world}: fsdp {fsdp / MIB:.1f} MiB per rank (largest rank) vs ideal ddp / {world} = "
            f"{ddp / world / MIB:.1f} MiB: ratio {ratios[world]:.3f} (ideal 1.000); "
            f"ddp {ddp / MIB:.1f} MiB = {ddp / fsdp:.2f} x fsdp"
        )
        print(
            f"  info: rank 0's losses per step, ddp {', '.join(f'{v:.6f}' for v in ddp_loss)}; "
            f"fsdp {', '.join(f'{v:.6f}' for v in fsdp_loss)}"
        )
    print(flush=True)
    return ratios


def loss_drift(a: list[float], b: list[float]) -> float:
    """The largest relative difference between two loss curves."""
    return max(abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def measure_time(shape: dict, launches: int, warmup: int, steps: int, block: int, min_params: int) -> float:
    """``launches`` launches of both loops; prints each launch and the table; returns the median ratio."""
    ratios, samples = [], {"qaccel": [], "baseline": []}
    single: dict[str, list[float]] = {"qaccel": [], "baseline": []}
    for launch in range(launches):
        acc = Accelerator(nprocs=TIME_WORLD, compute_setup="cpu", strategy="fsdp", fsdp_min_params=min_params)
        print(
            f"step time: launch {launch + 1} of {launches}: {warmup} warm-up + {steps} timed steps per side, "
            f"turns of {block} ...",
            flush=True,
        )
        per_rank = acc.distribute(time_rank, all_results=True)(acc, shape, warmup, steps, block, launch)
        total = {}
        for name in ("qaccel", "baseline"):
            total[name] = sum(max(turn) for turn in zip(*(r[name]["turns"] for r in per_rank)))
            samples[name].append(total[name] / steps)
            single[name] += [max(s) for s in zip(*(r[name]["steps"] for r in per_rank))]
        ratios.append(total["qaccel"] / total["baseline"])
        first = per_rank[0]
        drift = max(loss_drift(r["qaccel"]["losses"], r["baseline"]["losses"]) for r in per_rank)
        held = {name: max(sum(r[name]["bytes"].values()) for r in per_rank) / MIB for name in total}
        print(
            f"  qaccel {total['qaccel'] / steps:.3f} s/step, baseline {total['baseline'] / steps:.3f} s/step, "
            f"ratio {ratios[-1]:.3f}; losses' largest relative difference {drift:.2e}; held per rank: qaccel "
            f"{held['qaccel']:.1f} MiB, baseline {held['baseline']:.1f} MiB; FSDP units: qaccel "
            f"{first['qaccel']['units']}, baseline {first['baseline']['units']}",
            flush=True,
        )
        if first["qaccel"]["units"] != first["baseline"]["units"]:
            print(
                "  WARNING: qaccel's policy made a different number of FSDP units than the hand-written loop",
                flush=True,
            )
        if drift > LOSS_RTOL:
            print(
                f"  WARNING: the two loops' losses differ by more than {LOSS_RTOL:g} (relative): qaccel "
                f"{first['qaccel']['losses']}, baseline {first['baseline']['losses']}",
                flush=True,
            )

    print(
        f"\nstep time: world {TIME_WORLD}, CPU, gloo, {first['threads']} torch thread(s) per rank; "
        f"{describe(shape)}; "
        f"{launches} launch(es) x {steps} timed steps per side; seconds per step (a launch's mean, slowest rank per "
        "turn)"
    )
    print(f"{'':40s} {'median':>8s} {'min':>8s} {'max':>8s}")
    for name, med, lo, hi in (
        row("baseline fully_shard loop", samples["baseline"]),
        row("qaccel strategy='fsdp' loop", samples["qaccel"]),
    ):
        print(f"{name:40s} {med:8.3f} {lo:8.3f} {hi:8.3f}")
    step_q, step_b = statistics.median(single["qaccel"]), statistics.median(single["baseline"])
    print(
        f"info: median single step (slowest rank): qaccel {step_q:.3f} s, baseline {step_b:.3f} s, "
        f"ratio {step_q / step_b:.3f}"
    )
    ratio = statistics.median(ratios)
    print(f"ratio per launch {', '.join(f'{r:.3f}' for r in ratios)}; median {ratio:.3f}\n", flush=True)
    return ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("memory", "time"), help="one of the two parts (default both)")
    parser.add_argument(
        "--quick", action="store_true", help="8 x Linear(1024, 1024), 1 launch of 10 timed steps per side"
    )
    parser.add_argument("--layers", type=int, help=f"Linear layers (default {LAYERS}, --quick {QUICK['layers']})")
    parser.add_argument(
        "--width", type=int, help=f"their in and out features (default {WIDTH}, --quick {QUICK['width']})"
    )
    parser.add_argument("--batch", type=int, default=BATCH, help=f"samples per rank and step (default {BATCH})")
    parser.add_argument(
        "--worlds",
        default=",".join(map(str, MEMORY_WORLDS)),
        help="worlds for the memory part, comma-separated (default 2,4)",
    )
    parser.add_argument("--launches", type=int, help=f"step-time launches (default 3, --quick {QUICK['launches']})")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side and launch (default 1)")
    parser.add_argument(
        "--steps", type=int, help=f"timed steps per side and launch (default 6, --quick {QUICK['steps']})"
    )
    parser.add_argument("--block", type=int, default=1, help="steps per turn (default 1)")
    opts = parser.parse_args()
    defaults = QUICK if opts.quick else {"layers": LAYERS, "width": WIDTH, "launches": 3, "steps": 6}
    for name, value in defaults.items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
    if min(opts.layers, opts.width, opts.batch, opts.launches, opts.steps, opts.block) < 1 or opts.warmup < 0:
        parser.error("sizes, --launches, --steps and --block must be at least 1, --warmup at least 0")
    worlds = tuple(int(w) for w in opts.worlds.split(","))
    shape = {"layers": opts.layers, "width": opts.width, "batch": opts.batch}
    # qaccel's size rule (default 1 M parameters) makes every Linear a unit of its own, as the baseline does by
    # hand; for layers smaller than that the threshold comes down to one layer so the two shard alike.
    min_params = min(1_000_000, opts.width**2 + opts.width)
    started = time.perf_counter()

    verdicts = []
    if opts.only in (None, "memory"):
        for world, ratio in measure_memory(shape, worlds, min_params).items():
            verdicts.append(f"  info  world {world}: fsdp bytes held / (ddp / {world}): {ratio:.3f} (ideal 1.000)")
    if opts.only in (None, "time"):
        ratio = measure_time(shape, opts.launches, opts.warmup, opts.steps, opts.block, min_params)
        verdicts.append(
            f"  {verdict(ratio <= TARGET)}  qaccel fsdp step <= {TARGET} x hand-written fully_shard "
            f"(world {TIME_WORLD}): {ratio:.3f} x"
        )
    print("targets")
    print("\n".join(verdicts))
    print(f"\ntotal benchmark time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
