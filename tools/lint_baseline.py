"""Line length (E501) and complexity (C901) held to a baseline that only shrinks.

pyproject.toml sets the limits (``[tool.ruff] line-length``, ``[tool.ruff.lint.mccabe] max-complexity``); the lines and
functions past them when the limits came in are counted per file and rule in ``tools/lint_baseline.json``. New code
obeys the limits: a file with more violations of a rule than its count fails. A fix shrinks the baseline in the same
commit: a count above what the code has fails too, until ``--update`` writes the lower one.

``python tools/lint_baseline.py``            check (``make lint`` and tests/packaging/test_lint_baseline.py run it)
``python tools/lint_baseline.py --update``   lower the counts to what the code has; never raises one
``python tools/lint_baseline.py --update --accept-new``   also record violations beyond the baseline (a file moved
                                              to a new path keeps its count under the new name; anything else is fixed)

Only the standard library and ruff (``python -m ruff``, from the dev extra).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / "tools" / "lint_baseline.json"
RULES = ("C901", "E501")
#: What ``make lint`` checks with ruff.
PATHS = ("tinkergym", "tests", "benchmarks", "examples", "env_packages", "tools")

#: (file relative to the repository, rule) -> how many violations.
Counts = dict[tuple[str, str], int]


def violations(paths: tuple[str, ...] = PATHS, root: Path = REPO) -> list[dict]:
    """ruff's JSON findings for ``RULES`` in ``paths`` (relative to ``root``), with pyproject.toml's limits."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--exit-zero", "--output-format", "json", "--select", ",".join(RULES),
         "--config", str(REPO / "pyproject.toml"), *paths],
        cwd=root, capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"ruff failed ({done.returncode}): {done.stderr.strip()}")
    return json.loads(done.stdout)


def count(found: list[dict], root: Path = REPO) -> Counts:
    """The findings counted per file (as a path relative to ``root``, with forward slashes) and rule."""
    return dict(Counter((Path(item["filename"]).resolve().relative_to(root.resolve()).as_posix(), item["code"]) for item in found))


def read(path: Path = BASELINE) -> Counts:
    """The baseline: ``{"file": {"RULE": count}}`` in the JSON file."""
    return {(file, rule): n for file, rules in json.loads(path.read_text(encoding="utf-8")).items() for rule, n in rules.items()}


def write(counts: Counts, path: Path = BASELINE) -> None:
    nested: dict[str, dict[str, int]] = {}
    for (file, rule), n in sorted(counts.items()):
        if n > 0:
            nested.setdefault(file, {})[rule] = n
    lines = [f"  {json.dumps(file)}: {json.dumps(rules, sort_keys=True)}" for file, rules in sorted(nested.items())]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")  # a file a line: a fix is a one-line diff


def compare(now: Counts, baseline: Counts) -> tuple[list[str], list[str]]:
    """(over, stale): each file and rule with more violations than its baseline count, and each whose count is above
    what the code has, as lines that say so."""
    over = [f"{file}: {now[file, rule]} {rule} where the baseline allows {baseline.get((file, rule), 0)}"
            for file, rule in sorted(now) if now[file, rule] > baseline.get((file, rule), 0)]
    stale = [f"{file}: the baseline allows {n} {rule}, the code has {now.get((file, rule), 0)}"
             for (file, rule), n in sorted(baseline.items()) if n > now.get((file, rule), 0)]
    return over, stale


def shrunk(now: Counts, baseline: Counts, accept_new: bool = False) -> Counts:
    """The baseline lowered to ``now``; counts above the baseline are recorded only with ``accept_new``."""
    if accept_new:
        return dict(now)
    return {key: min(n, now.get(key, 0)) for key, n in baseline.items() if now.get(key, 0) > 0}


def _locations(found: list[dict], keys: set[tuple[str, str]], root: Path = REPO) -> list[str]:
    lines = []
    for item in found:
        file = Path(item["filename"]).resolve().relative_to(root.resolve()).as_posix()
        if (file, item["code"]) in keys:
            lines.append(f"  {file}:{item['location']['row']}: {item['code']} {item['message']}")
    return sorted(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="lower the baseline's counts to what the code has")
    parser.add_argument("--accept-new", action="store_true", help="with --update: also record violations beyond the baseline")
    args = parser.parse_args(argv)
    found = violations()
    now, baseline = count(found), read()
    over, stale = compare(now, baseline)
    if args.update:
        kept = shrunk(now, baseline, accept_new=args.accept_new)
        write(kept)
        print(f"{BASELINE.relative_to(REPO)}: {sum(kept.values())} violations of {', '.join(RULES)}")
        if over and not args.accept_new:
            print("beyond the baseline, not recorded (fix them; a moved file: --update --accept-new):\n" + "\n".join(over), file=sys.stderr)
            return 1
        return 0
    if over:
        keys = {(file, rule) for file, rule in now if now[file, rule] > baseline.get((file, rule), 0)}
        print("new code past the line length or complexity limit (pyproject.toml [tool.ruff]); fix it:\n" + "\n".join(over), file=sys.stderr)
        print("\n".join(_locations(found, keys)), file=sys.stderr)
    if stale:
        print("the baseline allows more than the code has; shrink it with python tools/lint_baseline.py --update:\n" + "\n".join(stale),
              file=sys.stderr)
    return 1 if over or stale else 0


if __name__ == "__main__":
    sys.exit(main())
