"""A call's total memory is bounded, not only each process's: forks, memfds, tmpfs files and shared memory together.

Where the host lets this process make memory cgroups, the call's cgroup reports its peak; in the implied bound (no
cgroup), the sandbox's processes and files are sampled from the host. Either way the total stays within the bound
the result reports, plus :data:`SLACK` (sampling's own error, bubblewrap's helpers, the kernel's rounding).
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest

from tinkergym.errors import ConfigError
from tinkergym.sandbox import memory as sandbox_memory
from tinkergym.sandbox import MEMORY_BOUNDS, memory_bound, run_python

MIB = 1 << 20
#: What a measured total may exceed the reported bound by.
SLACK = 16 * MIB

#: Forks 8 children that each hold just under the address-space limit, fills 16 memfds, the tmpfs /tmp and
#: /dev/shm, maps System V shared memory, then holds just under the limit itself: about 11x ``memory_mb`` if
#: nothing bounds the call's total. ``MARKER`` names every process of it (its comm) for the host's sampler.
ATTACK = r'''
import ctypes, os, signal, time
MiB = 1 << 20
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(15, MARKER.encode(), 0, 0, 0)  # PR_SET_NAME
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
def hold(fill):
    for size in range(LIMIT - 16, 0, -8):
        try:
            return size, bytes([fill]) * (size * MiB)
        except MemoryError:
            pass
    return 0, b''
report, pids = {}, []
for _ in range(8):
    try:
        pid = os.fork()
    except OSError as exc:
        report['fork'] = exc.errno
        break
    if pid == 0:
        block = hold(1)
        time.sleep(4)
        os._exit(0)
    pids.append(pid)
time.sleep(1)
fds = []
def fill(make, count):
    done = 0
    try:
        for i in range(count):
            fds.append(make(i))
            for _ in range(16):
                os.write(fds[-1], b'\x02' * MiB)
                done += 1
    except (OSError, MemoryError) as exc:
        return done, getattr(exc, 'errno', 'MemoryError')
    return done, None
report['memfd'] = fill(lambda i: os.memfd_create(f'm{i}'), 16)
report['tmp'] = fill(lambda i: os.open(f'/tmp/f{i}', os.O_CREAT | os.O_WRONLY, 0o600), 8)
report['shm'] = fill(lambda i: os.open(f'/dev/shm/f{i}', os.O_CREAT | os.O_WRONLY, 0o600), 8)
libc.shmat.restype = ctypes.c_void_p
shmid = libc.shmget(0, 64 * MiB, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
address = libc.shmat(shmid, None, 0) if shmid >= 0 else None
if address not in (None, ctypes.c_void_p(-1).value):
    ctypes.memset(address, 3, 64 * MiB)
    report['sysv'] = 64
else:
    report['sysv'] = ctypes.get_errno()
report['main'], block = hold(4)
time.sleep(1.5)
report['children'] = [os.waitpid(pid, 0)[1] for pid in pids]
print('REPORT', report)
'''


def _sampled_total(marker: str) -> int:
    """Bytes the processes named ``marker`` hold (proportional anonymous and shared memory, unmapped memfds)
    plus what their tmpfs /tmp and /dev/shm hold, as the host sees it now."""
    total, seen, member = 0, set(), None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as handle:
                if handle.read().strip() != marker:
                    continue
            with open(f"/proc/{entry}/smaps_rollup") as handle:
                fields = dict(line.split(":", 1) for line in handle if line[:1].isalpha())
            total += sum(int(fields.get(key, "0 kB").split()[0]) * 1024 for key in ("Pss_Anon", "Pss_Shmem"))
            member = member or entry
            for fd in os.listdir(f"/proc/{entry}/fd"):
                path = f"/proc/{entry}/fd/{fd}"
                if os.readlink(path).startswith("/memfd:"):
                    info = os.stat(path)
                    if (info.st_dev, info.st_ino) not in seen:
                        seen.add((info.st_dev, info.st_ino))
                        total += info.st_blocks * 512
        except (OSError, ValueError):
            continue
    for folder in ("tmp", "dev/shm") if member else ():
        try:
            info = os.statvfs(f"/proc/{member}/root/{folder}")
            total += (info.f_blocks - info.f_bfree) * info.f_frsize
        except OSError:
            pass
    return total


def _attack(**kwargs):
    """Run :data:`ATTACK` with ``memory_mb=128``; return the result and the highest total sampled from the host."""
    marker = "tg" + uuid.uuid4().hex[:13]  # comm holds 15 characters
    code = ATTACK.replace("MARKER", repr(marker)).replace("LIMIT", "128")
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _sampled_total(marker))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = run_python(code, memory_mb=128, timeout=30, **kwargs)
    finally:
        stop.set()
        sampler.join()
    return result, peak[0]


def _host_kind() -> str:
    """The bound this host should give a call, found apart from the sandbox's own probing (exact as root only)."""
    mounts = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            left, _, right = line.partition(" - ")
            mounts.append((left.split()[4], right.split()[0], right.split()[2].split(",")))
    for kind, fstype in (("cgroup-v2", "cgroup2"), ("cgroup-v1", "cgroup")):
        for mountpoint, mounted, options in mounts:
            if mounted != fstype or not os.access(mountpoint, os.W_OK):
                continue
            if "memory" in (options if kind == "cgroup-v1" else open(f"{mountpoint}/cgroup.subtree_control").read().split()):
                return kind
    return "implied"


