"""``SlurmCluster``: where ``distribute()`` submits its job, checked when it is made."""

# pyright: reportUnnecessaryIsInstance=false
# (what users pass is checked at run time, whatever the annotations say)

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qaccel.options.checks import choice, count
from qaccel.options.kinds import JobOutput

_TIME = re.compile(r"^(?:(\d+)-)?(\d+(?::\d+){0,2})$")


@dataclass(frozen=True)
class SlurmCluster:
    """Where ``distribute()`` submits its job: ``nodes`` x ``tasks_per_node`` SLURM tasks, one rank each.

    Args:
        nodes: the job's nodes.
        tasks_per_node: ranks per node (one per GPU).
        partition: sbatch's ``--partition``; None leaves the cluster's default.
        time: the time limit, ``"HH:MM:SS"``, ``"D-HH:MM:SS"`` or minutes.
        account: sbatch's ``--account``; None leaves the default.
        gpus_per_node: sbatch's ``--gpus-per-node``; None leaves the default.
        cpus_per_task: sbatch's ``--cpus-per-task``; None leaves the default.
        setup: shell lines run in the job before the ranks start (``module load ...``, ``source venv/bin/activate``).
        sbatch: any other sbatch option, e.g. ``{"qos": "high", "signal": "USR1@300"}`` (the default ``signal`` is
            ``USR1@180``: the warning ``resume()`` saves and requeues on).
        folder: where each job gets a folder of its own (the pickled function, results and logs); it must be on a
            file system that the submitting machine and the compute nodes share.
        output: whose output appears in the caller while it waits: ``"rank0"``, ``"all"`` (every rank's lines,
            prefixed with ``[rank N]``) or ``"none"``; the job's state changes appear always.
    """

    nodes: int = 1
    tasks_per_node: int = 1
    partition: str | None = None
    time: str | int = "01:00:00"
    account: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    setup: Sequence[str] = ()
    sbatch: Mapping[str, Any] = dataclasses.field(default_factory=dict[str, Any])
    folder: str | os.PathLike[str] = "qaccel_jobs"
    output: JobOutput | str = JobOutput.RANK0

    def __post_init__(self) -> None:
        for name in ("nodes", "tasks_per_node"):
            count(f"SlurmCluster.{name}", getattr(self, name), 1)
        for name in ("gpus_per_node", "cpus_per_task"):
            if getattr(self, name) is not None:
                count(f"SlurmCluster.{name}", getattr(self, name), 0 if name == "gpus_per_node" else 1)
        minutes(self.time)
        if isinstance(self.setup, str) or not all(isinstance(line, str) for line in self.setup):
            raise TypeError(f"SlurmCluster.setup must be a list of shell lines; got {self.setup!r}")
        if not isinstance(self.sbatch, Mapping):
            raise TypeError(f"SlurmCluster.sbatch must be a dict of sbatch options; got {self.sbatch!r}")
        object.__setattr__(self, "output", choice("SlurmCluster.output", self.output, JobOutput))
        object.__setattr__(self, "setup", tuple(self.setup))
        object.__setattr__(self, "sbatch", dict(self.sbatch))

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    def __hash__(self) -> int:
        return hash((self.nodes, self.tasks_per_node, self.partition, str(self.folder)))


def minutes(limit: str | int) -> int:
    """A SLURM time limit in whole minutes (rounded up), from minutes or SLURM's forms: ``MM``, ``MM:SS``,
    ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``."""
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        return limit
    match = _TIME.match(limit) if isinstance(limit, str) else None
    if match is None or limit in ("0", "00"):
        raise ValueError(
            f"SlurmCluster.time must be minutes > 0 or a SLURM time limit ('HH:MM:SS', 'D-HH:MM:SS', "
            f"...); got {limit!r}"
        )
    days, fields = match.group(1), [int(f) for f in match.group(2).split(":")]
    if days is not None:  # D-HH[:MM[:SS]]
        hours, mins, secs = (fields + [0, 0])[:3]
        hours += int(days) * 24
    else:  # MM, MM:SS or HH:MM:SS
        hours, mins, secs = ([0, 0] + fields)[-3:] if len(fields) == 3 else (0, *(fields + [0])[:2])
    return max(1, math.ceil(hours * 60 + mins + secs / 60))


def cluster_of(cluster: Any, nprocs: int) -> SlurmCluster | None:
    """A SlurmCluster of ``nprocs`` ranks, with submitit installed (it submits the job), or None."""
    if cluster is None:
        return None
    if not isinstance(cluster, SlurmCluster):
        raise TypeError(f"cluster must be a qaccel.SlurmCluster or None; got {type(cluster).__name__}")
    if cluster.world_size != nprocs:
        raise ValueError(
            f"nprocs={nprocs} but the cluster has nodes x tasks_per_node = {cluster.nodes} x "
            f"{cluster.tasks_per_node} = {cluster.world_size} ranks: make them equal"
        )
    try:
        import submitit  # noqa: F401  # pyright: ignore[reportUnusedImport] - the job goes through it
    except ImportError:
        raise ImportError(
            "cluster= submits through submitit, which is not installed: pip install submitit (from "
            "qaccel's checkout: pip install -e '.[slurm]')"
        ) from None
    return cluster
