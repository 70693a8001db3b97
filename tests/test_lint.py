"""The repository as ruff and pyright see it: no finding and nothing left to format, with the rules and versions of
the test extra (``pyproject.toml`` says which code ruff leaves out: code other projects wrote, ported with its
imports changed, and which modules pyright reads strictly)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is a test dependency (pip install -e '.[test]')")
    return subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def test_ruff_finds_nothing():
    run = _ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert run.returncode == 0, run.stdout + run.stderr


def test_ruff_format_leaves_every_file_as_it_is():
    run = _ruff("format", "--no-cache", "--check", ".")
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_finding_is_reported(tmp_path):
    """The check above can fail: the same configuration finds an unused import and an unformatted line."""
    (tmp_path / "bad.py").write_text("import os\nx = {  'a':1}\n")
    config = str(ROOT / "pyproject.toml")
    assert "F401" in _ruff("check", "--no-cache", "--config", config, str(tmp_path / "bad.py")).stdout
    assert _ruff("format", "--no-cache", "--config", config, "--check", str(tmp_path / "bad.py")).returncode == 1


def test_pyright_finds_nothing_in_the_package():
    """pyright as pyproject.toml sets it: the package in standard mode, what users import and call strict."""
    pyright = shutil.which("pyright")
    if pyright is None:
        pytest.fail("pyright is a test dependency (pip install -e '.[test]')")
    run = subprocess.run(
        [pyright, "--pythonpath", sys.executable], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0 and "0 errors" in run.stdout, run.stdout + run.stderr
