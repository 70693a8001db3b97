"""The rule for tests whose real component (SLURM, two hosts) cannot run: skipped with the reason, failed in CI."""

from __future__ import annotations

import pytest
from support.component import in_ci, unavailable


@pytest.mark.parametrize("value", ["true", "TRUE", "True", "1", "yes", " true "])
def test_ci_is_on(value):
    assert in_ci({"CI": value})


@pytest.mark.parametrize(
    "environ", [{}, {"CI": ""}, {"CI": "false"}, {"CI": "0"}, {"CI": "no"}, {"GITHUB_ACTIONS": "true"}]
)
def test_ci_is_off(environ):
    assert not in_ci(environ)


def test_unavailable_outside_ci_skips_with_the_reason_alone():
    with pytest.raises(pytest.skip.Exception) as info:
        unavailable("SLURM is not installed", {"CI": "false"})
    assert info.value.msg == "SLURM is not installed"


def test_unavailable_in_ci_fails_with_the_reason():
    with pytest.raises(pytest.fail.Exception) as info:
        unavailable("SLURM is not installed", {"CI": "true"})
    assert info.value.msg == "SLURM is not installed [CI=true: a test whose real component cannot run fails]"
    assert not info.value.pytrace
