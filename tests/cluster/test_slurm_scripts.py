"""The sbatch templates in slurm/, submitted unmodified with ``sbatch`` to a real local SLURM (fake nodes n1, n2).

Each test overrides only what a CPU-only cluster needs (``--gpus-per-node=0``, ``--cpus-per-task``, the task or
worker count, and the rendezvous host/port since n1/n2 do not resolve) and passes a tiny training script as the
template's argument. Every rank takes two real DDP steps on its own data and reports one ``RESULT`` line; the
tests check the ranks, their nodes, the world size, an all-reduced sum and that the trained weights are the same on
every rank and equal to training on all ranks' data at once, plus the job's final state. With a rank raising on one
node, the multi-node templates must end the whole job (--kill-on-bad-exit) instead of leaving the others blocked.
After every job, no process carrying the job's environment may still run, and torchrun's files are in the job's
TMPDIR (the test's directory), not in /tmp.

docs/cluster.md's two GPU recipes run in the two jobs of train.sbatch, on the local SLURM's two GPUs per node
(which its torch cannot use: the ranks train on the CPU): every rank sees its node's GPUs in the job that trains,
each sees its own in the job where a rank fails; each rank reports the GPU qaccel's rule gives it before it trains
(template_train.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.procs import REPO, free_port, left_in, script_file, wait_dead

pytestmark = pytest.mark.slurm

TRAIN = script_file("template_train.py")
ARGS = ["--tag", "two words"]  # reach the training script through the template's "$@", quoting intact
CPU_ONLY = ["--gpus-per-node=0"]


def _env(cluster, tmp_path: Path, **extra: str) -> dict:
    """The environment sbatch exports to the job: qaccel importable, temp files in the test's own dir."""
    env = cluster.env
    env.update(PYTHONPATH=str(REPO), TMPDIR=str(tmp_path / "tmp"), **extra)
    (tmp_path / "tmp").mkdir()
    return env


