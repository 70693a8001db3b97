"""The training curves as a PNG: the losses in one panel, the other metrics in a second.

matplotlib is optional (``pip install matplotlib``). The figure is drawn on matplotlib's non-interactive Agg
canvas directly, without pyplot: the user's backend choice and pyplot's list of open figures are left alone, and
nothing needs closing.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from qaccel.storage import write_bytes

_PREFIXES = ("train_", "val_", "test_")


def curves(history: list[dict[str, float]], path: Path) -> Path | None:
    """A PNG at ``path`` (written atomically) of every metric of ``history`` against its rows' "step": the keys
    ending in ``loss`` in the first panel, the others in a second one if there are any. A metric's train_, val_ and
    test_ curves share a colour, told apart by their line style; a value missing from a row (validation on some
    steps only) is skipped. None, and nothing written, without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None

    names: dict[str, None] = {}  # every metric, in order of first appearance
    for row in history:
        names.update((name, None) for name in row if name != "step" and _number(row[name]) is not None)
    losses = [name for name in names if name.endswith("loss")]
    panels = [panel for panel in (losses, [name for name in names if name not in losses]) if panel] or [[]]

    figure = Figure(figsize=(8, 3.2 * len(panels)), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    colours: dict[str, Any] = {}
    for ax, panel in zip(axes, panels):
        for name in panel:
            points = [(row.get("step", index), _number(row.get(name))) for index, row in enumerate(history)]
            steps, values = zip(*[(step, value) for step, value in points if value is not None])
            base = _base(name)
            colour = colours.setdefault(base, f"C{len(colours) % 10}")
            ax.plot(
                steps,
                values,
                label=name,
                color=colour,
                linestyle=_style(name),
                marker="o" if len(steps) <= 30 else None,
                markersize=3,
            )
        values = [_number(row.get(name)) for name in panel for row in history]
        finite = [v for v in values if v is not None and math.isfinite(v)]
        if panel is losses and finite and min(finite) > 0 and max(finite) / min(finite) > 100:
            ax.set_yscale("log")  # a loss falling by orders of magnitude
        ax.set_ylabel("loss" if panel is losses else "metric")
        ax.grid(alpha=0.3)
        if panel:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no metrics", ha="center", va="center", transform=ax.transAxes)
    axes[-1].set_xlabel("step")

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(buffer.getvalue(), path, durable=False)
    return path


def _number(value: Any) -> float | None:
    """``value`` as a float (a NaN leaves a gap in its curve), or None when it is missing or not a number."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _base(name: str) -> str:
    return next((name[len(p) :] for p in _PREFIXES if name.startswith(p)), name)


def _style(name: str) -> str:
    return {"val_": "--", "test_": ":"}.get(next((p for p in _PREFIXES if name.startswith(p)), ""), "-")
