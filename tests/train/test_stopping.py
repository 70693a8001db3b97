"""A stop on a signal comes within seconds wherever a loop spends the time between its steps (an evaluation, a
checkpoint being written), after the same step on every rank; and a signal is never swallowed: one that comes after
the last step still ends the run as a stop. Real processes (2 ranks, gloo) running tests/scripts/stop_between_steps.py
(3 epochs of 6 steps, an evaluation and a checkpoint after each); every stopped run is run again and must end bitwise
where an uninterrupted run ends.

Each test signals the script as a scheduler does (the caller, torchrun's agent, srun) when its log shows the work it
is about to do, and checks the checkpoint the stop saved (which says after which step all ranks stopped), how soon
the stop line came, the exit status, that nothing is left running, and the second run.

Which launcher runs which stop: a signal during an evaluation with steps still to come, under torchrun (its agent
passes the signal on to the workers, each a rank in place); a signal during the last evaluation, after the last step,
under python (the caller passes it on to the ranks it started) and under srun (SLURM signals every task itself); a
signal while a checkpoint is written, under python. Whoever delivers the signal, each rank stops through the same
code armed by resume(), so every launcher runs once and every scenario runs once: the other pairs would repeat runs
that prove nothing new. A Trainer fit stopped during a slow epoch-end callback is in tests/test_trainer_runs.py, with
the Trainer's other stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
from support.procs import (
    marked_pids,
    once_per_session,
    result_lines,
    run_script,
    script_file,
    signal_when,
    slurm_env,
    torchrun_cmd,
    wait_dead,
)
from support.real_train import real_env
from torch.utils.data import DataLoader, TensorDataset

from qaccel import Accelerator, Preempted

pytestmark = pytest.mark.timeout(240)

SCRIPT = script_file("stop_between_steps.py")
EPOCHS = "3"  # of 6 steps each (96 samples, batches of 8, 2 ranks)
EVAL_S = 2.0  # each epoch's evaluation in the evaluation tests; the signal comes as it starts
SAVE_S = 1.5  # each checkpoint's writing in the checkpoint test
# What a stop may take beyond the work under way when the signal came: the ranks agree within about
# stopping.CHECK_EVERY_S (0.5 s), then save; loose, for a loaded CI machine (measured on 2 cores: 0.03 s, and
# 0.14 s beside two busy loops)
AGREE_AND_SAVE_S = 2.0
STOPPED = "qaccel: stopped by "
EXIT = {
    "python": 128 + signal.SIGTERM,
    "torchrun": 1,
    "srun": 128 + signal.SIGTERM,
}  # torchrun: its own code


def _uninterrupted(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    proc = run_script(
        SCRIPT,
        "--ckpt",
        str(tmp / "ckpt"),
        "--epochs",
        EPOCHS,
        "--eval-s",
        "0",
        env=real_env(),
        cwd=tmp,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr
    return result_lines(proc.stdout)[0]["hash"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final parameters' hash of a run nobody signalled, computed once for all pytest-xdist workers."""
    return once_per_session(
        tmp_path_factory,
        "stop_between_steps_uninterrupted",
        lambda: _uninterrupted(tmp_path_factory),
    )


def _command(launcher: str, script: Path, *args: str, tmp_path: Path) -> list[str]:
    if launcher == "torchrun":
        return [
            *torchrun_cmd(tmp_path / "logs", "--standalone", "--nproc_per_node", "2"),
            str(script),
            *args,
        ]
    if launcher == "srun":
        return [
            "srun",
            "-N1",
            "-n2",
            f"--job-name={tmp_path.name}",
            sys.executable,
            str(script),
            *args,
        ]
    return [sys.executable, str(script), *args]


