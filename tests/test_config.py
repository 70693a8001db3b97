"""Every bad argument fails at construction, naming the argument and what is allowed."""

from __future__ import annotations

import datetime
import re
import warnings

import pytest
import torch
from support import component

import qaccel.errors
import qaccel.options
from qaccel import Accelerator


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        ({"nprocs": 0}, ValueError, "nprocs must be a positive int; got 0"),
        ({"nprocs": -2}, ValueError, "nprocs must be a positive int; got -2"),
        ({"nprocs": 2.0}, ValueError, "nprocs must be a positive int; got 2.0"),
        ({"nprocs": "2"}, ValueError, "nprocs must be a positive int; got '2'"),
        ({"nprocs": True}, ValueError, "nprocs must be a positive int; got True"),
        ({"compute_setup": "tpu"}, ValueError, "compute_setup must be one of 'auto', 'cpu', 'gpu'; got 'tpu'"),
        ({"compute_setup": None}, ValueError, "compute_setup must be one of 'auto', 'cpu', 'gpu'; got None"),
        ({"log_setup": "gpu"}, ValueError, "log_setup must be one of 'auto', 'cpu'; got 'gpu'"),
        ({"backend": "ucc"}, ValueError, "backend must be one of 'gloo', 'nccl'"),
        ({"backend": "nccl", "compute_setup": "cpu"}, ValueError, "backend='nccl' needs GPU compute"),
        ({"dtype": "float64"}, TypeError, "dtype must be a torch.dtype (e.g. torch.float64) or None; got 'float64'"),
        ({"dtype": float}, TypeError, "dtype must be a torch.dtype"),
        ({"dtype": torch.int64}, ValueError, "dtype must be a floating-point or complex torch.dtype"),
        ({"timeout": 0}, ValueError, "timeout must be a positive number of seconds or a timedelta; got 0"),
        ({"timeout": "10"}, ValueError, "timeout must be a positive number"),
        ({"start_method": "fork"}, ValueError, "start_method must be one of 'forkserver', 'spawn'; got 'fork'"),
    ],
)
def test_bad_argument_raises_at_construction(kwargs, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        Accelerator(**kwargs)


def test_mpi_only_when_torch_has_it():
    if torch.distributed.is_mpi_available():
        assert Accelerator(backend="mpi", compute_setup="cpu").backend == "mpi"
    else:
        with pytest.raises(ValueError, match="backend must be one of 'gloo', 'nccl'; got 'mpi'"):
            Accelerator(backend="mpi")


def test_gpu_without_cuda_raises():
    if torch.cuda.device_count() > 0:
        component.unavailable("checks the error of a machine without CUDA, and this one has a GPU")
    with pytest.raises(RuntimeError, match="compute_setup='gpu' but CUDA is not available"):
        Accelerator(compute_setup="gpu")


def test_more_gpu_ranks_than_gpus_raises(monkeypatch):
    """The GPU count is the only thing faked here: no GPU on CI, and the check must run before any launch."""
    monkeypatch.setattr(qaccel.environment.gpus, "cuda_device_count", lambda: 1)
    with pytest.raises(RuntimeError, match=r"2 GPU ranks on this node but only 1 visible GPU\(s\)"):
        Accelerator(nprocs=2, compute_setup="gpu", backend="gloo")
    acc = Accelerator(nprocs=1, compute_setup="auto", backend="gloo")
    assert acc.device == torch.device("cuda", 0) and acc.log_device == torch.device("cpu")


def test_good_arguments_resolve():
    acc = Accelerator(
        nprocs=2, compute_setup="cpu", log_setup="auto", dtype=torch.float64, timeout=datetime.timedelta(seconds=5)
    )
    assert (acc.backend, acc.dtype, acc.device, acc.log_device) == (
        "gloo",
        torch.float64,
        torch.device("cpu"),
        torch.device("cpu"),
    )
    assert acc._config.timeout == 5.0


@pytest.mark.parametrize("rank", [0, 1])
def test_torchrun_world_mismatch_warns_once_per_job_on_rank_0(monkeypatch, rank):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(qaccel.errors, "_WARNED", set())  # a fresh process: nothing warned yet
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accelerator(nprocs=4, compute_setup="cpu")
        Accelerator(nprocs=4, compute_setup="cpu")
    expected = ["Accelerator(nprocs=4) but torchrun started 2 ranks; following torchrun"] if rank == 0 else []
    assert [str(w.message) for w in caught] == expected
    assert (acc.rank, acc.world_size) == (rank, 2)
