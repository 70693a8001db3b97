"""Reading files that may carry code: a torch file is a pickle, and a pickle runs whatever its author chose when it
is read.

``load`` reads with ``torch.load(weights_only=True)``, which takes tensors and plain data only (and the types the
caller allows); what needs more, such as an object of the user's own class or a nevergrad optimizer, is unpickled
in full only where ``allow_pickle`` says so: True reads it anyway, False never, and None (the default) only when no
one but this user could have written the file (``who_else_can_write``). A refusal raises ``Untrusted``, naming the
file, its owner and mode, who else could write it, and the option that reads it anyway.
"""

from __future__ import annotations

import grp
import os
import pickle
import pwd
import stat
from collections.abc import Iterable
from typing import Any

import torch

ALLOW = "allow_pickle=True"


class Untrusted(Exception):
    """A file that needs full unpickling, which this call may not do."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path


def load(
    path: str | os.PathLike[str], allow_pickle: bool | None, *args: Any, safe: Iterable[Any] = (), **kwargs: Any
) -> Any:
    """``torch.load(path, *args, **kwargs)`` with weights_only and the ``safe`` types; in full, only where
    ``allow_pickle`` allows it (see the module's doc)."""
    try:
        with torch.serialization.safe_globals(list(safe)):
            return torch.load(path, *args, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        if "weights only" not in str(exc).lower():
            raise  # not a pickle that needs more: damaged, or no torch file at all
    check(path, f"it holds {_needs(path)}", allow_pickle)
    return torch.load(path, *args, weights_only=False, **kwargs)


def check(path: str | os.PathLike[str], needs: str, allow_pickle: bool | None) -> None:
    """Raise Untrusted unless ``path`` (a file, or a folder and all it holds), which ``needs`` full unpickling, may
    be unpickled in full."""
    path = os.path.abspath(os.fspath(path))
    if allow_pickle is True:
        return
    if allow_pickle is False:
        why = "allow_pickle=False"
    elif (why := who_else_can_write(path)) is None:
        return
    raise Untrusted(
        path,
        f"{path} ({_owner_and_mode(path)}) needs full unpickling to be read ({needs}), which runs "
        f"whatever code its author put in it, and {why}: qaccel reads it only with {ALLOW}, if you "
        "trust everyone who can write there",
    )


def who_else_can_write(path: str | os.PathLike[str]) -> str | None:
    """None when only this user (or root) can have written ``path``, a file or a folder with everything in it: it
    and every folder above it belong to them, and no one else may write in them (a folder others may write in
    counts only above the file, with the sticky bit that keeps each entry its owner's, as /tmp). Else why not."""
    real = os.path.realpath(path)
    below = [real]
    if os.path.isdir(real):
        below += [os.path.join(base, name) for base, dirs, files in os.walk(real) for name in dirs + files]
    for entry in below:
        if (why := _writable_by_others(entry, above=False)) is not None:
            return why
    folder = os.path.dirname(real)
    while True:
        if (why := _writable_by_others(folder, above=True)) is not None:
            return why
        if folder == os.path.dirname(folder):
            return None
        folder = os.path.dirname(folder)


def _writable_by_others(path: str, above: bool) -> str | None:
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path} cannot be checked ({exc.strerror or exc})"
    me = os.getuid()
    if st.st_uid not in (me, 0):
        return f"{path} belongs to {_user(st.st_uid)}"
    writable = st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid))
    if writable and not (above and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        who = "every user" if st.st_mode & stat.S_IWOTH else f"group {_group(st.st_gid)}"
        return f"{path} can be written by {who} (mode {oct(stat.S_IMODE(st.st_mode))})"
    return None


def _private_group(gid: int) -> bool:
    """The user's own group (a user private group, as most distributions make): it holds no one else."""
    try:
        me, group = pwd.getpwuid(os.getuid()), grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == me.pw_gid and group.gr_name == me.pw_name and set(group.gr_mem) <= {me.pw_name}


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


def _owner_and_mode(path: str) -> str:
    try:
        st = os.lstat(path)
    except OSError:
        return "cannot be read"
    return f"owner {_user(st.st_uid)}, mode {oct(stat.S_IMODE(st.st_mode))}"


def _needs(path: str | os.PathLike[str]) -> str:
    """What in a torch file only full unpickling reads, in words."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - an old format, say: the words stay general
        names = []
    return f"objects of {', '.join(sorted(names)[:5])}" if names else "objects that are not plain data"
