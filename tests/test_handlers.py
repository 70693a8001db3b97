"""Accelerate's kwargs handlers: taken as qaccel's classes or Accelerate's own objects, checked when the Accelerator
is made, and reaching the torch objects qaccel makes (the DDP wrapper and its communication hook, the process
group's timeout, autocast, the profiler) on real ranks."""

from __future__ import annotations

import dataclasses
import datetime
import json

import pytest
import torch
from support import component

from qaccel import Accelerator, handlers
from qaccel.utils import (
    AutocastKwargs,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)

CLASSES = (DistributedDataParallelKwargs, InitProcessGroupKwargs, GradScalerKwargs, AutocastKwargs, ProfileKwargs)


def test_the_classes_have_accelerates_fields_and_defaults():
    accelerate_utils = component.module("accelerate.utils")
    for ours in CLASSES:
        theirs = getattr(accelerate_utils, ours.__name__)
        mine, its = ours(), theirs()
        assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)], ours
        for name in (f.name for f in dataclasses.fields(ours)):
            value = getattr(its, name)
            assert getattr(mine, name) == getattr(value, "value", value), (ours.__name__, name)
        assert mine.to_kwargs() == its.to_kwargs() == {}


def test_accelerates_objects_resolve_as_qaccels():
    accelerate_utils = component.module("accelerate.utils")
    theirs = [
        accelerate_utils.DistributedDataParallelKwargs(
            find_unused_parameters=True, bucket_cap_mb=1, comm_hook=accelerate_utils.DDPCommunicationHookType.FP16
        ),
        accelerate_utils.InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=800)),
        accelerate_utils.AutocastKwargs(cache_enabled=False),
    ]
    ours = [
        DistributedDataParallelKwargs(find_unused_parameters=True, bucket_cap_mb=1, comm_hook="fp16"),
        InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=800)),
        AutocastKwargs(cache_enabled=False),
    ]
    from_theirs, from_ours = Accelerator(kwargs_handlers=theirs)._config, Accelerator(kwargs_handlers=ours)._config
    assert from_theirs.handlers == from_ours.handlers
    assert from_ours.handlers.ddp == {"find_unused_parameters": True, "bucket_cap_mb": 1}
    assert from_ours.handlers.comm_hook is DDPCommunicationHookType.FP16
    assert from_ours.handlers.autocast == {"cache_enabled": False}
    assert from_theirs.timeout == from_ours.timeout == 800.0


def test_init_process_group_kwargs_set_the_timeout_and_backend_options():
    config = Accelerator(compute_setup="cpu", kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])._config
    assert config.backend == "gloo" and config.timeout == 1800.0, "Accelerate's timeout for a backend other than nccl"
    assert (
        Accelerator(
            timeout=800, kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=800))]
        )._config.timeout
        == 800.0
    )
    with pytest.raises(
        ValueError,
        match=r"InitProcessGroupKwargs\(timeout=datetime.timedelta\(seconds=800\)\) "
        r"contradicts timeout=60",
    ):
        Accelerator(timeout=60, kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=800))])
    with pytest.raises(ValueError, match="init_method=.... is not in qaccel: the ranks meet through qaccel's store"):
        Accelerator(kwargs_handlers=[InitProcessGroupKwargs(init_method="tcp://10.0.0.1:29500")])


@pytest.mark.parametrize(
    "given, error, match",
    [
        ([AutocastKwargs(), AutocastKwargs(enabled=False)], ValueError, "two AutocastKwargss; pass one"),
        (AutocastKwargs(), TypeError, "kwargs_handlers must be a list of handlers"),
        ([{"find_unused_parameters": True}], TypeError, "kwargs_handlers takes DistributedDataParallelKwargs, "),
        (
            [DistributedDataParallelKwargs(comm_hook="int8")],
            ValueError,
            "comm_hook must be one of 'no', 'fp16', 'bf16', 'power_sgd', 'batched_power_sgd'; got 'int8'",
        ),
        (
            [DistributedDataParallelKwargs(comm_wrapper="power_sgd")],
            ValueError,
            "comm_wrapper must be one of 'no', 'fp16', 'bf16'; got 'power_sgd'",
        ),
        (
            [ProfileKwargs(activities=["tpu"])],
            ValueError,
            "ProfileKwargs.activities: 'tpu' is not one of 'cpu', 'cuda'",
        ),
    ],
)
def test_a_mistake_fails_when_the_accelerator_is_made(given, error, match):
    with pytest.raises(error, match=match):
        Accelerator(kwargs_handlers=given)


def test_accelerates_fp8_recipes_and_ddp_settings_under_fsdp_are_refused_with_the_reason():
    accelerate_utils = component.module("accelerate.utils")
    recipe = accelerate_utils.TERecipeKwargs
    recipe = recipe.__new__(recipe)  # its __post_init__ needs TransformerEngine, which is not installed here
    with pytest.raises(ValueError, match="TERecipeKwargs is Accelerate's; qaccel has no fp8 training"):
        Accelerator(kwargs_handlers=[recipe])
    with pytest.raises(ValueError, match="DistributedDataParallelKwargs applies to strategy='ddp'"):
        Accelerator(strategy="fsdp", kwargs_handlers=[DistributedDataParallelKwargs(static_graph=True)])


