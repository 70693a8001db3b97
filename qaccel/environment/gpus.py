"""Which GPU a rank takes, decided where the rank runs: from the GPUs it sees and how many ranks its node runs.

Launchers give GPUs to ranks two ways. Every rank of a node sees all of the node's GPUs (``srun --gpus-per-node``,
torchrun, a plain launch) and its local rank picks one; or each rank sees only its own (``srun --gpus-per-task=1``,
``--gpu-bind=single:1``, a Kubernetes pod per GPU, an MPI wrapper that sets ``CUDA_VISIBLE_DEVICES``) and takes it.
torch's docs, Accelerate, Lightning and torchtitan take ``cuda:LOCAL_RANK`` either way, which fails on the second
("invalid device ordinal") on every rank but the node's first.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from qaccel.environment.layout import node_name

# what a launcher says it gave a task: SLURM's gres/gpu plugin sets these (CUDA_VISIBLE_DEVICES too), as a job asks
ALLOCATED = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE")
NODE_GPUS = "SLURM_GPUS_ON_NODE"  # the job's GPUs on this node, however they are bound to its tasks
FIXES = (
    "every rank sees its node's GPUs: sbatch --gpus-per-node=G with --ntasks-per-node=G; or one GPU per rank: "
    "srun --gpus-per-task=1 (or --gpu-bind=single:1), mpirun through a wrapper that sets "
    "CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK (MPICH: mpiexec -gpus-per-proc 1), a Kubernetes pod per "
    "GPU (nvidia.com/gpu: 1)"
)


class Binding(enum.StrEnum):
    """How a rank came to its GPU."""

    OWN = "own"
    """It sees exactly one GPU: the launcher bound it to this rank."""
    BY_LOCAL_RANK = "by local rank"
    """It sees at least as many GPUs as its node has ranks: its local rank picks one."""


@dataclass(frozen=True)
class GpuChoice:
    """The GPU a rank takes, and why."""

    index: int
    binding: Binding
    visible: int
    local_world: int

    def why(self) -> str:
        if self.binding is Binding.OWN:
            bound = (
                f", one of its node's {self.local_world} ranks: the launcher bound it" if self.local_world > 1 else ""
            )
            return f"sees 1 GPU ({visible_devices()}){bound}"
        return (
            f"sees {self.visible} GPUs ({visible_devices()}), its node runs {self.local_world} rank(s): "
            "the local rank picks"
        )


class GpuLayoutError(RuntimeError):
    """The GPUs a rank sees fit neither way of binding them."""


def cuda_device_count() -> int:
    """GPUs visible here, counted through NVML where possible so the caller's CUDA stays uninitialised."""
    return torch.cuda.device_count()


def choose(local_rank: int, local_world: int, visible: int, node_gpus: int | None = None) -> GpuChoice:
    """The GPU of the rank ``local_rank`` of its node's ``local_world`` that sees ``visible`` GPUs, of the
    ``node_gpus`` its launcher gave the node (when it says: ``node_gpus()``); raises GpuLayoutError for any other
    layout, naming it and the options that fix it."""
    if visible == 1 and (node_gpus is None or node_gpus >= local_world):
        return GpuChoice(0, Binding.OWN, visible, local_world)
    if visible >= local_world:
        return GpuChoice(local_rank, Binding.BY_LOCAL_RANK, visible, local_world)
    if visible == 1:
        raise GpuLayoutError(
            f"{where()}: the {local_world} ranks on this node share {node_gpus} GPU(s) ({NODE_GPUS}={node_gpus}; "
            f"local rank {local_rank} sees {visible_devices()}): ask for one GPU per rank; {FIXES}"
        )
    raise GpuLayoutError(
        f"{where()}: local rank {local_rank} of {local_world} ranks on this node sees {visible} GPUs "
        f"({visible_devices()}): neither one GPU per rank nor at least one GPU per rank of the node; {FIXES}"
    )


def node_gpus(environ: Mapping[str, str] | None = None) -> int | None:
    """How many GPUs the launcher gave this node, when it says (SLURM does)."""
    value = (os.environ if environ is None else environ).get(NODE_GPUS, "")
    return int(value) if value.isdigit() else None


def allocated(environ: Mapping[str, str] | None = None) -> str | None:
    """What the launcher says it gave this task (``SLURM_GPUS_ON_NODE=2``), or None when it gave no GPU."""
    env = os.environ if environ is None else environ
    for name in ALLOCATED:  # GPU indices, then the node's count
        value = env.get(name, "").strip()
        if value and value != "N/A" and not (name == NODE_GPUS and value == "0"):
            return f"{name}={value}"
    return None


def none_seen(asked: str) -> RuntimeError:
    """The error of a rank whose launcher gave it GPUs (``asked`` says how) that torch does not see."""
    build = (
        f"torch {torch.__version__} built with CUDA {torch.version.cuda}"
        if torch.version.cuda
        else f"torch {torch.__version__} built without CUDA (a CPU wheel)"
    )
    return RuntimeError(
        f"{where()}: {asked}, but torch sees no GPU here ({visible_devices()}; {build}); install a CUDA build of "
        "torch on the nodes (SlurmCluster(setup=[...]) can activate its environment), or train on the CPU with "
        "compute_setup='cpu'"
    )


def visible_devices(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    value = env.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES unset" if value is None else f"CUDA_VISIBLE_DEVICES={value}"


def where() -> str:
    """This node's name, as SLURM knows it when it can."""
    return f"node {node_name()}"
