"""``log_with``: the trackers qaccel writes to, by name (with the module and pip package each needs), or the
user's own tracker objects."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol, TypeGuard, cast

from qaccel.options.kinds import TrackingTool

# what log_with="all" takes, those installed (Accelerate's "all")
ALL_TRACKERS = (TrackingTool.TENSORBOARD, TrackingTool.WANDB, TrackingTool.MLFLOW)


def log_with(value: object, logging_dir: str | None) -> tuple[Any, ...]:
    """log_with as a tuple of tracker names and tracker objects: a name, an enum member whose value is one
    (Accelerate's LoggerType), a tracker object, or a list of them; "all" is the installed ones of ALL_TRACKERS."""
    if value is None:
        return ()
    chosen: list[Any] = []
    allowed = ", ".join(repr(name) for name in (*(t.value for t in ALL_TRACKERS), TrackingTool.CSV.value, "all"))
    items = list(cast("Sequence[object]", value)) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if _is_tracker_object(item):
            if getattr(item, "requires_logging_directory", False) and logging_dir is None:
                raise ValueError(
                    f"log_with's tracker {item.name!r} requires a logging directory: give project_dir=..., "
                    "logging_dir=... or project_config=ProjectConfiguration(project_dir=...)"
                )
            chosen.append(item)
            continue
        raw = item.value if isinstance(item, enum.Enum) else item
        name = raw.lower() if isinstance(raw, str) else raw
        if name not in (*TrackingTool, "all"):
            raise ValueError(
                f"log_with must be one of {allowed}, a tracker object with Accelerate's GeneralTracker "
                f"methods, or a list of them; got {item!r}"
            )
        for one in [t.value for t in ALL_TRACKERS if t.installed] if name == "all" else [name]:
            if one not in chosen:
                chosen.append(one)
    for name in chosen:
        if not isinstance(name, str):
            continue
        tool = TrackingTool(name)
        package = tool.package
        if not tool.installed:
            raise ImportError(
                f"log_with={name!r} needs the {package} package: pip install {package} (from qaccel's "
                f"checkout: pip install -e '.[{name}]')"
            )
        if tool.writes_folder and logging_dir is None:
            raise ValueError(
                f"log_with={name!r} writes into <logging_dir>/<project_name>: give project_dir=..., "
                "logging_dir=... or project_config=ProjectConfiguration(project_dir=..., logging_dir=...)"
            )
    return tuple(chosen)


class TrackerObject(Protocol):
    """What log_with takes as a user's tracker: Accelerate's GeneralTracker's name, log() and finish()."""

    name: str

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None: ...

    def finish(self) -> None: ...


def _is_tracker_object(item: object) -> TypeGuard[TrackerObject]:
    """A tracker of the user's own, as Accelerate's GeneralTracker: a name, log() and finish()."""
    return (
        not isinstance(item, (str, enum.Enum))
        and isinstance(getattr(item, "name", None), str)
        and callable(getattr(item, "log", None))
        and callable(getattr(item, "finish", None))
    )
