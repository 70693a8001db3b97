"""One failure raised on every rank: which rank's, and what the others raise (reports made here, as a gather would
hand them over; the collectives themselves are tested in tests/checkpoints/test_state_errors.py)."""

from __future__ import annotations

import pytest

from qaccel.comm import agreement
from qaccel.errors import RankError, RemoteTraceback

NOTE = "[qaccel] it failed on rank {rank}"


def _raised(exc: BaseException) -> BaseException:
    """``exc`` with a traceback, as a rank's failure has."""
    try:
        raise exc
    except BaseException as raised:  # noqa: BLE001 - handed back
        return raised


class _TwoArguments(Exception):
    def __init__(self, what, where):
        super().__init__(f"{what} at {where}")


def test_no_failure_raises_nothing():
    assert agreement.raise_first([None, None], None, 0, NOTE) is None


def test_every_rank_raises_the_lowest_failing_ranks_error_with_its_words_and_notes():
    first = _raised(FileNotFoundError(2, "No such file or directory", "/ckpt/a"))
    first.add_note("[qaccel] while writing /ckpt/a")
    reports = [None, agreement.told(first, 1), agreement.told(_raised(ValueError("later")), 2)]
    with pytest.raises(FileNotFoundError) as on_rank_0:
        agreement.raise_first(reports, None, 0, NOTE)
    assert (on_rank_0.value.errno, on_rank_0.value.filename, str(on_rank_0.value)) == (
        2,
        "/ckpt/a",
        "[Errno 2] No such file or directory: '/ckpt/a'",
    )
    assert on_rank_0.value.__notes__ == ["[qaccel] while writing /ckpt/a", "[qaccel] it failed on rank 1"]
    assert isinstance(on_rank_0.value.__cause__, RemoteTraceback) and "Traceback from rank 1" in str(
        on_rank_0.value.__cause__
    ), "the failing rank's traceback above it"
    with pytest.raises(FileNotFoundError) as on_rank_1:
        agreement.raise_first(reports, first, 1, NOTE)
    assert on_rank_1.value is first, "the failing rank raises its own exception"
    assert on_rank_1.value.__notes__ == on_rank_0.value.__notes__


def test_a_later_rank_that_failed_too_says_so_under_the_first_ones_error():
    own = _raised(ValueError("later"))
    reports = [agreement.told(_raised(OSError(5, "Input/output error")), 0), agreement.told(own, 1)]
    with pytest.raises(OSError) as info:
        agreement.raise_first(reports, own, 1, NOTE)
    assert info.value.__notes__ == ["[qaccel] rank 1 failed too: ValueError: later", "[qaccel] it failed on rank 0"]


def test_an_error_that_cannot_be_rebuilt_is_a_rank_error_with_its_words():
    reports = [agreement.told(_raised(_TwoArguments("the shard", "rank 0")), 0)]
    with pytest.raises(RankError, match=r"rank 0 raised .*_TwoArguments: the shard at rank 0") as info:
        agreement.raise_first(reports, None, 1, NOTE)
    assert info.value.rank == 0 and info.value.__notes__ == ["[qaccel] it failed on rank 0"]
