"""Progress over a loop, shown once: rank 0 draws a bar, the other ranks iterate silently (N bars on one terminal
are unreadable).

The bar is tqdm's when tqdm is installed (``pip install tqdm``; the ``progress`` extra); without it, a plain status line
on stderr every STATUS_INTERVAL_S seconds and at the end, so a log file gets a few lines, not a redraw per batch.
Either way the wrapper only iterates the loader the normal way, so a prepared loader's epoch marks (the last batch
syncs gradients) and its stop points are untouched.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, Self, TypeVar

from qaccel.comm.session import RankContext
from qaccel.train.data import PreparedDataLoader

T = TypeVar("T")
STATUS_INTERVAL_S = 10.0


def progress(
    iterable: Iterable[T], ctx: RankContext, desc: str | None = None, total: int | None = None, **options: Any
) -> Iterable[T]:
    """``iterable`` with a progress bar on rank 0 (``options`` go to tqdm); other ranks get it silently, and never
    import tqdm. A prepared loader about to skip batches (a resumed epoch) starts its bar at the skipped count."""
    if total is None:
        total = _length(iterable)
    if isinstance(iterable, PreparedDataLoader) and iterable.batches_to_skip and "initial" not in options:
        options["initial"] = iterable.batches_to_skip
    if ctx.rank != 0:
        return StatusLine(iterable, desc, total, show=False)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return StatusLine(iterable, desc, total, **options)
    return tqdm(iterable, desc=desc, total=total, **options)


def _length(iterable: Iterable[Any]) -> int | None:
    try:
        return len(iterable)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):  # no len (a generator, a stream's loader)
        return None


class StatusLine:
    """The fallback bar: iterates ``iterable`` and, when shown, writes ``desc: 30/100 (30%), 12.3 it/s, 2.4 s`` to
    stderr at most every STATUS_INTERVAL_S seconds and once at the end (also after a ``break``).

    It has the tqdm methods loops call (``set_postfix``, ``set_description``, ``update``, ``close``), so the same
    loop runs with tqdm, without it, and on the silent ranks. Of tqdm's options it honours ``initial``, ``unit``,
    ``disable`` and ``file``, and ignores the others.
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        desc: str | None = None,
        total: int | None = None,
        show: bool = True,
        *,
        initial: int = 0,
        unit: str = "it",
        disable: bool | None = False,
        file: Any = None,
        **ignored: Any,
    ) -> None:
        self.iterable = iterable
        self.desc = desc
        self.total = total
        self.n = initial
        self.unit = unit
        self.postfix = ""
        self._show = show and not disable
        self._file = file
        self._initial = initial
        self._start = self._last = time.monotonic()
        self._printed_n: int | None = None
        self._closed = False

    def __len__(self) -> int:
        return self.total if self.total is not None else len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        try:
            for item in self.iterable:
                yield item
                self.update()
        finally:
            self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._show and time.monotonic() - self._last >= STATUS_INTERVAL_S:
            self._write()

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: Any) -> None:
        values = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._show and self._printed_n != self.n:
                self._write()

    def _write(self) -> None:
        now = time.monotonic()
        elapsed = now - self._start
        done = f"{self.n}/{self.total} ({100 * self.n // self.total}%)" if self.total else f"{self.n} {self.unit}"
        rate = (self.n - self._initial) / elapsed if elapsed > 0 else 0.0
        line = f"{done}, {rate:.1f} {self.unit}/s, {elapsed:.1f} s" + (f", {self.postfix}" if self.postfix else "")
        file = self._file if self._file is not None else sys.stderr
        file.write(f"{self.desc}: {line}\n" if self.desc else f"{line}\n")
        file.flush()
        self._last, self._printed_n = now, self.n
