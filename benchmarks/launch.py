"""Launch-latency benchmark: qaccel's launches against a hand-written torch.multiprocessing.spawn + gloo world and
Accelerate's ``notebook_launcher`` (fork), at world 2 and world 4, CPU ranks.

Latency of one launch = (latest time.time() any rank records right after its first barrier) minus (the caller's
time.time() when it calls the launcher). Every "first launch" sample runs in a fresh interpreter (this script
re-run with --child), so each runner's start-up is paid each time, as a user pays it running ``python train.py``.
Each is timed bare (barrier only) and with real work: a 256-wide MLP prepared (DDP) with Adam and one training
step taken before the barrier; then STEPS (200) more steps are timed (the time per step must not depend on how the ranks
were started). Samples of the runners alternate within each round.

qaccel is run three ways: as a script made with ``Accelerator()`` at its top runs it, calling at once (the server
is forked from the caller; the first launch, not waiting for its imports, gets a quick server when there is a
core per rank), the same after a second of the caller's own set-up, and with a thread running in the caller,
which makes the fork unsafe (the server is a fresh interpreter, as in a Jupyter kernel). Later launches are
timed after a bare first one and a DDP second one, whose latency is printed on its own; each is followed by the
same world forked by hand from that process (torch loaded, a gloo group, the same work), the baseline its target
compares with. qaccel's own import is compared with ``import torch``, both timed in the same run.

The set-up-first script, as many users write one, is timed apart: the model, its optimizer and the data built with
torch ops in the caller first (their OpenMP pool runs), passed to the function, which prepares them, takes a step
and reaches a barrier (call -> first step), then STEPS more steps. Spawn, the same workers forked by hand (the
floor of any launcher: the ranks inherit all the caller built and imported) and Accelerate's notebook_launcher get
the same caller and function. qaccel makes its ``Accelerator()`` last, right before ``distribute()`` (timed from
the Accelerator), or at the top of the script. A second shape makes the optimizer in the function, so
that the caller never imports torch._dynamo and the ranks need it. The same two shapes run in a Jupyter kernel
as an import cell, a set-up cell and a launch cell, back to back ("Run All") and, for qaccel, with the launch
KERNEL_PAUSE_S after the import cell. No OMP_NUM_THREADS is set unless you export it (the first line says).

    python benchmarks/launch.py            # 7 rounds
    python benchmarks/launch.py --quick    # 3 rounds
    pip install accelerate                 # first, for Accelerate's rows (skipped with a note without it)
    pip install jupyter_client ipykernel   # first, for the Jupyter kernel's rows (or --no-kernel)

Prints a table and PASS/MISS per target; exits 0 unless a run of qaccel crashes (a crashed sample of another runner
is taken again and listed at the end).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from report import mlp, row, verdict

WORLDS = (2, 4)
STEPS = 200  # timed training steps after the first
LATER_LAUNCHES = 10
LATER_VS_FORK = 2.0  # a later launch against the same world forked by hand (as tight as the 0.1 s it replaces)
IMPORT_VS_TORCH = 0.1  # qaccel's own import (torch already imported) against import torch
CHILD_TIMEOUT_S = 180
SEED_SAMPLES = 1 << 16  # the set-up-first script's data set, built in the caller
VS_ACCELERATE = 0.5  # a first launch against Accelerate's notebook_launcher (fork), same caller, same work
KERNEL_PAUSE_S = 2  # a person's pause between a notebook's import cell and its launch cell
KINDS = ("bare", "ddp")
# the set-up-first script (model, optimizer and data built in the caller first, Accelerator() last), by kind:
# "seed" makes its optimizer in the caller, "seed_fn" in the function
SEED_KINDS = ("seed", "seed_fn")
SHAPES = {"seed": "set-up-first script", "seed_fn": "set-up-first script, optimizer made in the function"}
# Same work as `import qaccel` (qaccel imports torch first), and also prints qaccel's own share on top of torch.
IMPORT_QACCEL = "import time, torch; t = time.perf_counter(); import qaccel; print(time.perf_counter() - t)"


# ---- the work every runner's ranks do: (when past the first barrier, seconds of the timed steps) ----


def _work(kind: str, prepare, barrier) -> tuple[float, float]:
    """Bare: a barrier. DDP: prepare an MLP and Adam, one step, barrier; then STEPS more steps, timed."""
    import torch

    if kind == "bare":
        barrier()
        return time.time(), 0.0
    model = mlp(32, 256)
    model, optimizer = prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    gen = torch.Generator().manual_seed(0)
    return _train(model, optimizer, torch.randn(64, 32, generator=gen), torch.randn(64, 1, generator=gen), barrier)


def _train(model, optimizer, x, y, barrier) -> tuple[float, float]:
    """One step, a barrier (the time past it: ready), STEPS more steps, a barrier: (ready, the steps' seconds)."""
    import torch

    def step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    step()
    barrier()
    ready = time.time()
    for _ in range(STEPS):
        step()
    barrier()
    return ready, time.time() - ready


def _seed_setup(kind: str):
    """The caller's own set-up in the set-up-first script: the model, its optimizer (kind "seed"; "seed_fn": the
    function makes it) and the data built with torch ops (their pools run, several threads each) before any launcher
    is called. Building an optimizer imports torch._dynamo: with "seed" the caller has it, with "seed_fn" not."""
    import torch

    model = mlp(32, 256)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3) if kind == "seed" else None
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(SEED_SAMPLES, 32, generator=gen), torch.randn(SEED_SAMPLES, 1, generator=gen)
    with torch.no_grad():
        x = (x - x.mean(0)) / x.std(0)  # normalised, as a data pipeline does: a multi-threaded op
    return model, optimizer, x, y


