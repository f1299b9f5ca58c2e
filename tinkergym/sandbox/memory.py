"""The bound on a tool call's total memory: its processes and its files together (see :mod:`tinkergym.sandbox`).

``RLIMIT_AS`` bounds one process. Code can start many, each with an address space of its own, and can keep memory
where no address space counts it: files in its tmpfs folders, ``memfd_create``, System V shared memory. So each call
gets a bound on its total, and :func:`memory_bound` (and every result, ``SandboxResult.memory_bound``) says which:

- ``"cgroup-v2"`` or ``"cgroup-v1"``: the call runs in a memory cgroup of its own, made for it and removed after it
  (timeouts included: whatever is still in it is killed first). Its limit, ``memory_mb``, holds everything the call
  keeps: its processes' memory, its tmpfs files and memfds, System V shared memory, the kernel memory charged to it;
  with no swap (cgroup v2 ``memory.swap.max`` 0; v1 ``memory.memsw.limit_in_bytes``, or ``memory.swappiness`` 0).
  The sandbox is started held at a ``read`` of its standard input; this process writes its pid to the cgroup's
  ``cgroup.procs`` and only then sends the code, so bubblewrap and everything it starts are in the cgroup before
  any of the code runs. When the limit is reached the kernel's OOM killer ends a process of the call (all of them
  on v2, ``memory.oom.group``) and the result says so (``memory_killed``; "killed: memory limit"): a result, never
  an exception. v2 is used where a cgroup2 hierarchy hands the memory controller to the children of this
  process's cgroup (or of an ancestor of it) and this process may make cgroups there: as root, or in a subtree
  delegated to its user. v1 where the memory controller is a v1 hierarchy this process may write (root on a
  host with the hybrid layout). The cgroups are made beside or below this process's own, so the host's limits
  on it still hold.
- ``"implied"``: no cgroup can be made (an unprivileged user without delegation, a read-only ``/sys/fs/cgroup``).
  The code is then kept to one process: the seccomp filter answers ``EPERM`` to ``fork``, ``vfork``, ``clone``
  without ``CLONE_THREAD`` (threads still run; they share the one address space), ``memfd_create``, and System V
  shared memory and message queues (``shmget``, ``msgget``). The total is what the limits imply: ``memory_mb``
  (the one address space) plus the two tmpfs folders, ``2 * disk_mb`` (``/tmp`` and ``/dev/shm``, each ``--size``
  capped; ``RLIMIT_FSIZE`` caps each file within them), plus bubblewrap's two small helper processes, which run no
  code. Kernel memory for pipes, sockets and file names is bounded by the open-file limit rather than counted.
  With ``isolation="rlimits"`` (no seccomp filter; not a security boundary) the implied total is
  ``max_processes * memory_mb``: a bound on mistakes, not on attacks.
"""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache

from tinkergym.errors import ConfigError

#: The bounds a call's total memory can have, best first.
MEMORY_BOUNDS = ("cgroup-v2", "cgroup-v1", "implied")
#: Per-call cgroups are named this, then the owner's pid and a random part.
CGROUP_PREFIX = "tinkergym-sandbox-"
_MIB = 1 << 20


@dataclass(frozen=True)
class MemoryBound:
    """Which bound holds a call's total memory (one of :data:`MEMORY_BOUNDS`), and that total in bytes."""

    kind: str
    total_bytes: int


def memory_bound(*, memory_mb: int = 512, disk_mb: int = 64, max_processes: int = 32, isolation: str = "bubblewrap",
                 kind: str | None = None) -> MemoryBound:
    """The bound a call with these limits gets here: a cgroup if one can be made, else the implied total.

    Args:
        kind: ``None`` for the best this host offers; ``"implied"`` to do without a cgroup.

    Raises:
        ConfigError: ``kind`` is unknown, or a cgroup kind this host does not offer.
    """
    if kind is not None and kind not in MEMORY_BOUNDS:
        raise ConfigError(f"memory_bound={kind!r}: choose one of {list(MEMORY_BOUNDS)}, or leave it unset for the best this host offers.")
    offered = cgroup_parent()
    if kind is None:
        kind = offered[0] if offered is not None else "implied"
    elif kind != "implied" and (offered is None or offered[0] != kind):
        here = offered[0] if offered is not None else "no memory cgroup this process may make"
        raise ConfigError(f"memory_bound={kind!r}: this host offers {here}; leave it unset for the best it offers.")
    if kind != "implied":
        return MemoryBound(kind, memory_mb * _MIB)
    if isolation == "bubblewrap":
        return MemoryBound(kind, (memory_mb + 2 * disk_mb) * _MIB)
    return MemoryBound(kind, max_processes * memory_mb * _MIB)


def call_bound(*, kind: str | None = None, **sizes) -> tuple[MemoryBound, CallCgroup | None]:
    """One call's bound (``sizes`` and ``kind`` as for :func:`memory_bound`) and its cgroup, made, for a cgroup bound.

    The caller removes the cgroup after the call (:meth:`CallCgroup.remove`).

    Raises:
        ConfigError: as :func:`memory_bound`.
    """
    bound, parent = memory_bound(kind=kind, **sizes), cgroup_parent()
    if bound.kind == "implied" or parent is None:
        return bound, None
    try:
        return bound, CallCgroup.create(bound.kind, parent[1], bound.total_bytes)
    except OSError:  # the host's cgroups changed since they were probed: the implied bound holds instead
        return memory_bound(kind="implied", **sizes), None


# ----- where cgroups can be made ------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return ""


