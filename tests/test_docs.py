"""The documentation site builds with ``mkdocs build --strict`` (a broken link or anchor, a page missing from the
nav, a docstring that does not render, or an option table qaccel cannot give fails), and the Python on its pages
works. Every python block is one of three kinds:

- a complete script (it has ``if __name__ == "__main__":``): it runs with ``python`` and exits 0;
- a fragment, marked by the line ``<!-- fragment -->`` right before its fence: it compiles (so does the call the
  Options page's generated table opens with, right after the line ``<!-- options-table -->``);
- a file of the repository shown with ``--8<-- "path"``: its own tests run it.

A block that is none of these fails. In every block, the names of qaccel it uses must exist: attributes of an
Accelerator (``acc.x``, ``accelerator.x``, ``Accelerator.x``) and of ``qaccel`` (``qaccel.x``), what is imported from
qaccel, and the keyword arguments of qaccel's classes and functions it calls. An error message a page quotes is one
of qaccel's own, values filled in.

Without MkDocs installed (``pip install -e ".[docs]"``, or the ``test`` extra) the build test is skipped saying so,
or fails under CI=true, as the tests of support/component.py do for a missing SLURM.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
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
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[^\n]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.DOTALL | re.MULTILINE)
DOCS_PACKAGES = ("mkdocs", "mkdocs-material", "mkdocstrings", "mkdocstrings-python")
FRAGMENT = "<!-- fragment -->"  # the line right before a block's fence that marks it as a fragment
OPTIONS_TABLE = "<!-- options-table -->"  # docs/hooks.py's marker: the generated table follows, opening with a call
OPTIONS_TABLE_END = "<!-- end options-table -->"
INCLUDE = "--8<--"  # pymdownx.snippets: the block shows a file of the repository
ACCELERATOR_NAMES = ("acc", "accelerator", "Accelerator")  # how the pages name an Accelerator (or its class)
ACCELERATE_ARGUMENTS = ("cpu", "dataloader_config", "gradient_accumulation_plugin")  # Accelerator(**...) takes them


def _blocks() -> list[tuple[str, str, bool]]:
    """(page:line, code, marked as a fragment) of every python block on the site's pages, dedented to its fence."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip("\n").rpartition("\n")[2].strip()
            fragment = before in (FRAGMENT, OPTIONS_TABLE)
            found.append((f"{page.relative_to(DOCS)}:{line}", textwrap.dedent(match.group("code")), fragment))
    return found


