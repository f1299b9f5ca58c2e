"""The ``python`` tool's sandbox: :mod:`tinkergym.sandbox` (bubblewrap namespaces as an unprivileged uid)."""

from tinkergym.sandbox import ISOLATIONS, MAX_CODE_BYTES, SandboxResult, check_sandbox, find_python, run_python

__all__ = ["ISOLATIONS", "MAX_CODE_BYTES", "SandboxResult", "check_sandbox", "find_python", "run_python"]
