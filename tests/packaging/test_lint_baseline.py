"""Line length and complexity (tools/lint_baseline.py): new code obeys pyproject.toml's limits, the baseline of older
violations only shrinks, and a fix lowers it in the same commit."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import lint_baseline  # from tools/, on sys.path from the line above


def _branches(n: int) -> str:
    """A function of complexity ``n`` (``n - 1`` ifs)."""
    return "def f(x):\n" + "".join(f"    if x == {i}:\n        return {i}\n" for i in range(n - 1)) + "    return -1\n"


def test_the_code_has_no_violation_beyond_its_baseline_and_the_baseline_none_the_code_lacks() -> None:
    now, baseline = lint_baseline.count(lint_baseline.violations()), lint_baseline.read()
    over, stale = lint_baseline.compare(now, baseline)
    assert not over, "past pyproject.toml's line length or complexity limit (fix the code):\n" + "\n".join(over)
    assert not stale, "the baseline allows more than the code has: python tools/lint_baseline.py --update\n" + "\n".join(stale)


def test_the_limits_are_pyprojects_and_a_violation_beyond_the_baseline_fails(tmp_path: Path) -> None:
    (tmp_path / "fits.py").write_text("X = " + "1" * 156 + "\n" + _branches(15))
    (tmp_path / "past.py").write_text("X = " + "1" * 157 + "\n" + _branches(16))
    now = lint_baseline.count(lint_baseline.violations((".",), root=tmp_path), root=tmp_path)
    assert now == {("past.py", "E501"): 1, ("past.py", "C901"): 1}
    over, stale = lint_baseline.compare(now, {("past.py", "E501"): 1})
    assert over == ["past.py: 1 C901 where the baseline allows 0"] and not stale
    assert lint_baseline.compare(now, dict(now)) == ([], [])


def test_a_fix_must_shrink_the_baseline_and_update_never_raises_it(tmp_path: Path) -> None:
    baseline = {("a.py", "E501"): 3, ("b.py", "C901"): 1}
    now = {("a.py", "E501"): 2, ("c.py", "E501"): 1}
    over, stale = lint_baseline.compare(now, baseline)
    assert over == ["c.py: 1 E501 where the baseline allows 0"]
    assert stale == ["a.py: the baseline allows 3 E501, the code has 2", "b.py: the baseline allows 1 C901, the code has 0"]
    assert lint_baseline.shrunk(now, baseline) == {("a.py", "E501"): 2}
    assert lint_baseline.shrunk(now, baseline, accept_new=True) == now  # a moved file keeps its count under its new name
    lint_baseline.write(lint_baseline.shrunk(now, baseline), tmp_path / "baseline.json")
    assert lint_baseline.read(tmp_path / "baseline.json") == {("a.py", "E501"): 2}
