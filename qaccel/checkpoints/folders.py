"""A checkpoint on disk: its files' names, the marker written last that makes a folder a complete checkpoint, the
numbered folders of a directory (which is newest, which a save left beside its target), and reading a marker. No
ranks here: what any process can ask of a folder, the command line's ``inspect`` included."""

from __future__ import annotations

import errno
import glob
import json
import os
import re
import secrets
import shutil
from typing import Any

import torch

from qaccel.errors import CheckpointError

MODEL_FILE = "model.pt"
MARKER_FILE = "qaccel_state.json"  # written last: a checkpoint folder holding it is complete
SHARDED_DIR = "sharded"  # strategy="fsdp": models and optimizers, in torch.distributed.checkpoint's format
FORMAT = 2  # the marker lists every file's size and checksum
_NUMBERED = re.compile(r"checkpoint_(\d+)")
_SIDE = re.compile(r"\.(tmp|old)-[0-9a-f]{12}")  # what a save makes beside its target: .tmp-/.old- + token_hex(6)


def held_names(names: list[str]) -> str:
    """What a folder holds, in words: its first names and how many there are."""
    return ", ".join(names[:8]) + (f", ... ({len(names)} entries)" if len(names) > 8 else "") if names else "nothing"


def beside(target: str, kind: str) -> list[str]:
    """The folders saves of ``target`` made beside it (``kind``: ``tmp`` or ``old``), known by their names: a
    user's ``<target>.tmp-mine`` is none of them."""
    return [
        path
        for path in glob.glob(f"{glob.escape(target)}.{kind}-*")
        if (match := _SIDE.fullmatch(path, len(target))) and match.group(1) == kind and os.path.isdir(path)
    ]