def test_the_reported_bound_matches_the_host():
    bound = memory_bound(memory_mb=128, disk_mb=64)
    if os.geteuid() == 0:
        assert bound.kind == _host_kind()
    assert bound.kind in MEMORY_BOUNDS
    assert bound.total_bytes == (128 * MIB if bound.kind != "implied" else (128 + 2 * 64) * MIB)
    result = run_python("print(1)", memory_mb=128)
    assert (result.memory_bound, result.memory_total_bytes) == (bound.kind, bound.total_bytes)
    implied = run_python("print(1)", memory_mb=128, disk_mb=8, memory_bound="implied")
    assert (implied.output, implied.memory_bound, implied.memory_total_bytes) == ("1\n", "implied", (128 + 16) * MIB)
    assert memory_bound(memory_mb=100, max_processes=4, isolation="rlimits", kind="implied").total_bytes == 400 * MIB
    with pytest.raises(ConfigError, match="choose one of"):
        memory_bound(kind="cgroup-v3")
    other = next(kind for kind in ("cgroup-v2", "cgroup-v1") if kind != bound.kind)
    refused = run_python("print(1)", memory_bound=other)
    assert refused.returncode is None and "this host offers" in refused.output


@pytest.mark.slow
@pytest.mark.parametrize("kind", [None, "implied"])
def test_forks_memfds_tmpfs_and_shared_memory_stay_within_the_calls_total(kind):
    result, sampled = _attack(memory_bound=kind)
    assert result.memory_bound == (kind or memory_bound().kind)
    assert result.memory_total_bytes == (128 * MIB if result.memory_bound != "implied" else (128 + 2 * 64) * MIB)
    assert sampled <= result.memory_total_bytes + SLACK, (sampled / MIB, result)
    report = eval(result.output.split("REPORT ", 1)[1]) if "REPORT " in result.output else None  # noqa: S307 - our own dict
    if result.memory_bound != "implied":
        assert result.memory_peak_bytes is not None and result.memory_peak_bytes <= result.memory_total_bytes + SLACK, result
        # Over 1 GiB was asked for: the OOM killer ended a process, or allocations failed.
        failed = report is not None and (any(report["children"]) or any(report[k][1] for k in ("memfd", "tmp", "shm")))
        assert result.memory_killed or failed, result
        if result.memory_killed:
            assert "killed: memory limit (128 MiB" in result.to_text()
    else:
        # One process, no memfds, no System V shared memory: what is left fits the implied total.
        assert report is not None, result
        assert report["fork"] == 1 and report["memfd"] == (0, 1) and report["sysv"] == 1 and report["children"] == [], report


def _own_cgroups() -> list[str]:
    parent = sandbox_memory.cgroup_parent()
    prefix = f"{sandbox_memory.CGROUP_PREFIX}{os.getpid()}-"
    return [] if parent is None else [os.path.join(parent[1], name) for name in os.listdir(parent[1]) if name.startswith(prefix)]


