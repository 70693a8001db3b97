"""The Options page's table is generated from the code, so it cannot drift from what qaccel accepts.

``docs/options.md`` holds the table itself, between the lines ``<!-- options-table -->`` and
``<!-- end options-table -->``, so that the page reads whole where Markdown is shown as it is (GitHub). It is what
``qaccel.options.option_table()`` returns (the call with every default, and a table of option | default | values |
what it does); ``tests/test_docs.py`` fails when the two differ. To write it again after changing an option:

    python docs/hooks.py

As an MkDocs hook (registered in mkdocs.yml, ``hooks:``) it writes the table afresh between the two lines of the
page being built and leaves the lines out of the page. If qaccel cannot give the table, or no page holds the two
lines, the build fails: an ImportError or a PluginError, not a page without its table.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MARKER = "<!-- options-table -->"
END_MARKER = "<!-- end options-table -->"
PAGE = Path(__file__).resolve().parent / "options.md"
# the marker's line, the table, the end marker's line
REGION = re.compile(
    rf"^{re.escape(MARKER)}[ \t]*\n(?P<table>.*?)^{re.escape(END_MARKER)}[ \t]*$", re.DOTALL | re.MULTILINE
)
MARKER_LINE = re.compile(rf"^{re.escape(MARKER)}[ \t]*$", re.MULTILINE)  # a page that names it in its text is no match

_filled: list[str] = []


def table(markdown: str) -> str | None:
    """The table a page holds between the two marker lines; None if it has no such pair."""
    match = REGION.search(markdown)
    return None if match is None else match.group("table")


def with_table(markdown: str, new_table: str, keep_markers: bool = True) -> str:
    """``markdown`` with ``new_table`` between its marker lines (``keep_markers=False``: in their place)."""
    if REGION.search(markdown) is None:
        raise ValueError(f"no line {MARKER} followed by a line {END_MARKER}")
    body = new_table.strip() + "\n"
    filled = f"{MARKER}\n{body}{END_MARKER}" if keep_markers else body.rstrip("\n")
    return REGION.sub(lambda _: filled, markdown, count=1)


def on_pre_build(config, **kwargs):
    _filled.clear()


def on_page_markdown(markdown, page, config, files, **kwargs):
    if MARKER_LINE.search(markdown) is None:
        return markdown
    from mkdocs.exceptions import PluginError

    from qaccel.options import option_table  # ImportError until qaccel provides it: the build must fail

    try:
        markdown = with_table(markdown, option_table(), keep_markers=False)
    except ValueError as e:
        raise PluginError(f"docs/hooks.py: {page.file.src_uri}: {e}") from None
    _filled.append(page.file.src_uri)
    return markdown


def on_post_build(config, **kwargs):
    if not _filled:
        from mkdocs.exceptions import PluginError

        raise PluginError(
            f"docs/hooks.py: no page holds the lines {MARKER} ... {END_MARKER}, so the option table is on no page"
        )


def main() -> None:
    """Write the table of this checkout's qaccel into docs/options.md."""
    sys.path.insert(0, str(PAGE.parent.parent))  # this checkout's qaccel, whichever one is installed
    from qaccel.options import option_table

    text = PAGE.read_text()
    new = with_table(text, option_table())
    if new == text:
        print(f"{PAGE}: the option table is up to date")
    else:
        PAGE.write_text(new)
        print(f"{PAGE}: option table written")


if __name__ == "__main__":
    main()
