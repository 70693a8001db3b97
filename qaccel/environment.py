"""Where is this process running: plain, under torchrun, in a SLURM srun step, under mpirun or LSF's jsrun, under a
launcher that exported torch's env:// variables (a Kubernetes PyTorchJob, the DeepSpeed launcher, SageMaker), or
in a live process group.

Launch code asks this first so it can run in place when ranks already exist instead of spawning more. Each
launcher is one small class that reads its own variables (``LAUNCHERS``, tried in order); a process that merely
carries some of them (a login shell inside an allocation, a leftover ``RANK``) is taken for no rank.
"""

from __future__ import annotations

import enum
import itertools
import os
import re
import subprocess
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LAUNCHERS", "Environment", "Kind", "derived_port", "detect", "parse_nodelist", "parse_tasks_per_node",
           "qaccel_run_id", "rank_variables", "slurm_job_state", "slurm_port"]


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
        return self in (Kind.SLURM, Kind.MPI, Kind.LSF, Kind.ENV)


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

    @property
    def is_launched(self) -> bool:
        """True when the ranks already exist, so work must run in place rather than spawn."""
        return not self.kind.creates_processes


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


def detect(environ: Mapping[str, str] | None = None) -> Environment:
    """Classify the current process: the first of ``LAUNCHERS`` that finds a rank here, else plain."""
    env = os.environ if environ is None else environ
    for launcher in LAUNCHERS:
        found = launcher.find(env)
        if found is not None:
            return found
    return Environment(kind=Kind.PLAIN)


# A qaccel rank of a plain launch carries torch's env:// variables (rank_variables) and this one: a process it starts
# (a script of the user's run as a subprocess) is no rank of an env:// launcher's world.
STARTED_BY_QACCEL = "QACCEL_RANK_OF"


def qaccel_run_id(launch: str) -> str:
    """The ``TORCHELASTIC_RUN_ID`` of a plain launch's ranks (as torchrun's workers have one): Torchrun below tells
    it from torchrun's own."""
    return f"qaccel-{launch}"


class InitializedGroup:
    """The user made a torch.distributed group: run in it. Read without importing torch when nobody else has."""

    kind = Kind.INITIALIZED

    def find(self, env: Mapping[str, str]) -> Environment | None:
        if "torch" not in sys.modules:
            return None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        return _launcher_layout(env, self.kind, dist.get_rank(), dist.get_world_size())


class Torchrun:
    """torchrun (torchelastic) exports the whole layout, so take it verbatim."""

    kind = Kind.TORCHRUN

    def find(self, env: Mapping[str, str]) -> Environment | None:
        run_id = env.get("TORCHELASTIC_RUN_ID")
        if run_id is None or (STARTED_BY_QACCEL in env and run_id.startswith(qaccel_run_id(""))):
            return None  # a qaccel rank, or a process it started, looks like a torchrun worker but is none
        return _launcher_layout(env, self.kind, _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1))


class SlurmStep:
    """Only a multi-task srun step counts: a batch script or salloc shell also carries SLURM_PROCID."""

    kind = Kind.SLURM

    def find(self, env: Mapping[str, str]) -> Environment | None:
        return _slurm(env)


