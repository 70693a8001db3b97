"""qaccel.utils: the names scripts import from accelerate.utils, with Accelerate's signatures, acting on the ranks
of the running session (and on this process alone outside one)."""

from __future__ import annotations

import inspect

import pytest
import torch
from support import component

import qaccel.utils


def test_every_name_is_accelerates_with_its_signature():
    accelerate_utils = component.module("accelerate.utils")
    for name in qaccel.utils.__all__:
        theirs, ours = getattr(accelerate_utils, name), getattr(qaccel.utils, name)
        if inspect.isfunction(ours) and inspect.isfunction(theirs):
            assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name


def _on_ranks():
    import torch.distributed as dist

    from qaccel import utils

    rank = dist.get_rank()
    utils.set_seed(7, device_specific=True)
    seeded = torch.rand(1).item()
    shared = utils.broadcast_object_list([f"from {rank}", rank], from_process=1)
    utils.wait_for_everyone()
    batch = {"x": torch.ones(rank + 1, 2) * rank, "name": "kept"}
    return {
        "gather": utils.gather(torch.tensor([rank, rank])).tolist(),
        "gather_object": utils.gather_object([rank, f"r{rank}"]),
        "broadcast": utils.broadcast(torch.tensor([rank * 10]), from_process=1).tolist(),
        "shared": shared,
        "padded": utils.pad_across_processes(torch.ones(rank + 1), pad_index=-1).tolist(),
        "mean": utils.reduce(torch.tensor([float(rank)])).tolist(),
        "sum_scaled": utils.reduce(torch.tensor([float(rank + 1)]), reduction="sum", scale=2.0).tolist(),
        "sent": utils.send_to_device(batch, "meta", skip_keys="name")["x"].device.type,
        "seeded": seeded,
        "released": utils.release_memory(batch, shared),
    }


def test_the_functions_act_on_the_ranks_of_the_session(acc):
    first, second = acc.distribute(_on_ranks, all_results=True)()
    for result in (first, second):
        assert result["gather"] == [0, 0, 1, 1] and result["gather_object"] == [0, "r0", 1, "r1"]
        assert result["broadcast"] == [10] and result["shared"] == ["from 1", 1]
        assert result["mean"] == [0.5], "Accelerate's utils.reduce averages by default"
        assert result["sum_scaled"] == [6.0] and result["sent"] == "meta"
        assert result["released"] == [None, None]
    assert first["padded"] == [1.0, -1.0] and second["padded"] == [1.0, 1.0]
    assert first["seeded"] != second["seeded"], "device_specific: each rank its own seed"


def test_outside_a_session_they_act_on_this_process_alone_and_refuse_a_group_they_did_not_make():
    assert qaccel.utils.gather(torch.ones(2)).tolist() == [1.0, 1.0]
    assert qaccel.utils.gather_object(["only"]) == ["only"]
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match=r"qaccel.utils.gather\(\) acts on the ranks of a distribute\(\) call"):
            qaccel.utils.gather(torch.ones(1))
    finally:
        dist.destroy_process_group()


def test_the_availability_checks_say_what_is_installed_and_which_torch_this_is():
    import importlib.util

    assert qaccel.utils.is_schedulefree_available() is (importlib.util.find_spec("schedulefree") is not None)
    assert qaccel.utils.is_torch_version(">=", "2.0") and not qaccel.utils.is_torch_version("<", "2.0")
    assert qaccel.utils.is_torch_version("==", torch.__version__.split("+")[0])
    assert qaccel.utils.is_cuda_available() is torch.cuda.is_available()
    assert not qaccel.utils.is_npu_available()
    with pytest.raises(ValueError, match="operation must be one of <, <=, ==, !=, >=, >; got '=>'"):
        qaccel.utils.is_torch_version("=>", "2.0")
