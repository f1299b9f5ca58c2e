"""No module of tinkergym takes another module's private names (a leading underscore, not a dunder): neither
``from tinkergym.x import _y`` (relative imports too) nor ``x._y`` on a project module it imported. A name another
module needs is public where it is defined; a split that leaves one module reaching into another's privates has cut
one concept in half (STYLE.md, 8). Read with ``ast`` alone: nothing of the package is imported."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def is_private(name: str) -> bool:
    """``_y`` and ``__y`` are private; ``__y__`` (``__version__``, ``__all__``) is not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under ``root`` (its folder), by dotted name; a package by its own name."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def private_uses(root: Path, package: str) -> list[str]:
    """``path:line: module.name`` for each private name of another project module that a module of ``package`` takes:
    imported by name, or read as an attribute of a project module it imported (``a._y``, ``pkg.a._y``)."""
    modules = module_names(root, package)
    found = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        bound: dict[str, str] = {}  # a name bound in this module -> the project module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules or alias.name.split(".")[0] == package:
                        if alias.asname:
                            bound[alias.asname] = alias.name
                        else:
                            bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                source = absolute(node, name, is_package)
                if source is None or source.split(".")[0] != package:
                    continue
                for alias in node.names:
                    if f"{source}.{alias.name}" in modules:
                        bound[alias.asname or alias.name] = f"{source}.{alias.name}"
                    elif is_private(alias.name):
                        found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {source}.{alias.name}")
        for node in ast.walk(tree):
            chain = attribute_chain(node)  # a.b._c is read as a.b._c and again as a.b: the set below keeps one
            if not chain or chain[0] not in bound:
                continue
            module = bound[chain[0]]
            for attr in chain[1:]:
                if f"{module}.{attr}" in modules:
                    module = f"{module}.{attr}"
                    continue
                if is_private(attr):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {module}.{attr}")
                break
    return sorted(set(found))


def absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The module a ``from ... import`` names, relative imports resolved against ``module``."""
    if not node.level:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else [])) or None


def attribute_chain(node: ast.AST) -> list[str]:
    """``a.b.c`` as ``["a", "b", "c"]``; empty for anything that is not a name followed by attributes."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return [node.id, *reversed(attrs)] if isinstance(node, ast.Name) and attrs else []


def test_no_module_takes_another_modules_private_names() -> None:
    assert private_uses(REPO / "tinkergym", "tinkergym") == []


def test_the_check_finds_each_way_of_taking_a_private_name(tmp_path: Path) -> None:
    """A planted package: every way a module can take another's private name is found, and nothing else is."""
    pkg = tmp_path / "planted"
    (pkg / "inner").mkdir(parents=True)
    files = {
        "__init__.py": "__version__ = '1'\n",
        "a.py": "_hidden = 1\nvisible = 2\n\n\ndef _helper():\n    return _hidden\n",
        "inner/__init__.py": "from .. import a\nx = a._hidden\n",  # relative, from a package's face
        "inner/deep.py": "_deep = 3\n",
        "by_name.py": "from planted.a import _hidden, visible\n",
        "relative.py": "from .a import _helper as helper\n",
        "attribute.py": "from planted import a\n\n\ndef f():\n    return a._helper()\n",
        "dotted.py": "import planted.inner.deep\n\ny = planted.inner.deep._deep\n",
        "aliased.py": "import planted.a as m\n\nz = m._hidden\n",
        "allowed.py": ("from planted import __version__, a\nfrom planted.a import visible\nimport os\n\n\n"
                       "class C:\n    def __init__(self):\n        self._own = os._exit\n\n\n"
                       "def g():\n    return a.visible, a.__name__, visible, C()._own\n"),
    }
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    assert private_uses(pkg, "planted") == [
        "planted/aliased.py:3: planted.a._hidden",
        "planted/attribute.py:5: planted.a._helper",
        "planted/by_name.py:1: planted.a._hidden",
        "planted/dotted.py:3: planted.inner.deep._deep",
        "planted/inner/__init__.py:2: planted.a._hidden",
        "planted/relative.py:1: planted.a._helper",
    ]
