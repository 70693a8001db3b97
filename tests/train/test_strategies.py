"""The strategies behind one interface, on 2 real CPU ranks over gloo: each wraps the model its way, names its
Accelerate type, and hands out an optimizer state the caller's plain optimizer loads; DDP and FSDP2 give the same
one after the same steps."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from qaccel import Accelerator
from qaccel.options import DistributedType, Strategy
from qaccel.train import strategies
from qaccel.wrapping import is_sharded


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _step_and_hand_out(acc: Accelerator, kind: Strategy):
    """Two Adam steps on each rank's half of the batch; what the strategy hands out, keyed for a plain optimizer."""
    model = _net()
    plain = _net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    strategy = strategies.of(kind)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    mine = slice(4 * acc.process_index, 4 * acc.process_index + 4)
    for _ in range(2):
        optimizer.zero_grad()
        acc.backward(torch.nn.functional.mse_loss(model(x[mine]), y[mine]))
        optimizer.step()
    state = strategy.optimizer_state(model, optimizer.optimizer)
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=0.1)
    if acc.is_main_process:
        plain_optimizer.load_state_dict(strategy.plain_optimizer_state(state, plain, plain_optimizer))
    wrapped = "ddp" if isinstance(model, DistributedDataParallel) else "sharded" if is_sharded(model) else "plain"
    exp_avg = [plain_optimizer.state[p]["exp_avg"].clone() for p in plain.parameters()] if acc.is_main_process else []
    return strategy.kind, wrapped, acc.distributed_type, exp_avg


@pytest.fixture(scope="module")
def handed_out():
    out = {}
    for kind in Strategy:
        acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60, strategy=kind.value)
        out[kind] = acc.distribute(_step_and_hand_out)(acc, kind)
    return out


def test_each_strategy_is_its_kind_and_wraps_the_model_its_way(handed_out):
    assert handed_out[Strategy.DDP][:3] == (Strategy.DDP, "ddp", DistributedType.MULTI_CPU)
    assert handed_out[Strategy.FSDP][:3] == (Strategy.FSDP, "sharded", DistributedType.FSDP)


def test_the_optimizer_state_each_hands_out_loads_into_a_plain_optimizer_and_agrees(handed_out):
    ddp, fsdp = handed_out[Strategy.DDP][3], handed_out[Strategy.FSDP][3]
    assert len(ddp) == len(fsdp) == 4 and all(t.abs().sum() > 0 for t in ddp)
    for a, b in zip(ddp, fsdp):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_every_value_of_the_option_has_a_strategy():
    assert set(strategies.STRATEGIES) == set(Strategy)
    assert all(strategies.of(kind).kind is kind for kind in Strategy)


def test_only_fsdp_needs_a_process_group_with_one_rank():
    assert [kind for kind in Strategy if kind.needs_a_group_alone] == [Strategy.FSDP]
