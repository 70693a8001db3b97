"""strategy="fsdp" (torch's FSDP2) on 2 real CPU ranks over gloo: what it trains to, what stays sharded, and what
its checkpoints load into."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from support.procs import once_per_session, run_script, run_torchrun, slurm_env
from support.real_train import REAL, checked, real_env
from support.states import FailsWhenTold
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator
from qaccel.options import FSDP_MIN_PARAMS, Backend, MixedPrecision, Strategy
from qaccel.options.devices import check_sharding
from qaccel.train.sharding import units

EPOCHS = 3


class Block(torch.nn.Module):
    """A transformer-block-like unit: what fsdp_modules names."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, width: int = 8, blocks: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(5, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(48, 5, generator=g), torch.randn(48, 1, generator=g))


def _train(acc, batch_size, probe=False):
    """3 epochs of AdamW (built before prepare) with clipping; returns the full state dict and what was seen."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(_data(), batch_size=batch_size))
    seen = {"norms": [], "grads_on_accumulation": set(), "grads_on_sync": set(), "predictions": 0}
    for _ in range(EPOCHS):
        for x, y in loader:
            with acc.accumulate(model):
                out = model(x)
                acc.backward(torch.nn.functional.mse_loss(out, y))
                grads = {type(p.grad).__name__ for p in model.parameters()}
                seen["grads_on_sync" if acc.sync_gradients else "grads_on_accumulation"] |= grads
                norm = acc.clip_grad_norm_(model.parameters(), 0.5)
                if norm is not None:
                    seen["norms"].append(float(norm))
                optimizer.step()
                optimizer.zero_grad()
            seen["predictions"] += len(acc.gather_for_metrics(out.detach()))
    if probe:
        seen["unwrapped_is_model"] = acc.unwrap_model(model) is model
        seen["param_types"] = {type(p).__name__ for p in model.parameters()}
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        seen["local_share"] = local / sum(p.numel() for p in Net().parameters())
        seen["output_dtype"] = str(out.dtype)
    state = acc.get_state_dict(model)
    return {k: v.clone() for k, v in state.items()}, seen


@pytest.fixture(scope="module")
def runs():
    """One 3-epoch run each: FSDP2 on 2 ranks (size policy: each Linear of 16+ parameters a unit, the head not),
    the same with sync_each_batch, 1 process with the doubled batch, DDP on 2 ranks; all accumulate 2 micro-steps
    and clip."""
    fsdp = Accelerator(
        nprocs=2, compute_setup="cpu", timeout=60, strategy="fsdp", fsdp_min_params=16, gradient_accumulation_steps=2
    )
    one = Accelerator(nprocs=1, compute_setup="cpu", gradient_accumulation_steps=2)
    ddp = Accelerator(nprocs=2, compute_setup="cpu", timeout=60, gradient_accumulation_steps=2)
    each = Accelerator(
        nprocs=2,
        compute_setup="cpu",
        timeout=60,
        strategy="fsdp",
        fsdp_min_params=16,
        gradient_accumulation_steps=2,
        sync_each_batch=True,
    )
    return {
        "fsdp": fsdp.distribute(_train, all_results=True)(fsdp, 3, True),
        "fsdp sync_each_batch": each.distribute(_train)(each, 3),
        "one": one.distribute(_train)(one, 6),
        "ddp": ddp.distribute(_train)(ddp, 3),
    }


def _max_diff(a, b):
    assert list(a) == list(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_fsdp_on_two_ranks_trains_to_one_process_with_the_doubled_batch(runs):
    (state, seen), _ = runs["fsdp"]
    one_state, one_seen = runs["one"]
    assert _max_diff(state, one_state) < 1e-5
    assert seen["norms"] == pytest.approx(one_seen["norms"], abs=1e-5), "the clipped norm is over all shards"
    assert len(seen["norms"]) == EPOCHS * 4, "clipped on sync steps only (8 micro-steps of 3 per rank each epoch)"


def test_fsdp_trains_to_the_same_parameters_as_ddp(runs):
    assert _max_diff(runs["fsdp"][0][0], runs["ddp"][0]) < 1e-5


def test_fsdp_keeps_a_share_of_each_parameter_and_no_sharded_gradient_on_accumulation_steps(runs):
    (state, seen), (other_state, other_seen) = runs["fsdp"]
    assert seen["param_types"] == {"DTensor"} and seen["unwrapped_is_model"]
    assert 0.45 < seen["local_share"] < 0.6, "each rank holds about half of every parameter"
    # Between micro-steps the module holds its unsharded parameters, with local full-size gradients: no
    # reduce-scatter and no re-gather until the sync step, which leaves sharded gradients.
    assert seen["grads_on_accumulation"] == {"Tensor"}
    assert seen["grads_on_sync"] == {"DTensor"}
    assert seen["predictions"] == other_seen["predictions"] == EPOCHS * 48, "gather_for_metrics: every sample once"
    assert state and other_state == {}, "the full state dict lands on the main process only"


def test_sync_each_batch_reduces_every_micro_step_to_gradient_shards_and_the_same_result(runs):
    state, seen = runs["fsdp sync_each_batch"]
    assert seen["grads_on_accumulation"] == seen["grads_on_sync"] == {"DTensor"}, "sharded after every backward"
    assert _max_diff(state, runs["one"][0]) < 1e-5
    assert seen["norms"] == pytest.approx(runs["one"][1]["norms"], abs=1e-5)


def test_the_full_state_dict_loads_strictly_into_the_plain_model(runs):
    Net().load_state_dict(runs["fsdp"][0][0], strict=True)


def _bf16(acc):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    inputs = []
    model.blocks[0].up.register_forward_hook(lambda m, args, out: inputs.append((args[0].dtype, out.dtype)))
    x, y = _data().tensors
    out = model(acc.prepare_batch(x))
    acc.backward(torch.nn.functional.mse_loss(out, y))
    optimizer.step()
    return inputs[0], out.dtype, {p.dtype for p in model.parameters()}, {p.grad.dtype for p in model.parameters()}


def test_bf16_computes_in_bf16_and_keeps_fp32_parameters_and_gradients():
    acc = Accelerator(
        nprocs=2, compute_setup="cpu", timeout=60, strategy="fsdp", mixed_precision="bf16", fsdp_modules=[Block]
    )
    compute, output, params, grads = acc.distribute(_bf16)(acc)
    assert compute == (torch.bfloat16, torch.bfloat16)
    assert output == torch.float32, "the loss is computed from fp32 outputs"
    assert params == grads == {torch.float32}


def test_the_policy_shards_named_classes_or_submodules_by_size_and_never_cuts_a_tie():
    net = Net()
    assert units(net, ("Block",), 1) == list(net.blocks)
    # A Block holds 144 (up) + 136 (down) parameters; embed 48, head 9.
    assert units(net, (), 200) == list(net.blocks), "neither Linear alone reaches 200; together they do"
    assert units(net, (), 100) == [m for block in net.blocks for m in (block.up, block.down)]
    assert units(net, (), FSDP_MIN_PARAMS) == [], "small models: the root is the only unit"
    tied = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    tied[1].weight = tied[0].weight  # tied: neither may be a unit of its own
    assert units(tied, ("Linear",), 1) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"strategy": "zero3"}, "strategy must be one of 'ddp', 'fsdp'; got 'zero3'"),
        ({"fsdp_modules": [Block]}, "fsdp_modules and fsdp_min_params apply to strategy='fsdp' only"),
        ({"strategy": "fsdp", "fsdp_min_params": 0}, "fsdp_min_params must be a positive int"),
        ({"strategy": "fsdp", "fsdp_modules": Block}, "fsdp_modules must be a non-empty list of module classes"),
        ({"strategy": "fsdp", "fsdp_modules": [3]}, "fsdp_modules must be a non-empty list of module classes"),
    ],
)
def test_bad_strategy_arguments_fail_at_construction(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Accelerator(nprocs=2, compute_setup="cpu", **kwargs)


def test_fsdp_refuses_fp16_and_mpi_naming_what_works():
    with pytest.raises(ValueError, match="strategy='fsdp' supports mixed_precision 'no' or 'bf16'"):
        check_sharding(Strategy.FSDP, MixedPrecision.FP16, Backend.NCCL)
    with pytest.raises(ValueError, match="backend 'gloo' \\(CPU\\) or 'nccl' \\(GPU\\); got backend='mpi'"):
        check_sharding(Strategy.FSDP, MixedPrecision.NO, Backend.MPI)


def _stepped_optimizer(acc):
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 5)).sum().backward()
    optimizer.step()
    acc.prepare(model, optimizer)


def test_an_optimizer_that_already_stepped_is_refused():
    acc = Accelerator(nprocs=1, compute_setup="cpu", strategy="fsdp")
    with pytest.raises(ValueError, match="this optimizer already has state"):
        acc.distribute(_stepped_optimizer)(acc)


def _optimizer_first(acc):
    torch.manual_seed(0)
    model = Net()
    optimizer = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))  # before the model, in its own call
    model = acc.prepare(model)
    before = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    x, y = _data().tensors
    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    after = acc.get_state_dict(model)
    return all(not torch.equal(before[k], after[k]) for k in before)


def test_an_optimizer_prepared_before_its_model_updates_the_shards():
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60, strategy="fsdp", fsdp_modules=[Block])
    assert acc.distribute(_optimizer_first)(acc) is True


def _return_the_model(acc):
    return acc.prepare(Net())


def test_a_sharded_model_returned_from_a_rank_says_what_to_return_instead():
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60, strategy="fsdp")
    with pytest.raises(TypeError, match=r"cannot leave its rank; return acc.get_state_dict\(model\) instead"):
        acc.distribute(_return_the_model)(acc)


# ---- checkpoints ----


def _checkpointed(acc, ckpt, epochs, stop_after=None, explode_at=None):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.5)
    loader = DataLoader(_data(), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    exploding = FailsWhenTold("disk full")  # rank 0 writes registered objects after the shards
    acc.register_for_checkpointing(exploding)
    acc.resume(ckpt, keep=2)
    for epoch in range(loader.epoch, epochs):
        for x, y in loader:
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        exploding.fail = epoch + 1 == explode_at
        try:
            acc.save_state()
        except OSError as failed:  # rank 0's error, on every rank
            return f"save failed: {failed}"
        if epoch + 1 == stop_after:
            return "stopped"
    return {k: v.clone() for k, v in acc.get_state_dict(model).items()}, acc.step


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """An uninterrupted 3-epoch FSDP run, and one stopped after epoch 2 (a save that died at epoch 2 first)."""
    root = tmp_path_factory.mktemp("fsdp_ckpt")
    acc = Accelerator(nprocs=2, compute_setup="cpu", timeout=60, strategy="fsdp", fsdp_modules=[Block])
    full = acc.distribute(_checkpointed)(acc, str(root / "full"), EPOCHS)
    failed = acc.distribute(_checkpointed, all_results=True)(acc, str(root / "part"), EPOCHS, explode_at=2)
    assert failed[0] == "save failed: disk full"
    assert failed[1] == "save failed: disk full", "rank 0's error on every rank"
    after_failed_save = sorted(os.listdir(root / "part"))
    assert acc.distribute(_checkpointed)(acc, str(root / "part"), EPOCHS, stop_after=2) == "stopped"
    return {"acc": acc, "root": root, "full": full, "after_failed_save": after_failed_save}


def test_a_save_that_dies_after_the_shards_are_written_leaves_the_last_good_checkpoint(checkpoints):
    assert checkpoints["after_failed_save"] == ["checkpoint_00000006"], "epoch 1's, whole; no temporary folder"


def test_each_rank_writes_its_shards_and_resume_is_bitwise(checkpoints):
    part = checkpoints["root"] / "part"
    newest = part / "checkpoint_00000012"
    assert sorted(os.listdir(part)) == ["checkpoint_00000006", "checkpoint_00000012"]
    assert sorted(os.listdir(newest / "sharded")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not list(newest.glob("model_*.pt")) and not list(newest.glob("optimizer_*.pt"))
    acc = checkpoints["acc"]
    state, step = acc.distribute(_checkpointed)(acc, str(part), EPOCHS)
    full_state, full_step = checkpoints["full"]
    assert step == full_step == EPOCHS * 6
    assert all(torch.equal(state[k], full_state[k]) for k in full_state), "resumed bitwise"


def _load(acc, ckpt):
    torch.manual_seed(1)  # other initial values: what is compared is what was loaded
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.5)
    loader = DataLoader(_data(), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    acc.register_for_checkpointing(FailsWhenTold("disk full"))
    acc.load_state(ckpt)
    moments = (
        sorted(round(float(s["exp_avg_sq"].sum()), 6) for s in optimizer.state.values())
        if acc.world_size == 1 or acc.strategy == "ddp"
        else None
    )
    return {k: v.clone() for k, v in acc.get_state_dict(model).items()}, acc.step, moments


@pytest.mark.parametrize("target", ["one process", "ddp on 2 ranks"])
def test_a_two_rank_sharded_checkpoint_loads_into_one_process_and_into_ddp(checkpoints, target):
    acc = (
        Accelerator(nprocs=1, compute_setup="cpu")
        if target == "one process"
        else Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
    )
    state, step, moments = acc.distribute(_load)(acc, str(checkpoints["root"] / "full"))
    full_state, full_step = checkpoints["full"]
    assert step == full_step and all(torch.equal(state[k], full_state[k]) for k in full_state)
    assert len(moments) == len(full_state) and all(m > 0 for m in moments), "the optimizer's moments came too"


def test_a_ddp_checkpoint_loads_into_fsdp_and_training_continues_alike(tmp_path):
    ddp = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
    fsdp = Accelerator(nprocs=2, compute_setup="cpu", timeout=60, strategy="fsdp", fsdp_modules=[Block])
    assert ddp.distribute(_checkpointed)(ddp, str(tmp_path / "a"), EPOCHS, stop_after=2) == "stopped"
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(tmp_path / "b")], check=True)
    on_ddp, _ = ddp.distribute(_checkpointed)(ddp, str(tmp_path / "a"), EPOCHS)
    on_fsdp, step = fsdp.distribute(_checkpointed)(fsdp, str(tmp_path / "b"), EPOCHS)
    assert step == EPOCHS * 6 and _max_diff(on_ddp, on_fsdp) < 1e-5


def _save_model(acc, out):
    torch.manual_seed(0)
    model = acc.prepare(Net())
    acc.save_model(model, out)
    return acc.get_state_dict(model)


def test_save_model_and_consolidate_write_one_plain_file(checkpoints, tmp_path):
    acc = checkpoints["acc"]
    state = acc.distribute(_save_model)(acc, str(tmp_path))
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    Net().load_state_dict(saved, strict=True)
    assert all(torch.equal(saved[k], state[k]) for k in state)

    out = tmp_path / "consolidated.pt"
    done = subprocess.run(
        [sys.executable, "-m", "qaccel", "consolidate", str(checkpoints["root"] / "full"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "checkpoint_00000018" in done.stdout and "model 0" in done.stdout
    consolidated = torch.load(out, weights_only=True)
    Net().load_state_dict(consolidated, strict=True)
    full_state, _ = checkpoints["full"]
    assert all(torch.equal(consolidated[k], full_state[k]) for k in full_state)


# ---- the real script (a Dataset class in it, num_workers=2, logging at the top, a checkpoint every epoch) ----


def _fsdp_plain_run(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("fsdp_reference")
    proc = run_script(REAL, "--ckpt", str(tmp / "ckpt"), "--strategy", "fsdp", env=real_env(), cwd=tmp, timeout=200)
    result = checked(proc)
    assert sorted(os.listdir(tmp / "ckpt" / "checkpoint_00000018" / "sharded")) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    return result["hash"]


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory):
    """real_train.py --strategy fsdp, launched plainly and uninterrupted (once for all xdist workers): its hash."""
    return once_per_session(tmp_path_factory, "fsdp_plain_run", lambda: _fsdp_plain_run(tmp_path_factory))


@pytest.mark.timeout(300)
def test_the_real_script_sharded_under_torchrun_restarts_and_resumes_bitwise(fsdp_reference, tmp_path):
    proc = run_torchrun(
        REAL,
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--strategy",
        "fsdp",
        "--crash-at",
        "1:2",
        torchrun_args=("--max-restarts", "1"),
        env=real_env(),
        cwd=tmp_path,
        timeout=250,
    )
    result = checked(proc)
    assert (result["attempt"], result["resumed"], result["trained"]) == ("1", True, 12), "from step 6 to 18"
    assert result["hash"] == fsdp_reference


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_the_real_script_sharded_under_srun_ends_alike(fsdp_reference, slurm_cluster, tmp_path):
    env = {**slurm_env(slurm_cluster), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONUNBUFFERED", None)
    proc = slurm_cluster.srun(
        ["-N1", "-n2", "python", str(REAL), "--ckpt", str(tmp_path / "ckpt"), "--strategy", "fsdp"],
        timeout=200,
        env=env,
    )
    assert checked(proc)["hash"] == fsdp_reference
