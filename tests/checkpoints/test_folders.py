"""A checkpoint on disk, without ranks: which folders are complete checkpoints, which is newest, what a save left
beside its target. Saves that really die between their renames are in test_state_errors.py and test_resume.py."""

from __future__ import annotations

import os

import pytest

from qaccel.checkpoints import folders


def _checkpoint(path, complete: bool = True) -> str:
    os.makedirs(path)
    if complete:
        with open(os.path.join(path, folders.MARKER_FILE), "w") as f:
            f.write("{}")
    return str(path)


def test_the_newest_complete_numbered_checkpoint_is_read_first(tmp_path):
    _checkpoint(tmp_path / "checkpoint_00000002")
    _checkpoint(tmp_path / "checkpoint_00000010")
    _checkpoint(tmp_path / "checkpoint_00000011", complete=False)  # a save that died before its marker
    _checkpoint(tmp_path / "notes")
    assert [step for step, _ in folders.numbered_in(str(tmp_path))] == [2, 10]
    assert folders.newest_checkpoint(tmp_path) == str(tmp_path / "checkpoint_00000010")


def test_a_backup_counts_only_for_a_step_no_checkpoint_replaced(tmp_path):
    _checkpoint(tmp_path / "checkpoint_00000003")
    _checkpoint(tmp_path / "checkpoint_00000003.old-0123456789ab")
    backup = _checkpoint(tmp_path / "checkpoint_00000004.old-0123456789ab")  # died between its two renames
    assert folders.numbered_in(str(tmp_path)) == [(3, str(tmp_path / "checkpoint_00000003")), (4, backup)]


def test_a_folder_that_is_a_checkpoint_is_its_own_and_an_empty_one_has_none(tmp_path):
    own = _checkpoint(tmp_path / "run")
    assert folders.candidates_in(own) == [own]
    assert folders.newest_checkpoint(tmp_path / "missing") is None


def test_only_what_a_save_names_counts_as_left_beside_its_target(tmp_path):
    target = str(tmp_path / "state")
    ours = _checkpoint(tmp_path / "state.tmp-0123456789ab", complete=False)
    _checkpoint(tmp_path / "state.tmp-mine", complete=False)  # the user's
    assert folders.beside(target, "tmp") == [ours]


def test_a_folder_holding_something_else_is_never_replaced(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "weights.bin").write_bytes(b"x")
    with pytest.raises(FileExistsError, match=r"not a qaccel checkpoint \(it holds weights.bin\)"):
        folders.check_replaceable(str(tmp_path / "data"))
