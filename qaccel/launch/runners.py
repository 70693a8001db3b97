"""Where fn runs, decided once per Accelerator and process: the seam between the facade and the ways ranks start.

Three runners answer the same small protocol (protocol.py): a plain launch starts the ranks (caller.PlainLaunch),
a cluster job submits them to SLURM (cluster.ClusterJob), and everywhere else fn runs in place, as this process's
rank (under torchrun, srun, mpirun and the other launchers environment.DETECTORS finds, in a group the user made,
inside a rank, or alone: in_place.InPlace). A new way to start ranks is one class in its own module, a line here,
and its test; a new launcher that starts the ranks itself is only a detector in environment.DETECTORS.
"""

from __future__ import annotations

from qaccel.comm import session
from qaccel.environment import Environment
from qaccel.launch import caller, cluster, in_place
from qaccel.launch.protocol import HandBack, Runner
from qaccel.options import Config


def choose(config: Config, env: Environment, hand_back: HandBack) -> Runner:
    """The runner for this process: a plain process with several ranks to start launches them (on the cluster,
    if one is given); every other process, and every process inside a session (a rank), runs fn in place."""
    starts = _starts_ranks(env)
    if starts and config.cluster is not None:
        return cluster.ClusterJob(config, env, hand_back)
    if starts and config.nprocs > 1:
        return caller.PlainLaunch(config, env, hand_back)
    return in_place.InPlace(config, env, hand_back)


def _starts_ranks(env: Environment) -> bool:
    """A process that starts ranks itself: no launcher made it a rank, and it is inside no session (no rank)."""
    return env.kind.creates_processes and session.current() is None
