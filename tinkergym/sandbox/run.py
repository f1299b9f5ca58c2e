"""Run untrusted Python code (a model's tool call) under real isolation.

:func:`run_python` runs code in a fresh interpreter inside a bubblewrap sandbox (the ``bwrap`` program
Flatpak uses; Debian/Ubuntu package ``bubblewrap``):

- new user, PID, network, IPC, UTS and cgroup namespaces (``--unshare-all``); no further user namespaces
  inside (``--disable-userns``); every capability dropped; a new session (no terminal injection);
- an unprivileged uid on the host as well as inside: when the caller is root, the sandbox is started as
  uid/gid 65534 (``nobody``, no supplementary groups), so root-only files stay closed and
  ``RLIMIT_NPROC`` holds. (bubblewrap started by root would map the sandbox's user to host uid 0.)
  The process limit counts the processes of that user in the sandbox's own user namespace, so calls
  running side by side do not share it;
- a read-only view of the system's ``/usr`` (and the ``/bin``, ``/lib``... links to it) and nothing else
  of the host: no ``/etc``, no home folders, no project files, no host ``/proc`` (a ``/proc`` of the
  sandbox's own PID namespace), a minimal read-only ``/dev``;
- a private, size-capped tmpfs as the working directory (``/tmp``, also ``HOME``) and another for
  ``/dev/shm``: nothing is written to the host disk, so there is nothing to clean up and cleanup never
  follows a mount into the host;
- the ``rlimits`` that bound each process (address space, CPU seconds, processes, file size, open files,
  no core dumps), a wall-clock ``timeout``, and output cut to ``max_output`` characters;
- a bound on the call's total memory, processes and files together (:mod:`tinkergym.sandbox.memory`): a memory
  cgroup of its own limited to ``memory_mb`` (``"cgroup-v2"``; ``"cgroup-v1"`` on a hybrid host) where this process
  may make one, else ``"implied"``: the code kept to one process, so ``memory_mb`` plus the two tmpfs folders.
  :func:`~tinkergym.sandbox.memory.memory_bound` says which holds here, each result which held for it (and its peak, and OOM kills);
- ``--die-with-parent``: when the sandbox's first process ends, the kernel ends every process in its PID
  namespace, so nothing a call starts (a double-forked daemon included) outlives it;
- a seccomp filter (bubblewrap's ``--seccomp``, built by libseccomp's own Python bindings, Debian/Ubuntu
  ``python3-seccomp``, Fedora ``python3-libseccomp``) that answers ``EPERM`` to the system calls code has no use
  for and that widen the kernel's attack surface (:data:`~tinkergym.sandbox.seccomp_filter.DENIED_SYSCALLS`: ``ptrace``, cross-process memory
  access, ``io_uring``, ``userfaultfd``, ``bpf``, ``perf_event_open``, the key store) and to ``socket`` and
  ``socketpair`` of any family but ``AF_UNIX``; system calls of another ABI (32-bit, x32) end the process.

The interpreter is the system's ``python3`` (tool code needs the standard library only); another one can
be named (``python=``) when the sandbox's user can read it. A Python installed under ``/root`` (pyenv,
conda) cannot be used after dropping to ``nobody``, which is why the caller's own interpreter is not the
default.

Where bubblewrap is missing or user namespaces are refused, :func:`run_python` refuses to run code and
says how to fix it, unless it is called with ``isolation="rlimits"``: a plain subprocess with the same
resource limits, a scrubbed environment, a best-effort network namespace and the uid drop when started as
root. That guard stops mistakes, not attackers (code can call libc through ctypes); it is an explicit
opt-in and never the default.

Like a notebook cell, the value of a final bare expression is printed (``2 + 2`` shows ``4``).
Exceptions come back as their traceback text.
"""

from __future__ import annotations

import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from functools import lru_cache

from tinkergym.errors import ConfigError, SandboxUnavailableError
from tinkergym.sandbox import memory as sandbox_memory
from tinkergym.sandbox.seccomp_filter import program_fd, seccomp_program

