"""Wheels of the root distribution, of every env package and of a freshly scaffolded package: each builds without
setuptools warnings (regular and editable builds) and ships exactly the files of its packages, data included.

Every project is copied to a temporary folder first, so the builds leave no ``build/`` or ``*.egg-info`` behind in
the source tree and never see stale ones from it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path, PurePosixPath

import pytest

from tinkergym.registry.scaffold import PackagePlan, scaffold_package

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
ENV_PACKAGES = sorted(path.parent for path in (REPO / "env_packages").glob("*/pyproject.toml"))
#: Never part of a build's input: virtual environments, build outputs, caches, the separate env package projects.
_SKIP_DIRS = {".git", "__pycache__", "build", "dist", "runs", ".cache", ".pytest_cache", "env_packages"}
_SKIP_PATTERNS = (".venv*", "*.egg-info", "*.pyc")
#: Build output lines that mention a warning but are not one about the project (pip turns byte-compiling off).
_BENIGN = ("byte-compiling is disabled",)


def _ignore(_folder: str, names: list[str]) -> set[str]:
    return {name for name in names if name in _SKIP_DIRS or any(fnmatch.fnmatch(name, p) for p in _SKIP_PATTERNS)}


def _copy_project(project: Path, dest: Path) -> Path:
    shutil.copytree(project, dest, ignore=_ignore)
    return dest


def _setuptools_config(project: Path) -> dict:
    return tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


def _package_dirs(project: Path) -> dict[str, Path]:
    """Each package the project declares -> its source folder (``[tool.setuptools.package-dir]`` applied)."""
    config = _setuptools_config(project)
    mapping = config.get("package-dir", {})
    packages = config["packages"]
    if isinstance(packages, dict):  # [tool.setuptools.packages.find]
        from setuptools import find_packages

        found = packages["find"]
        packages = find_packages(str(project / found.get("where", ["."])[0]), include=found.get("include", ("*",)), exclude=found.get("exclude", ()))
    return _folders(project, mapping, packages)


def _declared(project: Path) -> list[str]:
    """The packages the project declares, ``[tool.setuptools.packages.find]`` resolved."""
    return list(_package_dirs(project))


def _folders(project: Path, mapping: dict[str, str], packages: list[str]) -> dict[str, Path]:
    dirs = {}
    for package in packages:
        parts = package.split(".")
        for cut in range(len(parts), -1, -1):
            prefix = ".".join(parts[:cut])
            if prefix in mapping:
                dirs[package] = project.joinpath(mapping[prefix], *parts[cut:])
                break
        else:
            dirs[package] = project.joinpath(*parts)
    return dirs


def _expected_files(project: Path) -> set[str]:
    """Every file under the folders of the declared packages (modules and data), as paths inside the wheel."""
    expected = set()
    for package, folder in _package_dirs(project).items():
        assert folder.is_dir(), f"{project.name}: package {package} has no folder {folder}"
        for path in folder.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                expected.add(str(PurePosixPath(*package.split("."), *path.relative_to(folder).parts)))
    return expected


def _clean_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONWARNINGS", "PIP_VERBOSE", "PIP_QUIET")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    return env


def _warning_lines(output: str) -> list[str]:
    return [
        line for line in output.splitlines()
        if ("warn" in line.lower() or "would be ignored" in line.lower()) and not any(b in line for b in _BENIGN)
    ]


def _build_wheel(source: Path, out: Path) -> tuple[Path, str]:
    """``pip wheel`` as ``make install`` runs the backend (no isolation, no index), verbose so that setuptools'
    own log lines show as well as the Python warnings pip forwards."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=300, env=_clean_env(),
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    (wheel,) = out.glob("*.whl")
    return wheel, output


_EDITABLE = textwrap.dedent(
    """
    import sys, warnings
    from setuptools import build_meta
    from setuptools.warnings import InformationOnly
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_meta.build_editable(sys.argv[1])
    for w in caught:
        if not issubclass(w.category, InformationOnly):  # the "Editable installation." notice
            print(f"WARNING {w.category.__name__}: {w.message}")
    """
)


