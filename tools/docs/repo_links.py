"""Links from a page to a file of the repository outside docs/ (a MkDocs hook, see mkdocs.yml).

A page may link a source file as the repository shows it, relative to the page: ``[rows.py](../../tinkergym/results/rows.py)``
from ``docs/results/README.md``. Such a link works in the repository (on a code host, in an editor) and, with this hook,
on the site too: the file is copied into the site under ``source/`` (as the file it is: a Markdown file is not made a
page) and the link points there. A link to a file that does not exist, or to a folder, is left as it is, and the strict
build fails on it, naming the page and the link.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File

#: Where the repository's files that pages link are served in the site.
SITE_FOLDER = "source"
#: An inline Markdown link or image, ``[text](target "title")``, or a reference definition, ``[name]: target``.
LINK = re.compile(r"(?P<head>\]\(\s*<?|^\s{0,3}\[[^\]]+\]:\s*<?)(?P<target>[^\s)>#]+)(?P<anchor>#[^\s)>]*)?", re.MULTILINE)
FENCE = re.compile(r"^\s*(```|~~~)")


class RepoFile(File):
    """A file of the repository outside docs/, copied into the site as it is (never rendered as a page)."""

    def is_documentation_page(self) -> bool:
        return False

    def is_static_page(self) -> bool:
        return False


def _outside_targets(markdown: str, page_uri: str, docs: Path, root: Path) -> dict[str, str]:
    """The links of ``markdown`` (the page ``page_uri``) that leave ``docs`` for an existing file under ``root``:
    each target as written -> the file's path in the repository."""
    found: dict[str, str] = {}
    fenced = False
    for line in markdown.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        if fenced:
            continue
        for match in LINK.finditer(line):
            target = match.group("target")
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("/"):
                continue  # a URL, or a path from the site's root
            path = (docs / posixpath.dirname(page_uri) / target).resolve()
            if path.is_relative_to(docs) or not path.is_relative_to(root) or not path.is_file():
                continue
            found[target] = path.relative_to(root).as_posix()
    return found


def _folders(config: Any) -> tuple[Path, Path]:
    docs = Path(config.docs_dir).resolve()
    return docs, Path(config.config_file_path).resolve().parent


def on_files(files: Any, config: Any) -> Any:
    """Add to the site every repository file that a page links."""
    docs, root = _folders(config)
    wanted: set[str] = set()
    for file in files.documentation_pages():
        if file.abs_src_path:
            wanted |= set(_outside_targets(Path(file.abs_src_path).read_text(encoding="utf-8"), file.src_uri, docs, root).values())
    for path in sorted(wanted):
        files.append(RepoFile.generated(config, f"{SITE_FOLDER}/{path}", abs_src_path=str(root / path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Point each link to a repository file at its copy in the site."""
    docs, root = _folders(config)
    targets = _outside_targets(markdown, page.file.src_uri, docs, root)
    if not targets:
        return markdown
    here = posixpath.dirname(page.file.src_uri) or "."

    def point(match: re.Match[str]) -> str:
        target = match.group("target")
        if target not in targets:
            return match.group(0)
        copy = posixpath.relpath(f"{SITE_FOLDER}/{targets[target]}", here)
        return match.group("head") + copy + (match.group("anchor") or "")

    out, fenced = [], False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        out.append(line if fenced else LINK.sub(point, line))
    return "".join(out)
