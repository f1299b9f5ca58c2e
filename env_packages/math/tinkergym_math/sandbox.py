"""Run untrusted Python code in a constrained subprocess (the ``python`` tool of ``tinker/MathTool-v0``).

:func:`run_python` starts ``sys.executable -I`` (isolated mode: no user site, no ``PYTHON*``
variables, no script directory on ``sys.path``) in a new session, with:

- a wall-clock ``timeout``: the whole process group is killed (``SIGKILL``) when it runs out;
- resource limits, set in the child before any user code runs: address space (``RLIMIT_AS``, default
  512 MiB), CPU seconds (``RLIMIT_CPU``), processes (``RLIMIT_NPROC``), file size (``RLIMIT_FSIZE``),
  open files, and no core dumps. They are applied by a short prelude the child runs first rather than
  by ``preexec_fn``, which is unsafe when the calling program has threads (a trainer often does);
- a private temporary working directory (also ``HOME`` and ``TMPDIR``), deleted afterwards;
- a scrubbed environment (``PATH``, ``LANG``, single-threaded BLAS; nothing inherited);
- no network, best effort: the prelude tries ``unshare(CLONE_NEWNET)`` (then with ``CLONE_NEWUSER``)
  through ctypes and silently goes on if the kernel refuses; in every case ``socket.socket``,
  ``socket.create_connection``, ``getaddrinfo`` and friends are replaced so that using them raises
  ``PermissionError``;
- when started as root, the child drops to uid/gid 65534 (``nobody``) so it cannot raise its limits
  (only when ``nobody`` can read the interpreter's files; otherwise it keeps the caller's uid);
- output (stdout and stderr interleaved) cut to ``max_output`` characters; a flood of output ends the
  run early.

Like a notebook cell, the value of a final bare expression is printed (``2 + 2`` shows ``4``).
Exceptions come back as their traceback text. This is a guard against mistakes and casual abuse in a
training loop, not a security boundary against a determined attacker (code can still call libc
directly through ctypes); run training jobs in a container as well.
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

#: Longest code accepted, in UTF-8 bytes (it is sent through a pipe before the child starts reading).
MAX_CODE_BYTES = 60_000
#: uid/gid the child switches to when the caller is root.
NOBODY = 65534
#: Output beyond this many bytes stops the run early.
OUTPUT_FLOOD_BYTES = 1 << 20

_PRELUDE = r"""
import sys
def _tinkergym_setup(config):
    import ctypes, os, resource
    if config["network_namespace"]:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            for flags in (0x40000000, 0x40000000 | 0x10000000):  # CLONE_NEWNET, then with CLONE_NEWUSER
                if libc.unshare(flags) == 0:
                    break
        except Exception:
            pass
    for name, soft, hard in config["limits"]:
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
    if config["drop_to"] is not None and os.geteuid() == 0:
        try:
            os.setgroups([])
            os.setgid(config["drop_to"])
            os.setuid(config["drop_to"])
        except OSError:
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
import json as _json
_tinkergym_setup(_json.loads(sys.argv[1]))
sys.stderr = sys.stdout
_tinkergym_code = sys.stdin.read()
del _json
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
    """

    output: str
    returncode: int | None
    timed_out: bool
    truncated: bool
    duration: float

    def to_text(self) -> str:
        """The output with a note on timeouts, signals and exit codes, for a tool result."""
        notes = []
        if self.timed_out:
            notes.append(f"[timed out after {self.duration:.1f}s; the process was killed]")
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


def _limits(timeout: float, memory_mb: int, max_file_mb: int) -> list[tuple[str, int, int]]:
    """``(name, soft, hard)`` resource limits for the child (CPU: SIGXCPU at soft, SIGKILL at hard)."""
    cpu = max(1, math.ceil(timeout)) + 1
    memory, files = memory_mb * 1024 * 1024, max_file_mb * 1024 * 1024
    return [
        ("RLIMIT_AS", memory, memory),
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_NPROC", 32, 32),
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


@lru_cache(maxsize=1)
def _nobody_can_run_python() -> bool:
    """Whether uid ``nobody`` can reach this interpreter's standard library and site-packages.

    (A Python installed under a private home directory, e.g. ``/root/.pyenv``, cannot be used after
    dropping privileges; the child then keeps the caller's uid and relies on the other limits.)
    """
    paths = {os.path.dirname(os.path.realpath(sys.executable))}
    paths.update(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib"))
    for path in paths:
        path = os.path.realpath(path)
        try:
            if os.stat(path).st_mode & 0o005 != 0o005:
                return False
            while path != os.path.dirname(path):
                path = os.path.dirname(path)
                if not os.stat(path).st_mode & 0o001:
                    return False
        except OSError:
            return False
    return True


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


def run_python(
    code: str,
    *,
    timeout: float = 5.0,
    memory_mb: int = 512,
    max_output: int = 4_000,
    max_file_mb: int = 16,
    network_namespace: bool = True,
) -> SandboxResult:
    """Run ``code`` in a sandboxed Python subprocess and return what it printed (see the module docstring).

    Args:
        code: Python source.
        timeout: Wall-clock seconds before the process group is killed (the CPU limit is one more).
        memory_mb: Address-space limit in MiB.
        max_output: Characters of output kept.
        max_file_mb: Largest file the code may write, in MiB.
        network_namespace: Also try ``unshare(CLONE_NEWNET)`` (sockets are refused either way).
    """
    start = time.monotonic()
    if os.name != "posix":
        return SandboxResult("Error: the python tool needs Linux or macOS.", None, False, False, 0.0)
    payload = code.encode("utf-8", errors="replace") if isinstance(code, str) else b""
    if len(payload) > MAX_CODE_BYTES:
        return SandboxResult(f"Error: the code is {len(payload):,} bytes long; the limit is {MAX_CODE_BYTES:,}.", None, False, False, 0.0)
    workdir = tempfile.mkdtemp(prefix="tinkergym-math-")
    try:
        drop_to = NOBODY if os.geteuid() == 0 and _nobody_can_run_python() else None
        if drop_to is not None:
            os.chown(workdir, drop_to, drop_to)
        config = {"limits": _limits(timeout, memory_mb, max_file_mb), "drop_to": drop_to, "network_namespace": network_namespace}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _PRELUDE, json.dumps(config)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                cwd=workdir, env=_clean_environment(workdir), start_new_session=True, close_fds=True,
            )
        except OSError as exc:
            return SandboxResult(f"Error: could not start Python ({exc}).", None, False, False, time.monotonic() - start)
        return _finish(proc, payload, start, timeout, max_output)
    finally:
        _remove_tree(workdir)


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