def _build_editable(source: Path, out: Path) -> str:
    """The editable build behind ``pip install -e`` (what ``make install`` does), with every Python warning kept."""
    done = subprocess.run(
        [sys.executable, "-c", _EDITABLE, str(out)], cwd=source, capture_output=True, text=True, timeout=300, env=_clean_env()
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


def _check_wheel(project: Path, wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = [n for n in names if n.split("/")[0].endswith(".dist-info")]
    shipped = set(names) - set(dist_info)
    expected = _expected_files(project)
    # (1) every module and data file of the declared packages, and nothing from outside them
    assert not expected - shipped, f"{wheel.name} lacks {sorted(expected - shipped)}"
    assert not shipped - expected, f"{wheel.name} ships files that are not in its packages: {sorted(shipped - expected)}"
    data = {n for n in expected if not n.endswith(".py")}
    assert any(n.endswith("tinkergym_envs.toml") or "/templates/" in n for n in data), sorted(data)
    # (2) no tests, build junk or metadata other than the one dist-info folder
    tops = {n.split("/")[0] for n in names}
    packages = {p.split(".")[0] for p in _declared(project)}
    assert tops - packages == {n.split("/")[0] for n in dist_info} and len({n.split("/")[0] for n in dist_info}) == 1, tops
    for name in names:
        parts = PurePosixPath(name).parts
        assert parts[0] != "tests", name
        assert not any(p.endswith(".egg-info") or p == "__pycache__" for p in parts), name
        assert not name.endswith((".pyc", "conftest.py")) and not fnmatch.fnmatch(parts[-1], "test_*.py"), name
    # (3) the license texts the project declares, as they are, in the dist-info's licenses/
    with zipfile.ZipFile(wheel) as archive:
        for pattern in tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))["project"].get("license-files", []):
            for path in project.glob(pattern):
                inside = f"{dist_info[0].split('/')[0]}/licenses/{path.relative_to(project).as_posix()}"
                assert inside in names and archive.read(inside) == path.read_bytes(), f"{wheel.name} lacks its license text {inside}"


def test_the_root_project_declares_its_apache_license() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert text.lstrip().startswith("Apache License\n") and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def _check_quiet(build: str, output: str) -> None:
    assert not _warning_lines(output), f"{build} printed warnings:\n" + "\n".join(_warning_lines(output))


@pytest.mark.slow
@pytest.mark.parametrize("project", [REPO, *ENV_PACKAGES], ids=lambda p: "root" if p == REPO else p.name)
def test_wheel_builds_quietly_and_ships_its_files(project: Path, tmp_path: Path) -> None:
    source = _copy_project(project, tmp_path / "src")
    wheel, output = _build_wheel(source, tmp_path / "wheel")
    _check_quiet(f"pip wheel {project.name}", output)
    _check_wheel(source, wheel)
    _check_quiet(f"editable build of {project.name}", _build_editable(source, tmp_path / "editable"))


def test_math_wheel_ships_the_dataset() -> None:
    """The expected file lists are derived from the source tree; make sure that derivation sees the dataset."""
    expected = _expected_files(REPO / "env_packages" / "math")
    assert {"tinkergym_math/data/train.jsonl", "tinkergym_math/data/test.jsonl", "tinkergym_math/tinkergym_envs.toml"} <= expected
    templates = _expected_files(REPO)
    assert "tinkergym/registry/templates/package/tests/test_env.py.tmpl" in templates
    assert "tinkergym/registry/templates/package/README.md.tmpl" in templates


@pytest.mark.slow
def test_scaffolded_package_builds_quietly_with_its_data(tmp_path: Path) -> None:
    root = scaffold_package("quiet-wheel", tmp_path / "scaffold")
    plan = PackagePlan.for_name("quiet-wheel")
    assert f"{plan.module}/tinkergym_envs.toml" in _expected_files(root)
    wheel, output = _build_wheel(root, tmp_path / "wheel")
    _check_quiet("pip wheel of a scaffolded package", output)
    _check_wheel(root, wheel)
    _check_quiet("editable build of a scaffolded package", _build_editable(root, tmp_path / "editable"))


_IMPORT_ALL = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    import tinkergym
    names, where = [], {}
    for info in pkgutil.walk_packages(tinkergym.__path__, "tinkergym."):
        if info.name.endswith("__main__") or ".migrations" in info.name:
            continue
        module = importlib.import_module(info.name)
        names.append(info.name)
        where[info.name] = module.__file__
    from importlib.metadata import entry_points
    plugins = sorted(ep.name for ep in entry_points(group="tinkergym.backends") if str(ep.dist.locate_file("")).rstrip("/") == sys.argv[1])
    print(json.dumps({"modules": names, "files": where, "backends": plugins}))
    """
)


@pytest.mark.slow
def test_the_installed_wheel_imports_every_module(tmp_path: Path) -> None:
    """``pip install .`` (a regular wheel, not an editable install) gives every module, its data and its plugins."""
    wheel, _ = _build_wheel(_copy_project(REPO, tmp_path / "src"), tmp_path / "dist")
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=300, env=_clean_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    env = {**_clean_env(), "PYTHONPATH": str(target)}
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL, str(target)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.splitlines()[-1])
    in_tree = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__") for p in (REPO / "tinkergym").rglob("*.py")
               if "migrations" not in p.parts and p.name != "__main__.py"}
    assert set(found["modules"]) == in_tree - {"tinkergym"}
    assert all(Path(f).is_relative_to(target) for f in found["files"].values()), "imported from the wheel, not the source tree"
    assert found["backends"] == ["remote", "scheduled", "shared", "tinker", "torch", "vllm"]
    shipped = {p.relative_to(target / "tinkergym").as_posix() for p in (target / "tinkergym").rglob("*") if p.is_file()}
    assert {"registry/known_packages.json", "scheduler/migrations/env.py"} <= shipped
