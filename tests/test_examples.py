"""The examples run as a user runs them: with python (qaccel starts the ranks), under torchrun and under srun.

The examples only print their results, as users' scripts do; the checks of those results are here.

Every example runs under python, and every one in place under torchrun (each rank started by the launcher,
printing its result once). The runs that stop and continue (long_run.py, digits_trainer.py) run their first part
under python and continue under torchrun, so one pair of runs checks both launchers and the continuation across
them. srun is the other launcher that runs the script in place: it starts regression.py as a task per rank, and
the ranks read their place from SLURM's variables where torchrun's give it; what the script does once it has its
rank is the same as under torchrun, so the other examples need no srun run of their own (quickstart.py runs under
srun in tests/cluster/test_slurm_scripts.py).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import component
from support.procs import REPO, script_env, slurm_env, torchrun_cmd

pytestmark = pytest.mark.timeout(240)


def _torchrun(tmp_path):
    return torchrun_cmd(tmp_path / "torchelastic", "--standalone", "--nproc_per_node", "2")


REGRESSION = [sys.executable, str(REPO / "examples/regression.py")]
DIGITS = str(REPO / "examples/digits_trainer.py")
# What an example imports beyond qaccel's requirements (the examples extra; the test extra has them too)
NEEDS = {"digits_trainer.py": ("sklearn", "matplotlib", "tensorboard")}


def _needs(example):
    missing = [module for module in NEEDS.get(example, ()) if importlib.util.find_spec(module) is None]
    if missing:
        component.unavailable(f"{example} needs {', '.join(missing)}: pip install -e '.[test]' (or '.[examples]')")


def _run(cmd, tmp_path):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=script_env(), cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _loss_went_down(out):
    """regression.py's result line: the last epoch's train loss is under half the first epoch's."""
    losses = re.search(r"train loss ([\d.]+) -> ([\d.]+),", out)
    assert losses and float(losses.group(2)) < 0.5 * float(losses.group(1)), out


def _classified(out):
    """classify_cnn.py's evaluation: every one of the 1000 test images counted once, and at least 80 % right."""
    accuracy = re.search(r"test accuracy ([\d.]+)% on 1000 samples \(test split: 1000\)", out)
    assert accuracy and float(accuracy.group(1)) >= 80, out


def test_quickstart(tmp_path):
    out = _run([sys.executable, str(REPO / "examples/quickstart.py"), "--epochs", "10"], tmp_path)
    assert out.count("final mean loss") == 1 and "(2 ranks)" in out


