"""Processes started with exactly the variables other launchers give their ranks, without those launchers: a
Kubernetes PyTorchJob's pods and the DeepSpeed launcher (torch's env:// variables), MPICH's and MVAPICH's mpirun,
LSF's jsrun, Flux's job shell. Each pair of processes is one world of 2, run in place (no ranks of qaccel's own),
with the layout the launcher gave; a process that merely carries such variables starts its own ranks. (tests/launch/test_mpirun.py runs
a real Open MPI.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from support.procs import free_port, report_results, script_env, script_file

from qaccel.environment import derived_port

pytestmark = pytest.mark.timeout(180)
SCRIPT = script_file("report_ranks.py")
LAUNCHERS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_PROCID",
    "SLURM_STEP_ID",
    "QACCEL_RANK_OF",
)


def _env(**variables: str) -> dict[str, str]:
    env = script_env()
    for name in LAUNCHERS:
        env.pop(name, None)
    return {**env, **variables}


def _ranks(envs: list[dict[str, str]], tag: str = "launcher") -> list[dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), tag], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for env in envs
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    results = [r for out, _ in outs for r in report_results(out)]
    assert len(results) == len(envs), "each process is one rank: none started ranks of its own"
    return sorted(results, key=lambda r: r["rank"])


def _free_job() -> str:
    """An LSF job id whose derived port is free now."""
    for job in range(40000 + os.getpid() % 1000, 60000, 7):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", derived_port(str(job))))
                return str(job)
            except OSError:
                continue
    raise RuntimeError("no free derived port")


def _layout(results: list[dict]) -> list[tuple]:
    return [(r["rank"], r["local"], r["node"], r["world"], r["sum"], r["env_rank"]) for r in results]


def test_pytorchjob_pods_are_one_world_of_one_rank_per_node():
    """A PyTorchJob gives each pod RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and no LOCAL_RANK: one
    process per node."""
    port = str(free_port())
    results = _ranks([_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(2)])
    assert _layout(results) == [(0, 0, 0, 2, 1, "0"), (1, 0, 1, 2, 1, "1")]


def test_the_deepspeed_launchers_ranks_are_one_world_on_one_node():
    port = str(free_port())
    results = _ranks(
        [
            _env(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE="2",
                LOCAL_SIZE="2",
                CROSS_RANK="0",
                CROSS_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )
            for r in range(2)
        ]
    )
    assert _layout(results) == [(0, 0, 0, 2, 1, "0"), (1, 1, 0, 2, 1, "1")]


@pytest.mark.parametrize("family", ["mpich", "mvapich"])
def test_mpich_and_mvapich_ranks_are_one_world(family):
    """MPICH's (and Intel MPI's) and MVAPICH's variables; the rendezvous address passed as mpirun -x would.
    (Without it, on one node, the port is derived from the launcher's daemon: tests/environment/test_mpi.py.)"""
    names = {
        "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        "mvapich": (
            "MV2_COMM_WORLD_RANK",
            "MV2_COMM_WORLD_SIZE",
            "MV2_COMM_WORLD_LOCAL_RANK",
            "MV2_COMM_WORLD_LOCAL_SIZE",
        ),
    }[family]
    port = str(free_port())
    results = _ranks(
        [
            _env(**dict(zip(names, (str(r), "2", str(r), "2"))), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            for r in range(2)
        ]
    )
    assert _layout(results) == [(0, 0, 0, 2, 1, "0"), (1, 1, 0, 2, 1, "1")], "RANK exported for the code in it"


def test_jsrun_ranks_rendezvous_on_the_first_compute_host_at_the_jobs_port():
    job = _free_job()
    results = _ranks(
        [
            _env(
                JSM_NAMESPACE_RANK=str(r),
                JSM_NAMESPACE_SIZE="2",
                JSM_NAMESPACE_LOCAL_RANK=str(r),
                JSM_NAMESPACE_LOCAL_SIZE="2",
                LSB_JOBID=job,
                LSB_MCPU_HOSTS="launchnode 1 127.0.0.1 2",
            )
            for r in range(2)
        ]
    )
    assert _layout(results) == [(0, 0, 0, 2, 1, "0"), (1, 1, 0, 2, 1, "1")]


def test_flux_tasks_of_one_node_rendezvous_on_the_loopback_at_the_jobs_port():
    job = _free_job()
    results = _ranks(
        [
            _env(
                FLUX_TASK_RANK=str(r),
                FLUX_TASK_LOCAL_ID=str(r),
                FLUX_JOB_SIZE="2",
                FLUX_JOB_NNODES="1",
                FLUX_JOB_ID=job,
            )
            for r in range(2)
        ]
    )
    assert _layout(results) == [(0, 0, 0, 2, 1, "0"), (1, 1, 0, 2, 1, "1")]


def test_a_process_with_a_leftover_rank_starts_its_own_ranks():
    """RANK and WORLD_SIZE without a rendezvous address (a shell that kept them) are no launcher's: the script
    starts its own 2 ranks, as a plain python does."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "leftover"],
        env=_env(RANK="1", WORLD_SIZE="2"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [result] = report_results(proc.stdout)
    assert (result["rank"], result["world"], result["sum"]) == (0, 2, 1), "rank 0's result of its own 2 ranks"