def _expected_weight(world: int) -> list[float]:
    """TRAIN's weights after its two steps, trained in one process on every rank's data (DDP averages gradients)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        loss = sum(model(torch.full((8, 4), float(r + 1))).pow(2).mean() for r in range(world)) / world
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.weight.flatten().tolist()


def _submit(
    cluster,
    tmp_path: Path,
    template: str,
    options: list[str],
    env: dict,
    timeout: float = 100,
):
    """sbatch slurm/<template> with ``options`` and TRAIN as its argument; wait until the job
    has left the queue and none of its processes runs.  Returns (job info, RESULT objects by rank, output)."""
    job_id, output = cluster.sbatch_wait(
        REPO / "slurm" / template, timeout, options, env=env, cwd=tmp_path, script_args=[str(TRAIN), *ARGS]
    )
    results = sorted(
        (json.loads(line[len("RESULT ") :]) for line in output.splitlines() if line.startswith("RESULT ")),
        key=lambda r: r["rank"],
    )
    assert _running_with(f"TMPDIR={tmp_path / 'tmp'}") == [], output  # batch shell, srun, torchrun, ranks: all gone
    return cluster.job_info(job_id), results, output


def _state(info: dict) -> tuple:
    return info.get("JobState"), info.get("ExitCode")


def _running_with(env_entry: str) -> list[int]:
    """Live processes whose environment holds ``env_entry`` (the job's batch shell, srun tasks, torchrun, ranks)."""
    marker = env_entry.encode()
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                if marker in Path(f"/proc/{d}/environ").read_bytes().split(b"\0") and wait_dead([int(d)], 5):
                    found.append(int(d))
            except OSError:
                pass
    return found


def _gpus(output: str) -> list[tuple]:
    """Every rank's GPU, as its ``GPU`` line reports it: (rank, node, physical GPU, binding), by rank."""
    reports = (json.loads(line[len("GPU ") :]) for line in output.splitlines() if line.startswith("GPU "))
    return sorted((r["rank"], r["node"], r["gpu"], r["binding"]) for r in reports)


def _check_training(results: list[dict], world: int, kind: str, output: str) -> None:
    assert [r["rank"] for r in results] == list(range(world)), output
    assert {(r["world_size"], r["rank_sum"], r["kind"]) for r in results} == {(world, world * (world - 1) // 2, kind)}
    assert all(r["argv"] == ARGS for r in results)
    assert all(r["weight"] == results[0]["weight"] for r in results)  # bitwise equal on every rank
    assert results[0]["weight"] == pytest.approx(_expected_weight(world), rel=1e-6, abs=1e-7)


@pytest.mark.timeout(150)
def test_one_node_template_runs_one_srun_task_per_rank(slurm_cluster, tmp_path):
    env = _env(slurm_cluster, tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    info, results, output = _submit(
        slurm_cluster, tmp_path, "one_node.sbatch", [*CPU_ONLY, "--ntasks-per-node=2", "--cpus-per-task=1"], env
    )
    assert _state(info) == ("COMPLETED", "0:0"), output
    _check_training(results, 2, "slurm", output)
    # one node, SLURM's choice: n1, or n2 while a job of an earlier test still holds n1's CPUs
    node = results[0]["slurm_node"]
    assert [(r["local_rank"], r["node_rank"], r["slurm_node"]) for r in results] == [(0, 0, node), (1, 0, node)]
    assert left_in(tmp_path / "tmp") == []


@pytest.mark.timeout(150)
def test_multi_node_template_runs_one_srun_task_per_rank_on_every_node_whose_local_rank_picks_its_gpu(
    slurm_cluster, tmp_path
):
    """docs/cluster.md's first GPU recipe: --gpus-per-node, every rank sees its node's GPUs."""
    env = _env(slurm_cluster, tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    info, results, output = _submit(
        slurm_cluster,
        tmp_path,
        "train.sbatch",
        ["--gpus-per-node=2", "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1"],
        env,
    )
    assert _state(info) == ("COMPLETED", "0:0"), output
    _check_training(results, 4, "slurm", output)
    # srun places tasks in blocks: ranks 0, 1 on the first node, 2, 3 on the second
    assert [(r["local_rank"], r["node_rank"], r["slurm_node"]) for r in results] == [
        (0, 0, "n1"),
        (1, 0, "n1"),
        (0, 1, "n2"),
        (1, 1, "n2"),
    ]
    assert _gpus(output) == [
        (0, 0, "0", "by local rank"),
        (1, 0, "1", "by local rank"),
        (2, 1, "0", "by local rank"),
        (3, 1, "1", "by local rank"),
    ], output
    assert left_in(tmp_path / "tmp") == []


@pytest.mark.timeout(150)
def test_torchrun_one_node_template_follows_torchruns_workers(slurm_cluster, tmp_path):
    env = _env(slurm_cluster, tmp_path, NPROC_PER_NODE="2")
    info, results, output = _submit(
        slurm_cluster, tmp_path, "torchrun_one_node.sbatch", [*CPU_ONLY, "--cpus-per-task=2"], env
    )
    assert _state(info) == ("COMPLETED", "0:0"), output
    _check_training(results, 2, "torchrun", output)
    assert [(r["local_rank"], r["node_rank"], r["slurm_node"]) for r in results] == [(0, 0, "n1"), (1, 0, "n1")]
    # torchrun's own files went to the job's TMPDIR, not to /tmp
    assert [name.startswith("torchelastic_") for name in left_in(tmp_path / "tmp")] == [True]


@pytest.mark.timeout(150)
def test_torchrun_multi_node_template_rendezvouses_one_torchrun_per_node(slurm_cluster, tmp_path):
    env = _env(slurm_cluster, tmp_path, NPROC_PER_NODE="2", RDZV_HOST="127.0.0.1", RDZV_PORT=str(free_port()))
    info, results, output = _submit(
        slurm_cluster, tmp_path, "torchrun_multi_node.sbatch", [*CPU_ONLY, "--nodes=2", "--cpus-per-task=2"], env
    )
    assert _state(info) == ("COMPLETED", "0:0"), output
    _check_training(results, 4, "torchrun", output)
    # node ranks come from the rendezvous, not from SLURM: node 0 may be n1 or n2, but each is one SLURM node
    assert [(r["local_rank"], r["node_rank"]) for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)], output
    nodes = [r["slurm_node"] for r in results]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and {nodes[0], nodes[2]} == {"n1", "n2"}, output
    assert sorted(name.startswith("torchelastic_") for name in left_in(tmp_path / "tmp")) == [True, True]


@pytest.mark.timeout(150)
def test_one_node_template_runs_the_quickstart_example_without_arguments(slurm_cluster, tmp_path):
    env = _env(slurm_cluster, tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    job_id, output = slurm_cluster.sbatch_wait(
        REPO / "slurm" / "one_node.sbatch",
        100,
        [*CPU_ONLY, "--ntasks-per-node=2", "--cpus-per-task=1"],
        env=env,
        cwd=REPO,
    )  # submitted from the repository root, as documented
    assert _state(slurm_cluster.job_info(job_id)) == ("COMPLETED", "0:0"), output
    assert output.count("final mean loss") == 1, output
    assert "(2 ranks)" in output, output


@pytest.mark.timeout(150)
def test_multi_node_template_binds_one_gpu_per_task_and_stops_every_rank_when_one_fails(slurm_cluster, tmp_path):
    """docs/cluster.md's second GPU recipe: --gpus-per-task=1, each rank sees its own GPU; then rank 3 raises."""
    env = _env(
        slurm_cluster,
        tmp_path,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        FAIL_RANK="3",
        TRAIN_TIMEOUT="600",
    )
    info, results, output = _submit(
        slurm_cluster,
        tmp_path,
        "train.sbatch",
        ["--gpus-per-node=2", "--gpus-per-task=1", "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1"],
        env,
    )
    assert _gpus(output) == [(0, 0, "0", "own"), (1, 0, "1", "own"), (2, 1, "0", "own"), (3, 1, "1", "own")], output
    assert info.get("JobState") == "FAILED" and info.get("ExitCode") != "0:0", output
    assert "ValueError: rank 3 fails on purpose" in output and "[qaccel] raised on rank 3 of 4" in output, output
    # the other ranks, blocked in DDP's first broadcast for up to 600 s, were killed (or the job would outlast
    # _submit's wait) and printed no result
    assert results == []


@pytest.mark.timeout(150)
def test_torchrun_multi_node_template_stops_both_nodes_when_a_worker_fails(slurm_cluster, tmp_path):
    """One worker per node: the one that fails on one node, the one it leaves blocked on the other."""
    env = _env(
        slurm_cluster,
        tmp_path,
        NPROC_PER_NODE="1",
        RDZV_HOST="127.0.0.1",
        RDZV_PORT=str(free_port()),
        FAIL_RANK="1",
        TRAIN_TIMEOUT="600",
    )
    info, results, output = _submit(
        slurm_cluster, tmp_path, "torchrun_multi_node.sbatch", [*CPU_ONLY, "--nodes=2", "--cpus-per-task=2"], env
    )
    assert info.get("JobState") == "FAILED" and info.get("ExitCode") != "0:0", output
    assert "ValueError: rank 1 fails on purpose" in output and "[qaccel] raised on rank 1 of 2" in output, output
    assert results == []