#: Longest code accepted, in UTF-8 bytes (it is sent through a pipe before the child starts reading).
MAX_CODE_BYTES = 60_000
#: uid/gid the sandbox runs as on the host when the caller is root.
NOBODY = 65534
#: Output beyond this many bytes stops the run early.
OUTPUT_FLOOD_BYTES = 1 << 20
#: The two ways to run code: real isolation (the default) and the weaker opt-in guard.
ISOLATIONS = ("bubblewrap", "rlimits")
#: Where the interpreter is looked for when none is named.
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")
#: The system folders shown read-only inside the sandbox (links among them are recreated as links).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: The working directory (and ``HOME``/``TMPDIR``) inside the sandbox.
SANDBOX_WORKDIR = "/tmp"

_INSTALL_HINT = (
    "Install bubblewrap and libseccomp's Python bindings (Debian/Ubuntu: apt-get install bubblewrap python3-seccomp; "
    "Fedora/RHEL: dnf install bubblewrap python3-libseccomp; Arch: pacman -S bubblewrap libseccomp) and allow unprivileged user namespaces (sysctl "
    "kernel.unprivileged_userns_clone=1 on older Debian kernels; on Ubuntu 24.04 and later an AppArmor profile "
    "for bwrap, or kernel.apparmor_restrict_unprivileged_userns=0; in Docker, run with --security-opt "
    "seccomp=unconfined or use a runtime that allows them). Or accept a weaker guard that is NOT a security "
    "boundary: isolation='rlimits' (for tinker/MathTool-v0: gym.make(..., python_sandbox='rlimits'))."
)

_PRELUDE = r"""
import sys
def _tinkergym_setup(network_namespace, limits):
    import resource
    if network_namespace == "1":
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            for flags in (0x40000000, 0x40000000 | 0x10000000):  # CLONE_NEWNET, then with CLONE_NEWUSER
                if libc.unshare(flags) == 0:
                    break
        except Exception:
            pass
    for item in limits:
        name, soft, hard = item.split(":")
        soft, hard = int(soft), int(hard)
        limit = getattr(resource, name, None)
        if limit is None:
            continue
        try:
            current = resource.getrlimit(limit)[1]
            if current != resource.RLIM_INFINITY:
                soft, hard = min(soft, current), min(hard, current)
            resource.setrlimit(limit, (soft, hard))
        except (ValueError, OSError):
            pass
    import socket, _socket
    def _denied(*args, **kwargs):
        raise PermissionError("network access is disabled in this sandbox")
    class _NoSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            _denied()
    for module in (socket, _socket):
        for attr in ("socket", "SocketType"):
            if hasattr(module, attr):
                setattr(module, attr, _NoSocket)
        for attr in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo",
                     "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getnameinfo"):
            if hasattr(module, attr):
                setattr(module, attr, _denied)
def _tinkergym_run(code):
    import ast, linecache, traceback
    linecache.cache["<python>"] = (len(code), None, code.splitlines(True), "<python>")
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = ast.parse(code, "<python>")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<python>", "exec"), namespace)
        if last is not None:
            value = eval(compile(last, "<python>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit:
        raise
    except SyntaxError as exc:
        traceback.print_exception(type(exc), exc, None, file=sys.stdout)
        sys.stdout.flush()
        raise SystemExit(1)
    except BaseException as exc:
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        traceback.print_exception(type(exc), exc, tb, file=sys.stdout)
        sys.stdout.flush()
        raise SystemExit(1)
_tinkergym_setup(sys.argv[1], sys.argv[2:])
sys.stderr = sys.stdout
_tinkergym_code = sys.stdin.read()
_tinkergym_run(_tinkergym_code)
"""


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run produced.

    Attributes:
        output: stdout and stderr, interleaved, decoded as UTF-8 (bad bytes replaced), cut to the limit.
        returncode: The exit status (negative: killed by that signal); ``None`` if it never started.
        timed_out: The wall-clock timeout killed it.
        truncated: The output was cut.
        duration: Seconds from start to finish.
        memory_bound: What bounded the call's total memory (one of :data:`~tinkergym.sandbox.memory.MEMORY_BOUNDS`; ``""`` if it never started).
        memory_total_bytes: That bound's total, for the call's processes and files together.
        memory_peak_bytes: The most the call held at once, where its cgroup kept it.
        memory_killed: The OOM killer ended a process of the call: it reached its memory bound.
    """

    output: str
    returncode: int | None
    timed_out: bool
    truncated: bool
    duration: float
    memory_bound: str = ""
    memory_total_bytes: int = 0
    memory_peak_bytes: int | None = None
    memory_killed: bool = False

    def to_text(self) -> str:
        """The output with a note on timeouts, signals and exit codes, for a tool result."""
        notes = []
        if self.timed_out:
            notes.append(f"[timed out after {self.duration:.1f}s; the process was killed]")
        elif self.memory_killed:
            notes.append(f"[killed: memory limit ({self.memory_total_bytes >> 20} MiB for all the call's processes and files)]")
        elif self.truncated and self.returncode is not None and self.returncode < 0:
            notes.append("[stopped: too much output]")
        elif self.returncode is not None and self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            notes.append(f"[killed by {name}: a time, memory or file-size limit was hit]")
        elif self.returncode not in (0, None) and not self.output.strip():
            notes.append(f"[exit code {self.returncode}]")
        text = self.output.rstrip("\n")
        if not text and not notes:
            return "(no output; print() what you want to see)"
        return "\n".join(part for part in (text, *notes) if part)


def _refused(message: str, start: float | None = None) -> SandboxResult:
    duration = 0.0 if start is None else time.monotonic() - start
    return SandboxResult(f"Error: {message}", None, False, False, duration)


# ----- limits and environment ---------------------------------------------------------------------


def _limits(timeout: float, memory_mb: int, max_file_mb: int, max_processes: int) -> list[tuple[str, int, int]]:
    """``(name, soft, hard)`` resource limits for the child (CPU: SIGXCPU at soft, SIGKILL at hard)."""
    cpu = max(1, math.ceil(timeout)) + 1
    memory, files = memory_mb * 1024 * 1024, max_file_mb * 1024 * 1024
    return [
        ("RLIMIT_AS", memory, memory),
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_NPROC", max_processes, max_processes),
        ("RLIMIT_FSIZE", files, files),
        ("RLIMIT_NOFILE", 256, 256),
        ("RLIMIT_CORE", 0, 0),
    ]


def _clean_environment(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
        "MPLCONFIGDIR": workdir,
    }


def _run_as() -> int | None:
    """The host uid the code runs as: ``nobody`` when the caller is root, else the caller's own."""
    return NOBODY if os.geteuid() == 0 else None


