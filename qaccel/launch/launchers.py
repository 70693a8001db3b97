"""Where fn runs, decided once per Accelerator and process: the seam between the facade and the ways ranks start.

Three launchers answer the same small protocol (protocol.py): a plain launch starts the ranks (caller.PlainLaunch),
a cluster job submits them to SLURM (cluster.ClusterJob), and everywhere else fn runs in place, as this process's
rank (under torchrun, srun, mpirun and the other launchers of environment.LAUNCHERS, in a group the user made,
inside a rank, or alone: in_place.InPlace). A new way to start ranks is one class in its own module, a line here,
and its test; a new launcher that starts the ranks itself is only a class in environment.LAUNCHERS.
"""

from __future__ import annotations

import sys

from qaccel import environment
from qaccel.comm import session
from qaccel.environment import Environment
from qaccel.launch import caller, cluster, in_place, server
from qaccel.launch.protocol import HandBack, Launcher
from qaccel.options import Config, StartMethod


def choose(config: Config, env: Environment, hand_back: HandBack) -> Launcher:
    """The launcher for this process: a plain process with several ranks to start launches them (on the cluster,
    if one is given); every other process, and every process inside a session (a rank), runs fn in place."""
    starts = _starts_ranks(env)
    if starts and config.cluster is not None:
        return cluster.ClusterJob(config, env, hand_back)
    if starts and config.nprocs > 1:
        return caller.PlainLaunch(config, env, hand_back)
    return in_place.InPlace(config, env, hand_back)


def warm_up_in_kernel() -> None:
    """In a Jupyter kernel that would start ranks itself, start the server as qaccel is imported. A kernel runs
    threads, so its server is a fresh interpreter importing torch (≈ 1.6 s): started with the import cell, it is
    ready by the time a later cell launches, where starting it with the Accelerator would make that launch wait."""
    if _in_jupyter_kernel() and _starts_ranks(environment.detect()):
        server.warm_up(StartMethod.FORKSERVER)


def _starts_ranks(env: Environment) -> bool:
    """A process that starts ranks itself: no launcher made it a rank, and it is inside no session (no rank)."""
    return env.kind.creates_processes and session.current() is None


def _in_jupyter_kernel() -> bool:
    ipython = sys.modules.get("IPython")
    return getattr(getattr(ipython, "get_ipython", lambda: None)(), "kernel", None) is not None