def _stopped(
    cmd: list[str],
    ready: str,
    env: dict,
    tmp_path: Path,
    launcher: str,
    checkpoint: Path,
    within_s: float,
) -> None:
    """Send SIGTERM when stderr shows ``ready``: the run must save ``checkpoint`` and stop (said once) within
    ``within_s`` of the signal, exit as a stop and leave nothing running. Under srun, SLURM sends it to every task
    (scancel --signal=TERM, as at a time limit: killing srun itself would make it kill the tasks)."""
    mark = f"QACCEL_TEST_MARK_{uuid.uuid4().hex}"
    env = {**env, mark: "1"}
    send = None
    if launcher == "srun":

        def send(sig):
            scancel = subprocess.run(
                ["scancel", f"--signal={sig.name[3:]}", f"--name={tmp_path.name}"],
                env=env,
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            assert scancel.returncode == 0, scancel.stderr

    first = signal_when(
        cmd,
        signal.SIGTERM,
        ready,
        env=env,
        cwd=tmp_path,
        timeout=150,
        then=STOPPED,
        send=send,
    )
    assert first.returncode == EXIT[launcher], first.stderr
    stops = [line for line in first.stderr.splitlines() if line.startswith(STOPPED)]
    assert stops == [f"{STOPPED}SIGTERM after saving state to {checkpoint}"], first.stderr
    assert first.then_s is not None and first.then_s < within_s, (
        f"stopped {first.then_s:.2f} s after the signal; allowed {within_s} s"
    )
    assert wait_dead(marked_pids(mark), timeout=10) == []


def _rerun(cmd: list[str], env: dict, tmp_path: Path, resumed: str) -> str:
    """Run ``cmd`` to its end; it must say ``resumed``. The final parameters' hash."""
    second = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=150,
        check=False,
    )
    assert second.returncode == 0, second.stderr
    assert resumed in second.stderr, second.stderr
    return result_lines(second.stdout)[0]["hash"]


def _loop_stopped_during_evaluation(launcher, epoch, uninterrupted, tmp_path, env):
    """SIGTERM as epoch ``epoch``'s evaluation starts: every rank finishes it and stops before the next epoch's first
    step, saving after step 6 * ``epoch``; after epoch 3, the last, no step comes, and the run still ends as a stop."""
    ckpt = tmp_path / "ckpt"
    step = 6 * epoch
    args = ("--ckpt", str(ckpt), "--epochs", EPOCHS)
    _stopped(
        _command(launcher, SCRIPT, *args, "--eval-s", str(EVAL_S), tmp_path=tmp_path),
        f"rank 0 evaluates epoch {epoch}",
        env,
        tmp_path,
        launcher,
        ckpt / f"checkpoint_{step:08d}",
        EVAL_S + AGREE_AND_SAVE_S,
    )
    again = _command(launcher, SCRIPT, *args, "--eval-s", "0", tmp_path=tmp_path)
    resumed = f"rank 1 resumed from {ckpt / f'checkpoint_{step:08d}'} at epoch {epoch} step {step}"
    assert _rerun(again, env, tmp_path, resumed) == uninterrupted


def test_a_signal_to_torchrun_during_an_evaluation_stops_every_rank_as_it_ends(uninterrupted, tmp_path):
    _loop_stopped_during_evaluation("torchrun", 2, uninterrupted, tmp_path, real_env())


def test_a_signal_during_the_last_evaluation_still_ends_the_run_as_a_stop(uninterrupted, tmp_path):
    _loop_stopped_during_evaluation("python", 3, uninterrupted, tmp_path, real_env())


@pytest.mark.slurm
def test_a_signal_to_srun_during_the_last_evaluation_stops_every_task_and_ends_the_run_as_a_stop(
    uninterrupted, slurm_cluster, tmp_path
):
    env = {**slurm_env(slurm_cluster), "OMP_NUM_THREADS": "1"}
    _loop_stopped_during_evaluation("srun", 3, uninterrupted, tmp_path, env)


