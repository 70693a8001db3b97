"""`qaccel env` (what qaccel sees here), `qaccel test` (a real distributed smoke test for a new machine), `qaccel
consolidate` (one model file from a checkpoint), `qaccel inspect` (what a checkpoint holds) and `qaccel where` (a
running job's ranks say where they are)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import qaccel
from qaccel.accelerator import Accelerator
from qaccel.checkpoints import folders
from qaccel.checkpoints import state as checkpoint
from qaccel.comm import hangs, session
from qaccel.environment import Environment, detect
from qaccel.environment import gpus as gpu_rule


def _accelerator(args: argparse.Namespace) -> Accelerator:
    return Accelerator(
        nprocs=1 if args.nprocs is None else args.nprocs, compute_setup=args.compute_setup, timeout=args.timeout
    )


def env_report(args: argparse.Namespace) -> int:
    """Print versions, the detected environment and the ranks/devices qaccel would use."""
    env = detect()
    gpus = gpu_rule.cuda_device_count()
    lines = [
        ("qaccel", qaccel.__version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("cuda", f"{torch.version.cuda or 'not built'}; {gpus} GPU(s) visible"),
        ("nccl", "available" if dist.is_nccl_available() else "not available"),
        ("gloo", "available" if dist.is_gloo_available() else "not available"),
        ("mpi", "available" if dist.is_mpi_available() else "not available"),
        ("environment", str(env.kind)),
    ]
    acc = _accelerator(args)
    if env.is_launched:
        lines.append(
            (
                "this process",
                f"rank {acc.rank} of {acc.world_size} (local {acc.local_rank}, node {acc.node_rank} of {env.num_nodes})",
            )
        )
        lines.append(("rendezvous", f"{env.master_addr}:{env.master_port}" if env.master_addr else "from the launcher"))
        local = env.local_world_size
    else:
        if args.nprocs is None:
            lines.append(
                (
                    "nprocs",
                    (
                        "your script's Accelerator(nprocs=N) decides; shown: N=1, "
                        "`qaccel env --nprocs N` shows the plan for N"
                    ),
                )
            )
        lines.append(
            (
                "would start",
                f"{acc.world_size} ranks on this node, forked from a torch-preloaded forkserver"
                if acc.world_size > 1
                else "nothing: fn runs in this process",
            )
        )
        lines.append(
            (
                "rendezvous",
                "TCPStore on 127.0.0.1, port picked by the kernel" if acc.world_size > 1 else "none (one process)",
            )
        )
        local = acc.world_size
    device_key = "device (rank 0)" if acc.world_size > 1 and not env.is_launched else "device"
    lines += [
        (device_key, str(acc.device)),
        ("gpu", _gpu_line(acc, env, gpus)),
        ("backend", acc.backend),
        ("log device", str(acc.log_device)),
    ]
    threads, why = session.thread_budget(local)
    lines.append(("threads per rank", f"{threads if threads is not None else torch.get_num_threads()} ({why})"))
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key:<{width}}  {value}")
    return 0


def _gpu_line(acc: Accelerator, env: Environment, seen: int) -> str:
    """Which GPU each rank takes here, and why (environment/gpus.py)."""
    if acc.device.type != "cuda":
        return f"none ({seen} visible, {gpu_rule.visible_devices()})"
    if env.is_launched:
        choice = gpu_rule.choose(env.local_rank, env.local_world_size, seen, gpu_rule.node_gpus())
        return f"{acc.device}: {choice.why()}"
    ranks = acc.world_size
    last = f"-{ranks - 1}" if ranks > 1 else ""
    return f"rank{'s' if ranks > 1 else ''} 0{last} take cuda:0{last}: {gpu_rule.choose(0, ranks, seen).why()}"


# ---- qaccel test: each check runs fn on every rank; these functions travel to the ranks by reference ----


def _identify(acc: Accelerator) -> tuple:
    return (acc.rank, acc.world_size, os.getpid(), str(acc.device))


def _reduce(acc: Accelerator) -> dict:
    return acc.all_reduce_dict({"rank": acc.rank, "one": 1.0, "vec": torch.full((3,), float(acc.rank))}, op="sum")


def _broadcast(acc: Accelerator) -> str:
    return acc.broadcast(f"from rank {acc.rank}", src=acc.world_size - 1)


def _big_result(acc: Accelerator) -> torch.Tensor:
    return torch.arange(2**20, dtype=torch.float32) + acc.rank


class SmokeTestError(Exception):
    pass


class CheckFailed(Exception):
    """A check of qaccel test found something wrong."""


def _expect(holds: bool, what: object) -> None:
    """A check that runs under ``python -O`` too, which strips ``assert``."""
    if not holds:
        raise CheckFailed(what)


def _fail_last_rank(acc: Accelerator) -> None:
    if acc.rank == acc.world_size - 1:
        raise SmokeTestError("raised on purpose by qaccel test")
    acc.wait_for_everyone()


def smoke_test(args: argparse.Namespace) -> int:
    """Launch, all-reduce, broadcast, result transfer and the error path, each checked; prints what passed."""
    acc = _accelerator(args)
    n = acc.world_size
    expected_ranks = sum(range(n))
    checks: list[tuple[str, Callable[[], str]]] = []

    def launch() -> str:
        out = acc.distribute(_identify, all_results=True)(acc)
        _expect([o[0] for o in out] == list(range(n)), f"ranks {out}")
        _expect(len({o[2] for o in out}) == n or detect().is_launched, "ranks share a process")
        return f"{n} rank(s) on {', '.join(sorted({o[3] for o in out}))}"

    def reduce() -> str:
        out = acc.distribute(_reduce)(acc)
        _expect(out["rank"] == expected_ranks and out["one"] == float(n), out)
        _expect(out["vec"].tolist() == [float(expected_ranks)] * 3, out)
        return "all_reduce_dict sum over ranks is correct"

    def broadcast() -> str:
        out = acc.distribute(_broadcast, all_results=True)(acc)
        _expect(out == [f"from rank {n - 1}"] * n, out)
        return f"every rank got rank {n - 1}'s object"

    def result() -> str:
        out = acc.distribute(_big_result)(acc)
        owner = acc.rank if detect().is_launched else 0  # in place, each rank gets its own return value
        _expect(out.shape == (2**20,) and out[-1].item() == 2**20 - 1 + owner, "wrong tensor")
        return f"4 MiB result from rank {owner} intact"

    def error_path() -> str:
        start = time.monotonic()
        try:
            acc.distribute(_fail_last_rank)(acc)
        except SmokeTestError as exc:
            _expect(any(f"rank {n - 1}" in note for note in exc.__notes__), exc.__notes__)
            return f"exception type and rank {n - 1} came back; all ranks stopped in {time.monotonic() - start:.2f} s"
        raise CheckFailed("the rank's exception did not reach the caller")

    checks = [("launch", launch), ("all-reduce", reduce), ("broadcast", broadcast), ("result", result)]
    if detect().is_launched:
        acc.print("note: ranks were started by a launcher; skipping the error-path check (it would end the job)")
    else:
        checks.append(("error path", error_path))

    passed = failed = 0
    for name, check in checks:
        start = time.monotonic()
        try:
            detail = check()
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then counted
            failed += 1
            print(f"FAIL {name} on rank {acc.rank}: {type(exc).__name__}: {exc}", flush=True)
        else:
            passed += 1
            acc.print(f"PASS {name} ({time.monotonic() - start:.2f} s): {detail}")
    acc.print(f"qaccel test: {passed} passed, {failed} failed")
    return 1 if failed else 0


def consolidate(args: argparse.Namespace) -> int:
    """One plain model file from a (sharded) save_state() checkpoint."""
    found = checkpoint.consolidate(args.checkpoint, args.out, args.model, allow_pickle=args.allow_pickle or None)
    size = os.path.getsize(args.out) / 2**20
    print(
        f"qaccel consolidate: model {args.model} of {found} -> {args.out} ({size:.1f} MiB); load it with "
        "model.load_state_dict(torch.load(path, weights_only=True))"
    )
    return 0


def inspect(args: argparse.Namespace) -> int:
    """A checkpoint's world, step and loader positions, without loading it."""
    seen = folders.inspect(args.checkpoint)
    print(f"checkpoint   {seen['path']}")
    print(f"written by   {seen['world_size']} rank(s){', sharded (FSDP)' if seen['sharded'] else ''}")
    print(f"step         {seen['step']} optimizer updates, of {seen['accumulation_steps']} micro-step(s) each")
    for i, loader in enumerate(seen["loaders"]):
        batch = loader.get("batch_size")
        per_rank = "the global batch, sliced per rank" if loader.get("split_batches") else "per rank"
        shape = f"; batch {batch} {per_rank}, global batch {loader['global_batch']}" if batch is not None else ""
        done = loader.get("done", "?")
        print(
            f"loader {i}     epoch {loader['epoch']}, {done} of the epoch's batches done by all ranks together "
            f"({loader['batches']} per rank){shape}"
        )
    return 0