# ----- the interpreter ----------------------------------------------------------------------------


def _others_can_use(path: str) -> bool:
    """Whether a user with no special rights can read (and, for folders, enter) ``path`` and its parents."""
    try:
        mode = os.stat(path).st_mode
        if mode & 0o004 == 0 or (os.path.isdir(path) or os.access(path, os.X_OK)) and mode & 0o001 == 0:
            return False
        while path != os.path.dirname(path):
            path = os.path.dirname(path)
            if not os.stat(path).st_mode & 0o001:
                return False
    except OSError:
        return False
    return True


def find_python(python: str | None = None) -> str:
    """The interpreter tool code runs with, as a real path: ``python`` if given, else the system's ``python3``.

    Raises:
        ConfigError: ``python`` is not an executable file, or no system ``python3`` exists.
    """
    if python is not None:
        if not isinstance(python, (str, os.PathLike)) or not os.path.isfile(python) or not os.access(python, os.X_OK):
            raise ConfigError(f"python={python!r}: name an executable Python interpreter, e.g. /usr/bin/python3.")
        return os.path.realpath(python)
    for candidate in SYSTEM_PYTHONS:
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return os.path.realpath(candidate)
    raise ConfigError(
        "No system python3 was found for the sandbox (looked in "
        f"{', '.join(SYSTEM_PYTHONS)}). Install one (Debian/Ubuntu: apt-get install python3-minimal) or name "
        "an interpreter that every user can read with python=... (python_executable=... for tinker/MathTool-v0)."
    )


def _interpreter_dirs(python: str) -> list[str]:
    """Folders outside the system ones that ``python`` (a real path) needs: its installation prefix."""
    if any(python == root or python.startswith(root + "/") for root in SYSTEM_DIRS):
        return []
    return [os.path.dirname(os.path.dirname(python))]


# ----- bubblewrap ---------------------------------------------------------------------------------


