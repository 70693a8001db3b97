"""MkDocs hook: the Options page's table is generated from the code, so it cannot drift from what qaccel accepts.

Registered in mkdocs.yml (``hooks:``). A page's line ``<!-- options-table -->`` is replaced with the markdown table
``qaccel.options.option_table()`` returns (the call with every default, and a table of option | default |
values | what it does). If qaccel cannot give the table, the
build fails: an ImportError, not a page without its table.
"""

from __future__ import annotations

MARKER = "<!-- options-table -->"

_filled: list[str] = []


def on_pre_build(config, **kwargs):
    _filled.clear()


def on_page_markdown(markdown, page, config, files, **kwargs):
    if MARKER not in markdown:
        return markdown
    from qaccel.options import option_table  # ImportError until qaccel provides it: the build must fail

    _filled.append(page.file.src_uri)
    return "\n".join(option_table().strip() + "\n" if line.strip() == MARKER else line for line in markdown.split("\n"))


def on_post_build(config, **kwargs):
    if not _filled:
        from mkdocs.exceptions import PluginError

        raise PluginError(f"docs/hooks.py: no page holds the line {MARKER}, so the option table is on no page")
