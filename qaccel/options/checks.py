"""The checks every option group shares: a count, a flag, a choice from a closed set, seconds, a folder. Each
raises naming the option and what it takes."""

from __future__ import annotations

import datetime
import enum
import os
from collections.abc import Sequence
from typing import Any


def choice(name: str, value: object, allowed: type[enum.StrEnum], members: Sequence[enum.StrEnum] | None = None) -> Any:
    """``value`` as a member of ``allowed`` (of ``members``, when only some are available here)."""
    members = tuple(allowed) if members is None else tuple(members)
    if not isinstance(value, str) or value not in members:
        raise ValueError(f"{name} must be one of {', '.join(repr(m.value) for m in members)}; got {value!r}")
    return allowed(value)


def count(name: str, value: object, least: int, meaning: str = "") -> int:
    """``value``, an int (not a bool) of at least ``least``; else ValueError naming ``name`` and, when given, what it
    counts (``meaning``). Every layer checks its counts with this one rule."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        kind = {0: "a non-negative int", 1: "a positive int"}.get(least, f"an int >= {least}")
        raise ValueError(f"{name} must be {kind}{f' ({meaning})' if meaning else ''}; got {value!r}")
    return value


def folder(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"{name} must be a folder (a str or path) or None; got {value!r}")
    return os.path.abspath(os.fspath(value))  # ranks may start elsewhere (torchrun --chdir, a SLURM job)


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return value


def seconds(timeout: object) -> float:
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta; got {timeout!r}")
    return float(timeout)
