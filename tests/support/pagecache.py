"""How much of a file the page cache holds, read with mincore(2), and whether a folder's file system can drop it."""

from __future__ import annotations

import ctypes
import mmap
import os

_libc = ctypes.CDLL(None, use_errno=True)


def cached_pages(path: str | os.PathLike) -> int:
    """The number of ``path``'s pages in the page cache (mapping the file reads none of them)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        buffer = (ctypes.c_char * size).from_buffer(mapped)
        try:
            pages = -(-size // mmap.PAGESIZE)
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(ctypes.c_void_p(ctypes.addressof(buffer)), ctypes.c_size_t(size), vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path}")
            return sum(byte & 1 for byte in vector)
        finally:
            del buffer  # the mapping cannot close while a ctypes array looks into it


def cached_in(folder: str | os.PathLike) -> dict[str, int]:
    """Every file under ``folder`` that has pages in the page cache, with their number."""
    found = {}
    for base, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(base, name)
            if (pages := cached_pages(path)) > 0:
                found[os.path.relpath(path, folder)] = pages
    return found


def droppable(folder: str | os.PathLike) -> str | None:
    """None where ``folder``'s file system can drop its files' pages; else why not (tmpfs: the pages are the files)."""
    folder = os.path.realpath(folder)
    best, kind = "", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, fs, *_ = line.split()
            if (folder == point or folder.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, kind = point, fs
    return f"{folder} is on {kind}, whose files are the page cache itself" if kind in ("tmpfs", "ramfs") else None
