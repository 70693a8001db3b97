"""Resume in one line: numbered checkpoints (keep the newest K, never read a half-written one), resume() at a later
epoch's middle with exactly the batches left, and the stop on a signal that every rank agrees on."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from support.procs import script_env, script_file
from torch.utils.data import DataLoader, Dataset, TensorDataset

from qaccel import Accelerator, Preempted

pytestmark = pytest.mark.timeout(240)


def _setup(acc, n=64, batch=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    data = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    loader = DataLoader(TensorDataset(data), batch_size=batch, shuffle=True)
    return acc.prepare(model, optimizer, loader)


def _step(acc, model, optimizer, x):
    loss = model(x / 64).pow(2).mean()
    optimizer.zero_grad()
    acc.backward(loss)
    optimizer.step()


def _params(acc, model):
    return [p.detach().clone() for p in acc.unwrap_model(model).parameters()]


def test_numbered_checkpoints_keep_the_newest_k(single, tmp_path):
    model, optimizer, loader = _setup(single)
    written = []
    for (x,) in loader:
        _step(single, model, optimizer, x)
        if single.step % 3 == 0:
            written.append(single.save_state(tmp_path / "ckpt", keep=2))
    assert single.step == 16 and len(written) == 5
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["checkpoint_00000012", "checkpoint_00000015"]
    assert written[-1] == str(tmp_path / "ckpt" / "checkpoint_00000015")
    marker = json.loads((tmp_path / "ckpt" / "checkpoint_00000015" / "qaccel_state.json").read_text())
    files = marker.pop("files")
    assert marker == {"format": 2, "step": 15, "world_size": 1, "accumulation_steps": 1}
    assert sorted(files) == ["loader_0.pt", "model_0.pt", "optimizer_0.pt", "random_states_0.pt"]
    for name, recorded in files.items():  # every file's size and checksum, as written
        data = (tmp_path / "ckpt" / "checkpoint_00000015" / name).read_bytes()
        words = data + bytes(-len(data) % 8)
        total = sum(int.from_bytes(words[i : i + 8], "little") for i in range(0, len(words), 8)) % 2**64
        assert recorded == {"size": len(data), "sum64": total}


def test_the_newest_complete_checkpoint_is_read_never_a_half_written_one(single, tmp_path):
    ckpt = tmp_path / "ckpt"
    model, optimizer, loader = _setup(single)
    saved = {}
    for (x,) in loader:
        _step(single, model, optimizer, x)
        if single.step in (4, 8):
            single.save_state(ckpt, keep=10)
            saved[single.step] = _params(single, model)
    # what killed saves leave: a temporary directory, and one without its completion marker
    shutil.copytree(ckpt / "checkpoint_00000008", ckpt / "checkpoint_00000012.tmp-0123456789ab")
    shutil.copytree(ckpt / "checkpoint_00000008", ckpt / "checkpoint_00000011")
    os.remove(ckpt / "checkpoint_00000011" / "qaccel_state.json")
    fresh = Accelerator(compute_setup="cpu")
    model2, _optimizer2, _loader2 = _setup(fresh)
    assert fresh.load_state(ckpt) == str(ckpt / "checkpoint_00000008")
    assert fresh.step == 8
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh, model2), saved[8]))
    # a save of step 8 that died between its two renames: its backup is the newest complete checkpoint
    os.rename(ckpt / "checkpoint_00000008", ckpt / "checkpoint_00000008.old-0123456789ab")
    assert fresh.load_state(ckpt) == str(ckpt / "checkpoint_00000008.old-0123456789ab")
    # the next save with keep removes what the dead saves left (a folder without a marker is not qaccel's to remove)
    fresh.save_state(ckpt, keep=1)
    assert sorted(os.listdir(ckpt)) == ["checkpoint_00000008", "checkpoint_00000011"]


def test_a_first_start_finds_nothing_to_load(single, tmp_path):
    _setup(single)
    assert single.load_state(tmp_path / "none", missing_ok=True) is None
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        single.load_state(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    assert single.load_state(tmp_path / "empty", missing_ok=True) is None


def test_bad_arguments_are_named(single, tmp_path):
    _setup(single)
    with pytest.raises(ValueError, match="save_state\\(\\) needs a directory, a resume\\(directory\\) call"):
        single.save_state()
    with pytest.raises(ValueError, match="load_state\\(\\) needs a directory"):
        single.load_state()
    with pytest.raises(ValueError, match="keep must be a positive int"):
        single.save_state(tmp_path, keep=0)
    with pytest.raises(ValueError, match="requeue_signal must be a signal name such as 'SIGUSR1'"):
        single.resume(tmp_path, requeue_signal="SIGNOPE")
    with pytest.raises(ValueError, match="max_restarts must be a non-negative int; got -1"):
        Accelerator(max_restarts=-1)
    with pytest.raises(RuntimeError, match="resume\\(\\) must run inside the function you distribute"):
        Accelerator(nprocs=2, compute_setup="cpu").resume(tmp_path)


def _epochs(acc, ckpt, epochs, stop_at=None):
    """Train ``epochs`` epochs from the newest checkpoint in ``ckpt``; record (epoch, batch index, sample ids).
    With ``stop_at=(epoch, batch)``, save when the batch before it is done, and return."""
    model, optimizer, loader = _setup(acc)
    acc.resume(ckpt)
    seen = []
    for epoch in range(loader.epoch, epochs):
        for (x,) in loader:
            batch = loader.state_dict()["batches"] - 1
            seen.append((epoch, batch, x.flatten().int().tolist()))
            _step(acc, model, optimizer, x)
            if (epoch, batch + 1) == stop_at:
                acc.save_state()
                return seen, acc.step, None
    return seen, acc.step, _params(acc, model)


def test_resume_at_epoch_2_batch_3_continues_with_exactly_the_batches_left(acc, tmp_path):
    """8 batches per rank and epoch; the first run stops as epoch 2's batch 3 starts. (Accelerate's
    skip_first_batches gives the wrong batches after the first epoch: accelerate#2016.)"""
    straight = acc.distribute(_epochs, all_results=True)(acc, str(tmp_path / "a"), 4)
    first = acc.distribute(_epochs, all_results=True)(acc, str(tmp_path / "b"), 4, stop_at=(2, 3))
    resumed = acc.distribute(_epochs, all_results=True)(acc, str(tmp_path / "b"), 4)
    for rank in range(2):
        whole, steps, params = straight[rank]
        before, stopped_at, _ = first[rank]
        after, resumed_steps, resumed_params = resumed[rank]
        assert stopped_at == 2 * 8 + 3 and resumed_steps == steps == 32
        assert before + after == whole, "the resumed run saw exactly the batches that were left"
        assert after[0][:2] == (2, 3)
        assert all(torch.equal(a, b) for a, b in zip(resumed_params, params))


