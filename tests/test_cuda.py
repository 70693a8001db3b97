"""The CUDA paths: device placement, NCCL, bf16/fp16. They need a GPU, so they run on the lent GPU machine
(see docs/contributing.md, "Testing on a GPU"); on a CPU-only machine they are reported as skipped, never as passed.

One GPU reaches NCCL only as a one-rank group; the multi-GPU code (one device per local rank, DDP with
device_ids) differs from it only in the device index.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch
from support import component
from support.procs import REPO, free_port, run_script, script_env, script_file
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator, Preempted, TrainConfig, Trainer

pytestmark = pytest.mark.timeout(180)

if not torch.cuda.is_available():  # the whole file at once, so ``-rs`` gives the reason once, not per test
    component.no_gpu("needs a CUDA GPU (run tests/test_cuda.py on a GPU machine)")


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def test_auto_picks_the_gpu_and_nccl():
    acc = Accelerator(compute_setup="auto", log_setup="auto")
    assert acc.device == torch.device("cuda", 0)
    assert acc.log_device == torch.device("cuda", 0)
    assert acc.backend == "nccl"
    assert Accelerator(compute_setup="gpu", log_setup="cpu").log_device == torch.device("cpu")


def test_more_gpu_ranks_than_gpus_is_refused_at_construction():
    with pytest.raises(RuntimeError, match="visible GPU"):
        Accelerator(nprocs=torch.cuda.device_count() + 1, compute_setup="gpu")


def test_ranks_that_each_see_one_gpu_take_it_and_reduce_cuda_tensors_over_gloo(tmp_path):
    """Two ranks as a launcher that binds one GPU per rank starts them (a pod per GPU, srun --gpus-per-task=1): each
    sees one GPU and takes it, where cuda:LOCAL_RANK would be an invalid ordinal for rank 1. One GPU here, so both
    see the same one: NCCL would refuse that, gloo over CUDA tensors does not."""
    import subprocess

    from support.procs import result_lines

    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script_file("gpu_ranks.py"))],
            cwd=tmp_path,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=script_env(
                RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, CUDA_VISIBLE_DEVICES="0"
            ),
        )
        for rank in (0, 1)
    ]
    outs = [proc.communicate(timeout=150) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    results = sorted((r for out, _ in outs for r in result_lines(out)), key=lambda r: r["rank"])
    assert [(r["device"], r["sum"], r["on"]) for r in results] == [("cuda:0", [3.0, 3.0], "cuda")] * 2


def test_prepare_moves_model_optimizer_state_and_batches_to_the_gpu():
    acc = Accelerator(compute_setup="gpu", dtype=torch.float64)
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # Adam state exists, on the CPU
    model, optimizer = acc.prepare(model, optimizer)
    assert {p.device for p in model.parameters()} == {acc.device}
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    assert states and {t.device for t in states} == {acc.device}
    x = torch.randn(8, 4).pin_memory()
    labels = torch.arange(8)
    batch = acc.prepare_batch({"x": x, "y": labels, "name": "b"})
    assert batch["x"].device == acc.device and batch["x"].dtype == torch.float64
    assert batch["y"].device == acc.device and batch["y"].dtype == torch.int64
    assert batch["name"] == "b"
    torch.testing.assert_close(batch["x"].cpu(), x.double())
    assert acc.prepare_batch(batch)["x"] is batch["x"], "a batch already in place is not copied"
    optimizer.zero_grad()
    model(batch["x"]).sum().backward()
    optimizer.step()


def test_prepared_loader_yields_gpu_batches_with_pinned_memory_kept():
    acc = Accelerator(compute_setup="gpu")
    data = TensorDataset(torch.randn(10, 4), torch.arange(10))
    loader = acc.prepare(DataLoader(data, batch_size=4, pin_memory=True))
    seen = [(x.device, y.dtype, len(y)) for x, y in loader]
    assert seen == [(acc.device, torch.int64, 4), (acc.device, torch.int64, 4), (acc.device, torch.int64, 2)]


def test_bf16_autocast_on_the_gpu_returns_float32_outputs_and_trains():
    acc = Accelerator(compute_setup="gpu", mixed_precision="bf16")
    model = _mlp()
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = acc.prepare_batch(torch.randn(64, 4))
    y = x.sum(dim=1, keepdim=True)
    with acc.autocast():
        assert (x @ x.T).dtype == torch.bfloat16
    losses = []
    for _ in range(30):
        out = model(x)
        assert out.dtype == torch.float32
        loss = torch.nn.functional.mse_loss(out, y)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def _fp16_setup():
    acc = Accelerator(compute_setup="gpu", mixed_precision="fp16")
    model = _mlp()
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = acc.prepare_batch(torch.randn(32, 4))
    return acc, model, optimizer, x


def test_fp16_scaler_steps_and_skips_a_step_with_inf_gradients():
    acc, model, optimizer, x = _fp16_setup()
    before = [p.detach().clone() for p in model.parameters()]
    with acc.autocast():
        assert (x @ x.T).dtype == torch.float16
    acc.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    assert not acc.optimizer_step_was_skipped
    after = [p.detach().clone() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    acc.backward(model(x).mean() * float("inf"))
    optimizer.step()
    optimizer.zero_grad()
    assert acc.optimizer_step_was_skipped
    assert all(torch.equal(a, p) for a, p in zip(after, model.parameters())), "a skipped step changes nothing"


def test_device_placement_false_leaves_the_model_and_batches_on_the_cpu():
    acc = Accelerator(compute_setup="gpu", device_placement=False)
    model, loader = acc.prepare(_mlp(), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4))
    assert next(model.parameters()).device.type == "cpu" and next(iter(loader)).device.type == "cpu"
    placed = Accelerator(compute_setup="gpu").prepare(_mlp(), device_placement=[True])
    assert next(placed.parameters()).device.type == "cuda"


def test_grad_scaler_kwargs_make_the_fp16_scaler():
    from qaccel.utils import GradScalerKwargs

    acc = Accelerator(
        compute_setup="gpu",
        mixed_precision="fp16",
        kwargs_handlers=[GradScalerKwargs(init_scale=1024.0, growth_interval=1)],
    )
    model = _mlp()
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert acc.scaler.get_scale() == 1024.0
    acc.backward(model(acc.prepare_batch(torch.randn(8, 4))).pow(2).mean())
    optimizer.step()
    assert acc.scaler.get_scale() == 2048.0, "growth_interval=1: the scale doubles after one good step"


def test_compiled_bf16_training_on_the_gpu_matches_eager():
    losses = {}
    for backend in (None, "inductor"):
        acc = Accelerator(compute_setup="gpu", mixed_precision="bf16", dynamo_backend=backend)
        torch.manual_seed(0)
        model = _mlp()
        model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        generator = torch.Generator().manual_seed(1)
        losses[backend] = []
        for _ in range(20):
            loss = model(acc.prepare_batch(torch.randn(32, 4, generator=generator))).pow(2).mean()
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses[backend].append(loss.item())
    assert max(abs(a - b) for a, b in zip(losses[None], losses["inductor"])) < 1e-2, "bf16: within its rounding"


def test_fp16_clip_grad_norm_unscales_first():
    acc, model, _optimizer, x = _fp16_setup()
    reference = _mlp().to(acc.device)
    with torch.autocast("cuda", dtype=torch.float16):
        reference(x).float().pow(2).mean().backward()
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    acc.backward(model(x).pow(2).mean())
    got = acc.clip_grad_norm_(model.parameters(), float("inf"))
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-6)


def test_fp16_save_and_load_state_restore_scaler_and_cuda_rng(tmp_path):
    acc, model, optimizer, x = _fp16_setup()
    acc.backward(model(x).mean() * float("inf"))
    optimizer.step()  # skipped: the scale backs off from its initial value
    optimizer.zero_grad()
    acc.save_state(str(tmp_path / "ckpt"))
    saved_rng = torch.cuda.get_rng_state()
    scale = acc.scaler.get_scale()
    want = torch.rand(3, device=acc.device)
    fresh, model2, _, _ = _fp16_setup()
    torch.rand(100, device=fresh.device)
    fresh.load_state(str(tmp_path / "ckpt"))
    assert fresh.scaler.get_scale() == scale < 65536.0
    assert torch.equal(torch.cuda.get_rng_state(), saved_rng)
    assert torch.equal(torch.rand(3, device=fresh.device), want)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_nccl_group_made_by_the_user_is_reused_for_every_collective(tmp_path):
    """A one-rank NCCL group: init with set_device, barrier with device_ids, packed all-reduce on the GPU."""
    script = script_file("cuda_user_nccl_group.py")
    proc = run_script(
        script, env=script_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())), cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "OUT nccl True" in proc.stdout


def test_cpu_ranks_launched_from_a_caller_that_initialised_cuda_can_use_cuda(tmp_path):
    """Ranks come from a forkserver, never a fork of the caller, so CUDA state in the caller cannot break them."""
    script = script_file("cuda_in_the_caller.py")
    proc = run_script(script, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "OUT [2.0, 3.0]" in proc.stdout


@pytest.mark.parametrize(
    "example, args",
    [
        ("quickstart.py", ["--epochs", "3"]),
        ("regression.py", ["--epochs", "3", "--bf16", "--accumulate", "2"]),
        ("classify_cnn.py", ["--epochs", "1", "--bf16", "--out", "model.pt"]),
    ],
)
def test_examples_run_on_the_gpu(example, args, tmp_path):
    proc = run_script(REPO / "examples" / example, "--nprocs", "1", *args, timeout=150, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    if example != "quickstart.py":
        assert "on cuda:0" in proc.stdout, proc.stdout


def test_ranks_inherit_the_callers_cuda_rng_and_start_with_cuda_uninitialised(tmp_path):
    """A top-level torch.manual_seed seeds CUDA lazily: ranks draw what a seeded process draws on the GPU; once
    the caller has drawn on the GPU, ranks continue from its states. The forkserver (torch and torch._dynamo
    preloaded) must never have initialised CUDA, or no forked rank could use it."""
    script = script_file("cuda_rng.py")
    proc = run_script(script, cwd=tmp_path, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert "OUT True True" in proc.stdout, proc.stdout


def test_forked_loader_workers_of_a_rank_that_uses_cuda_and_a_spawned_child_that_does(tmp_path):
    """Children of a rank are forked (CUDA-safe as under torchrun: pinning runs in the rank, workers never touch
    CUDA); a child that needs CUDA takes a spawn context and imports the script, as torchrun's grandchildren do."""
    script = script_file("cuda_loader_workers.py")
    proc = run_script(script, cwd=tmp_path, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert "OUT " in proc.stdout, proc.stdout
    out = eval(proc.stdout.split("OUT ", 1)[1])
    assert sum(total for total, _, _ in out) == 4.0 * sum(range(32)), "the two ranks' shares make the dataset"
    assert [spawned for _, spawned, _ in out] == [[3.0], [3.0]]
    assert {method for _, _, method in out} == {"fork"}


# ---- save_state(background=True) of GPU tensors: copied to the CPU at the call ----


def _saved_then_changed(acc, folder, background):
    """Three steps on the GPU, a save, every parameter and optimizer state changed at once; what loads back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 1))
    model, optimizer = acc.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        optimizer.zero_grad()
        acc.backward(model(acc.prepare_batch(torch.randn(8, 512, generator=g))).pow(2).mean())
        optimizer.step()
        if step == 1:  # a save before: the measured one copies into its memory
            acc.save_state(f"{folder}-before", background=background)
    staging = acc._registry().staging
    before = [] if staging is None else [t.data_ptr() for t in staging.staged if type(t) is torch.Tensor]
    acc.save_state(folder, background=background)  # the copies are queued, not waited for: the changes queue after
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1)
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    value.add_(1)
    acc.wait_for_checkpoint()
    plain = [] if staging is None else [t for t in staging.staged if type(t) is torch.Tensor]
    memory = {"reused": [t.data_ptr() for t in plain] == before, "pinned": all(t.is_pinned() for t in plain)}
    acc.load_state(folder)
    devices = {str(p.device) for p in model.parameters()}
    return {k: v.detach().cpu().clone() for k, v in acc.get_state_dict(model).items()}, devices, memory


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_background_save_on_the_gpu_writes_the_state_at_the_call(strategy, tmp_path):
    acc = Accelerator(compute_setup="gpu", strategy=strategy)
    (blocking, devices, _), (background, _, memory) = (
        acc.distribute(_saved_then_changed)(acc, str(tmp_path / way), way == "bg") for way in ("blocking", "bg")
    )
    assert devices == {"cuda:0"}
    assert memory == {"reused": True, "pinned": True}, "pinned staging memory, copied into again by the next save"
    assert blocking.keys() == background.keys() and all(torch.equal(blocking[k], background[k]) for k in blocking)


# ---- strategy="fsdp" (FSDP2) on the GPU: a one-rank NCCL mesh; and CPU ranks on a GPU machine stay on the CPU ----


def _fsdp_steps(acc, ckpt):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    seen = {
        "devices": {str(p.device) for p in model.parameters()},
        "types": {type(p).__name__ for p in model.parameters()},
    }
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
    for _ in range(5):
        out = model(acc.prepare_batch(x))
        acc.backward(torch.nn.functional.mse_loss(out, acc.prepare_batch(y)))
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    seen["output_dtype"] = out.dtype
    if ckpt is not None:
        acc.save_state(ckpt)
        acc.load_state(ckpt)
        seen["sharded_files"] = sorted(os.listdir(os.path.join(ckpt, "sharded")))
    state = acc.get_state_dict(model)
    return {k: v.detach().cpu().clone() for k, v in state.items()}, seen


def test_fsdp_on_one_gpu_shards_on_an_nccl_mesh_and_trains_like_the_cpu(tmp_path):
    gpu = Accelerator(compute_setup="gpu", strategy="fsdp")
    state, seen = gpu.distribute(_fsdp_steps)(gpu, str(tmp_path / "ckpt"))
    assert gpu.backend == "nccl"
    assert seen["devices"] == {"cuda:0"} and seen["types"] == {"DTensor"}
    assert seen["sharded_files"] == [".metadata", "__0_0.distcp"]
    cpu = Accelerator(compute_setup="cpu")
    reference, _ = cpu.distribute(_fsdp_steps)(cpu, None)
    for key in reference:
        torch.testing.assert_close(state[key], reference[key], atol=1e-4, rtol=1e-4)


def test_fsdp_bf16_on_the_gpu_returns_float32_outputs_and_keeps_float32_parameters():
    acc = Accelerator(compute_setup="gpu", strategy="fsdp", mixed_precision="bf16")
    state, seen = acc.distribute(_fsdp_steps)(acc, None)
    assert seen["output_dtype"] == torch.float32
    assert {v.dtype for v in state.values()} == {torch.float32}


def test_fsdp_cpu_ranks_on_a_gpu_machine_stay_on_the_cpu():
    """gloo + FSDP2 without an explicit cpu mesh moves the model to CUDA and crashes (torch #132471)."""
    acc = Accelerator(nprocs=2, compute_setup="cpu", strategy="fsdp", timeout=60)
    state, seen = acc.distribute(_fsdp_steps)(acc, None)
    assert seen["devices"] == {"cpu"} and state


# ---- resume() and the stop on a signal, on the GPU: one rank (DDP) and a one-rank NCCL mesh (FSDP2) ----


def _stopped_on_the_gpu(acc, ckpt, signal_at):
    """3 epochs of 8 steps; SIGTERM to this process after step ``signal_at`` (0: after the last step)."""
    torch.manual_seed(0)
    model = _mlp()
    g = torch.Generator().manual_seed(1)
    loader = DataLoader(
        TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)), batch_size=4, shuffle=True
    )
    model, optimizer, loader = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loader)
    acc.resume(ckpt)
    for _ in range(loader.epoch, 3):
        for x, y in loader:
            optimizer.zero_grad()
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            if acc.step == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
    if signal_at == 0:
        os.kill(os.getpid(), signal.SIGTERM)
    return {k: v.detach().cpu().clone() for k, v in acc.get_state_dict(model).items()}, str(
        next(model.parameters()).device
    )


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_stop_on_the_gpu_saves_and_a_second_run_continues_bitwise(strategy, tmp_path):
    acc = Accelerator(compute_setup="gpu", strategy=strategy)
    straight, device = acc.distribute(_stopped_on_the_gpu)(acc, str(tmp_path / "a"), -1)
    assert device == "cuda:0"
    with pytest.raises(Preempted, match="stopped by SIGTERM after saving state to .*checkpoint_00000005"):
        acc.distribute(_stopped_on_the_gpu)(acc, str(tmp_path / "b"), 5)
    resumed, _ = acc.distribute(_stopped_on_the_gpu)(acc, str(tmp_path / "b"), -1)
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    with pytest.raises(Preempted, match="checkpoint_00000024"):  # after the last step: a stop all the same
        acc.distribute(_stopped_on_the_gpu)(acc, str(tmp_path / "c"), 0)


def test_a_trainer_fit_on_the_gpu_gives_the_model_and_optimizer_back_where_they_were(tmp_path):
    """nprocs=1 fits in place on the GPU (compute_setup="auto"); the model and its optimizer's state come back to
    the CPU, where the script made them, so the code after fit() runs on CPU tensors, as after a plain launch."""
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(32, 4)
    trainer = Trainer(
        model,
        optimizer,
        TrainConfig(max_iter=1, log_folder=tmp_path, tracking_tool="csv", verbose=False),
        "mse",
        DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8),
    )
    seen = []
    trainer.on_train_start = lambda: seen.append(next(trainer.model.parameters()).device.type)
    trainer.fit()
    assert seen == ["cuda"], "trained on the GPU"
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert {v.device.type for s in optimizer.state.values() for k, v in s.items() if k != "step"} == {"cpu"}
    model(x)  # CPU tensors, as the script has them
    optimizer.step()
