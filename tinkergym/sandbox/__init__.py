"""Run untrusted Python code (a model's tool call) under real isolation: :func:`run_python`.

:mod:`~tinkergym.sandbox.run` runs the code (bubblewrap, or plain ``rlimits`` where asked), held by the seccomp filter
of :mod:`~tinkergym.sandbox.seccomp_filter` and the bound on its total memory of :mod:`~tinkergym.sandbox.memory`.
Standard library only.
"""

from tinkergym.sandbox.memory import MEMORY_BOUNDS, MemoryBound, memory_bound
from tinkergym.sandbox.run import ISOLATIONS, MAX_CODE_BYTES, NOBODY, SandboxResult, check_sandbox, find_python, run_python
from tinkergym.sandbox.seccomp_filter import DENIED_SYSCALLS

__all__ = [
    "DENIED_SYSCALLS",
    "ISOLATIONS",
    "MAX_CODE_BYTES",
    "MEMORY_BOUNDS",
    "NOBODY",
    "MemoryBound",
    "SandboxResult",
    "check_sandbox",
    "find_python",
    "memory_bound",
    "run_python",
]