def _readme_quick_start() -> str:
    """The block tests/test_readme.py runs under python, torchrun and srun."""
    readme = (REPO / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", readme[readme.index("## Quick start") :], re.DOTALL).group(1)


MARKED = _blocks()
BLOCKS = [(name, code) for name, code, _ in MARKED]
# Complete scripts, less the README's quick start that the Getting started page repeats: test_readme.py runs that.
SCRIPTS = [(name, code) for name, code in BLOCKS if MAIN_GUARD in code and code != _readme_quick_start()]


def _qaccel_callable(func: ast.expr) -> object | None:
    """The function a call calls, when it is one of qaccel's names: ``Accelerator(...)``, ``qaccel.SlurmCluster(...)``;
    None otherwise."""
    import qaccel

    if isinstance(func, ast.Name) and func.id in qaccel.__all__:
        return getattr(qaccel, func.id)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "qaccel":
        return getattr(qaccel, func.attr, None)
    return None


def _unknown_names(code: str) -> list[str]:
    """The names of qaccel that ``code`` uses and qaccel does not have."""
    import qaccel

    unknown = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner = node.value.id
            if owner in ACCELERATOR_NAMES and not hasattr(qaccel.Accelerator, node.attr):
                unknown.append(f"{owner}.{node.attr}: no Accelerator.{node.attr}")
            elif owner == "qaccel" and not hasattr(qaccel, node.attr):
                unknown.append(f"qaccel.{node.attr}: not in qaccel")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module_name = node.module if isinstance(node, ast.ImportFrom) else None
            for alias in node.names:
                name = module_name or alias.name
                if name.split(".")[0] != "qaccel":
                    continue
                try:
                    module = importlib.import_module(name)
                except ImportError as e:
                    unknown.append(f"import {name}: {e}")
                    continue
                if module_name is not None and not hasattr(module, alias.name):
                    unknown.append(f"from {name} import {alias.name}: {name} has no {alias.name}")
        elif isinstance(node, ast.Call) and (callee := _qaccel_callable(node.func)) is not None:
            parameters = inspect.signature(callee).parameters
            allowed = {n for n, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
                if callee is not qaccel.Accelerator:
                    continue
                allowed |= set(ACCELERATE_ARGUMENTS)
            unknown += [
                f"{ast.unparse(node.func)}({k.arg}=...): no such argument"
                for k in node.keywords
                if k.arg is not None and k.arg not in allowed
            ]
    return unknown


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
        unavailable(
            f"building the documentation needs {', '.join(missing)} "
            "(pip install -e '.[docs]'); the site's build is not checked"
        )
    site = tmp_path / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(REPO / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        capture_output=True,
        text=True,
        timeout=200,
        env=_env(),
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    options = (site / "options" / "index.html").read_text()
    assert "<!-- options-table -->" not in options and options.count("<tr>") > 10  # the generated table
    api = (site / "api" / "index.html").read_text()
    assert 'id="qaccel.Accelerator.prepare"' in api and 'id="qaccel.environment.detect"' in api


def test_the_options_page_holds_the_table_qaccel_generates():
    """docs/options.md reads whole on GitHub: the table is in the file, and it is the one qaccel gives today."""
    from qaccel.options import option_table

    page = (DOCS / "options.md").read_text()
    assert page.count(OPTIONS_TABLE) == 1 and page.count(OPTIONS_TABLE_END) == 1, (
        f"docs/options.md must hold the lines {OPTIONS_TABLE} and {OPTIONS_TABLE_END} once each, the table between"
    )
    written = page.split(OPTIONS_TABLE + "\n", 1)[1].split(OPTIONS_TABLE_END, 1)[0]
    assert written == option_table().strip() + "\n", (
        "the option table in docs/options.md is not qaccel.options.option_table()'s: "
        "write it again with `python docs/hooks.py`"
    )


def test_the_getting_started_quick_start_is_the_readmes():
    """So the README's test runs it; a page whose quick start differed would be run here as a script of its own."""
    page = (DOCS / "getting-started.md").read_text()
    code = re.search(r"```python\n(.*?)```", page[page.index("## Quick start") :], re.DOTALL).group(1)
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


def test_every_python_block_is_a_script_a_fragment_or_a_file_of_the_repository():
    """So that no block is left untested by mistake: a block that does not run must say it is a fragment."""
    wrong = []
    for name, code, fragment in MARKED:
        if code.strip().startswith(INCLUDE):
            if fragment:
                wrong.append(f"docs/{name}: a file shown with {INCLUDE} is not a fragment")
        elif fragment and MAIN_GUARD in code:
            wrong.append(f"docs/{name}: marked {FRAGMENT}, but it has {MAIN_GUARD!r} and runs as a script")
        elif not fragment and MAIN_GUARD not in code:
            wrong.append(
                f"docs/{name}: neither a complete script (with {MAIN_GUARD!r}) nor marked as a fragment "
                f"(a line {FRAGMENT} right before its fence)"
            )
    assert not wrong, "\n".join(wrong)


def test_the_python_blocks_name_only_what_qaccel_has():
    unknown = [
        f"docs/{name}: {problem}"
        for name, code in BLOCKS
        if not code.strip().startswith(INCLUDE)
        for problem in _unknown_names(code)
    ]
    assert not unknown, "\n".join(unknown)


def test_the_name_check_finds_what_qaccel_does_not_have():
    """The check itself: a fragment naming what is not there is caught, one naming what is there passes."""
    assert (
        _unknown_names(
            "acc.prepare(model)\nqaccel.Preempted\nfrom qaccel import Trainer\n"
            "Accelerator(nprocs=2, cpu=True)\nqaccel.SlurmCluster(nodes=2)"
        )
        == []
    )
    assert (
        len(
            _unknown_names(
                "accelerator.unscale_gradients()\nqaccel.Nothing\nfrom qaccel import nothing\n"
                "Accelerator(deepspeed_plugin=None)\nTrainConfig(epochs=3)"
            )
        )
        == 5
    )


def test_what_the_accelerate_page_says_qaccel_lacks_it_lacks():
    """The "What qaccel does not have" table of Coming from Accelerate: no name of its first column is on the
    Accelerator (a name that lands there must leave the table)."""
    import qaccel

    page = (DOCS / "guides" / "accelerate.md").read_text()
    table = page.split("## What qaccel does not have", 1)[1].split("\n## ", 1)[0]
    names = [
        name
        for row in table.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`(\w+)`", row.split("|")[1])
    ]
    assert len(names) > 30
    assert [name for name in names if hasattr(qaccel.Accelerator, name)] == []


def test_every_file_of_the_repository_the_pages_name_exists():
    """The pages name tests, examples, sbatch scripts and benchmarks by their paths: none may be left behind by a
    move or a rename (mkdocs checks links between pages, not these)."""
    named = re.compile(r"(?<![\w/.])(?:tests|examples|slurm|benchmarks|docs)/[\w/.-]+\.(?:py|sbatch|md)\b")
    missing = sorted(
        {
            f"{page.relative_to(REPO)}: {path}"
            for page in [REPO / "README.md", *DOCS.rglob("*.md")]
            for path in named.findall(page.read_text())
            if not (REPO / path).is_file()
        }
    )
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("name, code", SCRIPTS, ids=[name for name, _ in SCRIPTS])
def test_complete_script_runs(name, code, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=200,
        env=_env(),
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, f"docs/{name} exited with {proc.returncode}:\n{proc.stdout}{proc.stderr}"


# An error message quoted on a page: a line (in a text block, or in backquotes) that starts with an exception's name.
QUOTED_ERROR = re.compile(
    r"(?:^|`)(?:qaccel\.errors\.)?(?P<type>[A-Z]\w*(?:Error|Exception)): "
    r"(?:\[Errno \d+\] )?(?P<text>[^`\n]+)",
    re.MULTILINE,
)
# Messages of torch's, which the pages quote to say what qaccel adds to them: not qaccel's text.
FOREIGN = ("[../", "[enforce fail")
MIN_FIXED = 20  # characters of fixed text a quote must match in one of qaccel's messages


def _templates() -> list[list[str]]:
    """qaccel's string literals and f-strings as their fixed parts, in order (a value goes between two parts)."""
    found = []
    for path in (REPO / "qaccel").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                parts, fixed = [], ""
                for value in node.values:
                    if isinstance(value, ast.Constant):
                        fixed += value.value
                    else:
                        parts.append(fixed)
                        fixed = ""
                found.append(parts + [fixed])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.append([node.value])
    return found


def _quotes(text: str, templates: list[list[str]]) -> bool:
    """Whether ``text`` (the start of a message, maybe cut where the page wraps it) is one of the templates with
    values filled in, as far as it goes: the first parts of one match it, with at least MIN_FIXED fixed characters."""
    for parts in templates:
        for count in range(len(parts), 0, -1):
            if sum(len(part) for part in parts[:count]) < MIN_FIXED:
                break
            pattern = ".+?".join(re.escape(" ".join(part.split())) for part in parts[:count])
            if re.match(pattern, text):
                return True
    return False


def test_error_messages_quoted_in_the_pages_are_the_ones_qaccel_raises():
    """A page that quotes an error (`CheckpointError: checkpoint ... is damaged: ...`) quotes qaccel's own words, as
    one of its messages gives them with the values filled in."""
    templates = _templates()
    quoted, wrong = 0, []
    for page in sorted([*DOCS.rglob("*.md"), REPO / "README.md"]):
        for match in QUOTED_ERROR.finditer(page.read_text()):
            text = " ".join(match.group("text").split())
            if any(mark in text for mark in FOREIGN):
                continue
            quoted += 1
            if not _quotes(text, templates):
                wrong.append(f"{page.relative_to(REPO)}: {match.group('type')}: {text}")
    assert quoted >= 5, "few quoted errors found: is the pattern still right?"
    assert not wrong, "not qaccel's words:\n" + "\n".join(wrong)


def test_the_quote_check_tells_qaccels_words_from_others():
    templates = [["checkpoint ", " was written by ", " rank", " with gradient accumulation ", ""]]
    assert _quotes("checkpoint /a/checkpoint_9 was written by 4 ranks with gradient accumulation 1:", templates)
    assert _quotes("checkpoint /a/checkpoint_9 was written by 4 ranks with", templates), "cut where the page wraps"
    assert not _quotes("checkpoint /a/checkpoint_9 was saved by 4 ranks with gradient accumulation 1", templates)
