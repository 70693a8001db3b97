"""The options resolved: what every rank needs to set itself up, typed as resolved, frozen, small and picklable."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from qaccel.handlers import Handlers
from qaccel.options.cluster import SlurmCluster
from qaccel.options.kinds import Backend, ComputeSetup, DeviceType, LogSetup, MixedPrecision, StartMethod, Strategy


@dataclass(frozen=True, kw_only=True)
class Config:
    """The options resolved by ``make_config`` (checked, closed sets as enums, ``auto`` decided) and what they decide:
    what every rank needs to set itself up. Each field is typed as resolved; ``None`` where a cluster job's nodes
    decide (``devices.on_node``). ``kwargs_handlers`` and ``dynamo_backend`` are resolved into ``handlers`` and
    ``compile``."""

    nprocs: int
    compute_setup: ComputeSetup
    log_setup: LogSetup
    device_type: DeviceType | None  # None: decided on a cluster job's nodes
    log_device_type: DeviceType | None  # None: as device_type, decided on the nodes
    backend: Backend | None  # None: decided on a cluster job's nodes
    dtype: torch.dtype | None
    timeout: float  # seconds
    start_method: StartMethod
    gradient_accumulation_steps: int
    keep_global_batch: bool
    sync_each_batch: bool
    mixed_precision: MixedPrecision
    split_batches: bool
    even_batches: bool
    dispatch_batches: bool
    device_placement: bool
    use_seedable_sampler: bool
    data_seed: int | None
    rng_types: tuple[str, ...]
    step_scheduler_with_optimizer: bool
    max_restarts: int
    strategy: Strategy
    fsdp_modules: tuple[str, ...]  # class names
    fsdp_min_params: int
    debug: bool
    project_dir: str | None  # absolute
    log_with: tuple[Any, ...]  # tracker names and the user's tracker objects
    logging_dir: str | None  # absolute
    keep_checkpoints: int | None
    rank_prefix: bool
    handlers: Handlers  # from kwargs_handlers
    compile: Mapping[str, Any] | None  # torch.compile's arguments, from dynamo_backend
    cluster: SlurmCluster | None
