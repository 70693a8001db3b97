"""What Accelerate and transformers remember about the caller's process never reaches a rank as if it were the
rank's (qaccel/launch/caller_state.py): a PartialState or a transformers Trainer made in the caller fails the launch
at once, saying what to do; Accelerate's state a forked rank inherits is forgotten. (TrainingArguments made in the
caller and set up again in each rank: tests/test_third_party_scripts.py.)"""

from __future__ import annotations

import pytest
from support import component
from support.procs import result_lines, run_script, script_file

pytestmark = pytest.mark.timeout(120)
SCRIPT = script_file("third_party/caller_state.py")


def _run(mode: str, tmp_path) -> dict:
    proc = run_script(SCRIPT, mode, cwd=tmp_path, timeout=100)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    [result] = result_lines(proc.stdout)
    assert result["caller_world"] == 1
    return result["result"]


@pytest.mark.parametrize(
    ("mode", "state"),
    [("named", "PartialState"), ("trainer", "AcceleratorState")],
    ids=["a PartialState fn uses", "a transformers Trainer passed to fn"],
)
def test_accelerate_state_made_in_the_caller_fails_the_launch_at_once_saying_what_to_do(tmp_path, mode, state):
    component.installed("transformers" if mode == "trainer" else "accelerate")
    failed = _run(mode, tmp_path)
    assert failed["error"].startswith(
        f"distribute({'uses_state' if mode == 'named' else 'uses_trainer'}): an Accelerate {state} made in the caller"
    ), failed
    assert "make the Accelerator, PartialState or Trainer inside the function you distribute" in failed["error"]
    assert failed["seconds"] < 1, "refused while pickling the call, before any rank started"


def test_a_forked_rank_forgets_the_accelerate_state_the_caller_made(tmp_path):
    component.installed("accelerate")
    ranks = _run("inherited", tmp_path)
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)], "each rank's Accelerator is the rank's"
