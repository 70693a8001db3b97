"""dynamo_backend / TorchDynamoPlugin: prepare() compiles over the DDP or FSDP2 wrapper, in place, with the results
of eager training and no recompilation per step; unwrap_model gives the user's module."""

from __future__ import annotations

import pytest
import torch
from support import component

from qaccel import Accelerator
from qaccel.utils import TorchDynamoPlugin

STEPS = 20


def _train(dynamo_backend, strategy="ddp", mixed_precision="no"):
    """On each rank: 20 SGD steps of a small MLP on the rank's own data; the losses, and what compilation did."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from qaccel import Accelerator

    acc = Accelerator(
        compute_setup="cpu", dynamo_backend=dynamo_backend, strategy=strategy, mixed_precision=mixed_precision
    )
    torch.manual_seed(0)
    user_module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model, optimizer = acc.prepare(user_module, torch.optim.SGD(user_module.parameters(), lr=0.05))
    generator = torch.Generator().manual_seed(dist.get_rank())
    losses, graphs = [], []
    for _ in range(STEPS):
        x = torch.randn(8, 16, generator=generator)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        graphs.append(counters["stats"]["unique_graphs"])
    return {
        "losses": losses,
        "graphs": graphs,
        "compiled": "compile" in vars(acc.unwrap_model(model)).get("_qaccel_forward_layers", {}),
        "unwrapped": acc.unwrap_model(model) is user_module,
        "prepared": type(model).__name__,
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_training_matches_eager_without_recompiling(acc, strategy):
    eager = acc.distribute(_train, all_results=True)(None, strategy)
    compiled = acc.distribute(_train, all_results=True)("aot_eager", strategy)
    for plain, fast in zip(eager, compiled):
        assert not plain["compiled"] and fast["compiled"]
        assert fast["prepared"] == plain["prepared"], "compiled in place: the prepared object is the same kind"
        assert fast["unwrapped"] and plain["unwrapped"]
        assert max(abs(a - b) for a, b in zip(plain["losses"], fast["losses"])) <= 1e-5
        assert fast["graphs"][1] > 0 and fast["graphs"][-1] == fast["graphs"][1], "no recompilation after step 2"


def test_the_plugin_reads_accelerates_variables_and_names_bad_values(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "max-autotune")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "true")
    assert Accelerator()._config.compile == {"backend": "inductor", "mode": "max-autotune", "fullgraph": True}
    assert Accelerator(dynamo_backend="no")._config.compile is None
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND")
    assert Accelerator()._config.compile is None
    with pytest.raises(ValueError, match="dynamo_backend must be one of 'no', 'eager', 'aot_eager', 'inductor'"):
        Accelerator(dynamo_backend="fast")
    with pytest.raises(ValueError, match="use_regional_compilation=True.* is not in qaccel"):
        Accelerator(dynamo_backend=TorchDynamoPlugin(backend="inductor", use_regional_compilation=True))


def test_accelerates_plugin_and_backend_enum_are_taken():
    accelerate_utils = component.module("accelerate.utils")
    plugin = accelerate_utils.TorchDynamoPlugin(backend=accelerate_utils.DynamoBackend.AOT_EAGER, dynamic=False)
    assert Accelerator(dynamo_plugin=plugin)._config.compile == {"backend": "aot_eager", "dynamic": False}
    assert Accelerator(dynamo_backend=accelerate_utils.DynamoBackend.EAGER)._config.compile == {"backend": "eager"}
    with pytest.raises(ValueError, match="pass dynamo_backend or dynamo_plugin, not both"):
        Accelerator(dynamo_backend="eager", dynamo_plugin=plugin)


def test_unwrap_model_can_take_autocast_off_in_place(single):
    torch.manual_seed(0)
    user_module = torch.nn.Linear(8, 8)
    acc = Accelerator(compute_setup="cpu", mixed_precision="bf16")
    model = acc.prepare(user_module)
    x = torch.randn(4, 8)
    assert acc.unwrap_model(model) is user_module and not torch.equal(
        model(x), torch.nn.functional.linear(x, user_module.weight, user_module.bias)
    ), "kept: the forward runs under bf16 autocast"
    assert acc.unwrap_model(model, keep_fp32_wrapper=False) is user_module
    assert torch.equal(model(x), torch.nn.functional.linear(x, user_module.weight, user_module.bias))
    assert "forward" not in vars(user_module), "the class's forward is back"
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    assert acc.unwrap_model(compiled) is compiled
    assert acc.unwrap_model(compiled, keep_torch_compile=False) is compiled._orig_mod
