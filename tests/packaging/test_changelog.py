"""CHANGELOG.md keeps Keep a Changelog's shape: ``## [Unreleased]`` first, then one ``## [x.y.z] - YYYY-MM-DD`` per
release, newest first, each heading once; under each, Added, Changed, Deprecated, Removed, Fixed and Security at most
once and in that order, so a new entry goes under the one heading of its kind."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
RELEASE = re.compile(r"^\[(?P<version>\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$")


def releases(text: str) -> list[tuple[str, list[str]]]:
    """Each ``## `` heading's title with the ``### `` headings under it, in the file's order."""
    found: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("## "):
            found.append((line[3:].strip(), []))
        elif line.startswith("### "):
            assert found, f"{line!r} comes before any release heading"
            found[-1][1].append(line[4:].strip())
    return found


def problems(text: str) -> list[str]:
    """What breaks the shape, one line each; empty for a well-kept changelog."""
    found = releases(text)
    said = []
    titles = [title for title, _ in found]
    if not titles or titles[0] != "[Unreleased]":
        said.append("the first release heading is not ## [Unreleased]")
    said += [f"## {title} appears {titles.count(title)} times" for title in sorted(set(titles)) if titles.count(title) > 1]
    versions = []
    for title, kinds in found:
        match = RELEASE.match(title)
        if title != "[Unreleased]" and not match:
            said.append(f"## {title} is neither [Unreleased] nor [x.y.z] - YYYY-MM-DD")
        if match:
            versions.append(tuple(int(part) for part in match["version"].split(".")))
        said += [f"### {kind} under ## {title} is not one of {', '.join(KINDS)}" for kind in kinds if kind not in KINDS]
        said += [f"### {kind} appears {kinds.count(kind)} times under ## {title}" for kind in sorted(set(kinds)) if kinds.count(kind) > 1]
        known = [kind for kind in kinds if kind in KINDS]
        if known != sorted(set(known), key=KINDS.index):
            said.append(f"the headings under ## {title} are not in the order {', '.join(KINDS)}: {', '.join(kinds)}")
    if versions != sorted(versions, reverse=True):
        said.append("the releases are not newest first")
    return said


def test_the_changelog_has_each_release_once_and_each_kind_of_change_once_per_release() -> None:
    assert problems((REPO / "CHANGELOG.md").read_text(encoding="utf-8")) == []


def test_the_packages_version_has_its_release_heading() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    titles = [title for title, _ in releases((REPO / "CHANGELOG.md").read_text(encoding="utf-8"))]
    assert any(title.startswith(f"[{version}] - ") for title in titles), f"no ## [{version}] - DATE heading for pyproject.toml's version"


def test_repeated_and_misplaced_headings_are_named() -> None:
    text = ("# Changelog\n\n## [Unreleased]\n\n### Changed\n- a\n\n### Added\n- b\n\n### Changed\n- c\n\n### Notes\n\n"
            "## [0.1.0] - 2026-01-02\n\n## [0.2.0] - 2026-02-03\n\n## [0.1.0] - 2026-01-02\n")
    assert problems(text) == [
        "## [0.1.0] - 2026-01-02 appears 2 times",
        "### Notes under ## [Unreleased] is not one of Added, Changed, Deprecated, Removed, Fixed, Security",
        "### Changed appears 2 times under ## [Unreleased]",
        "the headings under ## [Unreleased] are not in the order Added, Changed, Deprecated, Removed, Fixed, Security: Changed, Added, Changed, Notes",
        "the releases are not newest first",
    ]
    assert problems("## [0.1.0] - 2026-01-02\n### Added\n") == ["the first release heading is not ## [Unreleased]"]
