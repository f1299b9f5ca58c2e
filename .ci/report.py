"""The end of a CI run: the time of each lane and the slowest tests of all lanes.

``python .ci/report.py FOLDER``: ``FOLDER/lanes.tsv`` holds a line per lane (name, seconds, exit status), written by
the Makefile's lanes as each ends, and a last line ``total`` for the whole run (lanes may run side by side);
``FOLDER/*.xml`` the JUnit reports of the pytest lanes (one per lane, named after it). Only the standard library: it
runs with any Python, before or after an install.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SLOWEST = 30
#: The line of lanes.tsv that holds the whole run's time (lanes may run side by side, so their sum is not it).
TOTAL = "total"


def lanes(folder: Path) -> list[tuple[str, float, int]]:
    """(lane, seconds, exit status) in the order the lanes ran."""
    path = folder / "lanes.tsv"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        name, seconds, status = line.split("\t")
        rows.append((name, float(seconds), int(status)))
    return rows


def test_times(folder: Path) -> list[tuple[float, str, str]]:
    """(seconds, lane, test id) of every test case in the lanes' JUnit reports (setup, call and teardown together)."""
    found = []
    for report in sorted(folder.glob("*.xml")):
        for case in ET.parse(report).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            found.append((float(case.get("time") or 0.0), report.stem, name))
    return sorted(found, reverse=True)


def main(folder: Path) -> None:
    ran = lanes(folder)
    total = [seconds for name, seconds, _ in ran if name == TOTAL]
    ran = [row for row in ran if row[0] != TOTAL]
    whole = f"{total[-1]:.0f} s from start to end" if total else f"{sum(s for _, s, _ in ran):.0f} s in all"
    print(f"\n==== lanes ({whole}) ====")
    for name, seconds, status in ran:
        print(f"{seconds:8.0f} s  {name}{'' if status == 0 else f'  (exit {status})'}")
    times = test_times(folder)
    print(f"\n==== the {min(SLOWEST, len(times))} slowest tests of {len(times)} (setup, call and teardown) ====")
    for seconds, lane, name in times[:SLOWEST]:
        print(f"{seconds:8.1f} s  [{lane}] {name}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".ci-reports"))
