"""torch._dynamo imported with the garbage collector paused, now or whenever it is first needed: checked in fresh
interpreters, where torch has not imported it yet."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

COUNT_COLLECTIONS = """
import gc, json, sys, torch
from qaccel.imports import import_quietly, import_quietly_when_needed
collections = []  # those made while torch._dynamo is being imported


def importing_dynamo():
    module = sys.modules.get("torch._dynamo")
    return module is not None and getattr(module.__spec__, "_initializing", False)


gc.callbacks.append(lambda phase, info: phase == "start" and importing_dynamo() and collections.append(1))
"""


def _run(code: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", COUNT_COLLECTIONS + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_an_optimizer_imports_dynamo_without_a_collection_once_asked_to():
    quiet = _run("""
        import_quietly_when_needed()
        import_quietly_when_needed()  # once is enough: no second finder
        finders = sum(type(f).__name__ == "_QuietFinder" for f in sys.meta_path)
        torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # torch imports dynamo here
        print(json.dumps({"finders": finders, "collections": len(collections), "dynamo": "torch._dynamo" in sys.modules,
                          "gc_enabled": gc.isenabled(), "left": [type(f).__name__ for f in sys.meta_path],
                          "loader": type(torch._dynamo.__loader__).__name__}))
        """)
    assert quiet["dynamo"] and quiet["finders"] == 1
    assert quiet["collections"] <= 1 and quiet["gc_enabled"], "one, when the collector is back on: " + str(quiet)
    assert "_QuietFinder" not in quiet["left"], "the finder goes once its module is imported"
    assert quiet["loader"] == "SourceFileLoader", "the module keeps its own loader (inspect, reloads)"
    plain = _run("""
        torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        print(json.dumps({"collections": len(collections)}))
        """)
    assert plain["collections"] > 10, "the import does trigger collections when nothing pauses them"


def test_import_quietly_imports_now_and_passes_over_what_is_missing():
    result = _run("""
        gc.disable()
        import_quietly(["torch._dynamo", "no_such_module_anywhere"])
        print(json.dumps({"collections": len(collections), "dynamo": "torch._dynamo" in sys.modules,
                          "gc_enabled": gc.isenabled()}))
        """)
    assert result == {"collections": 0, "dynamo": True, "gc_enabled": False}, "the collector is left as it was"