def test_grad_scaler_kwargs_need_fp16_which_runs_on_gpus_only():
    with pytest.warns(UserWarning, match="mixed_precision='fp16' without GPU compute trains in float32"):
        acc = Accelerator(
            compute_setup="cpu", mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=8.0)]
        )
    assert acc._config.handlers.scaler == {"init_scale": 8.0} and acc.scaler is None
    # the GPU side (the scaler made with these settings) is in tests/test_cuda.py


def test_autocast_kwargs_reach_the_prepared_forward_and_autocast(single):
    torch.manual_seed(0)
    plain = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    expected = plain(x)
    off = Accelerator(compute_setup="cpu", mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)])
    on = Accelerator(compute_setup="cpu", mixed_precision="bf16")
    assert torch.equal(off.prepare(_copy(plain))(x), expected), "autocast off: float32 through"
    assert not torch.equal(on.prepare(_copy(plain))(x), expected), "bf16 autocast rounds"
    with on.autocast():
        assert torch.is_autocast_enabled("cpu")
    with on.autocast(AutocastKwargs(enabled=False)):
        assert not torch.is_autocast_enabled("cpu")
    with off.autocast():
        assert not torch.is_autocast_enabled("cpu")


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    twin = torch.nn.Linear(8, 8)
    twin.load_state_dict(model.state_dict())
    return twin


def _ddp_settings():
    """On each rank: Accelerators made inside the rank with and without DDP settings."""
    import torch.distributed as dist

    from qaccel import Accelerator
    from qaccel.utils import DistributedDataParallelKwargs

    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.used(x)

    def two_steps(acc):
        torch.manual_seed(0)
        model = acc.prepare(Branches())
        for _ in range(2):
            model(torch.randn(3, 4) + dist.get_rank()).sum().backward()
        return model

    found = {}
    settings = DistributedDataParallelKwargs(
        find_unused_parameters=True, bucket_cap_mb=1, broadcast_buffers=False, gradient_as_bucket_view=True
    )
    model = two_steps(Accelerator(compute_setup="cpu", kwargs_handlers=[settings]))
    found["attributes"] = (
        model.find_unused_parameters,
        model.bucket_bytes_cap,
        model.broadcast_buffers,
        model.gradient_as_bucket_view,
    )
    try:
        two_steps(Accelerator(compute_setup="cpu"))
        found["default"] = "trained"
    except RuntimeError as exc:
        found["default"] = str(exc).splitlines()[0]
    for hook in ("fp16", "power_sgd"):
        acc = Accelerator(
            compute_setup="cpu",
            kwargs_handlers=[
                DistributedDataParallelKwargs(
                    comm_hook=hook, comm_state_option={"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
                )
            ],
        )
        torch.manual_seed(0)
        model = acc.prepare(torch.nn.Linear(4, 4))
        model(torch.randn(3, 4) * (dist.get_rank() + 1) / 3).sum().backward()
        grad = model.module.weight.grad
        found[hook] = (model._get_ddp_logging_data().get("comm_hook"), torch.equal(grad.half().float(), grad))
    return found


@pytest.mark.timeout(120)
def test_ddp_settings_and_communication_hooks_reach_the_wrapper_on_real_ranks(acc):
    for found in acc.distribute(_ddp_settings, all_results=True)():
        assert found["attributes"] == (True, 1024 * 1024, False, True)
        assert "Expected to have finished reduction in the prior iteration" in found["default"], (
            "without find_unused_parameters the unused branch fails: the setting is what makes it train"
        )
        assert found["fp16"] == ("fp16_compress_hook", True), "gradients all-reduced in fp16"
        assert found["power_sgd"][0] == "powerSGD_hook"


def _profiled(out: str):
    import torch.distributed as dist

    from qaccel import Accelerator
    from qaccel.utils import ProfileKwargs

    ready = []
    acc = Accelerator(compute_setup="cpu", kwargs_handlers=[ProfileKwargs(output_trace_dir=out, record_shapes=True)])
    with acc.profile() as profiler:
        torch.mm(torch.ones(16, 16), torch.ones(16, 16))
    scheduled = ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 1}, on_trace_ready=ready.append)
    with acc.profile(scheduled) as stepped:
        for _ in range(4):
            torch.ones(4).sum()
            stepped.step()
    return {"rank": dist.get_rank(), "ops": [e.key for e in profiler.key_averages()], "ready": len(ready)}


@pytest.mark.timeout(120)
def test_profile_writes_one_chrome_trace_per_rank_and_takes_a_schedule(acc, tmp_path):
    out = tmp_path / "traces"
    results = acc.distribute(_profiled, all_results=True)(str(out))
    assert sorted(p.name for p in out.iterdir()) == ["profile_0.json", "profile_1.json"]
    for path in out.iterdir():
        events = json.loads(path.read_text())["traceEvents"]
        assert any(e.get("name") == "aten::mm" for e in events), path
    for result in results:
        assert "aten::mm" in result["ops"] and result["ready"] == 1, result


def test_trace_path_is_accelerates_file_name():
    assert handlers.trace_path(ProfileKwargs(output_trace_dir="t"), 3) == "t/profile_3.json"
    assert handlers.trace_path(ProfileKwargs(), 0) is None
