"""The layout a launcher gives a rank (Environment), how it came to run (Kind), and what every launcher's detector
answers to (Detector)."""

from __future__ import annotations

import enum
import os
import socket
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol


class Kind(enum.StrEnum):
    """How this process came to run: decides whether distribute() starts ranks and where a rank's layout comes from.

    A ``StrEnum``, so it prints and compares as its name ("torchrun").
    """

    PLAIN = "plain"
    """``python script.py``: distribute() starts the ranks itself."""
    TORCHRUN = "torchrun"
    """torchrun started the ranks and exported their layout (RANK, WORLD_SIZE, ...)."""
    SLURM = "slurm"
    """Each task of an srun step is a rank; its layout comes from SLURM_* variables."""
    MPI = "mpi"
    """Each process of mpirun (Open MPI, MPICH, Intel MPI, MVAPICH) is a rank; its layout comes from the MPI's."""
    LSF = "lsf"
    """Each process of LSF's jsrun is a rank; its layout comes from JSM_NAMESPACE_* variables."""
    FLUX = "flux"
    """Each task of a Flux job (flux run, flux submit) is a rank; its layout comes from FLUX_TASK_* and FLUX_JOB_*."""
    ENV = "env"
    """A launcher exported torch's env:// variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) without torchrun:
    a Kubernetes PyTorchJob, the DeepSpeed launcher, SageMaker."""
    INITIALIZED = "initialized"
    """The user already made a process group: run in it, make none."""

    @property
    def creates_processes(self) -> bool:
        """True when distribute() must start the ranks; otherwise they exist and fn runs in place."""
        return self is Kind.PLAIN

    @property
    def started_by_launcher(self) -> bool:
        """True when a launcher (torchrun, srun, mpirun, ...) chose the world: qaccel makes the group from its
        variables."""
        return self not in (Kind.PLAIN, Kind.INITIALIZED)

    @property
    def exports_rank_variables(self) -> bool:
        """True when qaccel must export torchrun's variables (RANK, MASTER_ADDR, ...) for torch and user code (all
        of them: a launcher of env:// variables may leave out LOCAL_RANK and the like)."""
        return self in (Kind.SLURM, Kind.MPI, Kind.LSF, Kind.FLUX, Kind.ENV)


class World(NamedTuple):
    """How many ranks the world has, and how many of them run on this node."""

    size: int
    local_size: int


@dataclass(frozen=True)
class Environment:
    """The rank layout this process finds itself in."""

    kind: Kind
    rank: int = 0
    local_rank: int = 0
    node_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    num_nodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    address_from: str = field(default="MASTER_ADDR", compare=False)  # where master_addr came from, for errors

    @property
    def is_launched(self) -> bool:
        """True when the ranks already exist, so work must run in place rather than spawn."""
        return not self.kind.creates_processes

    def world(self, nprocs: int) -> World:
        """The world this process's ranks make: the launcher's, when a launcher made them (it wins over ``nprocs``),
        else the ``nprocs`` ranks a plain launch starts on this node. The one place that decides it: the options'
        GPU check, the session's plan and the Accelerator's warning ask here."""
        if self.is_launched:
            return World(self.world_size, self.local_world_size)
        return World(nprocs, nprocs)


def usable_cores() -> int:
    """The cores this process may run on: its affinity (srun, taskset or a container may bind it to some), else
    the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def node_name() -> str:
    """This node's name, as SLURM knows it when it can: what errors and reports call the node."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def rank_variables(env: Environment) -> dict[str, str]:
    """The variables torchrun gives a worker about its place in the world (the rendezvous address too, when
    known); qaccel's ranks and srun tasks get them, so user code and torch's env:// read the same names everywhere."""
    rendezvous = {} if env.master_addr is None else {"MASTER_ADDR": env.master_addr}
    if env.master_port is not None:
        rendezvous["MASTER_PORT"] = str(env.master_port)
    return {
        **rendezvous,
        "RANK": str(env.rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "GROUP_RANK": str(env.node_rank),
        "NODE_RANK": str(env.node_rank),
        "GROUP_WORLD_SIZE": str(env.num_nodes),
        "ROLE_RANK": str(env.rank),
        "ROLE_WORLD_SIZE": str(env.world_size),
        "ROLE_NAME": "default",
    }


# A qaccel rank of a plain launch carries torch's env:// variables (rank_variables) and this one: a process it starts
# (a script of the user's run as a subprocess) is no rank of an env:// launcher's world.
STARTED_BY_QACCEL = "QACCEL_RANK_OF"


def qaccel_run_id(launch: str) -> str:
    """The ``TORCHELASTIC_RUN_ID`` of a plain launch's ranks (as torchrun's workers have one): Torchrun below tells
    it from torchrun's own."""
    return f"qaccel-{launch}"


def derived_port(job: str) -> int:
    """A rendezvous port every rank of a job derives alike from the job's name: 20000 plus a stable hash of it
    below 10000 (a range apart from slurm_port's)."""
    return 20000 + zlib.crc32(job.encode()) % 10000


class Detector(Protocol):
    """Finds the ranks one launcher made (torchrun, srun, mpirun, ...) in a process's variables: one class per
    launcher, in a module of its own, tried in the order of ``environment.DETECTORS``. A process that merely carries
    some of the variables (a login shell inside an allocation, a leftover ``RANK``) is no rank: ``find`` says None."""

    kind: Kind

    def find(self, env: Mapping[str, str]) -> Environment | None: ...