def test_quickstart_under_torchrun_follows_torchrun_and_warns_once_of_a_world_mismatch(tmp_path):
    """One torchrun run serves both checks (each run costs a torchrun and two ranks): the result is printed once by
    a 2-rank world, and asking for --nprocs 4 is warned about once per job, not once per rank."""
    proc = subprocess.run(
        [*_torchrun(tmp_path), str(REPO / "examples/quickstart.py"), "--epochs", "10", "--nprocs", "4"],
        capture_output=True,
        text=True,
        timeout=200,
        env=script_env(),
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("final mean loss") == 1 and "(2 ranks)" in proc.stdout, proc.stdout
    assert proc.stderr.count("Accelerator(nprocs=4) but torchrun started 2 ranks; following torchrun") == 1, proc.stderr


def test_regression_bf16_with_gradient_accumulation_under_torchrun(tmp_path):
    """One torchrun run: the example with bf16 and gradient accumulation, run in place by torchrun. In float32:
    under python, the straight run of test_regression_resumes_where_it_stopped_and_matches_a_straight_run, and in
    place under srun, test_regression_prints_once_under_srun; bf16 and accumulation on ranks qaccel starts:
    tests/train/test_training.py."""
    out = _run(
        [*_torchrun(tmp_path), str(REPO / "examples/regression.py"), "--bf16", "--accumulate", "2", "--epochs", "4"],
        tmp_path,
    )
    assert out.count("validation loss") == 1 and "2 rank(s)" in out and "float32 with bf16" in out, out
    _loss_went_down(out)


def test_regression_resumes_where_it_stopped_and_matches_a_straight_run(tmp_path):
    first = _run([*REGRESSION, "--epochs", "2", "--checkpoint", "ckpt"], tmp_path)
    assert "epoch   2/2" in first and (tmp_path / "ckpt").is_dir()
    resumed = _run([*REGRESSION, "--epochs", "4", "--checkpoint", "ckpt", "--resume"], tmp_path)
    straight = _run([*REGRESSION, "--epochs", "4"], tmp_path)
    assert straight.count("validation loss") == 1 and "2 rank(s)" in straight, straight  # the example under python
    for out in (first, resumed, straight):
        _loss_went_down(out)
    assert "resumed from ckpt after epoch 2/4" in resumed
    epochs = [line for line in resumed.splitlines() if line.startswith("epoch")]
    assert [line.split("/")[0] for line in epochs] == ["epoch   3", "epoch   4"], resumed
    # save_state/load_state restore weights, Adam state, data order and RNG states bitwise: same losses.
    assert epochs == [line for line in straight.splitlines() if line.startswith(("epoch   3", "epoch   4"))]
    assert resumed.splitlines()[-1] == straight.splitlines()[-1], (resumed, straight)


def test_regression_refuses_float64_with_bf16(tmp_path):
    proc = subprocess.run(
        [*REGRESSION, "--dtype", "float64", "--bf16"],
        capture_output=True,
        text=True,
        timeout=60,
        env=script_env(),
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2 and "error: --bf16" in proc.stderr and "float64" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_classify_cnn_evaluates_every_sample_once_and_saves_once_into_the_working_directory(tmp_path):
    # the default --out (--out PATH: under torchrun, below); one epoch, as under torchrun (each costs ~10 s)
    out = _run([sys.executable, str(REPO / "examples/classify_cnn.py"), "--epochs", "1"], tmp_path)
    assert out.count("test accuracy") == 1
    _classified(out)
    assert out.count("saved ") == 1, out
    saved = tmp_path / "classify_cnn" / "model.pt"  # save_model(model, --out): the folder's model.pt
    assert f"weights to {saved}" in out and saved.exists()


def _trained_digits(out, epochs, first=1):
    """digits_trainer.py's run of ``--epochs`` ``epochs`` (epochs 0 .. epochs - 1, counted as qadence does; epoch 0 is
    not printed nor written): epochs ``first``..``epochs - 1`` printed (train and validation), the final validation
    accuracy printed once and at least 90 %, and the run's folder (printed) holding a PNG of the curves, checkpoints
    and TensorBoard files with train_loss at every epoch and val_loss at every epoch and before training (step 0),
    each step once. Returns the run's folder."""
    for phase in ("train", "val"):
        printed = [int(n) for n in re.findall(rf"^epoch (\d+): {phase}_accuracy ", out, re.MULTILINE)]
        assert printed == list(range(first, epochs)), out
    assert out.count("validation accuracy") == 1, out
    accuracy = re.search(r"^validation accuracy ([\d.]+)% after epoch (\d+)$", out, re.MULTILINE)
    assert accuracy and float(accuracy.group(1)) >= 90 and int(accuracy.group(2)) == epochs - 1, out
    assert out.count("run folder: ") == 1, out
    folder = Path(re.search(r"^run folder: (.+) \(curves\.png", out, re.MULTILINE).group(1))
    assert (folder / "curves.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert any((folder / "checkpoints").iterdir())
    steps = _tensorboard_steps(folder / "tracking")
    assert steps["train_loss"] == list(range(1, epochs)), steps
    assert steps["val_loss"] == list(range(epochs)), steps
    return folder


def _tensorboard_steps(path):
    """The steps of train_loss and val_loss as TensorBoard reads ``path``: a folder (its event files in order, a
    resumed run's purge applied) or one event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path))
    events.Reload()
    return {tag: [event.step for event in events.Scalars(tag)] for tag in ("train_loss", "val_loss")}


def test_digits_trainer_continues_under_torchrun_the_run_it_started_under_python(tmp_path):
    """A run of 4 epochs (0 to 3) under python, then the same folder with --epochs 6 under torchrun (its ranks run in
    place) trains, prints once and tracks epochs 4 and 5 only; TensorBoard has every step once, and the second run's
    event file holds only its own steps."""
    _needs("digits_trainer.py")
    args = [DIGITS, "--log-folder", "run"]
    folder = _trained_digits(_run([sys.executable, *args, "--epochs", "4"], tmp_path), 4)
    assert folder == tmp_path.resolve() / "run"
    first = set((folder / "tracking").iterdir())
    again = _run([*_torchrun(tmp_path), *args, "--epochs", "6"], tmp_path)
    assert _trained_digits(again, 6, first=4) == folder
    (added,) = set((folder / "tracking").iterdir()) - first
    assert _tensorboard_steps(added) == {"train_loss": [4, 5], "val_loss": [4, 5]}


def test_classify_cnn_prints_once_under_torchrun_and_saves_to_out(tmp_path):
    out = _run(
        [*_torchrun(tmp_path), str(REPO / "examples/classify_cnn.py"), "--epochs", "1", "--out", str(tmp_path / "cnn")],
        tmp_path,
    )
    assert out.count("test accuracy") == 1 and out.count("saved ") == 1, out
    _classified(out)
    assert f"weights to {tmp_path / 'cnn' / 'model.pt'}" in out and (tmp_path / "cnn" / "model.pt").exists()
    assert not (tmp_path / "classify_cnn").exists()


@pytest.mark.slurm
def test_regression_prints_once_under_srun(slurm_cluster, tmp_path):
    """srun starts the example as 2 tasks, each a rank run in place: one world of 2, its result printed once."""
    proc = slurm_cluster.srun(
        ["-N1", "-n2", "--chdir", str(tmp_path), "python", str(REPO / "examples/regression.py"), "--epochs", "4"],
        timeout=200,
        env=slurm_env(slurm_cluster),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("validation loss") == 1 and "2 rank(s)" in proc.stdout, proc.stdout
    _loss_went_down(proc.stdout)


def test_long_run_continues_under_torchrun_where_it_stopped_under_python(tmp_path):
    """The first epoch under python, the second under torchrun from the checkpoint the first left: each run prints
    its final loss once, the second resumes from the end of the first epoch, and --keep 2 leaves the last two."""
    args = [str(REPO / "examples/long_run.py"), "--save-every", "20", "--keep", "2"]
    first = _run([sys.executable, *args, "--epochs", "1"], tmp_path)
    assert first.count("final loss") == 1 and "resumed" not in first
    again = _run([*_torchrun(tmp_path), *args, "--epochs", "2"], tmp_path)
    assert again.count("resumed from ") == 1 and "checkpoint_00000064 at epoch 1, step 64" in again
    assert again.count("final loss") == 1, again
    assert sorted(p.name for p in (tmp_path / "long_run_checkpoints").iterdir()) == [
        "checkpoint_00000120",
        "checkpoint_00000128",
    ]