def _seed_work(model, optimizer, x, y, prepare, barrier) -> tuple[float, float]:
    """The set-up-first script's training function: prepare what the caller built (and an optimizer, if it made
    none), one step, barrier; then STEPS more steps."""
    import torch

    if optimizer is None:
        model = prepare(model)
        optimizer = prepare(torch.optim.Adam(model.parameters(), lr=1e-3))
    else:
        model, optimizer = prepare(model, optimizer)
    return _train(model, optimizer, x[:64], y[:64], barrier)


def _threads_per_rank(world: int) -> None:
    """What qaccel gives each rank (the cores shared out), for the runners that leave it to the user."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def _collect(out_dir: str, world: int, t_call: float) -> dict:
    times = [json.loads(Path(out_dir, f"rank-{r}").read_text()) for r in range(world)]
    ready = max(t for t, _ in times)
    return {"call": ready - t_call, "ready": ready, "steps": max(s for _, s in times)}


# ---- children: each runs in a fresh interpreter and prints one JSON line ----


def _baseline_worker(rank: int, world: int, kind: str, port: int, out_dir: str, built: tuple | None = None) -> None:
    """One rank of the hand-written baseline: gloo group over TCP, DDP by hand; ``built``: the set-up-first script's
    model, optimizer and data, from the caller."""
    import torch
    import torch.distributed as dist

    _threads_per_rank(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def prepare(model, optimizer=None):
        if optimizer is None:  # one object, as the set-up-first function passes it when it makes the optimizer
            return (
                model if isinstance(model, torch.optim.Optimizer) else torch.nn.parallel.DistributedDataParallel(model)
            )
        return torch.nn.parallel.DistributedDataParallel(model), optimizer

    work = _work(kind, prepare, dist.barrier) if built is None else _seed_work(*built, prepare, dist.barrier)
    Path(out_dir, f"rank-{rank}").write_text(json.dumps(work))
    dist.destroy_process_group()


def _free_port() -> int:
    """A port the kernel says is free now (it may be taken before use; good enough for a benchmark)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_baseline(world: int, kind: str, method: str = "spawn") -> dict:
    """What a user writes by hand: mp.spawn the workers; ``method`` "fork": fork them, the floor of any launcher
    in the set-up-first script (the ranks inherit the caller's model, data and imports)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench-baseline-") as out_dir:
        port = _free_port()
        built = _seed_setup(kind) if kind in SEED_KINDS else None
        t_call = time.time()
        mp.start_processes(
            _baseline_worker, args=(world, kind, port, out_dir, built), nprocs=world, join=True, start_method=method
        )
        return _collect(out_dir, world, t_call)


def _accelerate_worker(world: int, kind: str, out_dir: str, built: tuple | None = None) -> None:
    from accelerate import Accelerator

    _threads_per_rank(world)
    acc = Accelerator(cpu=True)
    if built is None:
        ready_steps = _work(kind, acc.prepare, acc.wait_for_everyone)
    else:
        ready_steps = _seed_work(*built, acc.prepare, acc.wait_for_everyone)
    Path(out_dir, f"rank-{acc.process_index}").write_text(json.dumps(ready_steps))


def child_accelerate(world: int, kind: str) -> dict:
    """Accelerate's notebook_launcher: forks the caller (which has imported torch and accelerate)."""
    import warnings

    import torch  # noqa: F401 - imported before the call, as in a notebook
    from accelerate import notebook_launcher

    warnings.filterwarnings("ignore", message="OMP_NUM_THREADS")
    built = _seed_setup(kind) if kind in SEED_KINDS else None
    with tempfile.TemporaryDirectory(prefix="bench-accelerate-") as out_dir:
        t_call = time.time()
        notebook_launcher(
            _accelerate_worker, args=(world, kind, out_dir, built), num_processes=world, use_port=str(_free_port())
        )
        return _collect(out_dir, world, t_call)