def _signalled(acc, ckpt, rank_signalled, at_step, sig, out):
    model, optimizer, loader = _setup(acc, n=128)
    acc.resume(ckpt)
    try:
        for epoch in range(loader.epoch, 3):
            for (x,) in loader:
                _step(acc, model, optimizer, x)
                time.sleep(0.05)  # 0.05 s steps: the ranks see a signal within stopping.CHECK_EVERY_S = 0.5 s, 10 steps
                if acc.rank == rank_signalled and acc.step == at_step:
                    os.kill(os.getpid(), sig)  # only this rank gets it
        return "finished"
    except Preempted as stop:
        with open(os.path.join(out, f"stopped-{acc.rank}"), "w") as f:
            json.dump({"step": acc.step, "checkpoint": stop.checkpoint, "signal": stop.signal_name}, f)
        raise


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(acc, tmp_path, sig):
    with pytest.raises(Preempted) as raised:
        acc.distribute(_signalled)(acc, str(tmp_path / "ckpt"), 1, 5, sig, str(tmp_path))
    assert raised.value.code == 128 + sig and raised.value.signal_name == sig.name
    assert not raised.value.requeued, "no SLURM job here"
    stopped = [json.loads((tmp_path / f"stopped-{rank}").read_text()) for rank in range(2)]
    assert stopped[0] == stopped[1], "both ranks stopped after the same step, with the same checkpoint"
    assert 5 < stopped[0]["step"] <= 5 + 20, "within a second of the signal (48 steps of 0.05 s in all)"
    assert stopped[0]["checkpoint"] == str(tmp_path / "ckpt" / f"checkpoint_{stopped[0]['step']:08d}")
    assert os.listdir(tmp_path / "ckpt") == [f"checkpoint_{stopped[0]['step']:08d}"]


def _alone(acc, ckpt):
    model, optimizer, loader = _setup(acc)
    acc.resume(ckpt)
    armed = signal.getsignal(signal.SIGTERM)
    for (x,) in loader:
        _step(acc, model, optimizer, x)
        if acc.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
    return armed