def where(args: argparse.Namespace) -> int:
    """SIGUSR2 to the ranks of running jobs: each prints where it is to its own output and carries on."""
    for pid in args.pid:
        try:
            ranks = hangs.ask_where(pid)
        except FileNotFoundError:
            raise ProcessLookupError(f"no process {pid}") from None
        sent = (
            f"process {pid} (a plain launch passes it on to its ranks)"
            if ranks == [pid]
            else f"the workers of torchrun {pid}: {', '.join(map(str, ranks))}"
        )
        print(
            f"qaccel where: sent SIGUSR2 to {sent}; each rank prints where it is to its output (the terminal of a "
            "plain launch, or the rank's log) and goes on"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    doc = qaccel.__doc__  # None under python -OO
    parser = argparse.ArgumentParser(prog="qaccel", description=doc.splitlines()[0] if doc else None)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("consolidate", help="write a model of a (sharded) checkpoint as one plain state-dict file")
    p.add_argument("checkpoint", help="a save_state() checkpoint, or a folder of them (the newest is read)")
    p.add_argument("out", help="the file to write")
    p.add_argument("--model", type=int, default=0, help="which prepared model, in prepare() order (default 0)")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="read a sharded checkpoint's metadata (a pickle) even from a folder others can write",
    )
    p = sub.add_parser("inspect", help="show a checkpoint's world size, step and loader positions without loading it")
    p.add_argument("checkpoint", help="a save_state() checkpoint, or a folder of them (the newest is read)")
    p = sub.add_parser("where", help="make the ranks of a running job print where they are (SIGUSR2)")
    p.add_argument("pid", type=int, nargs="+", help="a plain launch's python process, a torchrun, or a rank")
    for name, help_text in (
        ("env", "show versions, the detected environment and what qaccel would use"),
        ("test", "run a short real distributed smoke test"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument(
            "--nprocs",
            type=int,
            default=2 if name == "test" else None,
            help="ranks to start in a plain process (env: the plan for N; default: what nprocs=1 starts)",
        )
        p.add_argument("--compute-setup", default="auto", choices=["auto", "cpu", "gpu"])
        p.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait")
    args = parser.parse_args(argv)
    try:
        commands = {
            "env": env_report,
            "test": smoke_test,
            "consolidate": consolidate,
            "inspect": inspect,
            "where": where,
        }
        return commands[args.command](args)
    except (ValueError, TypeError, RuntimeError, OSError) as exc:
        print(f"qaccel {args.command}: {exc}", file=sys.stderr)
        return 2
