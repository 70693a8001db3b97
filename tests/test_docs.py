"""The documentation site builds with ``mkdocs build --strict`` (a broken link or anchor, a page missing from the
nav, a docstring that does not render, or an option table qaccel cannot give fails), and the Python on its pages
works: a block that is a complete script (it has ``if __name__ == "__main__":``) runs with ``python`` and exits 0,
and every other block compiles.

Without MkDocs installed (``pip install -e ".[docs]"``, or the ``test`` extra) the build test is skipped saying so,
or fails under CI=true, as the tests of support/component.py do for a missing SLURM.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support.component import unavailable

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
MAIN_GUARD = 'if __name__ == "__main__":'
# A fenced python block, also one indented inside a list item: its closing fence has the opening one's indent.
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[^\n]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
DOCS_PACKAGES = ("mkdocs", "mkdocs-material", "mkdocstrings", "mkdocstrings-python")


def _blocks() -> list[tuple[str, str]]:
    """(page:line, code) of every python block on the site's pages, dedented to its fence."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{page.relative_to(DOCS)}:{line}", textwrap.dedent(match.group("code"))))
    return found


def _readme_quick_start() -> str:
    """The block tests/test_readme.py runs under python, torchrun and srun."""
    readme = (REPO / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", readme[readme.index("## Quick start"):], re.S).group(1)


BLOCKS = _blocks()
# Complete scripts, less the README's quick start that the Getting started page repeats: test_readme.py runs that.
SCRIPTS = [(name, code) for name, code in BLOCKS if MAIN_GUARD in code and code != _readme_quick_start()]


def _env() -> dict[str, str]:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_the_site_builds_strictly(tmp_path):
    missing = []
    for package in DOCS_PACKAGES:
        try:
            importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            missing.append(package)
    if missing:
        unavailable(f"building the documentation needs {', '.join(missing)} "
                    "(pip install -e '.[docs]'); the site's build is not checked")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(REPO / "mkdocs.yml"), "--site-dir", str(site)],
                          capture_output=True, text=True, timeout=200, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    options = (site / "options" / "index.html").read_text()
    assert "<!-- options-table -->" not in options and options.count("<tr>") > 10  # the generated table
    api = (site / "api" / "index.html").read_text()
    assert 'id="qaccel.Accelerator.prepare"' in api and 'id="qaccel.environment.detect"' in api


def test_the_getting_started_quick_start_is_the_readmes():
    """So the README's test runs it; a page whose quick start differed would be run here as a script of its own."""
    page = (DOCS / "getting-started.md").read_text()
    code = re.search(r"```python\n(.*?)```", page[page.index("## Quick start"):], re.S).group(1)
    assert code == _readme_quick_start()


def test_every_python_block_compiles():
    assert len(BLOCKS) > 10, "no python blocks found: is the fence pattern still right?"
    errors = []
    for name, code in BLOCKS:
        try:
            compile(code, name, "exec")
        except SyntaxError as e:
            errors.append(f"docs/{name}: {e}")
    assert not errors, "\n".join(errors)


def test_every_file_of_the_repository_the_pages_name_exists():
    """The pages name tests, examples, sbatch scripts and benchmarks by their paths: none may be left behind by a
    move or a rename (mkdocs checks links between pages, not these)."""
    named = re.compile(r"(?<![\w/.])(?:tests|examples|slurm|benchmarks|docs)/[\w/.-]+\.(?:py|sbatch|md)\b")
    missing = sorted({f"{page.relative_to(REPO)}: {path}"
                      for page in [REPO / "README.md", *DOCS.rglob("*.md")]
                      for path in named.findall(page.read_text()) if not (REPO / path).is_file()})
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("name, code", SCRIPTS, ids=[name for name, _ in SCRIPTS])
def test_complete_script_runs(name, code, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200, env=_env(),
                          cwd=tmp_path)
    assert proc.returncode == 0, f"docs/{name} exited with {proc.returncode}:\n{proc.stdout}{proc.stderr}"
