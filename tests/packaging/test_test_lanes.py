"""The test lanes' plumbing under pytest-xdist, run as `make test` runs a lane (``-n 2 --dist loadgroup``) on generated
test folders with the hooks of ``tests/conftest.py`` and ``testkit``:

- tests that share a module-scoped fixture, and tests of one named ``xdist_group`` (the Ray tests' local cluster), run
  in one test process; other tests spread over the processes. A pytest or pytest-xdist release that drops the groups
  (pytest 9.2 with pytest-xdist 3.8 ran every test where it fell, and built every module fixture once per process)
  fails here, not as a slower CI;
- a folder whose requirements do not import reports its modules skipped with the reason, and the requirements are
  imported by the test processes only, never by the controlling one (torch there cost every lane 5-30 s at its start);
- the GPU, GPU-on-CPU and vLLM lanes select their tests by marker (``-m gpu``, ``-m gpu_on_cpu``, ``-m vllm``) from the
  folders and modules that apply it (``make print-gpu-tests``), never from a list of files, and those paths hold every
  test the whole suite marks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("xdist")

LOAD_TESTKIT = f'''
import importlib.util, sys
import pytest

if "testkit" not in sys.modules:
    spec = importlib.util.spec_from_file_location("testkit", {str(Path(__file__).resolve().parents[1] / "testkit.py")!r})
    sys.modules["testkit"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["testkit"])
testkit = sys.modules["testkit"]
'''

CONFTEST = LOAD_TESTKIT + '''


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


def run_lane(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "--import-mode=importlib",
                           "-o", "addopts=", *args, str(folder)], capture_output=True, text=True, cwd=folder, timeout=120)


def test_module_fixtures_and_named_groups_keep_their_tests_in_one_process(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name, body in MODULES.items():
        (tmp_path / name).write_text(textwrap.dedent(body))
    done = run_lane(tmp_path, "-v")
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


#: A module that records which process imported it (a pytest-xdist test process names itself in PYTEST_XDIST_WORKER).
RECORDER = """
import os
with open(os.environ["IMPORTED_BY"], "a") as said:
    said.write(os.environ.get("PYTEST_XDIST_WORKER", "controller") + "\\n")
"""


def test_a_folder_without_its_requirements_is_skipped_and_only_test_processes_import_them(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "heavy_requirement.py").write_text(RECORDER)
    for folder, requires in (("has", '"heavy_requirement"'), ("lacks", '"heavy_requirement", "no_such_module_here"')):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "conftest.py").write_text(LOAD_TESTKIT + f"pytest_pycollect_makemodule = testkit.folder_requires({requires})\n")
        (tmp_path / folder / f"test_{folder}.py").write_text("import heavy_requirement\n" + ("import no_such_module_here\n" if folder == "lacks" else "")
                                                             + "\ndef test_it():\n    pass\n")
    imported_by = tmp_path / "imported-by.txt"
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-rs", "-p", "no:cacheprovider", "--import-mode=importlib", "-o", "addopts=",
                           str(tmp_path / "has"), str(tmp_path / "lacks")], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "lib"), "IMPORTED_BY": str(imported_by)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 passed, 1 skipped" in done.stdout and "lacks/test_lacks.py: could not import 'no_such_module_here'" in done.stdout, done.stdout[-3000:]
    importers = imported_by.read_text().split()
    assert importers and "controller" not in importers and set(importers) <= {"gw0", "gw1"}


REPO = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make")

#: A pytest plugin that writes each collected test's markers (after every conftest has added its own) to $LANE_MARKERS.
MARKERS_PLUGIN = """
import json, os
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    with open(os.environ["LANE_MARKERS"], "w") as out:
        json.dump({item.nodeid: sorted({mark.name for mark in item.iter_markers()}) for item in items}, out)
"""


def _make_prints(*args: str) -> list[str]:
    done = subprocess.run([MAKE or "make", "-s", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def _gpu_lane_args() -> list[str]:
    return _make_prints("print-gpu-tests")


def _markers(tmp_path: Path) -> dict[str, set[str]]:
    """Each test of the whole suite -> its markers."""
    (tmp_path / "lane_markers.py").write_text(MARKERS_PLUGIN)
    out = tmp_path / "markers.json"
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_XDIST")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")])), LANE_MARKERS=str(out))
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "lane_markers",
                           "-o", "addopts=--import-mode=importlib"], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {nodeid: set(names) for nodeid, names in json.loads(out.read_text()).items()}


@pytest.mark.skipif(MAKE is None, reason="needs make")
def test_the_gpu_lanes_select_by_marker_and_the_makefile_lists_no_test_files() -> None:
    args = _gpu_lane_args()
    assert args[:2] == ["-m", "gpu"] and "tests/gpu" in args[2:] and args[2:] == _make_prints("print-marked", "MARKER=gpu"), args
    assert all((REPO / path).exists() for path in args[2:]), args
    recipes = [line for line in (REPO / "Makefile").read_text().splitlines() if line.startswith("\t") or ":=" in line]
    assert not [line for line in recipes if re.search(r"\btest_\w+\.py\b", line)], "a lane lists test files: select them by marker"


@pytest.mark.slow
@pytest.mark.skipif(MAKE is None, reason="needs make")
def test_each_lanes_paths_hold_every_test_the_whole_suite_marks(tmp_path: Path) -> None:
    everything = _markers(tmp_path)
    marked = {marker: {nodeid for nodeid, names in everything.items() if marker in names} for marker in ("gpu", "gpu_on_cpu", "vllm")}
    for marker, nodeids in marked.items():
        paths = _make_prints("print-marked", f"MARKER={marker}")
        outside = sorted(n for n in nodeids if not any(n.split("::")[0] == path or n.startswith(f"{path}/") for path in paths))
        assert nodeids and not outside, f"marked {marker}, outside make print-marked's paths {paths}: {outside}"
    on_cpu, gpu = marked["gpu_on_cpu"], marked["gpu"]
    assert on_cpu <= gpu, sorted(on_cpu - gpu)  # the GPU path of a GPU test, run on the CPU
    assert not {nodeid for nodeid in on_cpu if "test_host_syncs.py" in nodeid}, "the main lane runs the host-sync tests on the CPU already"
