"""Rules the suite keeps about itself, checked on its own source: every skip goes through tests/support/component.py,
so that under CI=true a test whose component is missing fails instead of passing as a skip."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support import component

TESTS = Path(__file__).parent
SKIPS = re.compile(r"pytest\.(skip\(|importorskip\(|mark\.skip|mark\.skipif|mark\.xfail|xfail\()")


def test_every_skip_goes_through_support_component():
    offenders = [
        f"{path.relative_to(TESTS)}:{number}: {line.strip()}"
        for path in sorted(TESTS.rglob("*.py"))
        if path != TESTS / "support" / "component.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if SKIPS.search(line)
    ]
    assert offenders == [], "skip with component.unavailable() or component.module() instead:\n" + "\n".join(offenders)


def test_a_missing_test_dependency_skips_saying_how_to_install_it_and_fails_under_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(
        pytest.skip.Exception,
        match=r"no_such_module_of_qaccel is not installed .*pip install -e "
        r"'\.\[test\]'",
    ):
        component.module("no_such_module_of_qaccel")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"\[CI=true: a test whose real component cannot run fails\]"):
        component.module("no_such_module_of_qaccel")
    assert component.module("json").dumps([1]) == "[1]"