def _bubblewrap_argv(bwrap: str, python: str, disk_mb: int, seccomp_fd: int) -> list[str]:
    """The ``bwrap`` command line up to (not including) the interpreter; ``seccomp_fd`` holds the filter's program."""
    disk = str(disk_mb * 1024 * 1024)
    argv = [
        bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
        "--cap-drop", "ALL", "--hostname", "sandbox",
    ]
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in _interpreter_dirs(python):
        argv += ["--ro-bind", path, path]
    argv += [
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", disk, "--tmpfs", "/dev/shm",
        "--remount-ro", "/dev",
        "--size", disk, "--tmpfs", SANDBOX_WORKDIR,
        "--chdir", SANDBOX_WORKDIR,
        "--remount-ro", "/",
        "--seccomp", str(seccomp_fd),
    ]
    return argv


@lru_cache(maxsize=16)
def _bubblewrap_problem(bwrap: str | None, python: str, uid: int | None) -> str | None:
    """Why bubblewrap cannot run ``python`` here (``None`` if it can), found by starting it once."""
    if bwrap is None:
        return "the bubblewrap program (bwrap) was not found on PATH."
    try:
        program = seccomp_program()
    except SandboxUnavailableError as exc:
        return str(exc)
    fd = program_fd(program)
    argv = _bubblewrap_argv(bwrap, python, 1, fd) + [python, "-I", "-c", "print('ok')"]
    try:
        done = subprocess.run(
            argv, capture_output=True, timeout=30, env=_clean_environment(SANDBOX_WORKDIR), cwd="/",
            user=uid, group=uid, extra_groups=[] if uid is not None else None, pass_fds=(fd,),
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bubblewrap could not be started ({exc})."
    finally:
        os.close(fd)
    if done.returncode != 0 or done.stdout.strip() != b"ok":
        detail = (done.stderr or done.stdout).decode("utf-8", "replace").strip().splitlines()
        who = "" if uid is None else f" as uid {uid}"
        hint = ""
        if uid is not None and not _others_can_use(python):
            hint = f" {python} is not readable by uid {uid}: name an interpreter every user can read."
        return f"bubblewrap failed to start {python}{who}: {detail[-1] if detail else f'exit code {done.returncode}'}.{hint}"
    return None


def check_sandbox(isolation: str = "bubblewrap", python: str | None = None) -> str:
    """Check that code can run with ``isolation`` here; return the interpreter's path.

    Raises:
        ConfigError: an unknown ``isolation`` or a bad ``python``.
        SandboxUnavailableError: bubblewrap is missing or cannot start (the message says how to fix it),
            or, with ``rlimits`` as root, no interpreter that ``nobody`` can read exists.
    """
    if isolation not in ISOLATIONS:
        raise ConfigError(f"isolation={isolation!r}: choose one of {list(ISOLATIONS)} ('rlimits' is not a security boundary).")
    if os.name != "posix" or not sys.platform.startswith("linux"):
        if isolation == "bubblewrap":
            raise SandboxUnavailableError(f"Sandboxed code needs Linux (this is {sys.platform}). {_INSTALL_HINT}")
    interpreter = find_python(python)
    uid = _run_as()
    if isolation == "bubblewrap":
        problem = _bubblewrap_problem(shutil.which("bwrap"), interpreter, uid)
        if problem is not None:
            raise SandboxUnavailableError(f"Cannot run tool code in a sandbox: {problem} {_INSTALL_HINT}")
    elif uid is not None and not _others_can_use(interpreter):
        raise SandboxUnavailableError(
            f"{interpreter} is not readable by uid {uid}, and tool code never runs as root: name an "
            "interpreter every user can read (python=...), e.g. /usr/bin/python3."
        )
    return interpreter


# ----- running ------------------------------------------------------------------------------------


def _has_exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (its pid stays reserved for killpg)."""
    if not hasattr(os, "waitid"):
        return False
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _collect(proc: subprocess.Popen, deadline: float, keep_bytes: int) -> tuple[bytes, int, bool]:
    """Read the child's output until EOF, the deadline or a flood; return (kept, total, timed_out)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    kept, total, exited_at = bytearray(), 0, None
    while True:
        now = time.monotonic()
        if now >= deadline:
            return bytes(kept), total, True
        ready, _, _ = select.select([fd], [], [], min(0.05, deadline - now))
        if ready:
            data = os.read(fd, 65536)
            if not data:
                return bytes(kept), total, False
            total += len(data)
            if len(kept) < keep_bytes:
                kept += data[: keep_bytes - len(kept)]
            if total > max(OUTPUT_FLOOD_BYTES, keep_bytes):
                return bytes(kept), total, False
        elif _has_exited(proc.pid):
            exited_at = exited_at or now
            if now - exited_at > 0.2:  # a leftover grandchild holds the pipe open
                return bytes(kept), total, False


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_tree(path: str) -> None:
    def retry(func, target, _error):
        """Make a read-only leftover removable, then try again."""
        try:
            os.chmod(os.path.dirname(target) or target, 0o700)
            os.chmod(target, 0o700)
            func(target)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=retry)
    else:
        shutil.rmtree(path, onerror=retry)
    if os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)