def _qaccel_probe(acc, kind: str):
    def probe() -> tuple[float, float]:
        return _work(kind, acc.prepare, acc.wait_for_everyone)

    return probe


def child_qaccel(world: int, kind: str, threaded: int = 0, setup: int = 0) -> dict:
    """qaccel's first launch in this interpreter, timed from the call and from the Accelerator's construction;
    ``threaded``: with a thread running in the caller; ``setup``: seconds of the caller's own work (one core busy,
    as building a model and loading data keep it) between the construction and the call."""
    if threaded:
        threading.Thread(target=time.sleep, args=(CHILD_TIMEOUT_S,), daemon=True).start()
    from qaccel import Accelerator

    t_construct = time.time()
    acc = Accelerator(nprocs=world, compute_setup="cpu")
    run = acc.distribute(_qaccel_probe(acc, kind), all_results=True)
    busy_until = time.perf_counter() + setup
    while time.perf_counter() < busy_until:
        pass
    t_call = time.time()
    results = run()
    ready = max(t for t, _ in results)
    return {
        "call": ready - t_call,
        "construct": ready - t_construct,
        "ready": ready,
        "steps": max(s for _, s in results),
    }


def child_qaccel_seed(world: int, kind: str, top: int = 0) -> dict:
    """qaccel's first launch in the set-up-first script: the model, optimizer and data built first, then
    ``Accelerator()`` right before ``distribute()`` (timed from the Accelerator's construction); ``top``: the
    Accelerator made at the top of the script instead, before the same set-up (timed from the call)."""
    from qaccel import Accelerator

    if top:
        acc = Accelerator(nprocs=world, compute_setup="cpu")
    built = _seed_setup(kind)
    t_call = time.time()
    if not top:
        acc = Accelerator(nprocs=world, compute_setup="cpu")

    def train(model, optimizer, x, y):
        return _seed_work(model, optimizer, x, y, acc.prepare, acc.wait_for_everyone)

    results = acc.distribute(train, all_results=True)(*built)
    ready = max(t for t, _ in results)
    return {"call": ready - t_call, "ready": ready, "steps": max(s for _, s in results)}


