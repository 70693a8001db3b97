"""Accelerate's launch functions, so that a notebook or script written for Accelerate changes only its import:
``notebook_launcher`` and ``debug_launcher`` run the function on ranks of this machine through distribute(), and
return rank 0's result where Accelerate's return None."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from qaccel.accelerator import Accelerator
from qaccel.options import MIXED_PRECISION_VARIABLE, MixedPrecision, MixedPrecisionName


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int | None = None,
    mixed_precision: MixedPrecisionName | MixedPrecision = "no",
    use_port: str = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
) -> Any:
    """``function(*args)`` on ``num_processes`` ranks of this machine, as Accelerate's notebook_launcher; returns
    rank 0's result.

    ``mixed_precision`` reaches every Accelerator the function makes without one, Accelerate's and qaccel's (as
    ``ACCELERATE_MIXED_PRECISION``); ``max_restarts`` restarts all ranks after a failure; a
    ``log_line_prefix_template`` prefixes each line with its rank, as qaccel's ``[rank N]``. The rendezvous
    arguments (``use_port``, ``master_addr``, ``rdzv_backend``, ``rdzv_endpoint``, ``rdzv_conf``, ``rdzv_id``,
    ``monitor_interval``) have nothing to set: the ranks meet at a port the kernel gives qaccel's store, so two
    launches never collide. Several nodes are torchrun's or SLURM's work, and are refused saying so.
    """
    if num_processes is None:
        raise ValueError("notebook_launcher() needs num_processes=...: the number of ranks to start on this machine")
    if num_nodes != 1 or node_rank != 0:
        raise ValueError(
            f"notebook_launcher(num_nodes={num_nodes}, node_rank={node_rank}): qaccel starts ranks on "
            "this machine only; for several nodes run the script under torchrun (its c10d rendezvous) "
            "or SLURM, or give Accelerator(cluster=qaccel.SlurmCluster(nodes=...))"
        )
    accelerator = Accelerator(
        nprocs=num_processes,
        mixed_precision=mixed_precision,
        max_restarts=max_restarts,
        rank_prefix=log_line_prefix_template is not None,
    )
    with _ranks_environment(**{MIXED_PRECISION_VARIABLE: accelerator.mixed_precision.value}):
        return accelerator.distribute(function)(*args)


def debug_launcher(function: Callable[..., Any], args: tuple[Any, ...] = (), num_processes: int = 2) -> Any:
    """``function(*args)`` on ``num_processes`` ranks that use the CPU only, as Accelerate's debug_launcher (its
    ranks see no GPU and ``ACCELERATE_USE_CPU``, so an Accelerator made in them computes on the CPU); returns rank
    0's result."""
    accelerator = Accelerator(nprocs=num_processes, compute_setup="cpu", mixed_precision="no")
    with _ranks_environment(CUDA_VISIBLE_DEVICES="", ACCELERATE_USE_CPU="yes", **{MIXED_PRECISION_VARIABLE: "no"}):
        return accelerator.distribute(function)(*args)


@contextlib.contextmanager
def _ranks_environment(**variables: str) -> Iterator[None]:
    """Variables for the ranks of the launch inside the block (ranks take the caller's environment at the call);
    the caller's own are back afterwards."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
