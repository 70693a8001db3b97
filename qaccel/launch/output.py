"""Rank-prefixed output for a plain launch (``Accelerator(rank_prefix=True)``): ``[rank N] `` before every line.

The caller does the prefixing, not the rank: a rank's fds 1 and 2 are pipes the caller reads, so what a rank wrote
before it died is never lost, and output from C code, DataLoader workers and subprocesses (which inherit the fds)
is prefixed too. One thread per pipe cuts the bytes into lines and writes them to the caller's own fd 1 or 2 under
one lock, so lines of different ranks never mix. ``\\r`` ends a line too: a progress bar's redraws each get the
prefix, and a terminal still shows them in place.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import threading
import time
from multiprocessing.connection import Connection

JOIN_TIMEOUT_S = 2.0  # after the ranks are stopped; only an escaped child still holding a pipe makes it wait this long
CHUNK = 65536
MAX_LINE = 1 << 20  # longer lines are cut (each piece prefixed) rather than held in memory
_LINE_END = re.compile(rb"\r\n|\n|\r")
_WRITE_LOCK = threading.Lock()  # one for every launch in this process: they share fds 1 and 2


class PrefixedOutput:
    """The caller's side of one rank's stdout and stderr: pipes the rank writes into (``ends``, for the rank to
    take over), and threads copying what comes out to the caller's fds 1 and 2, each line prefixed."""

    def __init__(self, rank: int) -> None:
        prefix = f"[rank {rank}] ".encode()
        ends = []
        self._threads = []
        for dest in (1, 2):
            read_fd, write_fd = os.pipe()
            ends.append(Connection(write_fd, readable=False))  # pickled with fd passing, as multiprocessing's pipes
            thread = threading.Thread(
                target=_copy_lines, args=(read_fd, dest, prefix), daemon=True, name=f"qaccel-rank-{rank}-output-{dest}"
            )
            thread.start()
            self._threads.append(thread)
        self.ends: tuple[Connection, Connection] = (ends[0], ends[1])

    def close_ends(self) -> None:
        """Close the caller's copies of the write ends (once the rank has its own): EOF then comes when the rank and
        everything it started are gone."""
        for end in self.ends:
            end.close()


def finish(outputs: list[PrefixedOutput], timeout: float = JOIN_TIMEOUT_S) -> None:
    """Wait until every line the stopped ranks wrote is out; a child that escaped their process groups and still
    holds a pipe delays this by ``timeout`` at most (its later lines still come out, from a daemon thread)."""
    deadline = time.monotonic() + timeout
    for out in outputs:
        out.close_ends()
    for out in outputs:
        for thread in out._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _copy_lines(source: int, dest: int, prefix: bytes) -> None:
    """Copy ``source`` to ``dest`` until EOF, ``prefix`` before each line; a last unfinished line gets a newline."""
    rest = b""
    try:
        while chunk := os.read(source, CHUNK):
            lines, rest = _split(rest + chunk)
            if len(rest) > MAX_LINE:
                lines, rest = lines + [rest + b"\n"], b""
            _write(dest, b"".join(prefix + line for line in lines if line != b"\r"))  # "\r" alone: no text
        if rest:
            _write(dest, prefix + rest + b"\n")
    finally:
        os.close(source)


def _split(data: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines of ``data``, each with its ending, and the unfinished rest."""
    lines, start = [], 0
    for end in _LINE_END.finditer(data):
        lines.append(data[start : end.end()])
        start = end.end()
    return lines, data[start:]


def _write(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd`` under the lock; a closed or broken fd drops it (the rank must never block on it)."""
    view = memoryview(data)
    with _WRITE_LOCK:
        try:
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            pass


def redirect(ends: tuple[Connection, ...]) -> None:
    """In the rank, first thing: make the caller's pipes its fds 1 and 2 (inherited by whatever it starts); the
    rank then makes sys.stdout and sys.stderr line-buffered (whole_lines), so each line leaves it whole and at once."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    for end, fd in zip(ends, (1, 2)):
        os.dup2(end.fileno(), fd)
        end.close()


def flush_std_streams() -> None:
    """Flush sys.stdout and sys.stderr, and the interpreter's own streams where they were replaced (a tee, a
    capture), each once, ignoring a closed or broken one: a process on its way out or about to fork must not fail
    on its output, nor leave any of it unwritten."""
    streams = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    for stream in {id(stream): stream for stream in streams if stream is not None}.values():  # a tee may not hash
        with contextlib.suppress(Exception):
            stream.flush()


def whole_lines() -> None:
    """Line-buffered sys.stdout and sys.stderr in a rank, so each line leaves it in one write: ranks share the
    caller's fds 1 and 2, and lines of different ranks then never mix. Under PYTHONUNBUFFERED (or ``-u``) print
    writes the text and the newline separately, so an unbuffered standard stream gets a line buffer of its own."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or not hasattr(stream, "reconfigure"):
            continue
        stream.flush()
        if isinstance(getattr(stream, "buffer", None), io.RawIOBase) and stream is getattr(sys, f"__{name}__"):
            # sys.__stdout__ keeps the unbuffered stream (and its fd) alive; the new one shares the fd
            setattr(
                sys,
                name,
                open(  # noqa: SIM115 - the new sys stream, open for the process's life
                    stream.fileno(), "w", buffering=1, encoding=stream.encoding, errors=stream.errors, closefd=False
                ),
            )
        else:
            stream.reconfigure(line_buffering=True)
