"""backward, gradient accumulation, mixed precision and clipping: real 2-rank runs against one process."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator

pytestmark = pytest.mark.timeout(180)


def _data(n=64):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.3 - 1)


def _fit(acc, batch_size, epochs=2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(_data(), batch_size=batch_size))
    for _ in range(epochs):
        for x, y in loader:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    return [p.detach().clone() for p in acc.unwrap_model(model).parameters()]


def _assert_same(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_k_accumulation_steps_of_batch_b_equal_one_step_of_batch_kb():
    plain = _fit(Accelerator(compute_setup="cpu"), batch_size=16)
    accumulated = _fit(Accelerator(compute_setup="cpu", gradient_accumulation_steps=4), batch_size=4)
    _assert_same(accumulated, plain)
    assert not torch.equal(_fit(Accelerator(compute_setup="cpu"), batch_size=4)[0], plain[0])


def test_two_ranks_accumulating_equal_one_process_with_the_whole_batch():
    plain = _fit(Accelerator(compute_setup="cpu"), batch_size=16)
    acc = Accelerator(nprocs=2, compute_setup="cpu", gradient_accumulation_steps=2)
    for params in acc.distribute(_fit, all_results=True)(acc, 4):
        _assert_same(params, plain)


def test_split_batches_on_two_ranks_equal_one_process_with_the_loaders_batch():
    plain = _fit(Accelerator(compute_setup="cpu"), batch_size=16)
    split = Accelerator(nprocs=2, compute_setup="cpu", split_batches=True)
    for params in split.distribute(_fit, all_results=True)(split, 16):
        _assert_same(params, plain)
    assert not torch.equal(
        Accelerator(nprocs=2, compute_setup="cpu").distribute(_fit)(Accelerator(nprocs=2, compute_setup="cpu"), 16)[0],
        plain[0],
    ), "without it, the global batch is 32"


def _sync_pattern(acc):
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(_data(14 * acc.world_size), batch_size=2))
    pattern, local_grads_differ, updates = [], [], []
    for _ in range(2):
        for x, y in loader:
            before = acc.unwrap_model(model).weight.detach().clone()
            with acc.accumulate(model):
                acc.backward(torch.nn.functional.mse_loss(model(x), y))
                pattern.append(acc.sync_gradients)
                grad = acc.unwrap_model(model).weight.grad.clone()
                local_grads_differ.append(grad)
                optimizer.step()
                optimizer.zero_grad()
            updates.append(not torch.equal(before, acc.unwrap_model(model).weight))
    return pattern, updates, acc.gather(torch.stack(local_grads_differ))


def test_sync_every_k_micro_steps_and_on_the_last_batch_of_each_epoch():
    acc = Accelerator(nprocs=2, compute_setup="cpu", gradient_accumulation_steps=3)
    out = acc.distribute(_sync_pattern, all_results=True)(acc)
    per_epoch = [False, False, True, False, False, True, True]  # 7 batches per rank and epoch
    for pattern, updates, _ in out:
        assert pattern == per_epoch * 2
        assert updates == per_epoch * 2, "optimizer.step()/zero_grad() do nothing on accumulation steps"
    grads = out[0][2].reshape(2, 14, *out[0][2].shape[1:])  # [rank, micro-step, ...]
    for step, synced in enumerate(per_epoch * 2):
        same = torch.allclose(grads[0, step], grads[1, step])
        assert same == synced, f"micro-step {step}: DDP must sync exactly on update steps"


def test_sync_each_batch_reduces_every_micro_step_and_updates_every_k():
    acc = Accelerator(nprocs=2, compute_setup="cpu", gradient_accumulation_steps=3, sync_each_batch=True)
    out = acc.distribute(_sync_pattern, all_results=True)(acc)
    per_epoch = [False, False, True, False, False, True, True]
    for pattern, updates, _ in out:
        assert pattern == updates == per_epoch * 2, "the optimizer still waits for the k-th micro-step"
    grads = out[0][2].reshape(2, 14, *out[0][2].shape[1:])
    assert all(torch.allclose(grads[0, step], grads[1, step]) for step in range(14)), "in sync after every backward"
    plain = _fit(Accelerator(compute_setup="cpu"), batch_size=16)
    each = Accelerator(nprocs=2, compute_setup="cpu", gradient_accumulation_steps=2, sync_each_batch=True)
    for params in each.distribute(_fit, all_results=True)(each, 4):
        _assert_same(params, plain)


def _gradient_state(acc):
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_data(11), batch_size=2)  # 6 batches, 3 per rank; 11 % (2 * 2) = 3
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    state = acc.gradient_state
    seen = [(state.in_dataloader, state.end_of_dataloader, state.remainder)]
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            seen.append((state.sync_gradients, state.end_of_dataloader, state.remainder, state.in_dataloader))
    seen.append((state.in_dataloader, state.end_of_dataloader, state.remainder))
    return seen, (state.num_steps, state.sync_each_batch, state.sync_with_dataloader)


def test_gradient_state_tells_where_the_step_is_as_accelerates_does():
    acc = Accelerator(nprocs=2, compute_setup="cpu", gradient_accumulation_steps=2)
    for seen, settings in acc.distribute(_gradient_state, all_results=True)(acc):
        assert seen == [
            (False, False, -1),
            (False, False, 3, True),
            (True, False, 3, True),
            (True, True, 3, True),
            (False, False, -1),
        ]
        assert settings == (2, False, True)


def _no_sync_by_hand(acc):
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Linear(4, 1))
    x = torch.full((2, 4), float(acc.rank + 1))
    synced = []
    with acc.no_sync(model):
        model(x).sum().backward()
        synced.append(acc.gather(model.module.weight.grad.clone()))
        loss = model(x).sum()
        with acc.trigger_sync_in_backward(model):
            loss.backward()
        synced.append(acc.gather(model.module.weight.grad.clone()))
    model.module.weight.grad = None
    model(x).sum().backward()  # outside: DDP syncs again
    synced.append(acc.gather(model.module.weight.grad.clone()))
    return [bool(torch.equal(g[0], g[1])) for g in synced], model.require_backward_grad_sync


def test_no_sync_keeps_gradients_local_and_trigger_sync_in_backward_syncs_one_backward_inside_it():
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    for equal, restored in acc.distribute(_no_sync_by_hand, all_results=True)(acc):
        assert equal == [False, True, True] and restored


def _nested_evaluation(acc):
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(TensorDataset(torch.randn(5 * acc.world_size, 4)), batch_size=2)
    evaluation = DataLoader(TensorDataset(torch.arange(5.0 * acc.world_size)), batch_size=2)
    model, optimizer, train, evaluation = acc.prepare(model, optimizer, train, evaluation)
    pattern, counts = [], []
    for (x,) in train:
        seen = sum(len(acc.gather_for_metrics(v)) for (v,) in evaluation)  # evaluate before every step
        with acc.accumulate(model):
            pattern.append(acc.sync_gradients)
        counts.append((seen, len(acc.gather_for_metrics(x))))
    return pattern, counts


def test_an_evaluation_loop_inside_the_training_loop_leaves_the_training_loops_state_alone():
    """The last training batch still syncs, and gather_for_metrics still drops its padding, after an inner loop."""
    acc = Accelerator(nprocs=2, compute_setup="cpu", gradient_accumulation_steps=2)
    for out in acc.distribute(_nested_evaluation, all_results=True)(acc):
        assert out == ([False, True, True], [(10, 4), (10, 4), (10, 2)])  # 10 train samples: 4 + 4 + 2
    one = _nested_evaluation(Accelerator(compute_setup="cpu", gradient_accumulation_steps=2))
    assert one == ([False, True, True], [(5, 2), (5, 2), (5, 1)])


def _no_sync_flags(acc):
    first, second = acc.prepare(torch.nn.Linear(2, 1), torch.nn.Linear(2, 1))
    flags = []
    for models in [(first, second), (first, second), (first,), (first,)] * 2:
        with acc.accumulate(*models):
            flags.append((acc.sync_gradients, first.require_backward_grad_sync, second.require_backward_grad_sync))
    return flags, first.require_backward_grad_sync and second.require_backward_grad_sync


def test_accumulate_keeps_the_ddp_models_given_local_on_accumulation_steps_only():
    acc = Accelerator(nprocs=2, compute_setup="cpu", gradient_accumulation_steps=2)
    for flags, restored in acc.distribute(_no_sync_flags, all_results=True)(acc):
        # two models, then one: those given stay local on accumulation steps, the other keeps syncing
        assert flags == [(False, False, False), (True, True, True), (False, False, True), (True, True, True)] * 2
        assert restored, "after the block DDP syncs again"


def _bf16(acc):
    seen = {}

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            seen["autocast"] = torch.is_autocast_enabled("cpu")
            return self.linear(x)

    model = acc.prepare(Probe())
    out = model(torch.randn(2, 4))
    with acc.autocast():
        inner = torch.randn(3, 3) @ torch.randn(3, 3)
    acc.backward(out.sum())
    return seen["autocast"], out.dtype, inner.dtype, acc.unwrap_model(model).linear.weight.grad.dtype


def test_bf16_autocast_on_cpu_on_two_ranks():
    acc = Accelerator(nprocs=2, compute_setup="cpu", mixed_precision="bf16")
    for enabled, out_dtype, inner_dtype, grad_dtype in acc.distribute(_bf16, all_results=True)(acc):
        assert enabled and inner_dtype == torch.bfloat16
        assert out_dtype == torch.float32, "outputs come back in float32 for the loss"
        assert grad_dtype == torch.float32, "parameters and their gradients stay float32"


def test_no_mixed_precision_means_no_autocast():
    acc = Accelerator(compute_setup="cpu")
    enabled, out_dtype, inner_dtype, _ = _bf16(acc)
    assert not enabled and out_dtype == inner_dtype == torch.float32
    assert acc.scaler is None and Accelerator(compute_setup="cpu", mixed_precision="bf16").scaler is None


def test_fp16_without_a_gpu_trains_in_float32_as_accelerate_and_says_so():
    with pytest.warns(
        UserWarning,
        match=r"mixed_precision='fp16' without GPU compute trains in float32 \(no "
        r"autocast, no gradient scaler; Accelerate does the same\)",
    ):
        acc = Accelerator(compute_setup="cpu", mixed_precision="fp16")
    assert acc.mixed_precision == "no" and acc.scaler is None
    enabled, out_dtype, inner_dtype, _ = _bf16(acc)
    assert not enabled and out_dtype == inner_dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mixed_precision": "bf16", "dtype": torch.float64}, "with dtype=torch.float64 use mixed_precision='no'"),
        ({"mixed_precision": "fp8"}, "mixed_precision must be one of 'no', 'bf16', 'fp16'; got 'fp8'"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be a positive int; got 0"),
    ],
)
def test_bad_training_arguments_raise_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Accelerator(**kwargs)


def _clip(acc):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    norms = []
    for step in range(2):
        with acc.accumulate(model):
            acc.backward(model(torch.full((8, 4), 10.0)).pow(2).mean())
            expected = (
                torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) if acc.sync_gradients else None
            )
            norms.append((acc.clip_grad_norm_(model.parameters(), max_norm=1.0), expected))
    after = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    return norms, float(after)


def test_clip_grad_norm_returns_the_norm_and_skips_accumulation_steps():
    acc = Accelerator(nprocs=2, compute_setup="cpu", gradient_accumulation_steps=2)
    for norms, after in acc.distribute(_clip, all_results=True)(acc):
        (first, none), (second, expected) = norms
        assert first is None and none is None
        torch.testing.assert_close(second, expected)
        assert second > 1.0 and after == pytest.approx(1.0, rel=1e-4)


def _scheduled(acc):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer = acc.prepare(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    lrs = []
    for _ in range(3):
        acc.backward(model(torch.ones(1, 2)).sum())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs, isinstance(optimizer, torch.optim.Optimizer)


def test_lr_scheduler_drives_the_prepared_optimizer():
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    for lrs, is_optimizer in acc.distribute(_scheduled, all_results=True)(acc):
        assert lrs == [0.5, 0.25, 0.125] and is_optimizer


class _WithModes(torch.optim.SGD):
    """An optimizer with more than torch's Optimizer has, as schedule-free ones have train() and eval()."""

    mode = "train"

    def eval(self):
        self.mode = "eval"


def test_a_prepared_optimizer_has_what_the_users_optimizer_has_and_still_pickles(single):
    import cloudpickle

    model = torch.nn.Linear(2, 1)
    model, optimizer = single.prepare(model, _WithModes(model.parameters(), lr=0.1))
    optimizer.eval()
    assert optimizer.mode == "eval" and optimizer.optimizer.mode == "eval"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = optimizer.nothing
    copy = cloudpickle.loads(cloudpickle.dumps(optimizer))  # no recursion through __getattr__ while unpickling
    copy.eval()
    assert copy.optimizer.mode == "eval"
