"""Where is this process running: plain, under torchrun, in a SLURM srun step, under mpirun or LSF's jsrun, under a
launcher that exported torch's env:// variables (a Kubernetes PyTorchJob, the DeepSpeed launcher, SageMaker), or
in a live process group.

Launch code asks this first so it can run in place when ranks already exist instead of spawning more. Each
launcher has one small detector class that reads its own variables (a ``layout.Detector``; ``DETECTORS``, tried in
order); a process that merely carries some of them (a login shell inside an allocation, a leftover ``RANK``) is
taken for no rank.

One module per launcher (``torchrun.py``, ``slurm.py``, ``mpi.py``, ``lsf.py``, ``flux.py``, ``env_variables.py``) and one for a
group the user made (``initialized.py``), sharing the readers of ``variables.py``; a new launcher is one class in a
new module, a line in ``DETECTORS`` and a Kind.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from qaccel.environment.env_variables import EnvVariables
from qaccel.environment.flux import FluxTasks
from qaccel.environment.initialized import InitializedGroup
from qaccel.environment.layout import (
    STARTED_BY_QACCEL,
    Detector,
    Environment,
    Kind,
    derived_port,
    node_name,
    qaccel_run_id,
    rank_variables,
    usable_cores,
)
from qaccel.environment.lsf import LsfJsrun
from qaccel.environment.mpi import Mpi
from qaccel.environment.slurm import SlurmStep, parse_nodelist, parse_tasks_per_node, slurm_job_state, slurm_port
from qaccel.environment.torchrun import Torchrun

__all__ = [
    "DETECTORS",
    "STARTED_BY_QACCEL",
    "Detector",
    "Environment",
    "Kind",
    "derived_port",
    "detect",
    "node_name",
    "parse_nodelist",
    "parse_tasks_per_node",
    "qaccel_run_id",
    "rank_variables",
    "slurm_job_state",
    "slurm_port",
    "usable_cores",
]


def detect(environ: Mapping[str, str] | None = None) -> Environment:
    """Classify the current process: the first of ``DETECTORS`` that finds a rank here, else plain."""
    env = os.environ if environ is None else environ
    for detector in DETECTORS:
        found = detector.find(env)
        if found is not None:
            return found
    return Environment(kind=Kind.PLAIN)


DETECTORS: tuple[Detector, ...] = (
    InitializedGroup(),
    Torchrun(),
    SlurmStep(),
    Mpi(),
    LsfJsrun(),
    FluxTasks(),
    EnvVariables(),
)
"""Tried in this order: a live group wins over every launcher; the launchers' own variables over the env://
ones that srun tasks and qaccel's ranks are given too."""