class Mpi:
    """mpirun's processes, by the variables of the MPI that started them (the first family present): Open MPI's
    ``OMPI_COMM_WORLD_*``, MPICH's and Intel MPI's (Hydra) ``PMI_*``/``MPI_LOCAL*``, MVAPICH's ``MV2_COMM_WORLD_*``.

    MPI gives no rendezvous address: ``MASTER_ADDR``/``MASTER_PORT`` you pass (``mpirun -x``) win; on one node it
    is 127.0.0.1 and a port from the job's id (Open MPI's), else from the launcher's daemon, every local rank's
    parent; on several nodes MASTER_ADDR is needed, and a ValueError says so. Ranks are taken as placed by slot
    (mpirun's default): node = rank // local size.
    """

    kind = Kind.MPI
    FAMILIES = (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    )
    JOB_IDS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid")  # the same on every rank of an Open MPI job

    def find(self, env: Mapping[str, str]) -> Environment | None:
        family = next((f for f in self.FAMILIES if f[0] in env and f[1] in env), None)
        if family is None:
            return None
        rank_key, size_key, local_rank_key, local_size_key = family
        world_size = _int(env, size_key, 1)
        if world_size <= 1:
            return None
        rank = _int(env, rank_key, 0)
        local_world_size = _int(env, local_size_key, world_size)
        num_nodes = _ceil_div(world_size, local_world_size)
        master_addr = env.get("MASTER_ADDR") or ("127.0.0.1" if num_nodes == 1 else None)
        if master_addr is None:
            raise ValueError(f"an MPI job of {world_size} ranks on {num_nodes} nodes ({size_key}, {local_size_key}) "
                             "needs the rendezvous address of rank 0's node: pass MASTER_ADDR (and MASTER_PORT) to "
                             "every rank, e.g. mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500")
        master_port = _optional_int(env, "MASTER_PORT")
        if master_port is None:
            job = _first(env, self.JOB_IDS)
            if job is None and num_nodes > 1:
                raise ValueError(f"an MPI job on {num_nodes} nodes needs MASTER_PORT: mpirun -x MASTER_PORT=<a free "
                                 "port on rank 0's host>")
            master_port = derived_port(job if job is not None else f"daemon {os.getppid()}")
        return Environment(kind=self.kind, rank=rank, local_rank=_int(env, local_rank_key, rank),
                           node_rank=rank // max(local_world_size, 1), world_size=world_size,
                           local_world_size=local_world_size, num_nodes=num_nodes, master_addr=master_addr,
                           master_port=master_port)


class LsfJsrun:
    """LSF's jsrun: ``JSM_NAMESPACE_*`` give the layout; rank 0's host is the first compute host of
    ``LSB_MCPU_HOSTS`` (after the launch node, which runs no rank) and the port comes from ``LSB_JOBID`` (as
    Lightning's LSF environment takes them), unless MASTER_ADDR/MASTER_PORT are set."""

    kind = Kind.LSF

    def find(self, env: Mapping[str, str]) -> Environment | None:
        if "JSM_NAMESPACE_RANK" not in env or "JSM_NAMESPACE_SIZE" not in env:
            return None
        world_size = _int(env, "JSM_NAMESPACE_SIZE", 1)
        if world_size <= 1:
            return None
        rank = _int(env, "JSM_NAMESPACE_RANK", 0)
        local_world_size = _int(env, "JSM_NAMESPACE_LOCAL_SIZE", world_size)
        hosts = env.get("LSB_MCPU_HOSTS", "").split()[::2]  # "launch 1 host1 4 host2 4": names, then counts
        master_addr = env.get("MASTER_ADDR") or (hosts[1] if len(hosts) > 1 else hosts[0] if hosts else None)
        job = env.get("LSB_JOBID")
        master_port = _optional_int(env, "MASTER_PORT") or (derived_port(job) if job else None)
        if master_addr is None or master_port is None:
            raise ValueError("a jsrun rank needs LSB_MCPU_HOSTS and LSB_JOBID (set by LSF) or MASTER_ADDR and "
                             "MASTER_PORT to find rank 0")
        return Environment(kind=self.kind, rank=rank, local_rank=_int(env, "JSM_NAMESPACE_LOCAL_RANK", rank),
                           node_rank=rank // max(local_world_size, 1), world_size=world_size,
                           local_world_size=local_world_size, num_nodes=_ceil_div(world_size, local_world_size),
                           master_addr=master_addr, master_port=master_port)


