"""Where ranks compute and talk, decided together: the device type (from ``compute_setup`` and the GPUs seen), the
backend and the precision; for a cluster job's ranks, decided on its nodes (``on_node``)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist

from qaccel.environment import Environment, Kind, gpus
from qaccel.options.checks import choice
from qaccel.options.config import Config
from qaccel.options.kinds import Backend, ComputeSetup, DeviceType, LogSetup, MixedPrecision, Strategy


def _device_type(compute_setup: ComputeSetup, env: Environment, nprocs: int, asked: str | None = None) -> DeviceType:
    """Where this process's ranks compute, decided with the GPUs visible here: they must fit how the ranks take
    them (environment/gpus.py). ``asked``: the GPUs the job asked for, which must be here (a launcher's allocation
    counts too)."""
    if compute_setup is ComputeSetup.CPU:
        return DeviceType.CPU
    visible, asked = gpus.cuda_device_count(), asked or gpus.allocated()
    if visible == 0:
        if asked is not None:
            raise gpus.none_seen(asked)
        if compute_setup is ComputeSetup.GPU:
            raise RuntimeError(
                f"compute_setup='gpu' but CUDA is not available here ({gpus.where()}, "
                f"{gpus.visible_devices()}); use 'auto' or 'cpu'"
            )
        return DeviceType.CPU
    local_world = env.world(nprocs).local_size
    if env.is_launched:
        gpus.choose(env.local_rank, local_world, visible, gpus.node_gpus())
    elif local_world > visible:  # a plain launch's ranks all see the GPUs this process sees
        raise RuntimeError(
            f"{local_world} GPU ranks on this node but only {visible} visible GPU(s) "
            f"({gpus.visible_devices()}); lower nprocs or use compute_setup='cpu'"
        )
    return DeviceType.CUDA


def on_node(config: Config, env: Environment) -> Config:
    """``config`` with what make_config left to the nodes (a cluster job's device, backend and precision) decided
    here, where this rank runs; a configuration decided already comes back as it is."""
    if config.device_type is not None:
        return config
    asked_gpus = config.cluster.gpus_per_node if config.cluster is not None else None
    asked = (
        f"the job asked for {asked_gpus} GPU(s) per node (SlurmCluster(gpus_per_node={asked_gpus}))"
        if asked_gpus
        else None
    )
    devices = decide(
        ComputeSetup(config.compute_setup),
        config.backend,
        config.dtype,
        config.mixed_precision,
        env,
        config.nprocs,
        asked,
    )
    check_sharding(config.strategy, devices.mixed_precision, devices.backend)
    return dataclasses.replace(config, **devices._asdict(), log_device_type=log_device(config.log_setup, devices))


class Devices(NamedTuple):
    device_type: DeviceType | None
    backend: Backend | None
    dtype: torch.dtype | None
    mixed_precision: MixedPrecision


def decide(
    compute_setup: ComputeSetup,
    backend: object,
    dtype: object,
    mixed_precision: object,
    env: Environment,
    nprocs: int,
    asked: str | None = None,
) -> Devices:
    """The device type, backend and precision, decided together here."""
    device_type = _device_type(compute_setup, env, nprocs, asked)
    backend = _backend(backend, device_type)
    return Devices(device_type, backend, *_precision(dtype, mixed_precision, device_type))


def left_to_the_nodes(compute_setup: ComputeSetup, backend: object, dtype: object, mixed_precision: object) -> Devices:
    """For ranks that run elsewhere (a cluster job from a login node): only what needs no node is checked here;
    the device type and the backend left to choose (None) are decided on the nodes (on_node)."""
    if compute_setup is ComputeSetup.CPU:  # nothing about the nodes can change it
        return decide(compute_setup, backend, dtype, mixed_precision, Environment(Kind.PLAIN), 1)
    chosen = None if backend is None else choice("backend", backend, Backend)
    return Devices(None, chosen, *_precision(dtype, mixed_precision, None))


def log_device(log_setup: LogSetup, devices: Devices) -> DeviceType | None:
    return devices.device_type if log_setup is LogSetup.AUTO else DeviceType.CPU


ON_THE_NODES = "decided on the nodes"


def _backend(backend: object, device_type: DeviceType) -> Backend:
    if backend is None:
        return Backend.NCCL if device_type is DeviceType.CUDA else Backend.GLOO
    chosen = choice("backend", backend, Backend, Backend.available())
    if chosen is Backend.NCCL and device_type is DeviceType.CPU:
        raise ValueError("backend='nccl' needs GPU compute; use backend='gloo' (or None) with compute_setup='cpu'")
    if chosen is Backend.NCCL and not dist.is_nccl_available():
        raise RuntimeError("backend='nccl' but this torch build has no NCCL; use backend='gloo'")
    return chosen


MIXED_PRECISION_VARIABLE = "ACCELERATE_MIXED_PRECISION"


def mixed_precision_asked(value: object) -> object:
    """The option as given, or (None) what a launcher exported for Accelerators made without it, as Accelerate
    reads it."""
    if value is not None:
        return value
    exported = os.environ.get(MIXED_PRECISION_VARIABLE)
    if exported is None:
        return MixedPrecision.NO.value
    if exported.lower() not in tuple(MixedPrecision):
        raise ValueError(
            f"{MIXED_PRECISION_VARIABLE}={exported!r} (read for mixed_precision=None) must be one of "
            f"{', '.join(repr(m.value) for m in MixedPrecision)}"
        )
    return exported.lower()


def _precision(
    dtype: object, mixed_precision: object, device_type: DeviceType | None
) -> tuple[torch.dtype | None, MixedPrecision]:
    """The models' dtype and the mixed precision, checked together (on a device decided on the nodes: None)."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.float64) or None; got {dtype!r}")
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(
            f"dtype must be a floating-point or complex torch.dtype (it casts models and inputs); got {dtype}"
        )
    mixed = choice("mixed_precision", mixed_precision, MixedPrecision)
    if mixed is MixedPrecision.FP16 and device_type is DeviceType.CPU:  # as Accelerate, said out loud
        warnings.warn(
            "mixed_precision='fp16' without GPU compute trains in float32 (no autocast, no gradient "
            "scaler; Accelerate does the same): use 'bf16' for half precision on CPU",
            stacklevel=5,
        )
        mixed = MixedPrecision.NO
    if mixed is not MixedPrecision.NO and dtype is not None and dtype != torch.float32:
        raise ValueError(
            f"mixed_precision={mixed.value!r} runs float32 models in half precision; with dtype={dtype} use "
            "mixed_precision='no' (or dtype=None/torch.float32)"
        )
    return dtype, mixed


def check_sharding(strategy: Strategy, mixed_precision: MixedPrecision, backend: Backend | None) -> None:
    """What FSDP2 needs of the backend and the precision, once they are decided."""
    if strategy is not Strategy.FSDP:
        return
    if backend not in (Backend.GLOO, Backend.NCCL):
        raise ValueError(
            f"strategy='fsdp' runs on backend 'gloo' (CPU) or 'nccl' (GPU); got backend={backend and backend.value!r}"
        )
    if mixed_precision is MixedPrecision.FP16:
        raise ValueError(
            "strategy='fsdp' supports mixed_precision 'no' or 'bf16' (FSDP2's MixedPrecisionPolicy); "
            "fp16 needs a sharded gradient scaler qaccel does not provide"
        )
