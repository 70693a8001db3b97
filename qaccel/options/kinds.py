"""The closed sets of values the options take, as enums (``str`` enums, so ``acc.backend == "gloo"`` keeps
working) and as the ``Literal`` types a type checker reads: an option takes the member or its value."""

from __future__ import annotations

import enum
import importlib.util
from typing import Literal

import torch
import torch.distributed as dist


class ComputeSetup(enum.StrEnum):
    AUTO = "auto"  # a GPU when there is one
    CPU = "cpu"
    GPU = "gpu"


class LogSetup(enum.StrEnum):
    AUTO = "auto"  # the compute device
    CPU = "cpu"


class StartMethod(enum.StrEnum):
    FORKSERVER = "forkserver"
    SPAWN = "spawn"


class MixedPrecision(enum.StrEnum):
    NO = "no"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def half(self) -> torch.dtype | None:
        """The dtype autocast computes in; None without mixed precision."""
        return {MixedPrecision.BF16: torch.bfloat16, MixedPrecision.FP16: torch.float16}.get(self)


class Strategy(enum.StrEnum):
    DDP = "ddp"
    FSDP = "fsdp"

    @property
    def needs_a_group_alone(self) -> bool:
        """Whether a session of one rank still makes a process group: FSDP2's device mesh needs one."""
        return self is Strategy.FSDP


class Backend(enum.StrEnum):
    GLOO = "gloo"
    NCCL = "nccl"
    MPI = "mpi"

    @classmethod
    def available(cls) -> tuple[Backend, ...]:
        return (cls.GLOO, cls.NCCL) + ((cls.MPI,) if dist.is_mpi_available() else ())


class JobOutput(enum.StrEnum):
    """Whose output a cluster job shows in the caller while it waits."""

    RANK0 = "rank0"
    ALL = "all"  # every rank's lines, each prefixed with [rank N]
    NONE = "none"


class DistributedType(enum.StrEnum):
    """How a rank trains with the others, by Accelerate's names: alone, data parallel on CPUs or GPUs, or
    sharded."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    XLA = "XLA"  # never a rank's: Accelerate's scripts compare with it (its examples' collate_fn)


# The closed sets as a type checker reads them: an option takes the enum's member or its value.
ComputeSetupName = Literal["auto", "cpu", "gpu"]


LogSetupName = Literal["auto", "cpu"]


BackendName = Literal["gloo", "nccl", "mpi"]


StartMethodName = Literal["forkserver", "spawn"]


MixedPrecisionName = Literal["no", "bf16", "fp16"]


StrategyName = Literal["ddp", "fsdp"]


class DeviceType(enum.StrEnum):
    """Where a rank computes, resolved from ``compute_setup``: torch's device type names."""

    CPU = "cpu"
    CUDA = "cuda"


class TrackingTool(enum.StrEnum):
    """The trackers qaccel writes to (qadence's ExperimentTrackingTool values, and CSV), by ``log_with``'s and
    ``TrainConfig.tracking_tool``'s names; each knows the module it needs and the package that installs it."""

    TENSORBOARD = "tensorboard"  # the default
    MLFLOW = "mlflow"
    WANDB = "wandb"  # Weights & Biases
    CSV = "csv"  # needs nothing

    @property
    def module(self) -> str | None:
        """The module the tracker imports; None: it needs none."""
        return None if self is TrackingTool.CSV else self.value

    @property
    def package(self) -> str | None:
        """The pip package (and qaccel's extra of the tracker's name) that installs ``module``."""
        return {TrackingTool.MLFLOW: "mlflow-skinny", TrackingTool.CSV: None}.get(self, self.value)

    @property
    def installed(self) -> bool:
        """Its module can be imported here (CSV needs none)."""
        return self.module is None or importlib.util.find_spec(self.module) is not None

    @property
    def writes_folder(self) -> bool:
        """It writes into ``<logging_dir>/<project_name>``, so it needs a logging directory."""
        return self in (TrackingTool.TENSORBOARD, TrackingTool.CSV)