class EnvVariables:
    """A launcher that exported torch's env:// variables itself: all of ``RANK``, ``WORLD_SIZE`` (more than 1),
    ``MASTER_ADDR`` and ``MASTER_PORT`` (a Kubernetes PyTorchJob, the DeepSpeed launcher, SageMaker, the old
    ``torch.distributed.launch --use-env``). ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (or DeepSpeed's
    ``LOCAL_SIZE``) when given, else one process per node (a PyTorchJob's pods). Not in a process a qaccel rank
    started, which carries these too."""

    kind = Kind.ENV
    NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

    def find(self, env: Mapping[str, str]) -> Environment | None:
        if not all(env.get(name) for name in self.NEEDED) or STARTED_BY_QACCEL in env:
            return None
        world_size = _int(env, "WORLD_SIZE", 1)
        if world_size <= 1:
            return None
        rank = _int(env, "RANK", 0)
        local_world_size = _first_int(env, ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")) or 1
        node_rank = _first_int(env, ("GROUP_RANK", "NODE_RANK"))
        node_rank = rank // local_world_size if node_rank is None else node_rank
        return Environment(kind=self.kind, rank=rank, local_rank=_int(env, "LOCAL_RANK", rank % local_world_size),
                           node_rank=node_rank, world_size=world_size, local_world_size=local_world_size,
                           num_nodes=_ceil_div(world_size, local_world_size), master_addr=env["MASTER_ADDR"],
                           master_port=_int(env, "MASTER_PORT", 0))


LAUNCHERS = (InitializedGroup(), Torchrun(), SlurmStep(), Mpi(), LsfJsrun(), EnvVariables())
"""Tried in this order: a live group wins over every launcher; the launchers' own variables over the env://
ones that srun tasks and qaccel's ranks are given too."""


def _launcher_layout(env: Mapping[str, str], kind: Kind, rank: int, world_size: int) -> Environment:
    """The layout torchrun-style variables describe around a known rank and world (one node when silent)."""
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size)
    node_key = "GROUP_RANK" if "GROUP_RANK" in env else "NODE_RANK"
    return Environment(
        kind=kind,
        rank=rank,
        local_rank=_int(env, "LOCAL_RANK", rank),
        node_rank=_int(env, node_key, 0),
        world_size=world_size,
        local_world_size=local_world_size,
        num_nodes=_ceil_div(world_size, local_world_size),
        master_addr=env.get("MASTER_ADDR"),
        master_port=_optional_int(env, "MASTER_PORT"),
    )


