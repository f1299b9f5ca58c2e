"""The tool sandbox's seccomp filter: built by libseccomp's own Python bindings, handed to bubblewrap as a pipe.

:func:`seccomp_program` runs :data:`_FILTER_SCRIPT` in an interpreter that has the bindings (this one, or the system's
``python3`` with Debian/Ubuntu ``python3-seccomp``, Fedora ``python3-libseccomp``) and keeps the BPF program it
writes; :func:`program_fd` puts it in a pipe for ``bwrap --seccomp FD``. The filter answers ``EPERM`` to
:data:`DENIED_SYSCALLS` and to ``socket``/``socketpair`` of any family but ``AF_UNIX``; a system call of another ABI
(32-bit ``int 0x80``, x32) ends the process (libseccomp's default bad-arch action).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import lru_cache

from tinkergym.errors import SandboxUnavailableError

#: System calls the sandbox's seccomp filter answers with EPERM (``socket`` and ``socketpair`` too, for any family
#: but ``AF_UNIX``).
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "userfaultfd", "bpf", "perf_event_open", "keyctl", "add_key", "request_key",
)

#: Builds the filter with libseccomp's bindings and writes its BPF program to standard output (run by an
#: interpreter that has them: this one, or the system's ``python3`` with ``python3-seccomp``).
_FILTER_SCRIPT = r"""
import errno, socket, sys
import seccomp
denied = seccomp.ERRNO(errno.EPERM)
f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)  # other ABIs than the native one: the default bad-arch action, kill
for name in sys.argv[1:]:
    f.add_rule(denied, name)
for name in ("socket", "socketpair"):
    f.add_rule(denied, name, seccomp.Arg(0, seccomp.NE, socket.AF_UNIX))
sys.stdout.flush()
f.export_bpf(sys.stdout)
"""


@lru_cache(maxsize=1)
def seccomp_program() -> bytes:
    """The sandbox's seccomp filter as a BPF program (built once per process).

    Raises:
        SandboxUnavailableError: no interpreter here has libseccomp's Python bindings (the message says how to
            install them).
    """
    tried = []
    for interpreter in dict.fromkeys([sys.executable, "/usr/bin/python3", shutil.which("python3") or "/usr/bin/python3"]):
        try:
            done = subprocess.run([interpreter, "-I", "-c", _FILTER_SCRIPT, *DENIED_SYSCALLS], capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as exc:
            tried.append(f"{interpreter}: {exc}")
            continue
        if done.returncode == 0 and done.stdout and len(done.stdout) % 8 == 0:  # whole sock_filter instructions
            return done.stdout
        tried.append(f"{interpreter}: {(done.stderr.decode('utf-8', 'replace').strip().splitlines() or ['no program'])[-1]}")
    raise SandboxUnavailableError(  # check_sandbox adds how to install them, with bubblewrap
        "the sandbox's seccomp filter needs libseccomp's Python bindings (python3-seccomp), which no interpreter here has "
        f"({'; '.join(tried)})."
    )


def program_fd(program: bytes) -> int:
    """A pipe's read end holding ``program`` (for bubblewrap's ``--seccomp FD``); the caller closes it."""
    read, write = os.pipe()
    try:
        os.write(write, program)  # a few hundred bytes: well within a pipe's buffer
    finally:
        os.close(write)
    return read
