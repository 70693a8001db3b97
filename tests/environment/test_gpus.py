"""Which GPU a rank takes (qaccel/environment/gpus.py): the rule itself, and the rule over the variables real
launchers set: a real SLURM that hands out GPUs (the suite's local one: GRES gpu, CUDA_VISIBLE_DEVICES per task),
a real Open MPI with and without a wrapper that binds one GPU per process, and a Kubernetes PyTorchJob's pod."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from support import component
from support.procs import result_lines, run_mpirun, script_file, slurm_env

from qaccel.environment import detect, gpus
from qaccel.environment.gpus import Binding, GpuLayoutError

pytestmark = pytest.mark.timeout(180)
SCRIPT = script_file("gpu_choice.py")


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


def _srun(slurm_cluster, *options: str) -> list[dict]:
    proc = slurm_cluster.srun([*options, sys.executable, str(SCRIPT)], env=slurm_env(slurm_cluster), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sorted(result_lines(proc.stdout), key=lambda r: r["rank"])


@pytest.mark.slurm
def test_under_srun_every_rank_of_a_node_gets_a_gpu_of_its_own_however_slurm_binds_them(slurm_cluster):
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
    for options, expected in layouts.items():
        got = _srun(slurm_cluster, *options)
        assert [(r["node"], r["gpu"], r["binding"]) for r in got] == expected, options
    shared = _srun(slurm_cluster, "-N1", "-n2", "--gpus-per-node=1")
    assert all("the 2 ranks on this node share 1 GPU(s) (SLURM_GPUS_ON_NODE=1" in r["error"] for r in shared), shared


@pytest.mark.slurm
def test_an_srun_rank_given_gpus_its_torch_cannot_see_fails_at_construction_naming_its_node(slurm_cluster):
    if torch.cuda.device_count() > 0:
        component.unavailable("checks a rank whose torch sees none of the GPUs SLURM gave, and this machine has one")
    code = "from qaccel import Accelerator; Accelerator()"
    proc = slurm_cluster.srun(
        ["-N1", "-n2", "--gpus-per-task=1", sys.executable, "-c", code], env=slurm_env(slurm_cluster), timeout=120
    )
    assert proc.returncode != 0
    for gpu in ("0", "1"):  # on n1, or n2 while a job of another test holds n1's CPUs
        assert re.search(
            rf"RuntimeError: node n[12]: SLURM_STEP_GPUS={gpu}, but torch sees no GPU here "
            rf"\(CUDA_VISIBLE_DEVICES={gpu};",
            proc.stderr,
        ), proc.stderr
    cpu = slurm_cluster.srun(
        [
            "-N1",
            "-n2",
            "--gpus-per-task=1",
            sys.executable,
            "-c",
            "from qaccel import Accelerator; print(Accelerator(compute_setup='cpu').device)",
        ],
        env=slurm_env(slurm_cluster),
        timeout=120,
    )
    assert cpu.returncode == 0 and cpu.stdout.split() == ["cpu", "cpu"], cpu.stdout + cpu.stderr


def _mpirun(*args: str) -> list[dict]:
    proc = run_mpirun(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sorted(result_lines(proc.stdout), key=lambda r: r["rank"])


@pytest.mark.mpi
def test_under_mpirun_a_wrapper_that_binds_one_gpu_per_process_and_a_node_shared_by_all_both_work():
    wrapper = 'CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK exec "$@"'
    bound = _mpirun("bash", "-c", wrapper, "wrapper", sys.executable, str(SCRIPT))
    assert [(r["gpu"], r["binding"]) for r in bound] == [("0", "own"), ("1", "own")]
    shared = _mpirun("-x", "CUDA_VISIBLE_DEVICES=0,1", sys.executable, str(SCRIPT))
    assert [(r["gpu"], r["binding"]) for r in shared] == [("0", "by local rank"), ("1", "by local rank")]


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
