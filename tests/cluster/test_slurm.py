"""qaccel under a real SLURM (slurmctld + 2 slurmd, fake nodes n1/n2 on localhost): srun steps and sbatch.

A failing rank in an srun step (non-zero exit, its ValueError and "[qaccel] raised on rank 1 of 2", the step ended
in seconds): tests/launch/test_launcher_failures.py, with and without --kill-on-bad-exit."""

from __future__ import annotations

import json

import pytest
from support.procs import REPO, script_file, slurm_env

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]

SCRIPT = script_file("srun_ranks.py")


def _results(text):
    return sorted(
        (json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")), key=lambda r: r["rank"]
    )


def test_srun_two_nodes_each_task_is_a_rank(slurm_cluster):
    proc = slurm_cluster.srun(["-N2", "-n2", "python", str(SCRIPT)], timeout=120, env=slurm_env(slurm_cluster))
    assert proc.returncode == 0, proc.stderr
    results = _results(proc.stdout)
    assert [(r["rank"], r["local"], r["node"], r["world"], r["sum"], r["procid"]) for r in results] == [
        (0, 0, 0, 2, 1, "0"),
        (1, 0, 1, 2, 1, "1"),
    ]


def test_srun_two_tasks_one_node(slurm_cluster):
    proc = slurm_cluster.srun(["-N1", "-n2", "python", str(SCRIPT)], timeout=120, env=slurm_env(slurm_cluster))
    assert proc.returncode == 0, proc.stderr
    assert [(r["rank"], r["local"], r["node"], r["sum"]) for r in _results(proc.stdout)] == [(0, 0, 0, 1), (1, 1, 0, 1)]


def test_sbatch_without_srun_spawns_its_own_ranks(slurm_cluster, tmp_path):
    """The batch shell has SLURM_PROCID=0, SLURM_NTASKS=2 and no step: python there must spawn, not wait."""
    batch = tmp_path / "job.sbatch"
    batch.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --nodes=1\nexec python {SCRIPT}\n")
    env = slurm_cluster.env
    env["PYTHONPATH"] = str(REPO)
    _, output = slurm_cluster.sbatch_wait(str(batch), timeout=120, env=env)
    [result] = _results(output)
    assert (result["rank"], result["world"], result["sum"]) == (0, 2, 1), output
