"""The tool sandbox's seccomp filter: built by libseccomp's own Python bindings, handed to bubblewrap as a pipe.

:func:`seccomp_program` runs :data:`_FILTER_SCRIPT` in an interpreter that has the bindings (this one, or the system's
``python3`` with Debian/Ubuntu ``python3-seccomp``, Fedora ``python3-libseccomp``) and keeps the BPF program it
writes; :func:`program_fd` puts it in a pipe for ``bwrap --seccomp FD``. The filter answers ``EPERM`` to
:data:`DENIED_SYSCALLS` and to ``socket``/``socketpair`` of any family but ``AF_UNIX``; a system call of another ABI
(32-bit ``int 0x80``, x32) ends the process (libseccomp's default bad-arch action).

Where no cgroup bounds a call's memory (:mod:`tinkergym.sandbox.memory`), ``seccomp_program(single_process=True)`` also
keeps the code to one process and out of memory that no limit counts: ``EPERM`` to :data:`SINGLE_PROCESS_DENIED` and to
``clone`` without ``CLONE_THREAD`` (threads still start: they share the one address space), ``ENOSYS`` to ``clone3``
(whose flags a filter cannot read; the C library then falls back to ``clone``, as under Docker's default profile).
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

#: Also denied where the code must stay one process: new processes, and memory that no address space counts
#: (``memfd_create``, ``memfd_secret``, System V shared memory and message queues).
SINGLE_PROCESS_DENIED = ("fork", "vfork", "memfd_create", "memfd_secret", "shmget", "msgget")

#: Builds the filter with libseccomp's bindings and writes its BPF program to standard output (run by an
#: interpreter that has them: this one, or the system's ``python3`` with ``python3-seccomp``).
_FILTER_SCRIPT = r"""
import errno, platform, socket, sys
import seccomp
denied = seccomp.ERRNO(errno.EPERM)
f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)  # other ABIs than the native one: the default bad-arch action, kill
single_process, *names = sys.argv[1:]
for name in names:
    f.add_rule(denied, name)
for name in ("socket", "socketpair"):
    f.add_rule(denied, name, seccomp.Arg(0, seccomp.NE, socket.AF_UNIX))
if single_process == "1":
    for name in SINGLE_PROCESS_DENIED:
        try:
            f.add_rule(denied, name)
        except (RuntimeError, ValueError):  # a name this libseccomp does not know (memfd_secret on older ones)
            pass
    flags = 1 if platform.machine().startswith("s390") else 0  # clone's flags come second there
    f.add_rule(denied, "clone", seccomp.Arg(flags, seccomp.MASKED_EQ, 0x00010000, 0))  # no CLONE_THREAD
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
sys.stdout.flush()
f.export_bpf(sys.stdout)
"""


@lru_cache(maxsize=2)
def seccomp_program(single_process: bool = False) -> bytes:
    """The sandbox's seccomp filter as a BPF program (built once per process and variant).

    Args:
        single_process: Also deny new processes and the memory no limit counts (see the module docstring).

    Raises:
        SandboxUnavailableError: no interpreter here has libseccomp's Python bindings (the message says how to
            install them).
    """
    tried = []
    script = _FILTER_SCRIPT.replace("SINGLE_PROCESS_DENIED", repr(SINGLE_PROCESS_DENIED))
    for interpreter in dict.fromkeys([sys.executable, "/usr/bin/python3", shutil.which("python3") or "/usr/bin/python3"]):
        try:
            argv = [interpreter, "-I", "-c", script, "1" if single_process else "0", *DENIED_SYSCALLS]
            done = subprocess.run(argv, capture_output=True, timeout=30)
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
