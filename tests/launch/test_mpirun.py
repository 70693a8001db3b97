"""A real Open MPI: ``mpirun -np 2 python script.py`` makes each MPI process a rank, one world of 2 run in place,
with the rendezvous found on its own (one node: 127.0.0.1, a port from the MPI job's id) or where MASTER_ADDR and
MASTER_PORT passed with ``-x`` say."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.procs import free_port, report_results, script_env, script_file

pytestmark = [pytest.mark.timeout(180), pytest.mark.mpi]
SCRIPT = script_file("report_ranks.py")


def _mpirun(*args: str, env: dict[str, str]) -> list[dict]:
    # root may run it (containers, CI); two slots on any machine
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", *args, sys.executable, str(SCRIPT), "mpi"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = sorted(report_results(proc.stdout), key=lambda r: r["rank"])
    assert len(results) == 2, proc.stdout + proc.stderr
    return results


def _env() -> dict[str, str]:
    env = script_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    return env


def test_mpirun_processes_are_one_world_with_the_rendezvous_found_on_their_own():
    results = _mpirun(env=_env())
    assert [(r["rank"], r["local"], r["node"], r["world"], r["sum"], r["env_rank"]) for r in results] == [
        (0, 0, 0, 2, 1, "0"), (1, 1, 0, 2, 1, "1")]
    assert len({r["pid"] for r in results}) == 2


def test_mpirun_with_master_variables_passed_uses_them():
    results = _mpirun("-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={free_port()}", env=_env())
    assert [(r["rank"], r["world"], r["sum"]) for r in results] == [(0, 2, 1), (1, 2, 1)]
