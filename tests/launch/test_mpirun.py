"""A real Open MPI: ``mpirun -np 2 python script.py`` makes each MPI process a rank, one world of 2 run in place,
with the rendezvous found on its own (one node: 127.0.0.1, a port from the MPI job's id) or where MASTER_ADDR and
MASTER_PORT passed with ``-x`` say."""

from __future__ import annotations

import sys

import pytest
from support.procs import free_port, report_results, run_mpirun, script_file

pytestmark = [pytest.mark.timeout(180), pytest.mark.mpi]
SCRIPT = script_file("report_ranks.py")


def _mpirun(*args: str) -> list[dict]:
    proc = run_mpirun(*args, sys.executable, str(SCRIPT), "mpi")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = sorted(report_results(proc.stdout), key=lambda r: r["rank"])
    assert len(results) == 2, proc.stdout + proc.stderr
    return results


def test_mpirun_processes_are_one_world_with_the_rendezvous_found_on_their_own():
    results = _mpirun()
    assert [(r["rank"], r["local"], r["node"], r["world"], r["sum"], r["env_rank"]) for r in results] == [
        (0, 0, 0, 2, 1, "0"),
        (1, 1, 0, 2, 1, "1"),
    ]
    assert len({r["pid"] for r in results}) == 2


def test_mpirun_with_master_variables_passed_uses_them():
    results = _mpirun("-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={free_port()}")
    assert [(r["rank"], r["world"], r["sum"]) for r in results] == [(0, 2, 1), (1, 2, 1)]
