"""The options' documentation, generated from their declaration: the Accelerator's ``Args:`` and the docs' table."""

from __future__ import annotations

import textwrap
from typing import TypeVar

from qaccel.options.declared import OPTIONS

C = TypeVar("C")


def document(cls: type[C]) -> type[C]:
    """Append the options' ``Args:`` section to ``cls``'s docstring, from the one declaration."""
    lines = ["", "    Args:"]
    for option in OPTIONS:
        text = f"{option.name}: {option.meaning.replace('`', '``')}."
        lines += textwrap.wrap(text, 116, initial_indent=" " * 8, subsequent_indent=" " * 12)
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + "\n".join(lines) + "\n"
    return cls


def option_table() -> str:
    """The options for the docs, in Markdown: the call with every default written out, then a table."""
    positional = sum(not o.keyword_only for o in OPTIONS)
    arguments = ", ".join(f"{o.name}={o.default!r}" for o in OPTIONS)
    call = textwrap.fill(f"acc = Accelerator({arguments})", 112, subsequent_indent=" " * 18, break_on_hyphens=False)
    rows = [
        "```python",
        call,
        "```",
        "",
        f"The first {positional} may be given by position; the others are keyword-only.",
        "",
        "| option | default | values | what it does |",
        "| --- | --- | --- | --- |",
    ]
    for option in OPTIONS:
        rows.append(f"| `{option.name}` | `{option.default!r}` | {option.values} | {option.meaning} |")
    return "\n".join(rows) + "\n"
