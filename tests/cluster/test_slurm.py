"""qaccel under a real SLURM (slurmctld + 2 slurmd, fake nodes n1/n2 on localhost): srun steps and sbatch.

A failing rank in an srun step (non-zero exit, its ValueError and "[qaccel] raised on rank 1 of 2", the step ended
in seconds): tests/launch/test_launcher_failures.py, with and without --kill-on-bad-exit."""

from __future__ import annotations

import json

import pytest

from support.procs import REPO, slurm_env, write_script

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]

SCRIPT = """
import json, os
from qaccel import Accelerator

acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)

def work():
    total = acc.all_reduce_dict({"r": acc.rank}, op="sum")["r"]
    return {"rank": acc.rank, "local": acc.local_rank, "node": acc.node_rank, "world": acc.world_size,
            "sum": total, "pid": os.getpid(), "procid": os.environ.get("SLURM_PROCID")}

if __name__ == "__main__":
    first = acc.distribute(work)()
    again = acc.distribute(work)()  # a second group in the same task re-rendezvouses on the same port
    assert {**again, "pid": 0} == {**first, "pid": 0}, (again, first)
    os.write(1, ("RESULT " + json.dumps(first) + "\\n").encode())  # one write: a line never splits
"""


def _results(text):
    return sorted((json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")), key=lambda r: r["rank"])


def test_srun_two_nodes_each_task_is_a_rank(slurm_cluster, tmp_path):
    script = write_script(tmp_path, SCRIPT)
    proc = slurm_cluster.srun(["-N2", "-n2", "python", str(script)], timeout=120, env=slurm_env(slurm_cluster))
    assert proc.returncode == 0, proc.stderr
    results = _results(proc.stdout)
    assert [(r["rank"], r["local"], r["node"], r["world"], r["sum"], r["procid"]) for r in results] == [
        (0, 0, 0, 2, 1, "0"),
        (1, 0, 1, 2, 1, "1"),
    ]


def test_srun_two_tasks_one_node(slurm_cluster, tmp_path):
    script = write_script(tmp_path, SCRIPT)
    proc = slurm_cluster.srun(["-N1", "-n2", "python", str(script)], timeout=120, env=slurm_env(slurm_cluster))
    assert proc.returncode == 0, proc.stderr
    assert [(r["rank"], r["local"], r["node"], r["sum"]) for r in _results(proc.stdout)] == [(0, 0, 0, 1), (1, 1, 0, 1)]


def test_sbatch_without_srun_spawns_its_own_ranks(slurm_cluster, tmp_path):
    """The batch shell has SLURM_PROCID=0, SLURM_NTASKS=2 and no step: python there must spawn, not wait."""
    script = write_script(tmp_path, SCRIPT)
    batch = tmp_path / "job.sbatch"
    batch.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --nodes=1\nexec python {script}\n")
    env = slurm_cluster.env
    env["PYTHONPATH"] = str(REPO)
    _, output = slurm_cluster.sbatch_wait(str(batch), timeout=120, env=env)
    [result] = _results(output)
    assert (result["rank"], result["world"], result["sum"]) == (0, 2, 1), output
