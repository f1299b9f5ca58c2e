"""The command-line reference as click prints it (a MkDocs hook, see mkdocs.yml).

mkdocs-click writes the reference of the ``::: mkdocs-click`` directive (docs/reference/cli.md) from the click tree. Two
things of click's help do not come through it as they read in a terminal, and a Markdown step after it (on that page
only) puts them right:

- a ``\\b`` paragraph (click prints its lines as written: the commands' ``Examples:``) reaches Markdown as indented
  lines that would be joined into one; each becomes a code block under its heading line;
- an option without a default shows click's ``Sentinel.UNSET`` (click 8.3 and later), and an empty default an empty
  code span; both read ``None`` as mkdocs-click shows a default of None.
"""

from __future__ import annotations

import re
from typing import Any

from markdown import Extension, Markdown
from markdown.preprocessors import Preprocessor

#: The page holds the click reference: set by :func:`on_page_markdown` for the page about to be rendered.
_state = {"cli_page": False}
#: After mkdocs-click's own preprocessor (priority 141), before anything reads the blocks.
PRIORITY = 140
NO_DEFAULT = re.compile(r"\| (`Sentinel\.UNSET`|``) \|$")


def help_lines(lines: list[str]) -> list[str]:
    """``lines`` with each run of indented lines under a ``...:`` line (a ``\\b`` paragraph of click's help) made a code
    block, and the tables' missing defaults shown as ``None``."""
    out: list[str] = []
    i, fenced = 0, False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.rstrip().endswith(":") and not line.startswith((" ", "|", "#")) and i + 1 < len(lines) and lines[i + 1].startswith("  ") \
                and lines[i + 1].strip():
            j = i + 1
            while j < len(lines) and lines[j].startswith("  ") and lines[j].strip():
                j += 1
            out += [line, "", "```text", *(text[2:] for text in lines[i + 1:j]), "```", ""]
            i = j
            continue
        out.append(NO_DEFAULT.sub("| None |", line) if not fenced and line.startswith("| `") else line)
        i += 1
    return out


class _HelpAsPrinted(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        return help_lines(lines) if _state["cli_page"] else lines


class HelpAsPrinted(Extension):
    """The Markdown extension of :func:`help_lines`, active on the page that holds the click reference."""

    def extendMarkdown(self, md: Markdown) -> None:  # noqa: N802 - Python-Markdown's name
        md.preprocessors.register(_HelpAsPrinted(md), "tinkergym_cli_help", PRIORITY)


def on_config(config: Any) -> Any:
    config.markdown_extensions.append(HelpAsPrinted())
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    _state["cli_page"] = "::: mkdocs-click" in markdown
    return markdown
