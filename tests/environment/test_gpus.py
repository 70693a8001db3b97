"""Which GPU a rank takes (qaccel/environment/gpus.py): the rule itself, and the rule over the variables real
launchers set: a real SLURM that hands out GPUs (the suite's local one: GRES gpu, CUDA_VISIBLE_DEVICES per task),
a real Open MPI with and without a wrapper that binds one GPU per process, and a Kubernetes PyTorchJob's pod.

The rule reads nothing but the rank's environment, so each srun or mpirun layout runs a task that only saves its
environment (no torch to import), and gpu_choice.py's report, what a rank of that layout prints, is made from it
here. tests/cluster/test_slurm_scripts.py runs the same report inside the ranks of real jobs, for both of
docs/cluster.md's recipes."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from scripts import gpu_choice
from support import component
from support.procs import run_mpirun, slurm_env

from qaccel.environment import detect, gpus
from qaccel.environment.gpus import Binding, GpuLayoutError

pytestmark = pytest.mark.timeout(180)
# what a task runs: its environment, as its launcher made it, saved to a file of its own in the folder it is given
SAVE_ENVIRONMENT = (
    "import json, os, sys; json.dump(dict(os.environ), open(os.path.join(sys.argv[1], f'{os.getpid()}.json'), 'w'))"
)


@pytest.mark.parametrize(
    ("local_rank", "local_world", "visible", "node_gpus", "index", "binding"),
    [
        (1, 2, 1, None, 0, Binding.OWN),  # srun --gpus-per-task=1, a pod per GPU, an MPI wrapper
        (1, 2, 1, 2, 0, Binding.OWN),
        (1, 2, 2, 2, 1, Binding.BY_LOCAL_RANK),  # srun --gpus-per-node=2, torchrun on a 2-GPU node
        (1, 2, 8, None, 1, Binding.BY_LOCAL_RANK),  # fewer ranks than GPUs: the first ones
        (0, 1, 4, 4, 0, Binding.BY_LOCAL_RANK),  # one task with --gpus-per-node=4
    ],
)
def test_a_rank_takes_the_one_gpu_it_sees_or_the_one_its_local_rank_picks(
    local_rank, local_world, visible, node_gpus, index, binding
):
    choice = gpus.choose(local_rank, local_world, visible, node_gpus)
    assert (choice.index, choice.binding) == (index, binding)


def test_any_other_layout_is_refused_naming_it_and_the_options_that_fix_it(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(
        GpuLayoutError,
        match=r"local rank 3 of 4 ranks on this node sees 2 GPUs "
        r"\(CUDA_VISIBLE_DEVICES=2,3\): neither one GPU per rank nor at least one",
    ):
        gpus.choose(3, 4, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(
        GpuLayoutError,
        match=r"the 2 ranks on this node share 1 GPU\(s\) \(SLURM_GPUS_ON_NODE=1; "
        r"local rank 1 sees CUDA_VISIBLE_DEVICES=0\)",
    ) as raised:
        gpus.choose(1, 2, 1, node_gpus=1)
    for fix in (
        "sbatch --gpus-per-node=G with --ntasks-per-node=G",
        "srun --gpus-per-task=1",
        "--gpu-bind=single:1",
        "CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK",
        "mpiexec -gpus-per-proc 1",
        "nvidia.com/gpu: 1",
    ):
        assert fix in str(raised.value)


def _reports(folder: Path) -> list[dict]:
    """gpu_choice.py's report of every task whose environment is saved in ``folder``, made in that environment (the
    rule reads only it), by rank."""
    reports = []
    for saved in folder.glob("*.json"):
        with mock.patch.dict(os.environ, json.loads(saved.read_text()), clear=True):
            reports.append(gpu_choice.choice())
    return sorted(reports, key=lambda r: r["rank"])


def _srun(slurm_cluster, folder: Path, *options: str) -> list[dict]:
    folder.mkdir()
    proc = slurm_cluster.srun(
        [*options, sys.executable, "-c", SAVE_ENVIRONMENT, str(folder)], env=slurm_env(slurm_cluster), timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return _reports(folder)


@pytest.mark.slurm
def test_under_srun_every_rank_of_a_node_gets_a_gpu_of_its_own_however_slurm_binds_them(slurm_cluster, tmp_path):
    layouts = {  # rank: (node, physical GPU, binding)
        ("-N1", "-n2", "--gpus-per-node=2"): [(0, "0", "by local rank"), (0, "1", "by local rank")],
        ("-N1", "-n2", "--gpus-per-task=1"): [(0, "0", "own"), (0, "1", "own")],
        ("-N1", "-n2", "--gpus-per-node=2", "--gpu-bind=single:1"): [(0, "0", "own"), (0, "1", "own")],
        ("-N2", "-n4", "--gpus-per-node=2"): [
            (0, "0", "by local rank"),
            (0, "1", "by local rank"),
            (1, "0", "by local rank"),
            (1, "1", "by local rank"),
        ],
        ("-N1", "-n1", "--gpus-per-node=2"): [(0, "0", "by local rank")],
    }
    for i, (options, expected) in enumerate(layouts.items()):
        got = _srun(slurm_cluster, tmp_path / f"layout{i}", *options)
        assert [(r["node"], r["gpu"], r["binding"]) for r in got] == expected, (options, got)
    shared = _srun(slurm_cluster, tmp_path / "shared", "-N1", "-n2", "--gpus-per-node=1")
    assert len(shared) == 2 and all(
        "the 2 ranks on this node share 1 GPU(s) (SLURM_GPUS_ON_NODE=1" in r["error"] for r in shared
    ), shared


@pytest.mark.slurm
def test_an_srun_rank_given_gpus_its_torch_cannot_see_fails_at_construction_naming_its_node(slurm_cluster):
    """Each task makes a CPU Accelerator first (which works), then one with the default compute_setup="auto"."""
    if torch.cuda.device_count() > 0:
        component.unavailable("checks a rank whose torch sees none of the GPUs SLURM gave, and this machine has one")
    code = "from qaccel import Accelerator; print(Accelerator(compute_setup='cpu').device, flush=True); Accelerator()"
    proc = slurm_cluster.srun(
        ["-N1", "-n2", "--gpus-per-task=1", sys.executable, "-c", code], env=slurm_env(slurm_cluster), timeout=120
    )
    assert proc.returncode != 0
    assert proc.stdout.split() == ["cpu", "cpu"], proc.stdout + proc.stderr
    for gpu in ("0", "1"):  # on n1, or n2 while a job of another test holds n1's CPUs
        assert re.search(
            rf"RuntimeError: node n[12]: SLURM_STEP_GPUS={gpu}, but torch sees no GPU here "
            rf"\(CUDA_VISIBLE_DEVICES={gpu};",
            proc.stderr,
        ), proc.stderr


def _mpirun(folder: Path, *args: str) -> list[dict]:
    folder.mkdir()
    proc = run_mpirun(*args, sys.executable, "-c", SAVE_ENVIRONMENT, str(folder))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return _reports(folder)


@pytest.mark.mpi
def test_under_mpirun_a_wrapper_that_binds_one_gpu_per_process_and_a_node_shared_by_all_both_work(tmp_path):
    wrapper = 'CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK exec "$@"'
    bound = _mpirun(tmp_path / "bound", "bash", "-c", wrapper, "wrapper")
    assert [(r["gpu"], r["binding"]) for r in bound] == [("0", "own"), ("1", "own")], bound
    shared = _mpirun(tmp_path / "shared", "-x", "CUDA_VISIBLE_DEVICES=0,1")
    assert [(r["gpu"], r["binding"]) for r in shared] == [("0", "by local rank"), ("1", "by local rank")], shared


def test_a_kubernetes_pod_per_gpu_takes_the_one_it_sees():
    """A PyTorchJob's pod: the training operator sets these, and the device plugin makes one GPU visible."""
    pod = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "PYTHONUNBUFFERED": "1",
    }
    env = detect(pod)
    choice = gpus.choose(env.local_rank, env.local_world_size, 1, gpus.node_gpus(pod))
    assert (env.local_world_size, choice.index, choice.binding) == (1, 0, Binding.OWN)


def test_allocated_reads_what_slurm_says_it_gave():
    assert gpus.allocated({"SLURM_STEP_GPUS": "1", "SLURM_GPUS_ON_NODE": "2"}) == "SLURM_STEP_GPUS=1"
    assert gpus.allocated({"SLURM_STEP_GPUS": "0"}) == "SLURM_STEP_GPUS=0", "GPU 0, not none"
    assert gpus.allocated({"SLURM_GPUS_ON_NODE": "2"}) == "SLURM_GPUS_ON_NODE=2"
    assert gpus.allocated({"SLURM_GPUS_ON_NODE": "0"}) is None and gpus.allocated({}) is None