def _slurm(env: Mapping[str, str]) -> Environment | None:
    """Only a multi-task srun step counts: a batch script or salloc shell also carries SLURM_PROCID."""
    if "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return None
    count_key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    world_size = _int(env, count_key, 1)
    if world_size <= 1:
        return None

    node_rank = _int(env, "SLURM_NODEID", 0)
    num_nodes = _first_int(env, ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"))
    master_addr = env.get("MASTER_ADDR")
    if num_nodes is None or master_addr is None:
        hosts = _nodelist(env)
        num_nodes = num_nodes if num_nodes is not None else (len(hosts) or 1)
        master_addr = master_addr if master_addr is not None else next(iter(hosts), None)
    master_port = _optional_int(env, "MASTER_PORT")
    job_id = _first(env, ("SLURM_JOB_ID", "SLURM_JOBID"))
    if master_port is None and job_id is not None:
        master_port = slurm_port(job_id)

    return Environment(
        kind=Kind.SLURM,
        rank=_int(env, "SLURM_PROCID", 0),
        local_rank=_int(env, "SLURM_LOCALID", 0),
        node_rank=node_rank,
        world_size=world_size,
        local_world_size=_slurm_local_world_size(env, node_rank, world_size, num_nodes),
        num_nodes=num_nodes,
        master_addr=master_addr,
        master_port=master_port,
    )


def _slurm_local_world_size(env: Mapping[str, str], node_rank: int, world_size: int, num_nodes: int) -> int:
    """Tasks on this node from the per-node spec; an even split when the spec cannot say."""
    key = next((k for k in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if k in env), None)
    if key is not None:
        try:
            per_node = parse_tasks_per_node(env[key])
        except ValueError as err:
            raise ValueError(f"{key}={env[key]!r}: {err}") from None
        if 0 <= node_rank < len(per_node):
            return per_node[node_rank]
    return _ceil_div(world_size, num_nodes)


def _nodelist(env: Mapping[str, str]) -> list[str]:
    """The step's hosts, widening to the job's when the step list is absent."""
    key = next((k for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if k in env), None)
    if key is None:
        return []
    try:
        return parse_nodelist(env[key])
    except ValueError as err:
        raise ValueError(f"{key}={env[key]!r}: {err}") from None


def derived_port(job: str) -> int:
    """A rendezvous port every rank of a job derives alike from the job's name: 20000 plus a stable hash of it
    below 10000 (a range apart from slurm_port's)."""
    return 20000 + zlib.crc32(job.encode()) % 10000


def slurm_port(job_id: str) -> int:
    """15000 plus the job id's last four digits (Lightning's rule), identical on every task of the job."""
    digits = re.sub(r"\D", "", job_id)
    if not digits:
        raise ValueError(f"SLURM job id {job_id!r} has no digits to derive a port from")
    return 15000 + int(digits[-4:])


_TASKS_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def parse_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's compressed per-node task counts, e.g. "2(x3),1" -> [2, 2, 2, 1]."""
    text = spec.strip()
    if not text:
        return []
    counts: list[int] = []
    for item in text.split(","):
        match = _TASKS_ITEM.fullmatch(item.strip())
        if match is None or (match.group(2) is not None and int(match.group(2)) == 0):
            raise ValueError(f"malformed SLURM tasks-per-node spec {spec!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist expression without scontrol, which compute nodes may lack."""
    text = nodelist.strip()
    if not text:
        return []
    hosts: list[str] = []
    for expression in _split_top_level(text, nodelist):
        hosts.extend(_expand_host(expression.strip(), nodelist))
    return hosts


def _split_top_level(text: str, original: str) -> list[str]:
    """Split on commas that sit outside brackets; reject unbalanced brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"malformed SLURM nodelist {original!r}: nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"malformed SLURM nodelist {original!r}: unmatched ']'")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"malformed SLURM nodelist {original!r}: unclosed '['")
    parts.append(text[start:])
    if any(not part.strip() for part in parts):
        raise ValueError(f"malformed SLURM nodelist {original!r}: empty host name")
    return parts


def _expand_host(expression: str, original: str) -> list[str]:
    """One host pattern to its hosts; several bracket groups multiply out left to right."""
    parts = re.split(r"\[([^\[\]]*)\]", expression)
    pieces = [[part] if i % 2 == 0 else _expand_range(part, original) for i, part in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*pieces)]


def _expand_range(group: str, original: str) -> list[str]:
    """Bracket contents such as "01-04,07", keeping the zero padding of each range start."""
    values: list[str] = []
    for item in group.split(","):
        item = item.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if match is None:
            raise ValueError(f"malformed SLURM nodelist {original!r}: bad range {item!r}")
        low, high = match.group(1), match.group(2)
        if high is None:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"malformed SLURM nodelist {original!r}: descending range {item!r}")
        width = len(low)
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    """An integer variable, or the default when unset; garbage is an error, not a silent default."""
    value = _optional_int(env, name)
    return default if value is None else value


def _optional_int(env: Mapping[str, str], name: str) -> int | None:
    if name not in env:
        return None
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    return next((_optional_int(env, n) for n in names if n in env), None)


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((env[n] for n in names if n in env), None)


def _ceil_div(numerator: int, denominator: int) -> int:
    """Node count from totals, never below one, and safe against a zero denominator."""
    return max(1, -(-numerator // max(denominator, 1)))


def slurm_job_state(job_id: str) -> tuple[str | None, int]:
    """A SLURM job's state from scontrol (None once SLURM forgot the job, or without scontrol), and its requeues
    so far."""
    try:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                               timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None, 0
    state, restarts = re.search(r"\bJobState=(\S+)", shown.stdout), re.search(r"\bRestarts=(\d+)", shown.stdout)
    if shown.returncode or state is None:
        return None, 0
    return state.group(1), int(restarts.group(1)) if restarts else 0