def _check_positive(name: str, value, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ConfigError(f"{name}={value!r}: choose a number from {low} to {high}.")


def run_python(
    code: str,
    *,
    timeout: float = 5.0,
    memory_mb: int = 512,
    max_output: int = 4_000,
    max_file_mb: int = 16,
    disk_mb: int = 64,
    max_processes: int = 32,
    python: str | None = None,
    isolation: str = "bubblewrap",
    memory_bound: str | None = None,  # the option's name; the function is sandbox_memory.memory_bound
) -> SandboxResult:
    """Run ``code`` in a sandbox and return what it printed (see the module docstring).

    Never raises for anything the code does; a sandbox that cannot be set up comes back as an
    ``Error: ...`` result that says how to fix it (:func:`check_sandbox` raises it instead).

    Args:
        code: Python source.
        timeout: Wall-clock seconds before everything the call started is killed (the CPU limit is one more).
        memory_mb: Address-space limit of each process, and in a cgroup the limit of the call's total, in MiB.
        max_output: Characters of output kept.
        max_file_mb: Largest file the code may write, in MiB.
        disk_mb: Size of the working directory's tmpfs (and of ``/dev/shm``'s), in MiB (bubblewrap only).
        max_processes: Processes and threads the code may have at once.
        python: The interpreter (default: the system's ``python3``).
        isolation: ``"bubblewrap"`` (default) or ``"rlimits"`` (a weaker guard, not a security boundary).
        memory_bound: ``None`` (default) for the best bound on the call's total memory that this host offers;
            ``"implied"`` to do without a cgroup (see :mod:`tinkergym.sandbox.memory`).
    """
    start = time.monotonic()
    for name, value, low, high in (("timeout", timeout, 0.01, 3600), ("memory_mb", memory_mb, 16, 1 << 20),
                                   ("max_file_mb", max_file_mb, 0, 1 << 20), ("disk_mb", disk_mb, 1, 1 << 20),
                                   ("max_processes", max_processes, 1, 4096), ("max_output", max_output, 1, 1 << 24)):
        _check_positive(name, value, low, high)
    payload = code.encode("utf-8", errors="replace") if isinstance(code, str) else b""
    if len(payload) > MAX_CODE_BYTES:
        return _refused(f"the code is {len(payload):,} bytes long; the limit is {MAX_CODE_BYTES:,}.")
    try:
        interpreter = check_sandbox(isolation, python)
    except (SandboxUnavailableError, ConfigError) as exc:
        return _refused(str(exc))
    try:
        bound, cgroup = sandbox_memory.call_bound(memory_mb=int(memory_mb), disk_mb=int(disk_mb), max_processes=int(max_processes),
                                                  isolation=isolation, kind=memory_bound)
    except ConfigError as exc:
        return _refused(str(exc))
    limits = _limits(timeout, int(memory_mb), int(max_file_mb), int(max_processes))
    try:
        result = _launch(isolation, interpreter, payload, start, timeout, max_output, int(disk_mb), limits, cgroup)
        peak, killed = (cgroup.peak_bytes(), cgroup.oom_kills() > 0) if cgroup is not None else (None, False)
    finally:
        if cgroup is not None:
            cgroup.remove()
    return replace(result, memory_bound=bound.kind, memory_total_bytes=bound.total_bytes, memory_peak_bytes=peak, memory_killed=killed)


def _launch(isolation: str, interpreter: str, payload: bytes, start: float, timeout: float, max_output: int, disk_mb: int,
            limits: list[tuple[str, int, int]], cgroup: sandbox_memory.CallCgroup | None) -> SandboxResult:
    """Run the code with ``isolation``; without a cgroup, bubblewrap's seccomp filter keeps it to one process."""
    uid = _run_as()
    if isolation == "bubblewrap":
        try:
            fd = program_fd(seccomp_program(single_process=cgroup is None))  # built once; the other when bubblewrap was probed
        except SandboxUnavailableError as exc:
            return _refused(str(exc), start)
        try:
            argv = _bubblewrap_argv(shutil.which("bwrap") or "bwrap", interpreter, disk_mb, fd)
            argv += _interpreter_argv(interpreter, network_namespace=False, limits=limits)
            return _start(argv, payload, start, timeout, max_output, uid, cwd="/", workdir=SANDBOX_WORKDIR, exit_codes_of_signals=True,
                          pass_fds=(fd,), cgroup=cgroup)
        finally:
            os.close(fd)
    workdir = tempfile.mkdtemp(prefix="tinkergym-sandbox-")
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        argv = _interpreter_argv(interpreter, network_namespace=True, limits=limits)
        return _start(argv, payload, start, timeout, max_output, uid, cwd=workdir, workdir=workdir, exit_codes_of_signals=False,
                      cgroup=cgroup)
    finally:
        _remove_tree(workdir)


def _interpreter_argv(interpreter: str, *, network_namespace: bool, limits: list[tuple[str, int, int]]) -> list[str]:
    """The interpreter's command line: isolated mode, the prelude, then its settings as plain words."""
    return [interpreter, "-I", "-c", _PRELUDE, "1" if network_namespace else "0", *(f"{n}:{s}:{h}" for n, s, h in limits)]


def _start(argv: list[str], payload: bytes, start: float, timeout: float, max_output: int, uid: int | None, *,
           cwd: str, workdir: str, exit_codes_of_signals: bool, pass_fds: tuple[int, ...] = (),
           cgroup: sandbox_memory.CallCgroup | None = None) -> SandboxResult:
    """Start ``argv`` as ``uid`` in a new session (and ``cgroup``), feed it the code and collect the result."""
    if cgroup is not None:  # a shell holds at `read` until it is in the cgroup, then becomes argv: all it starts is in there
        argv = ["/bin/sh", "-c", 'read -r _ && exec "$@"', "sh", *argv]
        payload = b"\n" + payload
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=cwd, env=_clean_environment(workdir), start_new_session=True, close_fds=True,
            user=uid, group=uid, extra_groups=[] if uid is not None else None, pass_fds=pass_fds,
        )
    except OSError as exc:
        return _refused(f"could not start Python ({exc}).", start)
    if cgroup is not None:
        try:
            cgroup.join(proc.pid)
        except OSError as exc:
            _kill_group(proc)
            proc.communicate()
            return _refused(f"could not place the call in its memory cgroup {cgroup.path} ({exc}).", start)
    result = _finish(proc, payload, start, timeout, max_output)
    code = result.returncode
    if exit_codes_of_signals and code is not None and code > 128 and not result.timed_out:
        try:  # bubblewrap reports a child killed by signal N as exit code 128 + N
            signal.Signals(code - 128)
            result = SandboxResult(result.output, 128 - code, result.timed_out, result.truncated, result.duration)
        except ValueError:
            pass
    return result


def _finish(proc: subprocess.Popen, payload: bytes, start: float, timeout: float, max_output: int) -> SandboxResult:
    """Feed the code, collect the output, kill what is left and build the result."""
    try:
        assert proc.stdin is not None
        try:
            proc.stdin.write(payload)
            proc.stdin.close()
        except OSError:
            pass
        kept, total, timed_out = _collect(proc, start + timeout, max_output * 4 + 4)
    finally:
        _kill_group(proc)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    text = kept.decode("utf-8", errors="replace")
    truncated = total > len(kept) or len(text) > max_output
    if truncated:
        text = text[:max_output].rstrip("\ufffd") + f"\n... [output truncated after {max_output:,} characters]"
    return SandboxResult(text, proc.returncode, timed_out, truncated, time.monotonic() - start)
