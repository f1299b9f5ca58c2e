"""Whether ``import tinkergym`` reaches the installed package, or a folder of the same name shadows it.

Python imports from the script's folder (or the working directory, for ``python -c``, a REPL or a notebook) before it
looks at the installed packages. A ``tinkergym/`` folder there, such as a project folder or a clone of this repository,
is imported instead of the package: nothing registers the ``tinker/`` ids, and ``gym.make("tinker/Bandit-v0")`` fails
with Gymnasium's "Namespace tinker not found", where none of tinkergym's code runs to explain it. The commands here run
the installed package from anywhere, so they can look for such a folder and say so (:func:`shadow_note`).
"""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

#: The installed package's folder (this file is in its ``registry/``).
PACKAGE_DIR = Path(__file__).resolve().parents[1]

#: What a person runs to see which ``tinkergym`` Python imports from a folder.
IMPORT_CHECK = 'python -c "import tinkergym; print(tinkergym.__file__, list(tinkergym.__path__))"'


def shadowing_path(folder: Path) -> Path | None:
    """The ``tinkergym`` folder (or ``tinkergym.py``) in ``folder`` that a script run from there would import instead of the
    installed package; None when there is none, or it is the installed package itself.

    A module or a folder with ``__init__.py`` wins wherever it comes first on ``sys.path``. A folder without one is a
    namespace portion: it loses to an installed package found on ``sys.path`` later, and wins over one that an import hook
    provides (an editable install), which Python asks only after the path.
    """
    module = folder / "tinkergym.py"
    if module.is_file():
        return module
    candidate = folder / "tinkergym"
    try:
        if not candidate.is_dir() or candidate.resolve() == PACKAGE_DIR:
            return None
    except OSError:
        return None
    if (candidate / "__init__.py").is_file():
        return candidate
    rest = [p for p in sys.path if p and _resolved(p) != _resolved(str(folder))]
    spec = importlib.machinery.PathFinder.find_spec("tinkergym", rest)
    return candidate if spec is None or spec.origin is None else None


def _resolved(path: str) -> Path | None:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):
        return None


def import_check() -> str:
    """What to check when ``tinker/`` ids are missing although their packages are installed: which package ``import tinkergym``
    imports, and the folder that may shadow it."""
    return (f"tinkergym registers its env ids when `import tinkergym` imports the installed package ({PACKAGE_DIR}). Check what a "
            f"script imports by running, from its folder: {IMPORT_CHECK}; it should print {PACKAGE_DIR / '__init__.py'}. A folder "
            "named tinkergym (or a tinkergym.py) beside the script is imported instead: rename it, or run the script from elsewhere.")


def shadow_note(folder: Path) -> str | None:
    """A note for a command run in ``folder`` when a ``tinkergym`` there shadows the installed package for Python run there."""
    found = shadowing_path(folder)
    if found is None:
        return None
    return (f"note: {found} shadows the installed tinkergym package for Python run in {folder} (python script.py, python -c, "
            f"notebooks): `import tinkergym` there imports that {'file' if found.is_file() else 'folder'} instead, and "
            f"gym.make('tinker/...') then fails with "
            f"\"Namespace tinker not found\". Rename it, or run Python from another folder (check with: {IMPORT_CHECK}).")