def _mounts() -> list[tuple[str, str, str, list[str]]]:
    """``(root, mount point, filesystem type, super options)`` of this process's mounts."""
    unescape = lambda text: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)  # noqa: E731
    mounts = []
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3:
            mounts.append((unescape(fields[3]), unescape(fields[4]), tail[0], tail[2].split(",")))
    return mounts


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup in the v2 hierarchy (key ``"cgroup-v2"``) and in v1's memory one (``"cgroup-v1"``)."""
    own = {}
    for line in _read("/proc/self/cgroup").splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            own["cgroup-v2"] = path
        elif "memory" in controllers.split(","):
            own["cgroup-v1"] = path
    return own


def _candidates() -> list[tuple[str, str]]:
    """``(kind, folder)`` where a per-call memory cgroup might be made, best first."""
    own, found = _own_cgroups(), []
    for root, mountpoint, fstype, options in _mounts():
        kind = "cgroup-v2" if fstype == "cgroup2" else "cgroup-v1" if fstype == "cgroup" and "memory" in options else None
        path = own.get(kind or "")
        if kind is None or path is None or not (root == "/" or path == root or path.startswith(root + "/")):
            continue
        folder = os.path.normpath(mountpoint + "/" + (path if root == "/" else path[len(root):]))
        if kind == "cgroup-v2":  # the nearest cgroup, this one or above, whose children get the memory controller
            while "memory" not in _read(f"{folder}/cgroup.subtree_control").split() and folder != mountpoint:
                folder = os.path.dirname(folder)
            if "memory" not in _read(f"{folder}/cgroup.subtree_control").split():
                continue
        found.append((kind, folder))
    return sorted(found, key=lambda item: MEMORY_BOUNDS.index(item[0]))


@lru_cache(maxsize=1)
def cgroup_parent() -> tuple[str, str] | None:
    """``(kind, folder)`` under which this process makes per-call memory cgroups (found once), or ``None``."""
    for kind, folder in _candidates():
        _remove_stale(kind, folder)
        try:
            CallCgroup.create(kind, folder, 64 * _MIB).remove()
        except OSError:
            continue
        return kind, folder
    return None


def _remove_stale(kind: str, folder: str) -> None:
    """Remove the per-call cgroups of processes that ended without removing theirs."""
    try:
        names = [name for name in os.listdir(folder) if name.startswith(CGROUP_PREFIX)]
    except OSError:
        return
    for name in names:
        owner = name[len(CGROUP_PREFIX):].split("-")[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            CallCgroup(kind, os.path.join(folder, name)).remove(wait=0.5)


# ----- one call's cgroup --------------------------------------------------------------------------


class CallCgroup:
    """One call's memory cgroup: made before the call, removed after it."""

    def __init__(self, kind: str, path: str):
        self.kind, self.path = kind, path

    @classmethod
    def create(cls, kind: str, parent: str, limit_bytes: int) -> CallCgroup:
        """Make a cgroup under ``parent`` whose processes and files may hold ``limit_bytes`` in all, without swap.

        Raises:
            OSError: it cannot be made or limited (nothing is left behind).
        """
        group = cls(kind, os.path.join(parent, f"{CGROUP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"))
        os.mkdir(group.path)
        try:
            if kind == "cgroup-v2":
                group._write("memory.max", limit_bytes)
                group._write("memory.swap.max", 0, required=False)
                group._write("memory.oom.group", 1, required=False)  # the whole call ends, not one process of it
            else:
                group._write("memory.limit_in_bytes", limit_bytes)
                if not group._write("memory.memsw.limit_in_bytes", limit_bytes, required=False):  # without swap accounting
                    group._write("memory.swappiness", 0, required=False)
        except OSError:
            group.remove(wait=0.5)
            raise
        return group

    def _write(self, name: str, value: int, *, required: bool = True) -> bool:
        try:
            with open(os.path.join(self.path, name), "w") as handle:
                handle.write(str(value))
            return True
        except OSError:
            if required:
                raise
            return False

    def _number(self, name: str, key: str | None = None) -> int | None:
        text = _read(os.path.join(self.path, name))
        if key is not None:
            text = next((line.split()[1] for line in text.splitlines() if line.split()[:1] == [key]), "")
        return int(text) if text.strip().isdigit() else None

    def join(self, pid: int) -> None:
        """Move process ``pid`` (one not yet running anything it could fork from) into the cgroup.

        Raises:
            OSError: it could not be moved.
        """
        self._write("cgroup.procs", pid)

    def peak_bytes(self) -> int | None:
        """The most the call held at once (``None`` where the kernel does not keep it: cgroup v2 before Linux 5.19)."""
        return self._number("memory.peak" if self.kind == "cgroup-v2" else "memory.max_usage_in_bytes")

    def oom_kills(self) -> int:
        """How many of the call's processes the OOM killer ended."""
        name = "memory.events" if self.kind == "cgroup-v2" else "memory.oom_control"
        return self._number(name, "oom_kill") or 0

    def remove(self, wait: float = 5.0) -> None:
        """Kill whatever is left in the cgroup, then remove it (retrying for ``wait`` seconds while the killed exit)."""
        deadline, delay = time.monotonic() + wait, 0.001
        while True:
            self._kill_members()
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _kill_members(self) -> None:
        if self.kind == "cgroup-v2" and self._write("cgroup.kill", 1, required=False):
            return
        name = os.path.basename(self.path)
        for pid in _read(os.path.join(self.path, "cgroup.procs")).split():
            _kill_member(int(pid), name)


def _kill_member(pid: int, cgroup_name: str) -> None:
    """SIGKILL ``pid`` if it is still in the cgroup named ``cgroup_name`` (a pidfd: a reused pid is never hit)."""
    pidfd = None
    try:
        pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
        if not any(line.endswith("/" + cgroup_name) for line in _read(f"/proc/{pid}/cgroup").splitlines()):
            return
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    finally:
        if pidfd is not None:
            os.close(pidfd)
