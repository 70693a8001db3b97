"""Which failure the launcher reports as the cause, decided from made-up failure records (no processes)."""

from __future__ import annotations

import pickle

import pytest

from qaccel.errors import ErrorReport, raised_note
from qaccel.launch.failures import RankFailure, root_cause

RESET = "Connection reset by peer"


def _report(rank, t, exc_type="builtins.ValueError", message="bad value"):
    return ErrorReport(rank, exc_type, message, "Traceback ...", None, time=t)


def test_a_rank_dying_silently_is_the_cause_even_after_earlier_reports():
    failures = [RankFailure(0, _report(0, 1.0)), RankFailure(1, None, -9), RankFailure(2, None, 1)]
    assert root_cause(failures).rank == 1


def test_the_earliest_report_that_is_not_a_symptom_wins():
    failures = [
        RankFailure(0, _report(0, 1.0, "torch.distributed.DistNetworkError", RESET)),
        RankFailure(1, _report(1, 3.0, message="late cause")),
        RankFailure(2, _report(2, 2.0, message="the cause")),
    ]
    assert root_cause(failures).rank == 2


def test_a_peer_loss_message_is_a_symptom_whatever_its_type():
    symptom = RankFailure(0, _report(0, 1.0, "builtins.RuntimeError", f"[gloo] {RESET}"))
    cause = RankFailure(1, _report(1, 5.0, "builtins.KeyError", "'x'"))
    assert symptom.is_symptom and not cause.is_symptom
    assert root_cause([symptom, cause]) is cause


def test_only_symptoms_gives_the_earliest():
    failures = [RankFailure(r, _report(r, t, "torch.distributed.DistError", "x")) for r, t in ((0, 2.0), (1, 1.0))]
    assert root_cause(failures).rank == 1


def test_no_failures_is_an_error():
    with pytest.raises(ValueError, match="at least one failure"):
        root_cause([])


def test_a_report_carries_the_exception_and_survives_pickling():
    try:
        raise KeyError("missing")
    except KeyError as exc:
        report = ErrorReport.of(3, exc)
    again = pickle.loads(pickle.dumps(report))
    assert (again.rank, again.type, again.message) == (3, "builtins.KeyError", "'missing'")
    assert "raise KeyError" in again.traceback
    assert isinstance(pickle.loads(again.exc), KeyError)


def test_an_unpicklable_exception_is_reported_by_its_text():
    class Local(Exception):
        def __reduce__(self):
            raise TypeError("no")

    report = ErrorReport.of(0, Local("text"))
    assert report.exc is None and report.message == "text" and report.type.endswith("Local")


@pytest.mark.parametrize(
    "launched, expected",
    [
        (True, "[qaccel] raised on rank 1 of 4 (remote traceback above)"),
        (False, "[qaccel] raised on rank 1 of 4"),
    ],
)
def test_raised_note_for_a_cause(launched, expected):
    assert raised_note(1, 4, "builtins.ValueError", "bad", launched=launched) == expected


@pytest.mark.parametrize(
    "launched, tail",
    [
        (True, " (remote traceback above)"),
        (False, ": the cause is most likely in that rank's log"),
    ],
)
def test_raised_note_for_a_symptom_says_where_the_cause_is(launched, tail):
    note = raised_note(0, 2, "builtins.RuntimeError", RESET, launched=launched)
    assert note == "[qaccel] raised on rank 0 of 2 because it lost contact with another rank" + tail


def test_a_preempted_rank_is_a_stop_not_a_symptom():
    from qaccel import Preempted

    stop = RankFailure(0, ErrorReport.of(0, Preempted("SIGTERM", "/ck/checkpoint_00000003")))
    assert stop.is_stop and not stop.is_symptom and not stop.is_silent
    assert not RankFailure(1, ErrorReport.of(1, ValueError("boom"))).is_stop