def test_a_signal_while_a_checkpoint_is_written_stops_once_it_is_complete(uninterrupted, tmp_path):
    """SIGTERM as epoch 2's checkpoint starts (it takes SAVE_S): it is completed, and the stop saves again (the same
    step: the checkpoint replaced whole) before any step of epoch 3; the folder holds only complete checkpoints."""
    ckpt = tmp_path / "ckpt"
    args = ("--ckpt", str(ckpt), "--epochs", EPOCHS, "--eval-s", "0")
    _stopped(
        _command("python", SCRIPT, *args, "--save-s", str(SAVE_S), tmp_path=tmp_path),
        "rank 0 saves epoch 2",
        real_env(),
        tmp_path,
        "python",
        ckpt / "checkpoint_00000012",
        2 * SAVE_S + AGREE_AND_SAVE_S,
    )
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "checkpoint_00000006",
        "checkpoint_00000012",
    ]
    final = _rerun(
        _command("python", SCRIPT, *args, tmp_path=tmp_path),
        real_env(),
        tmp_path,
        f"rank 0 resumed from {ckpt / 'checkpoint_00000012'} at epoch 2 step 12",
    )
    assert final == uninterrupted


def _signalled_after_the_last_step(acc, ckpt, rank_signalled):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    model, optimizer, loader = acc.prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=4),
    )
    acc.resume(ckpt)
    for _ in range(loader.epoch, 2):
        for (x,) in loader:
            optimizer.zero_grad()
            acc.backward(model(x).pow(2).mean())
            optimizer.step()
    if acc.rank == rank_signalled:
        os.kill(os.getpid(), signal.SIGTERM)  # this rank only, once its loop is over: no check point comes
    return "finished"


def test_a_signal_to_one_rank_after_its_last_step_ends_the_session_as_a_stop_on_every_rank(acc, tmp_path):
    with pytest.raises(Preempted) as raised:
        acc.distribute(_signalled_after_the_last_step)(acc, str(tmp_path / "ckpt"), 1)
    assert raised.value.signal_name == "SIGTERM"
    assert raised.value.checkpoint == str(tmp_path / "ckpt" / "checkpoint_00000004")  # 2 epochs of 2 steps


def test_alone_a_signal_after_the_last_step_ends_the_session_as_a_stop(single, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(
        Preempted,
        match="stopped by SIGTERM after saving state to .*checkpoint_00000008",
    ):
        single.distribute(_signalled_after_the_last_step)(single, str(tmp_path / "ckpt"), 0)
    assert signal.getsignal(signal.SIGTERM) == before


def _stop_armed_in_a_nested_call(acc, ckpt, out):
    """fn calls resume(), then a distribute() inside it (a Trainer's fit, say) arms a stop of its own: that one
    ends with its call, and fn's stays armed. What each rank saw goes to ``out``."""
    acc.resume(ckpt + "-outer")
    handler = signal.getsignal(signal.SIGTERM)
    inner = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)  # each call its own, as each Trainer has
    seen = {
        "first": inner.distribute(_signalled_after_the_last_step)(inner, ckpt, -1),
        "still_armed": signal.getsignal(signal.SIGTERM) == handler,
        "threads": sorted(t.name for t in threading.enumerate() if t.name == "qaccel-stop"),
    }
    inner = Accelerator(nprocs=2, compute_setup="cpu", timeout=60)
    try:
        inner.distribute(_signalled_after_the_last_step)(inner, ckpt, 1)
    except Preempted as stop:
        seen["stopped"] = stop.checkpoint
    Path(out, f"rank{acc.rank}.json").write_text(json.dumps(seen))
    return "caught it"  # yet fn's own stop saw the signal too: this session ends as a stop as well


def test_a_stop_armed_in_a_distribute_call_inside_fn_ends_with_that_call(acc, tmp_path):
    with pytest.raises(Preempted) as raised:
        acc.distribute(_stop_armed_in_a_nested_call)(acc, str(tmp_path / "c"), str(tmp_path))
    assert raised.value.checkpoint == str(tmp_path / "c-outer" / "checkpoint_00000000"), "no signal is swallowed"
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {
            "first": "finished",
            "still_armed": True,
            "threads": ["qaccel-stop"],
            "stopped": str(tmp_path / "c" / "checkpoint_00000004"),
        }, seen