KERNEL_IMPORTS = {  # qaccel's Accelerator is made in the import cell: its server starts there, as in a script's top
    "qaccel": "import time, torch\nfrom qaccel import Accelerator\nimport launch\n"
    'acc = Accelerator(nprocs={world}, compute_setup="cpu")',
    "accelerate": "import tempfile, time, torch\nfrom accelerate import notebook_launcher\nimport launch",
}
KERNEL_LAUNCH = {
    "qaccel": """
t_call = time.time()

def train(model, optimizer, x, y):
    return launch._seed_work(model, optimizer, x, y, acc.prepare, acc.wait_for_everyone)

results = acc.distribute(train, all_results=True)(*built)
print("RESULT", max(t for t, _ in results) - t_call)
""",
    "accelerate": """
with tempfile.TemporaryDirectory() as out_dir:
    t_call = time.time()
    notebook_launcher(launch._accelerate_worker, args=({world}, "{kind}", out_dir, built), num_processes={world},
                      use_port=str(launch._free_port()))
    print("RESULT", launch._collect(out_dir, {world}, t_call)["call"])
""",
}


def child_kernel(world: int, kind: str, runner: str, pause: int = 0) -> dict:
    """A first launch in a Jupyter kernel, the set-up-first script as a notebook: an import cell (which makes qaccel's
    Accelerator), a set-up cell, then the launch cell, timed from the call; run back to back ("Run All"), or
    ``pause`` seconds after the import cell (a person running the cells)."""
    import textwrap

    import jupyter_client

    manager = jupyter_client.KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=os.path.dirname(os.path.abspath(__file__)))
    client = manager.client()
    client.start_channels()
    shown: list = []
    try:
        client.wait_for_ready(timeout=60)
        cells = [
            KERNEL_IMPORTS[runner].format(world=world),
            f"time.sleep({pause})" if pause else "",
            f"built = launch._seed_setup('{kind}')",
            KERNEL_LAUNCH[runner].format(world=world, kind=kind),
        ]
        for cell in cells:
            reply = client.execute_interactive(textwrap.dedent(cell), timeout=CHILD_TIMEOUT_S, output_hook=shown.append)
            if reply["content"]["status"] != "ok":
                raise RuntimeError(f"a cell failed in the kernel: {reply['content']}")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    text = "".join(m["content"].get("text", "") for m in shown if m["msg_type"] == "stream")
    return {"call": float(next(line for line in text.splitlines() if line.startswith("RESULT ")).split()[1])}


