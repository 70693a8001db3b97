"""The examples run as a user runs them: with python (qaccel starts the ranks) and under torchrun."""

from __future__ import annotations

import subprocess
import sys

import pytest

from procs import REPO, script_env

pytestmark = pytest.mark.timeout(240)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _run(cmd, tmp_path):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=script_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_quickstart(launcher, tmp_path):
    head = [sys.executable] if launcher == "python" else TORCHRUN
    out = _run([*head, str(REPO / "examples/quickstart.py"), "--epochs", "10"], tmp_path)
    assert out.count("final mean loss") == 1 and "(2 ranks)" in out


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_regression(launcher, tmp_path):
    head = [sys.executable] if launcher == "python" else TORCHRUN
    out = _run([*head, str(REPO / "examples/regression.py"), "--epochs", "10"], tmp_path)
    assert out.count("validation loss") == 1 and "2 rank(s)" in out


def test_classify_cnn_evaluates_every_sample_once_and_saves_once(tmp_path):
    out = _run([sys.executable, str(REPO / "examples/classify_cnn.py"), "--out", str(tmp_path / "cnn.pt")], tmp_path)
    assert out.count("test accuracy") == 1 and "on 1000 samples (test split: 1000)" in out
    assert (tmp_path / "cnn.pt").exists()
