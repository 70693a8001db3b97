"""Validate and resolve the Accelerator's arguments once, in the caller, so mistakes fail at construction."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from qaccel.environment import Environment

COMPUTE_SETUPS = ("auto", "cpu", "gpu")
LOG_SETUPS = ("auto", "cpu")
START_METHODS = ("forkserver", "spawn")
MIXED_PRECISIONS = ("no", "bf16", "fp16")
STRATEGIES = ("ddp", "fsdp")
FSDP_MIN_PARAMS = 1_000_000


@dataclass(frozen=True)
class Config:
    """What every rank needs to set itself up; small and picklable so it travels to the ranks."""

    nprocs: int
    device_type: str
    log_device_type: str
    backend: str
    dtype: torch.dtype | None
    timeout: float
    start_method: str
    gradient_accumulation_steps: int = 1
    mixed_precision: str = "no"
    max_restarts: int = 0
    strategy: str = "ddp"
    fsdp_modules: tuple[str, ...] = ()  # class names (MRO-matched), not classes: picklable, and __main__-proof
    fsdp_min_params: int = FSDP_MIN_PARAMS
    debug: bool = False  # check that every rank calls the same collective with the same shapes
    rank_prefix: bool = False  # "[rank N] " before each line the ranks of a plain launch print


DEBUG_VARIABLE = "QACCEL_DEBUG"


def _backends() -> tuple[str, ...]:
    return ("gloo", "nccl") + (("mpi",) if dist.is_mpi_available() else ())


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


def cuda_device_count() -> int:
    """GPUs visible here, counted through NVML where possible so the caller's CUDA stays uninitialised."""
    return torch.cuda.device_count()


def make_config(
    nprocs: int,
    compute_setup: str,
    log_setup: str,
    backend: str | None,
    dtype: torch.dtype | None,
    timeout: float | datetime.timedelta,
    start_method: str,
    env: Environment,
    gradient_accumulation_steps: int = 1,
    mixed_precision: str = "no",
    max_restarts: int = 0,
    strategy: str = "ddp",
    fsdp_modules: Sequence[type | str] | None = None,
    fsdp_min_params: int = FSDP_MIN_PARAMS,
    debug: bool | None = None,
    rank_prefix: bool = False,
) -> Config:
    """Check every argument and resolve the 'auto' choices; raises ValueError/TypeError/RuntimeError."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int; got {nprocs!r}")
    _choice("compute_setup", compute_setup, COMPUTE_SETUPS)
    _choice("log_setup", log_setup, LOG_SETUPS)
    _choice("start_method", start_method, START_METHODS)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.float64) or None; got {dtype!r}")
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"dtype must be a floating-point or complex torch.dtype (it casts models and inputs); got {dtype}")
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta; got {timeout!r}")

    gpus = cuda_device_count()
    if compute_setup == "gpu" and gpus == 0:
        raise RuntimeError("compute_setup='gpu' but CUDA is not available here; use 'auto' or 'cpu'")
    device_type = "cuda" if compute_setup == "gpu" or (compute_setup == "auto" and gpus > 0) else "cpu"

    if backend is None:
        backend = "nccl" if device_type == "cuda" else "gloo"
    _choice("backend", backend, _backends())
    if backend == "nccl" and device_type == "cpu":
        raise ValueError("backend='nccl' needs GPU compute; use backend='gloo' (or None) with compute_setup='cpu'")
    if backend == "nccl" and not dist.is_nccl_available():
        raise RuntimeError("backend='nccl' but this torch build has no NCCL; use backend='gloo'")

    local_ranks = env.local_world_size if env.is_launched else nprocs
    if device_type == "cuda" and local_ranks > gpus:
        raise RuntimeError(
            f"{local_ranks} GPU ranks on this node but only {gpus} visible GPU(s); "
            f"lower nprocs or use compute_setup='cpu'"
        )
    steps = gradient_accumulation_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be a positive int; got {steps!r}")
    _choice("mixed_precision", mixed_precision, MIXED_PRECISIONS)
    if mixed_precision == "fp16" and device_type != "cuda":
        raise ValueError("mixed_precision='fp16' needs GPU compute (its gradient scaler is CUDA-only); use 'bf16' on CPU")
    if mixed_precision != "no" and dtype is not None and dtype != torch.float32:
        raise ValueError(
            f"mixed_precision={mixed_precision!r} runs float32 models in half precision; with dtype={dtype} use "
            "mixed_precision='no' (or dtype=None/torch.float32)"
        )
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a non-negative int; got {max_restarts!r}")
    debug = _debug_choice(debug)
    if not isinstance(rank_prefix, bool):
        raise TypeError(f"rank_prefix must be True or False; got {rank_prefix!r}")
    modules = _sharding_choices(strategy, fsdp_modules, fsdp_min_params, mixed_precision, backend)
    log_device_type = device_type if log_setup == "auto" else "cpu"
    return Config(
        nprocs, device_type, log_device_type, backend, dtype, float(timeout), start_method, steps, mixed_precision,
        max_restarts, strategy, modules, fsdp_min_params, debug, rank_prefix,
    )


def _debug_choice(debug: bool | None) -> bool:
    """``debug``, or with None the QACCEL_DEBUG variable ("1"/"0", "true"/"false", ...; unset: off)."""
    if debug is not None:
        if not isinstance(debug, bool):
            raise TypeError(f"debug must be True, False or None (None: the {DEBUG_VARIABLE} variable); got {debug!r}")
        return debug
    value = os.environ.get(DEBUG_VARIABLE, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{DEBUG_VARIABLE} must be 1/true/yes/on or 0/false/no/off (or unset); got {value!r}")


def _sharding_choices(
    strategy: str, modules: Sequence[type | str] | None, min_params: int, mixed_precision: str, backend: str
) -> tuple[str, ...]:
    """Check the strategy's arguments; fsdp_modules as class names."""
    _choice("strategy", strategy, STRATEGIES)
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 1:
        raise ValueError(f"fsdp_min_params must be a positive int (parameters per sharded unit); got {min_params!r}")
    if strategy != "fsdp":
        if modules is not None or min_params != FSDP_MIN_PARAMS:
            raise ValueError(f"fsdp_modules and fsdp_min_params apply to strategy='fsdp' only; got strategy={strategy!r}")
        return ()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"strategy='fsdp' runs on backend 'gloo' (CPU) or 'nccl' (GPU); got backend={backend!r}")
    if mixed_precision == "fp16":
        raise ValueError("strategy='fsdp' supports mixed_precision 'no' or 'bf16' (FSDP2's MixedPrecisionPolicy); "
                         "fp16 needs a sharded gradient scaler qaccel does not provide")
    if modules is None:
        return ()
    if isinstance(modules, (str, type)) or not all(isinstance(m, (str, type)) for m in modules) or not modules:
        raise TypeError(f"fsdp_modules must be a non-empty list of module classes (or class names); got {modules!r}")
    return tuple(m if isinstance(m, str) else m.__qualname__ for m in modules)
