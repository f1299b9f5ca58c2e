"""The test lanes' grouping holds under pytest-xdist: tests that share a module-scoped fixture, and tests of one named
``xdist_group`` (the Ray tests' local cluster), run in one test process; other tests spread over the processes.

Run as `make test` runs a lane (``-n 2 --dist loadgroup``) on generated test modules, with the hook of
``tests/conftest.py``. A pytest or pytest-xdist release that drops the groups (pytest 9.2 with pytest-xdist 3.8 ran
every test where it fell, and built every module fixture once per process) fails here, not as a slower CI.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("xdist")

CONFTEST = f'''
import importlib.util, sys
import pytest

spec = importlib.util.spec_from_file_location("testkit", {str(Path(__file__).resolve().parents[1] / "testkit.py")!r})
testkit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(testkit)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    testkit.group_by_module_fixtures(items)
'''

MODULES = {
    "test_fixture.py": """
        import pytest

        @pytest.fixture(scope="module")
        def server():
            return object()

        @pytest.mark.parametrize("i", range(4))
        def test_uses_it(server, i):
            pass

        def test_does_not(i=0):
            pass
    """,
    "test_named_a.py": """
        import pytest

        @pytest.mark.xdist_group("cluster")
        @pytest.mark.parametrize("i", range(3))
        def test_a(i):
            pass
    """,
    "test_named_b.py": """
        import pytest

        @pytest.mark.xdist_group("cluster")
        @pytest.mark.parametrize("i", range(3))
        def test_b(i):
            pass
    """,
    "test_free.py": """
        import pytest

        @pytest.mark.parametrize("i", range(8))
        def test_free(i):
            pass
    """,
}


def test_module_fixtures_and_named_groups_keep_their_tests_in_one_process(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name, body in MODULES.items():
        (tmp_path / name).write_text(textwrap.dedent(body))
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider",
                           "--import-mode=importlib", "-o", "addopts=", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = re.findall(r"\[(gw\d)\] \[\s*\d+%\] PASSED (\S+)", done.stdout)
    assert len(ran) == 19, done.stdout[-3000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for worker, nodeid in ran:
        workers[nodeid.split("@")[1] if "@" in nodeid else nodeid.split("::")[1].split("[")[0]].add(worker)
    assert sum(1 for _, nodeid in ran if nodeid.endswith("@test_fixture")) == 4  # the module fixture's users, grouped by module
    assert sum(1 for _, nodeid in ran if nodeid.endswith("@cluster")) == 6  # a named group across two modules
    assert len(workers["test_fixture"]) == 1 and len(workers["cluster"]) == 1
    assert not any("@" in nodeid for _, nodeid in ran if "test_free" in nodeid or "test_does_not" in nodeid)
    assert {worker for worker, _ in ran} == {"gw0", "gw1"}  # the rest spread over both processes