def test_one_process_stops_at_the_next_step_and_gives_its_handlers_back(single, tmp_path):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    with pytest.raises(Preempted, match="stopped by SIGTERM after saving state to .*checkpoint_00000002"):
        single.distribute(_alone)(single, str(tmp_path / "ckpt"))
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before


def test_preempted_travels_and_reads_well():
    stop = pickle.loads(pickle.dumps(Preempted("SIGUSR1", "/ck/checkpoint_00000007", requeued=True)))
    assert isinstance(stop, SystemExit) and stop.code == 138
    assert str(stop) == (
        "stopped by SIGUSR1 after saving state to /ck/checkpoint_00000007; the SLURM job was "
        "requeued and will resume from it"
    )


class Dispositions(Dataset):
    """What a DataLoader worker does with the armed signals."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([int(signal.getsignal(signal.SIGTERM)), int(signal.getsignal(signal.SIGUSR1))])


def _pool_child():
    return int(signal.getsignal(signal.SIGTERM)), int(signal.getsignal(signal.SIGUSR1))


def _children_of_an_armed_rank(acc, ckpt):
    _model, _optimizer, _loader = _setup(acc)
    workers_loader = acc.prepare(DataLoader(Dispositions(), batch_size=2, num_workers=2))
    acc.resume(ckpt)
    workers = {tuple(row.tolist()) for (batch) in workers_loader for row in batch}
    pools = set()
    for _ in range(20):  # with a Python-level SIGTERM handler in its workers, Pool.__exit__ hangs about 1 run in 6
        with multiprocessing.Pool(2) as pool:
            pools.update(pool.starmap(_pool_child, [()] * 4))
    return workers, pools


def test_children_of_an_armed_rank_die_of_sigterm_but_dataloader_workers_wait_for_their_rank(acc, tmp_path):
    workers, pools = acc.distribute(_children_of_an_armed_rank)(acc, str(tmp_path / "ckpt"))
    assert workers == {(int(signal.SIG_IGN), int(signal.SIG_IGN))}
    assert pools == {(int(signal.SIG_DFL), int(signal.SIG_IGN))}


def _signalled_as_workers_start(acc, ckpt):
    model, optimizer, _ = _setup(acc)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(64.0).unsqueeze(1)), batch_size=4, num_workers=2))
    acc.resume(ckpt)
    sent = []

    def just_forked():  # in rank 1, right after it forks its first worker, before that worker can run its init
        if not sent and acc.rank == 1:
            sent.append(os.getpid())
            os.killpg(os.getpid(), signal.SIGTERM)  # the rank's process group, as torchrun's agent signals it

    os.register_at_fork(after_in_parent=just_forked)
    for _ in range(3):
        for (x,) in loader:
            _step(acc, model, optimizer, x)
            time.sleep(0.02)
    return "finished"


@pytest.mark.timeout(60)
def test_a_sigterm_while_dataloader_workers_start_stops_the_ranks_cleanly(acc, tmp_path):
    """The signal reaches a worker forked a moment ago: it must not die of it (its rank would fail instead of
    saving; under torchrun, a signal that comes at an epoch's start does this). Without stopping.held the worker dies
    every time."""
    with pytest.raises(Preempted) as raised:
        acc.distribute(_signalled_as_workers_start)(acc, str(tmp_path / "ckpt"))
    assert raised.value.signal_name == "SIGTERM"


def test_a_sigterm_sent_at_the_fork_still_ends_the_forked_child():
    """A child not yet scheduled when its pool terminates it gets SIGTERM before Python's after-fork code, which
    drops signals noted by then: the armed signals stay blocked until the child has its own handlers."""
    done = subprocess.run(
        [sys.executable, str(script_file("forked_in_the_window.py"))],
        capture_output=True,
        text=True,
        env=script_env(),
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", str(-signal.SIGTERM), "False"], (
        "blocked in the child until its reset, then died of it; the parent's mask given back"
    )


def test_max_restarts_under_torchrun_says_whose_restarts_apply(monkeypatch):
    for key, value in {
        "TORCHELASTIC_RUN_ID": "x",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
    }.items():
        monkeypatch.setenv(key, value)
    with pytest.warns(
        UserWarning, match="restarts the ranks of a plain launch only; under torchrun use torchrun --max-restarts"
    ):
        Accelerator(nprocs=2, compute_setup="cpu", max_restarts=2)