def numbered_in(directory: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints in ``directory``, oldest first. A save that died between its two
    renames counts through its ``.old-*`` backup, as long as no checkpoint of that step replaced it."""
    found: dict[int, str] = {}
    try:
        names = sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for name in names:  # "checkpoint_N" sorts before its "checkpoint_N.old-*"
        match = _NUMBERED.match(name)
        path = os.path.join(directory, name)
        if match is None or not os.path.isfile(os.path.join(path, MARKER_FILE)):
            continue
        step = int(match.group(1))
        side = _SIDE.fullmatch(name, match.end())
        if match.end() == len(name) or (side is not None and side.group(1) == "old" and step not in found):
            found[step] = path
    return sorted(found.items())


def candidates_in(directory: str) -> list[str]:
    """The checkpoints load_state(directory) may read, the preferred first: ``directory`` itself if it is one, else
    its complete ``checkpoint_<step>`` folders, newest first; else the backup a save left between its renames."""
    if os.path.isfile(os.path.join(directory, MARKER_FILE)):
        return [directory]
    numbered = [path for _, path in reversed(numbered_in(directory))]
    if numbered:
        return numbered
    backups = sorted(beside(directory, "old"), key=os.path.getmtime)
    return backups[-1:]  # a save died between its two renames: the previous checkpoint


def newest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The checkpoint load_state(directory) reads first; None if there is none."""
    candidates = candidates_in(os.path.abspath(os.fspath(directory)))
    return candidates[0] if candidates else None


def not_a_checkpoint(path: str) -> FileNotFoundError:
    """What is at ``path`` instead of a checkpoint, in an error."""
    if not os.path.lexists(path):
        return FileNotFoundError(f"no checkpoint at {path}: there is no such file or folder")
    if not os.path.isdir(path):
        return FileNotFoundError(f"no checkpoint at {path}: it is a file; give the checkpoint's folder")
    held = held_names(sorted(os.listdir(path)))
    return FileNotFoundError(
        f"{path} is not a qaccel checkpoint: it holds no {MARKER_FILE} (written last, so a half-written checkpoint "
        f"has none) and no complete checkpoint_<step> folder; it holds {held}"
    )


def prune(directory: str, keep: int) -> None:
    """Remove all but the ``keep`` newest complete checkpoints of ``directory``, backups already replaced, and what
    killed saves left (rank 0, the only writer, has finished writing)."""
    complete = numbered_in(directory)
    for _, path in complete[:-keep]:
        shutil.rmtree(path)
    kept = {path for _, path in complete[-keep:]}
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if (match := _NUMBERED.match(name)) and _SIDE.fullmatch(name, match.end()) and path not in kept:
            shutil.rmtree(path, ignore_errors=True)


def check_replaceable(target: str) -> None:
    """FileExistsError unless ``target`` is free, an empty folder or a checkpoint: the save swaps a new folder in
    whole, so a folder of the user's own files (or a file) would be lost."""
    if not os.path.lexists(target):
        return
    if os.path.islink(target) or not os.path.isdir(target):
        what = "a symbolic link" if os.path.islink(target) else "a file"
        raise FileExistsError(
            errno.EEXIST,
            f"save_state() would replace {target}, which is {what}: give a folder, "
            "new or a checkpoint, or keep=K to keep numbered checkpoints inside a folder",
            target,
        )
    names = sorted(os.listdir(target))
    if names and MARKER_FILE not in names:
        raise FileExistsError(
            errno.EEXIST,
            f"save_state() replaces its folder whole, and {target} is not a qaccel "
            f"checkpoint (it holds {held_names(names)}), so nothing was written: give a new or empty "
            "folder, or keep=K to keep numbered checkpoints inside this one",
            target,
        )


def new_tmp(target: str) -> str:
    """A new temporary folder beside ``target`` (what killed saves left there removed first), once ``target`` is
    known to be a folder the save may replace."""
    check_replaceable(target)
    for stale in beside(target, "tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = f"{target}.tmp-{secrets.token_hex(6)}"
    os.makedirs(tmp)
    return tmp


class Unreadable(Exception):
    def __init__(self, file: str, why: str) -> None:
        super().__init__(f"{file} {why}")
        self.file, self.why = file, why


def read_marker(directory: str) -> dict[str, Any]:
    """The checkpoint's marker: complete means a marker of this FORMAT, listing every file (one rule)."""
    try:
        with open(os.path.join(directory, MARKER_FILE), "rb") as f:
            marker = json.load(f)
    except (OSError, ValueError) as exc:
        raise Unreadable(MARKER_FILE, f"cannot be read ({exc})") from exc
    if not isinstance(marker, dict) or marker.get("format") != FORMAT or not isinstance(marker.get("files"), dict):
        raise Unreadable(MARKER_FILE, f"is not what save_state() writes (format {FORMAT}, listing every file)")
    return marker


def listed_count(marker: dict[str, Any], kind: str) -> int:
    """How many ``kind`` parts (``<kind>_0.pt``, ``<kind>_1.pt``, ...) the marker lists."""
    count = 0
    while f"{kind}_{count}.pt" in marker["files"]:
        count += 1
    return count


def marks_sharded(marker: dict[str, Any]) -> bool:
    return "sharded" in marker


def found_in(directory: str) -> str:
    """``directory`` if it is a checkpoint, else the newest complete one in it."""
    candidates = candidates_in(directory)
    if not candidates:
        raise not_a_checkpoint(directory)
    return candidates[0]


def inspect(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a checkpoint holds, read without loading it: its path (the newest of a folder of them), the world that
    wrote it, its step, whether it is sharded, and each prepared loader's position and batch."""
    found = found_in(os.path.abspath(os.fspath(path)))
    try:
        marker = read_marker(found)
    except Unreadable as exc:
        raise CheckpointError(f"checkpoint {found}: {exc}", found) from None
    accumulation = int(marker.get("accumulation_steps", 1))
    loaders = []
    for i in range(listed_count(marker, "loader")):
        state = torch.load(os.path.join(found, f"loader_{i}.pt"), weights_only=True)
        world = int(state.get("world_size", marker.get("world_size", 1)))
        batch = state.get("batch_size")
        loaders.append(
            {
                **state,
                "global_batch": None
                if batch is None
                else batch * accumulation * (1 if state.get("split_batches") else world),
            }
        )
    return {
        "path": found,
        "world_size": marker.get("world_size"),
        "step": marker.get("step"),
        "accumulation_steps": accumulation,
        "sharded": marks_sharded(marker),
        "loaders": loaders,
    }
