"""The README's quick start, copied from the README as printed, runs and prints its result once under python,
torchrun and a real srun."""

from __future__ import annotations

import re

import pytest
from support.procs import REPO, run_script, run_torchrun, slurm_env

pytestmark = pytest.mark.timeout(240)


def _quick_start(tmp_path):
    """The first python block after the README's "## Quick start" heading, as a script file."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Quick start") :]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert 'if __name__ == "__main__":' in code and "distribute(" in code
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    return script


def _printed_once(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("{'loss': ") == 1, proc.stdout
    loss = re.search(r"\{'loss': ([^}]*)\}", proc.stdout).group(1)
    assert float(loss) < 0.01, proc.stdout  # it trained: y = 3x - 1 is learnt


def test_quick_start_prints_once_under_python(tmp_path):
    _printed_once(run_script(_quick_start(tmp_path), cwd=tmp_path, timeout=200))


def test_quick_start_prints_once_under_torchrun(tmp_path):
    _printed_once(run_torchrun(_quick_start(tmp_path), cwd=tmp_path, timeout=200))


@pytest.mark.slurm
def test_quick_start_prints_once_under_srun(slurm_cluster, tmp_path):
    proc = slurm_cluster.srun(
        ["-N1", "-n2", "python", str(_quick_start(tmp_path))], timeout=200, env=slurm_env(slurm_cluster)
    )
    _printed_once(proc)