@pytest.mark.skipif(memory_bound().kind == "implied", reason="this host gives this process no memory cgroup")
def test_the_call_runs_in_its_own_cgroup_which_goes_away_even_on_timeout():
    seen: list[list[str]] = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            for path in _own_cgroups():
                try:
                    with open(os.path.join(path, "cgroup.procs")) as handle:
                        seen.append(handle.read().split())
                except OSError:
                    pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('started', flush=True)\ntime.sleep(60)\n"
    try:
        result = run_python(code, timeout=1.5)
    finally:
        stop.set()
        watcher.join()
    assert result.timed_out and "started" in result.output
    assert max(map(len, seen), default=0) >= 4, seen  # bubblewrap, its init, the interpreter and its child, all inside
    assert _own_cgroups() == []  # removed, which the kernel allows only once no process is left in it


@pytest.mark.skipif(memory_bound().kind == "implied", reason="this host gives this process no memory cgroup")
def test_a_cgroup_that_cannot_be_made_falls_back_to_the_implied_bound_and_stale_ones_are_removed(monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "read-only cgroup")

    monkeypatch.setattr(sandbox_memory.CallCgroup, "create", refuse)
    result = run_python("import os\nos.fork()", memory_mb=128)
    assert result.memory_bound == "implied" and "PermissionError" in result.output
    monkeypatch.undo()
    kind, parent = sandbox_memory.cgroup_parent()
    dead = 1
    while os.path.exists(f"/proc/{dead}"):
        dead += 7919
    stale = os.path.join(parent, f"{sandbox_memory.CGROUP_PREFIX}{dead}-left")
    os.mkdir(stale)
    sandbox_memory.cgroup_parent.cache_clear()
    assert sandbox_memory.cgroup_parent() == (kind, parent)
    assert not os.path.exists(stale)


def test_the_implied_bound_keeps_code_to_one_process_with_threads():
    code = (
        "import ctypes, os, subprocess, threading\n"
        "out = []\n"
        "threads = [threading.Thread(target=out.append, args=(i,)) for i in range(4)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print('threads', sorted(out))\n"
        "for name, call in (('fork', os.fork), ('memfd', lambda: os.memfd_create('x')), ('spawn', lambda: subprocess.run(['true']))):\n"
        "    try:\n"
        "        call()\n"
        "        print(name, 'ran')\n"
        "    except OSError as exc:\n"
        "        print(name, exc.errno)\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('shmget', libc.shmget(0, 1 << 20, 0o1600), ctypes.get_errno())\n"
        "print('msgget', libc.msgget(0, 0o1600), ctypes.get_errno())\n"
    )
    result = run_python(code, memory_bound="implied")
    assert result.output.splitlines() == ["threads [0, 1, 2, 3]", "fork 1", "memfd 1", "spawn 1", "shmget -1 1", "msgget -1 1"], result.output


def test_cgroup_v2_is_found_at_the_nearest_cgroup_that_hands_out_the_memory_controller(tmp_path, monkeypatch):
    """A delegated cgroup2 subtree: this process sits in a leaf below the cgroup that enables memory for its children."""
    root = tmp_path / "cgroup"
    leaf = root / "user.slice" / "service" / "leaf"
    leaf.mkdir(parents=True)
    (root / "cgroup.subtree_control").write_text("cpu memory pids\n")
    (root / "user.slice" / "cgroup.subtree_control").write_text("cpu memory\n")
    (root / "user.slice" / "service" / "cgroup.subtree_control").write_text("memory\n")
    (leaf / "cgroup.subtree_control").write_text("\n")
    v1 = tmp_path / "memory"
    v1.mkdir()
    monkeypatch.setattr(sandbox_memory, "_mounts", lambda: [("/", str(v1), "cgroup", ["rw", "memory"]), ("/", str(root), "cgroup2", ["rw"])])
    monkeypatch.setattr(sandbox_memory, "_own_cgroups", lambda: {"cgroup-v2": "/user.slice/service/leaf", "cgroup-v1": "/"})
    assert sandbox_memory._candidates() == [("cgroup-v2", str(root / "user.slice" / "service")), ("cgroup-v1", str(v1))]
    (root / "user.slice" / "service" / "cgroup.subtree_control").write_text("\n")  # not delegated: its parent then
    assert sandbox_memory._candidates()[0] == ("cgroup-v2", str(root / "user.slice"))
    for folder in (root, root / "user.slice"):
        (folder / "cgroup.subtree_control").write_text("cpu\n")  # no memory controller anywhere on v2: v1 only
    assert sandbox_memory._candidates() == [("cgroup-v1", str(v1))]
