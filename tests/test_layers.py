"""The package's layers: every module imports only modules of its own layer or of the layers below it, so a reader
(and a later change) can take each layer as built on the ones under it."""

from __future__ import annotations

import ast
from pathlib import Path

import qaccel

PACKAGE = Path(qaccel.__file__).parent
PACKAGES = {"qaccel", *(f"qaccel.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").exists())}
# lowest first; the package's own __init__ and __main__ re-export and may import anything
LAYERS = [
    {
        "qaccel.options",
        "qaccel.errors",
        "qaccel.environment",
        "qaccel.storage",
        "qaccel.unpickling",
        "qaccel.nested",
        "qaccel.imports",
        "qaccel.handlers",
        "qaccel.wrapping",
    },
    {"qaccel.comm"},
    {"qaccel.tracking"},
    {"qaccel.train"},
    {"qaccel.checkpoints"},
    {"qaccel.launch"},
    {"qaccel.accelerator", "qaccel.notebook", "qaccel.utils"},
    {"qaccel.trainer"},
    {"qaccel.cli", "qaccel"},
]


def _layer(module: str) -> int:
    for depth in range(module.count(".") + 1, 0, -1):
        prefix = ".".join(module.split(".")[:depth])
        for index, layer in enumerate(LAYERS):
            if prefix in layer:
                return index
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def _imports(path: Path) -> set[str]:
    """The qaccel modules (or names of a package) ``path`` imports, wherever it does: at the top, in a function or
    for annotations only (``if TYPE_CHECKING:``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "qaccel":
            if node.module in PACKAGES:
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "qaccel"}
    return found


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): p for p in PACKAGE.rglob("*.py")}


def test_every_module_belongs_to_a_layer():
    for module in _modules():
        if not module.endswith(("__init__", "__main__")):
            _layer(module)


def test_imports_only_go_down():
    upward = []
    for module, path in _modules().items():
        if module in ("qaccel.__init__", "qaccel.__main__"):
            continue
        own = _layer(module.removesuffix(".__init__"))
        for imported in _imports(path):
            if imported != "qaccel.__version__" and _layer(imported) > own:
                upward.append(f"{module} imports {imported}")
    assert upward == []


def test_the_check_sees_an_upward_import(tmp_path):
    """The check itself can fail: a comm module importing from train is caught."""
    path = tmp_path / "fake.py"
    path.write_text("from qaccel.train import checkpoint\nimport qaccel.launch.caller\n")
    assert {_layer(name) for name in _imports(path)} == {3, 5} and _layer("qaccel.comm.fake") == 1


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm): each is a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _import_graph() -> dict[str, set[str]]:
    modules = {name.removesuffix(".__init__"): path for name, path in _modules().items()}
    graph = {}
    for module, path in modules.items():
        if module in ("qaccel", "qaccel.__main__"):  # re-exports: above everything
            continue
        graph[module] = {name if name in modules else name.rpartition(".")[0] for name in _imports(path)}
        graph[module] = {name for name in graph[module] if name in modules and name != module}
    return graph


def test_no_module_imports_itself_back():
    """No circle of modules, not even through annotations: two modules that need each other's types share them
    through a small module both import (as train/registry.py's protocols do)."""
    assert _circles(_import_graph()) == []


def test_the_circle_check_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


def _names_from(path: Path, prefix: str) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(prefix)
        for alias in node.names
    }


def test_comm_is_handed_pieces_of_the_options_not_the_whole_config():
    """comm needs a rank's device type, backend, world and timeout, and is handed those: an option added to the
    Config cannot reach it unseen."""
    takers = [path.name for path in (PACKAGE / "comm").glob("*.py") if "Config" in _names_from(path, "qaccel.options")]
    assert takers == []


def test_launch_knows_nothing_of_training_checkpoints_or_trackers():
    """Getting fn onto the ranks is apart from what fn does there."""
    found = {
        f"{path.name} imports {name}"
        for path in (PACKAGE / "launch").glob("*.py")
        for name in _imports(path)
        if name.startswith(("qaccel.train", "qaccel.checkpoints", "qaccel.tracking"))
    }
    assert found == set()
