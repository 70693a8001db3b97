"""Files qaccel writes: always atomically; the user's also durably, with their size and checksum taken once
written and checked when read back; errors name the file and, for a full disk, how much room there was."""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, overload

import numpy as np
import torch

CHECKSUMS = True  # a 64-bit checksum of every checkpoint file (benchmarks/checkpoint_integrity.py measures it)
RELEASE = True  # a save first drops the checkpoint before it from the page cache (benchmarks/repeated_save.py)
_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


@dataclass(frozen=True)
class Sums:
    """What a file held when it was written: its size, and its checksum (None when checksums are off)."""

    size: int
    sum64: int | None

    def to_json(self) -> dict[str, int]:
        return {"size": self.size} if self.sum64 is None else {"size": self.size, "sum64": self.sum64}


def checksum(path: str | os.PathLike[str]) -> int:
    """The sum of the file's little-endian 64-bit words (the last one zero-padded), modulo 2**64.

    It catches what damages a file at rest or in a copy (a changed byte, a zeroed page, a cut), read through the
    page cache by mmap at memory speed: crc32 costs 6 times as much, which a 200 MB checkpoint's load would feel.
    It does not catch whole words swapped in place, which storage does not do.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            words = np.frombuffer(mapped, dtype="<u8", count=size // 8)
            total = int(words.sum(dtype=np.uint64))
            del words  # the mapping cannot close while an array looks into it
            return (total + int.from_bytes(mapped[size - size % 8 :], "little")) % 2**64


def sums(path: str | os.PathLike[str]) -> Sums:
    """A written file's size and checksum."""
    return Sums(os.stat(path).st_size, checksum(path) if CHECKSUMS else None)


def release(path: str | os.PathLike[str]) -> None:
    """Drop a durable file's pages (every file's under a folder) from the page cache, so that memory the process
    takes next reuses them. Only ever a hint: where the OS has no posix_fadvise or refuses it (tmpfs keeps its
    pages), they stay and nothing fails."""
    if not RELEASE or not hasattr(os, "posix_fadvise"):
        return
    path = os.fspath(path)
    files = (
        [os.path.join(base, name) for base, _, names in os.walk(path) for name in names]
        if os.path.isdir(path)
        else [path]
    )
    for file in files:
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


@overload
def write_with(write: Callable[[Any], Any], path: str | os.PathLike[str], durable: Literal[True] = True) -> Sums: ...
@overload
def write_with(write: Callable[[Any], Any], path: str | os.PathLike[str], durable: bool) -> Sums | None: ...
def write_with(write: Callable[[Any], Any], path: str | os.PathLike[str], durable: bool = True) -> Sums | None:
    """``write(f)`` into a temporary file beside ``path``, renamed onto it: a reader never sees half a file, and a
    failure leaves the previous one. A full disk raises an OSError saying so, for ``path``; any other error gets a
    note naming ``path``.

    ``durable`` (the user's files): fsynced before the rename, and the size and checksum returned, taken while the
    file is in the page cache. Without it (qaccel's own short-lived files, which nobody reads after a crash) there is
    neither fsync nor checksum, and None comes back.
    """
    path = os.path.abspath(os.fspath(path))
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "xb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        written = sums(tmp) if durable else None
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        named = named_full_disk(exc, path)
        if named is not None:
            raise named from exc
        if isinstance(exc, Exception):
            exc.add_note(f"[qaccel] while writing {path}")
        raise
    return written


def save(obj: Any, path: str | os.PathLike[str]) -> Sums:
    """torch.save, through write_with, durably."""
    return write_with(lambda f: torch.save(obj, f), path)


def write_bytes(data: bytes, path: str | os.PathLike[str], durable: bool = True) -> Sums | None:
    return write_with(lambda f: f.write(data), path, durable)


def damage(path: str, recorded: dict[str, int]) -> str | None:
    """Why the file at ``path`` is not what was written (``recorded``: Sums.to_json()), or None if it is."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return "is missing"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if size != recorded["size"]:
        return f"is {size} bytes long; {recorded['size']} were written (cut short by a copy or a full disk?)"
    if CHECKSUMS and recorded.get("sum64") is not None:
        try:
            total = checksum(path)
        except OSError as exc:
            return f"cannot be read ({exc.strerror or exc})"
        if total != recorded["sum64"]:
            return "does not hold what was written (its checksum differs: damaged on disk or in a copy)"
    return None


def disk_full(exc: BaseException) -> int | None:
    """ENOSPC or EDQUOT when ``exc`` comes from a full disk or quota, else None."""
    found = full_disk_error(exc)
    return None if found is None else found.errno


def named_full_disk(exc: BaseException, path: str) -> OSError | None:
    """The OSError to raise in place of ``exc`` when a full disk or quota is behind it: what, where, how much room."""
    full = disk_full(exc)
    return None if full is None else OSError(full, f"{_FULL[full]} writing {path} ({space(path)})", path)


def full_disk_error(exc: BaseException) -> OSError | None:
    """The OSError of a full disk or quota behind ``exc``, if any.

    torch.save reports a failed write as its own RuntimeError ("unexpected pos ..."), raised while handling the
    OSError of the file's ``write``, so the causes and contexts are searched, and the failures a
    torch.distributed.checkpoint error collects from every rank.
    """
    seen: set[int] = set()
    pending: list[Any] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _FULL:
            return current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):  # rank -> (exception, stack)
            pending.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        if isinstance(current, BaseException):
            pending += [current.__cause__, current.__context__]
    return None


def space(path: str | os.PathLike[str]) -> str:
    """How much room the file system holding ``path`` has, in words."""
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return "its free space could not be read"
    return f"{mib(usage.free)} free of {mib(usage.total)} on the file system holding {folder}"


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def tree_size(path: str) -> int:
    """Bytes in the files under ``path``."""
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                pass
    return total