def _forked_world(world: int, kind: str) -> float:
    """The baseline of a later launch: ``world`` children forked from this process (torch and torch._dynamo
    loaded, as qaccel's server has them), each joining a gloo group and doing the same work as a qaccel rank, as
    Accelerate's notebook_launcher does; seconds from the call to the last rank past its barrier."""
    import torch.multiprocessing as mp

    context = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="bench-fork-") as out_dir:
        port = _free_port()
        t_call = time.time()
        procs = [
            context.Process(target=_baseline_worker, args=(rank, world, kind, port, out_dir)) for rank in range(world)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        if any(proc.exitcode for proc in procs):
            raise RuntimeError(f"a forked baseline rank exited with {[proc.exitcode for proc in procs]}")
        return _collect(out_dir, world, t_call)["call"]


def child_later(world: int, count: int) -> dict:
    """A bare launch, a DDP one right after it ("second": it may wait for the rest of the server's imports, which
    the first did not), then ``count`` more of each kind, alternating bare and DDP, each followed by the same
    launch forked by hand from this process (the baseline); their latencies."""
    import torch._dynamo  # noqa: F401 - the forked baseline starts with what qaccel's server preloads: torch, dynamo

    from qaccel import Accelerator

    acc = Accelerator(nprocs=world, compute_setup="cpu")
    runs = {kind: acc.distribute(_qaccel_probe(acc, kind), all_results=True) for kind in KINDS}
    runs["bare"]()
    t_call = time.time()
    later: dict[str, list[float]] = {"second": [max(t for t, _ in runs["ddp"]()) - t_call]}
    later.update({key: [] for kind in KINDS for key in (kind, f"fork {kind}")})
    for _ in range(count):
        for kind in KINDS:
            t_call = time.time()
            later[kind].append(max(t for t, _ in runs[kind]()) - t_call)
            later[f"fork {kind}"].append(_forked_world(world, kind))
    return later


CHILDREN = {
    "baseline": child_baseline,
    "accelerate": child_accelerate,
    "qaccel": child_qaccel,
    "qaccel_seed": child_qaccel_seed,
    "kernel": child_kernel,
    "later": child_later,
}


# ---- the driver ----


def run_child(*args: object) -> dict:
    """Run this script with --child ARGS in a fresh interpreter and return the JSON it prints last; with "start",
    the seconds from starting the interpreter to its ranks being ready (what ``python train.py`` waits)."""
    started = time.time()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise RuntimeError(f"child {' '.join(map(str, args))} exited with code {proc.returncode}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "ready" in result:
        result["start"] = result["ready"] - started
    return result


CRASHES: list[str] = []  # samples whose child died, each taken again once


def sample(label: str, *args: object) -> dict:
    """run_child, taken again once if the child died: a hand-written baseline's rank sometimes aborts in torch's
    C++ teardown ("terminate called without an active exception"). Every crash is listed at the end, and one of
    qaccel's fails the benchmark."""
    try:
        return run_child(*args)
    except RuntimeError as exc:
        CRASHES.append(f"{label}: {exc}")
        print(f"  {label}: {exc}; taken again", flush=True)
        return run_child(*args)


def time_command(code: str) -> tuple[float, str]:
    """Wall-clock seconds of ``python -c CODE`` in a fresh interpreter, and what it printed."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
    )
    return time.perf_counter() - start, proc.stdout


def _runners(with_accelerate: bool) -> list[tuple[str, tuple]]:
    """(label, child arguments after world and kind) of each runner timed on a first launch."""
    runners = [
        ("spawn", ("baseline",)),
        ("qaccel", ("qaccel",)),
        ("qaccel, caller threaded", ("qaccel", 1)),
        ("qaccel after 1 s of set-up", ("qaccel", 0, 1)),
    ]
    return runners + ([("accelerate", ("accelerate",))] if with_accelerate else [])


def _seed_runners(with_accelerate: bool) -> list[tuple[str, tuple]]:
    """(label, child arguments after world and kind) of each runner timed in the set-up-first script's shape."""
    runners = [
        ("spawn", ("baseline",)),
        ("forked by hand", ("baseline", "fork")),
        ("qaccel, Accelerator last", ("qaccel_seed",)),
        ("qaccel, Accelerator at the top", ("qaccel_seed", 1)),
    ]
    return runners + ([("accelerate", ("accelerate",))] if with_accelerate else [])


def _kernel_runners(with_accelerate: bool, with_kernel: bool) -> list[tuple[str, tuple]]:
    """(label, child arguments after world and kind) of each runner timed in a Jupyter kernel (the set-up-first
    script's shapes)."""
    if not with_kernel:
        return []
    runners = [
        ("kernel, qaccel, Run All", ("kernel", "qaccel")),
        (f"kernel, qaccel, launch {KERNEL_PAUSE_S} s after the import", ("kernel", "qaccel", KERNEL_PAUSE_S)),
    ]
    return runners + ([("kernel, accelerate, Run All", ("kernel", "accelerate"))] if with_accelerate else [])


def _child_args(args: tuple, world: int, kind: str) -> tuple:
    return (args[0], world, kind, *args[1:])


def measure_world(world: int, rounds: int, with_accelerate: bool, with_kernel: bool) -> dict:
    """First launches of every runner and kind, ``rounds`` rounds with alternating samples; later launches."""
    runs = [(label, args, kind) for kind in KINDS for label, args in _runners(with_accelerate)]
    runs += [(label, args, kind) for kind in SEED_KINDS for label, args in _seed_runners(with_accelerate)]
    runs += [
        (label, args, kind) for kind in SEED_KINDS for label, args in _kernel_runners(with_accelerate, with_kernel)
    ]
    first: dict[tuple[str, str], list[dict]] = {(label, kind): [] for label, _, kind in runs}
    for i in range(rounds):
        line = []
        for label, args, kind in runs:
            first[label, kind].append(sample(label, *_child_args(args, world, kind)))
            line.append(f"{label} {kind} {first[label, kind][-1]['call']:.2f}")
        print(f"  world {world}, round {i + 1}: " + ", ".join(line) + " s", flush=True)
    later = run_child("later", world, LATER_LAUNCHES)
    print(
        f"  world {world}, second launch (DDP, right after a bare first) {later['second'][0]:.3f} s; later launches: "
        "bare "
        + ", ".join(f"{t:.3f}" for t in later["bare"])
        + "; DDP "
        + ", ".join(f"{t:.3f}" for t in later["ddp"])
        + " s",
        flush=True,
    )
    return {"first": first, "later": later}


def report_world(world: int, data: dict, with_accelerate: bool, with_kernel: bool) -> list[tuple[bool, str]]:
    """Print the world's table; return its (passed, target) lines."""
    first, later = data["first"], data["later"]

    def med(label: str, kind: str, key: str = "call") -> float:
        return statistics.median(sample[key] for sample in first[label, kind])

    rows = []
    for kind in KINDS:
        for label, _ in _runners(with_accelerate):
            rows.append(row(f"{label}, first launch, {kind}", [s["call"] for s in first[label, kind]]))
        rows.append(row(f"qaccel, construct -> ready, {kind}", [s["construct"] for s in first["qaccel", kind]]))
        for label, _ in _runners(with_accelerate):
            rows.append(row(f"{label}, process start -> ready, {kind}", [s["start"] for s in first[label, kind]]))
        rows.append(row(f"qaccel, later launches, {kind}", later[kind]))
        rows.append(row(f"forked by hand, later launches, {kind}", later[f"fork {kind}"]))
    for label, _ in _runners(with_accelerate):
        rows.append(row(f"{label}, {STEPS} steps after the first", [s["steps"] for s in first[label, "ddp"]]))
    for kind in SEED_KINDS:
        for label, _ in _seed_runners(with_accelerate) + _kernel_runners(with_accelerate, with_kernel):
            rows.append(row(f"{SHAPES[kind]}: {label}, call -> first step", [s["call"] for s in first[label, kind]]))
        for label, _ in _seed_runners(with_accelerate):
            rows.append(row(f"{SHAPES[kind]}: {label}, {STEPS} steps", [s["steps"] for s in first[label, kind]]))
    print(f"\nworld {world}, CPU, gloo; seconds; first launches: medians of {len(first['spawn', 'bare'])} rounds")
    print(f"{'':56s} {'median':>8s} {'min':>8s} {'max':>8s}")
    for name, median, low, high in rows:
        print(f"{name:56s} {median:8.3f} {low:8.3f} {high:8.3f}")

    targets = []
    for kind in SEED_KINDS:
        for label in ("qaccel, Accelerator last", "qaccel, Accelerator at the top"):
            targets += _seed_targets(world, kind, label, med, with_accelerate)
    for kind in SEED_KINDS if with_accelerate else ():
        fork, theirs = med("forked by hand", kind), med("accelerate", kind)
        targets.append(
            (
                None,
                (
                    f"world {world}, {SHAPES[kind]}: forked by hand (os.fork, gloo, DDP; no launcher) "
                    f"{fork:.3f} s = {fork / theirs:.2f} x Accelerate ({theirs:.3f} s), the floor of a first "
                    "launch"
                ),
            )
        )
    for kind in SEED_KINDS if with_kernel and with_accelerate else ():
        ours, theirs = med("kernel, qaccel, Run All", kind), med("kernel, accelerate, Run All", kind)
        paused = med(f"kernel, qaccel, launch {KERNEL_PAUSE_S} s after the import", kind)
        targets.append(
            (
                ours <= VS_ACCELERATE * theirs,
                (
                    f"world {world}, {SHAPES[kind]} in a Jupyter kernel, Run All: "
                    f"first launch <= {VS_ACCELERATE} x Accelerate's: {ours:.3f} s = {ours / theirs:.2f} x "
                    f"{theirs:.3f} s ({paused:.3f} s = {paused / theirs:.2f} x when launched {KERNEL_PAUSE_S} s "
                    "after the import cell)"
                ),
            )
        )
    if with_accelerate:
        threaded, theirs = med("qaccel, caller threaded", "ddp"), med("accelerate", "ddp")
        targets.append(
            (
                threaded <= VS_ACCELERATE * theirs,
                (
                    f"world {world}, first launch DDP with a threaded caller "
                    f"(a Jupyter kernel's path: fresh-interpreter server) <= {VS_ACCELERATE} x Accelerate: "
                    f"{threaded:.3f} s = {threaded / theirs:.2f} x {theirs:.3f} s"
                ),
            )
        )
    for kind in KINDS:
        ours, spawn = med("qaccel", kind), med("spawn", kind)
        targets.append(
            (
                ours <= 0.6 * spawn,
                f"world {world}, first launch {kind} <= 0.6 x spawn: {ours:.3f} s = {ours / spawn:.2f} x {spawn:.3f} s",
            )
        )
    if with_accelerate:
        ours, theirs = med("qaccel", "ddp"), med("accelerate", "ddp")
        targets.append(
            (
                ours <= theirs,
                (
                    f"world {world}, first launch DDP <= Accelerate's notebook_launcher: "
                    f"{ours:.3f} s = {ours / theirs:.2f} x {theirs:.3f} s"
                ),
            )
        )
    for kind in KINDS:
        ours, fork = statistics.median(later[kind]), statistics.median(later[f"fork {kind}"])
        targets.append(
            (
                ours <= LATER_VS_FORK * fork,
                (
                    f"world {world}, later launches {kind} <= {LATER_VS_FORK} x the "
                    f"same launch forked by hand: {ours:.3f} s = {ours / fork:.2f} x {fork:.3f} s"
                ),
            )
        )
    steps, exec_steps = med("qaccel", "ddp", "steps"), med("qaccel, caller threaded", "ddp", "steps")
    targets.append(
        (
            steps <= 1.05 * exec_steps,
            (
                f"world {world}, {STEPS} steps in ranks of a first launch called at "
                f"once (quick or forked server) <= 1.05 x in ranks of a fresh-interpreter server: {steps:.3f} s = "
                f"{steps / exec_steps:.2f} x"
            ),
        )
    )
    for kind in KINDS:
        ours = med("qaccel", kind, "start")
        others = ", ".join(
            f"{label} {med(label, kind, 'start'):.3f} s"
            for label, _ in _runners(with_accelerate)
            if label != "qaccel" and "set-up" not in label
        )
        targets.append((None, f"world {world}, python process start -> ready, {kind}: qaccel {ours:.3f} s; {others}"))
    for kind in KINDS:
        targets.append(
            (
                None,
                (
                    f"world {world}, first launch {kind} after 1 s of the caller's set-up: "
                    f"{med('qaccel after 1 s of set-up', kind):.3f} s from the call (the server's imports overlap "
                    "the set-up)"
                ),
            )
        )
    targets.append(
        (
            None,
            (
                f"world {world}, second launch, DDP, right after a bare first one: {later['second'][0]:.3f} s "
                "(it waits for the rest of the server's import, which the first launch did not)"
            ),
        )
    )
    return targets


def _seed_targets(world: int, kind: str, label: str, med, with_accelerate: bool) -> list[tuple[bool | None, str]]:
    """The set-up-first script (its ``kind``), qaccel run as ``label``: first launch against Accelerate's and spawn's,
    and its steps against spawn's ranks'."""
    ours, spawn = med(label, kind), med("spawn", kind)
    name = f"world {world}, {SHAPES[kind]}, {label}"
    against = f"{ours:.3f} s = {ours / spawn:.2f} x spawn ({spawn:.3f} s)"
    if with_accelerate:
        theirs = med("accelerate", kind)
        targets = [
            (
                ours <= VS_ACCELERATE * theirs,
                (
                    f"{name}: first launch <= {VS_ACCELERATE} x Accelerate's "
                    f"notebook_launcher: {against}, {ours / theirs:.2f} x Accelerate ({theirs:.3f} s)"
                ),
            )
        ]
    else:
        targets = [(None, f"{name}: first launch {against}")]
    steps, spawn_steps = med(label, kind, "steps"), med("spawn", kind, "steps")
    return targets + [
        (
            steps <= 1.05 * spawn_steps,
            f"{name}: {STEPS} steps <= 1.05 x spawn's ranks: {steps:.3f} s = {steps / spawn_steps:.2f} x",
        )
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="rounds of first launches (default 7)")
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS), help="world sizes (default 2 4)")
    parser.add_argument("--no-kernel", action="store_true", help="skip the Jupyter kernel's rows")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    opts = parser.parse_args()

    if opts.child:
        mode, *rest = opts.child
        print(json.dumps(CHILDREN[mode](*(int(a) if a.isdigit() else a for a in rest))))
        return 0

    rounds = 3 if opts.quick else opts.runs
    if rounds < 1:
        parser.error("--runs must be at least 1")
    started = time.perf_counter()
    with_accelerate = importlib.util.find_spec("accelerate") is not None
    if not with_accelerate:
        print("note: accelerate is not installed (pip install accelerate): its rows and target are skipped")
    with_kernel = importlib.util.find_spec("jupyter_client") is not None and not opts.no_kernel
    if not with_kernel:
        print("note: the Jupyter kernel's rows are skipped (--no-kernel, or pip install jupyter_client ipykernel)")

    print(f"import time: {rounds} x (torch, qaccel), alternating ...", flush=True)
    imp_torch, imp_qaccel, imp_own = [], [], []
    for _ in range(rounds):
        imp_torch.append(time_command("import torch")[0])
        wall, own = time_command(IMPORT_QACCEL)
        imp_qaccel.append(wall)
        imp_own.append(float(own))

    threads = os.environ.get("OMP_NUM_THREADS")
    print(f"OMP_NUM_THREADS {'is ' + threads if threads else 'is not set'} in the callers", flush=True)
    print("first launches, a fresh interpreter each ...", flush=True)
    data = {world: measure_world(world, rounds, with_accelerate, with_kernel) for world in opts.worlds}
    targets = []
    for world in opts.worlds:
        targets += report_world(world, data[world], with_accelerate, with_kernel)

    own = statistics.median(imp_own)
    print(
        f"\nimport torch {statistics.median(imp_torch):.3f} s, import torch + qaccel "
        f"{statistics.median(imp_qaccel):.3f} s (python -c, medians)"
    )
    torch_s = statistics.median(imp_torch)
    targets.append(
        (
            own <= IMPORT_VS_TORCH * torch_s,
            (
                f"qaccel's own import <= {IMPORT_VS_TORCH} x import torch: "
                f"{own:.3f} s = {own / torch_s:.3f} x {torch_s:.3f} s"
            ),
        )
    )
    print("\ntargets")
    for passed, text in targets:
        print(f"  {'info' if passed is None else verdict(passed):4s}  {text}")
    print(f"\ntotal benchmark time {time.perf_counter() - started:.0f} s")
    if CRASHES:
        print("crashed samples, each taken again:\n  " + "\n  ".join(CRASHES))
    return 1 if any(crash.startswith("qaccel") for crash in CRASHES) else 0


if __name__ == "__main__":
    sys.exit(main())
