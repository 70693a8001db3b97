"""Files qaccel writes for the user: atomically, with their size and checksum taken as they are written, read back
against them, and with errors that name the file and, for a full disk, how much room there was."""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

CHECKSUMS = True  # crc32 of every checkpoint file (benchmarks/checkpoint_integrity.py measures the cost)
_CHUNK = 1 << 24
_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


@dataclass(frozen=True)
class Sums:
    """What a file held when it was written: its size, and its crc32 (None when checksums are off)."""

    size: int
    crc32: int | None

    def to_json(self) -> dict[str, int]:
        return {"size": self.size} if self.crc32 is None else {"size": self.size, "crc32": self.crc32}


class _Summing:
    """A binary file wrapper that counts and checksums what goes through ``write``."""

    def __init__(self, f: Any) -> None:
        self.f, self.size, self.crc = f, 0, 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if CHECKSUMS:
            self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()


def write_with(write: Callable[[Any], Any], path: str | os.PathLike) -> Sums:
    """``write(f)`` into a temporary file beside ``path``, fsynced and renamed onto it: a reader never sees half a
    file, and a failure leaves the previous one. A full disk raises an OSError saying so, for ``path``; any other
    error gets a note naming ``path``."""
    path = os.path.abspath(os.fspath(path))
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "xb") as f:
            summing = _Summing(f)
            write(summing)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        full = disk_full(exc)
        if full is not None:
            raise OSError(full, f"{_FULL[full]} writing {path} ({space(path)})", path) from exc
        if isinstance(exc, Exception):
            exc.add_note(f"[qaccel] while writing {path}")
        raise
    return Sums(summing.size, summing.crc if CHECKSUMS else None)


def save(obj: Any, path: str | os.PathLike) -> Sums:
    """torch.save, through write_with."""
    return write_with(lambda f: torch.save(obj, f), path)


def write_bytes(data: bytes, path: str | os.PathLike) -> Sums:
    return write_with(lambda f: f.write(data), path)


def sums(path: str | os.PathLike) -> Sums:
    """A written file's size and crc32, read back (for files another library wrote)."""
    size, crc = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            size += len(chunk)
            if CHECKSUMS:
                crc = zlib.crc32(chunk, crc)
    return Sums(size, crc if CHECKSUMS else None)


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
    if CHECKSUMS and recorded.get("crc32") is not None:
        try:
            crc = sums(path).crc32
        except OSError as exc:
            return f"cannot be read ({exc.strerror or exc})"
        if crc != recorded["crc32"]:
            return "does not hold what was written (its checksum differs: damaged on disk or in a copy)"
    return None


def disk_full(exc: BaseException) -> int | None:
    """ENOSPC or EDQUOT when ``exc`` comes from a full disk or quota, else None."""
    found = full_disk_error(exc)
    return None if found is None else found.errno


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


def space(path: str | os.PathLike) -> str:
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
