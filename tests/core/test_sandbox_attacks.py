"""Tool code tried as an attacker would: each attack on the sandbox must fail, as root (CI) or not.

Root-only (0600) files are planted in the home folder and in the project; a listener waits on the host's
loopback; a process of the sandbox's own host uid runs beside it. None of them may be reached.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from tinkergym.errors import SandboxUnavailableError
from tinkergym.sandbox import NOBODY, check_sandbox, run_python

PROJECT = Path(__file__).resolve().parents[2]


@pytest.fixture
def planted(tmp_path):
    """Secret 0600 files in the home folder, in the project and in a temporary folder; removed afterwards."""
    secret = f"secret-{uuid.uuid4().hex}"
    paths = [Path.home() / f".tinkergym-planted-{uuid.uuid4().hex}", PROJECT / f".planted-{uuid.uuid4().hex}", tmp_path / "planted"]
    for path in paths:
        path.write_text(secret)
        path.chmod(0o600)
    yield secret, paths
    for path in paths:
        path.unlink(missing_ok=True)


def _sandbox_pids(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                if marker.encode() in handle.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


def test_host_files_are_out_of_sight(planted):
    secret, paths = planted
    targets = [*map(str, paths), "/etc/shadow", "/etc/passwd", str(PROJECT / "README.md"), str(Path.home() / ".bashrc")]
    code = (
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        print('OPENED', path, open(path).read()[:80])\n"
        "    except OSError as exc:\n"
        "        print('denied', path, type(exc).__name__)\n"
        f"for folder in ('/', '/root', '/home', {str(Path.home())!r}, {str(PROJECT)!r}, '/etc', '/work'):\n"
        "    try:\n"
        "        print('LISTED', folder, sorted(os.listdir(folder)))\n"
        "    except OSError as exc:\n"
        "        print('denied', folder, type(exc).__name__)\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.output
    assert secret not in result.output
    assert "OPENED" not in result.output
    listed = [line for line in result.output.splitlines() if line.startswith("LISTED")]
    assert len(listed) == 1 and listed[0].startswith("LISTED / "), result.output  # only the sandbox's own root
    assert set(eval(listed[0].removeprefix("LISTED / "))) <= {"bin", "dev", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}


def test_host_proc_and_the_trainers_environment_are_out_of_sight(monkeypatch):
    secret = f"token-{uuid.uuid4().hex}"
    monkeypatch.setenv("TINKERGYM_TEST_API_KEY", secret)
    code = (
        "import os\n"
        "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "print('pids', pids)\n"
        "for pid in pids + [" + str(os.getpid()) + ", " + str(os.getppid()) + "]:\n"
        "    try:\n"
        "        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as exc:\n"
        "        print('denied', pid, type(exc).__name__)\n"
    )
    result = run_python(code)
    assert secret not in result.output
    pids = eval(result.output.splitlines()[0].removeprefix("pids "))  # noqa: S307 - a list of ints we printed
    assert max(pids) < 10, "the sandbox sees host processes"


def test_mount_and_new_user_namespaces_are_refused(tmp_path):
    host = tmp_path / "host-folder"
    host.mkdir()
    (host / "keep.txt").write_text("keep")
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "os.makedirs('/tmp/m', exist_ok=True)\n"
        f"print('bind', libc.mount(b'{host}', b'/tmp/m', None, 4096, None), ctypes.get_errno())\n"  # MS_BIND
        "print('bind-root', libc.mount(b'/', b'/tmp/m', None, 4096 | 16384, None), ctypes.get_errno())\n"  # | MS_REC
        "print('userns', libc.unshare(0x10000000), ctypes.get_errno())\n"
        "print('userns+mountns', libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())\n"
        "print('listing', os.listdir('/tmp/m'))\n"
    )
    result = run_python(code)
    lines = dict(line.split(" ", 1) for line in result.output.splitlines())
    for key in ("bind", "bind-root", "userns", "userns+mountns"):
        assert lines[key].split()[0] == "-1", result.output
    assert lines["listing"] == "[]"
    assert (host / "keep.txt").read_text() == "keep"


def test_no_way_to_the_hosts_loopback():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    # Raw libc calls: no Python-level guard stands between the code and the kernel.
    code = (
        "import ctypes, os, struct\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def connect():\n"
        "    fd = libc.socket(2, 1, 0)\n"
        "    if fd < 0:\n"
        "        return f'socket errno {ctypes.get_errno()}'\n"
        "    addr = struct.pack('<H', 2) + struct.pack('>H', " + str(port) + ") + bytes([127, 0, 0, 1]) + bytes(8)\n"
        "    rc = libc.connect(fd, addr, len(addr))\n"
        "    return f'connect {rc} errno {ctypes.get_errno()}'\n"
        "print('own', connect())\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        try:\n"
        "            fd = os.open(f'/proc/{pid}/ns/net', os.O_RDONLY)\n"
        "            print('setns', pid, libc.setns(fd, 0x40000000), ctypes.get_errno(), connect())\n"
        "        except OSError as exc:\n"
        "            print('setns', pid, 'denied', exc.errno)\n"
    )
    try:
        result = run_python(code)
    finally:
        time.sleep(0.3)
        stop.set()
        thread.join()
        listener.close()
    assert accepted == [], result.output
    assert "connect 0 " not in result.output, result.output


def test_processes_outside_cannot_be_signalled():
    sentinel = subprocess.Popen(["sleep", "60"], **_as_sandbox_user())
    try:
        code = (
            "import os, signal\n"
            "os.kill(os.getppid(), signal.SIGSTOP)\n"
            "for pid in range(1, 40000):\n"
            "    for sig in (signal.SIGSTOP, signal.SIGKILL):\n"
            "        try:\n"
            "            os.kill(pid, sig) if pid != os.getpid() else None\n"
            "        except OSError:\n"
            "            pass\n"
            "try:\n"
            "    os.kill(-1, signal.SIGKILL)\n"
            "except OSError:\n"
            "    pass\n"
            "print('done')\n"
        )
        result = run_python(code, timeout=10)
        assert sentinel.poll() is None, "a process outside the sandbox was killed"
        with open(f"/proc/{sentinel.pid}/status") as handle:
            state = next(line for line in handle if line.startswith("State:"))
        assert "T" not in state, "a process outside the sandbox was stopped"
        assert not result.timed_out
    finally:
        sentinel.kill()
        sentinel.wait()


def _as_sandbox_user() -> dict:
    """Popen arguments that start a process as the uid sandboxed code runs as on the host."""
    if os.geteuid() == 0:
        return {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    return {}


@pytest.mark.parametrize("timeout", [3.0, 0.8])
def test_nothing_outlives_a_call(timeout):
    marker = f"daemon-{uuid.uuid4().hex}"
    code = (
        "import os, time, subprocess\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/usr/bin/python3', ['python3', '-c', 'import time; time.sleep(60)', {marker!r}])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "print('started')\n"
        + ("time.sleep(60)\n" if timeout < 1 else "")
    )
    result = run_python(code, timeout=timeout)
    assert result.timed_out == (timeout < 1)
    for _ in range(20):
        if not _sandbox_pids(marker):
            break
        time.sleep(0.1)
    assert _sandbox_pids(marker) == [], "a daemon started by tool code outlived the call"


def test_disk_is_bounded_in_total():
    marker = f"marker-{uuid.uuid4().hex}"
    code = (
        "import os\n"
        f"for folder in ('/tmp', '/dev/shm'):\n"
        f"    open(f'{{folder}}/{marker}', 'w').write('x')\n"
        "written = 0\n"
        "for folder in ('/tmp', '/dev/shm'):\n"
        "    for i in range(200):\n"
        "        try:\n"
        "            with open(f'{folder}/f{i}', 'wb') as handle:\n"
        "                handle.write(b'x' * (1 << 20))\n"
        "            written += 1\n"
        "        except OSError as exc:\n"
        "            print(folder, 'stopped', exc.errno)\n"
        "            break\n"
        "for path in ('/x', '/dev/x', '/usr/x', '/proc/x'):\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('WROTE', path)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('MiB', written)\n"
    )
    result = run_python(code, disk_mb=8, max_file_mb=4)
    assert "WROTE" not in result.output
    written = int(result.output.split("MiB ")[-1])
    assert written <= 2 * 8, result.output
    assert "/tmp stopped 28" in result.output and "/dev/shm stopped 28" in result.output  # ENOSPC
    assert not os.path.exists(f"/tmp/{marker}") and not os.path.exists(f"/dev/shm/{marker}")  # the host's stay untouched


def test_process_limit_holds_and_is_per_call():
    code = (
        "import os, time\n"
        "children = 0\n"
        "for _ in range(64):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(2)\n"
        "            os._exit(0)\n"
        "        children += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print('children', children, 'uid', os.getuid())\n"
    )
    results = [None] * 3

    def call(index):
        results[index] = run_python(code, max_processes=24, timeout=10)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        children = int(result.output.split()[1])
        # The limit holds (it would not for uid 0), and calls side by side do not eat into each other's.
        assert 16 <= children < 24, result.output
    if os.geteuid() == 0:
        assert results[0].output.split()[3] == str(NOBODY)


def test_refused_without_bubblewrap(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap"):
        check_sandbox()
    result = run_python("print('ran')")
    assert result.returncode is None and "ran" not in result.output
    assert "bubblewrap" in result.output and "not a security boundary" in result.output.lower()
    # The explicit opt-in still runs code, and never as root.
    result = run_python("import os\nprint('ran', os.getuid())", isolation="rlimits")
    assert result.output.split()[0] == "ran"
    if os.geteuid() == 0:
        assert result.output.split()[1] == str(NOBODY)


@pytest.mark.skipif(os.geteuid() != 0, reason="an interpreter only root can read exists only for root")
def test_an_interpreter_only_root_can_read_is_refused_not_run_as_root(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    python = private / "python3"
    shutil.copy2(os.path.realpath("/usr/bin/python3"), python)
    with pytest.raises(SandboxUnavailableError, match="not readable by uid"):
        check_sandbox(python=str(python))
    with pytest.raises(SandboxUnavailableError, match="not readable by uid"):
        check_sandbox("rlimits", python=str(python))
    assert "never runs as root" in run_python("print(1)", isolation="rlimits", python=str(python)).output


def test_rlimits_opt_in_is_not_root_and_keeps_its_limits():
    code = "import os, resource\nprint(os.getuid(), resource.getrlimit(resource.RLIMIT_NPROC)[0])"
    uid, nproc = run_python(code, isolation="rlimits", max_processes=20).output.split()
    assert int(nproc) <= 20
    if os.geteuid() == 0:
        assert int(uid) == NOBODY


#: Raw system calls through libc (what an attacker does past Python's own guards), x86-64 numbers: each prints
#: ``name result errno``. Arguments are valid where it matters, so that each call succeeds without the filter
#: on a stock kernel (io_uring with a zeroed params block, userfaultfd in user mode only, a keyring lookup...).
SYSCALL_ATTACKS = r'''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
src, dst, params, pair = (ctypes.create_string_buffer(n) for n in (16, 16, 120, 8))
local, remote = iovec(ctypes.cast(dst, ctypes.c_void_p), 16), iovec(ctypes.cast(src, ctypes.c_void_p), 16)
attacks = {
    "ptrace": (101, 0, 0, 0, 0),
    "process_vm_readv": (310, os.getpid(), ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0),
    "process_vm_writev": (311, os.getpid(), ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0),
    "io_uring_setup": (425, 1, ctypes.addressof(params)),
    "userfaultfd": (323, 1),
    "bpf": (321, 0, 0, 0),
    "perf_event_open": (298, 0, 0, -1, -1, 0),
    "keyctl": (250, 0, -3, 0),
    "add_key": (248, 0, 0, 0, 0, -3),
    "socket_inet": (41, 2, 1, 0),
    "socket_inet6": (41, 10, 2, 0),
    "socket_vsock": (41, 40, 1, 0),
    "socket_netlink": (41, 16, 3, 0),
    "socket_packet": (41, 17, 3, 0),
    "socketpair_inet": (53, 2, 1, 0, ctypes.addressof(pair)),
    "socket_unix": (41, 1, 1, 0),
}
for name, (nr, *args) in attacks.items():
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args))
    print(name, result, ctypes.get_errno())
'''


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the attack uses x86-64 system call numbers")
def test_the_seccomp_filter_denies_what_code_has_no_use_for():
    """ptrace, cross-process memory, io_uring, userfaultfd, bpf, perf events, the key store and every socket family but
    AF_UNIX answer EPERM inside the sandbox; without the filter (the rlimits guard) most of them succeed here."""
    import errno

    result = run_python(SYSCALL_ATTACKS)
    rows = {name: (int(value), int(err)) for name, value, err in (line.split() for line in result.output.splitlines())}
    assert len(rows) == 16, result.output
    for name, (value, err) in rows.items():
        if name == "socket_unix":
            assert value >= 0, result.output  # local sockets still work (multiprocessing, asyncio)
        else:
            assert (value, err) == (-1, errno.EPERM), (name, result.output)
    status = run_python("print(open('/proc/self/status').read())").output
    assert "Seccomp:\t2" in status  # a filter is in force (bubblewrap installs none of its own)
    unfiltered = run_python(SYSCALL_ATTACKS, isolation="rlimits").output
    allowed = [line.split()[0] for line in unfiltered.splitlines() if int(line.split()[1]) >= 0]
    assert {"ptrace", "socket_inet", "socket_unix"} <= set(allowed), unfiltered  # the calls are real: they work unfiltered


def test_system_calls_of_another_abi_end_the_process():
    """A 32-bit system call (int 0x80) would pass a filter written for x86-64's numbers: it ends the process instead."""
    if os.uname().machine != "x86_64":
        pytest.skip("the attack is x86-64 machine code")
    code = (
        "import ctypes, mmap\n"
        "# mov eax, 20 (getpid on i386); int 0x80; ret\n"
        "blob = bytes([0xb8, 20, 0, 0, 0, 0xcd, 0x80, 0xc3])\n"
        "page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
        "page.write(blob)\n"
        "address = ctypes.addressof(ctypes.c_char.from_buffer(page))\n"
        "print('before', flush=True)\n"
        "print('after', ctypes.CFUNCTYPE(ctypes.c_int)(address)(), flush=True)\n"
    )
    import signal

    if "after" not in run_python(code, isolation="rlimits").output:
        pytest.skip("this kernel runs no 32-bit system calls (no IA-32 emulation): nothing to filter")
    result = run_python(code)
    assert "before" in result.output and "after" not in result.output, result.output
    assert result.returncode == -signal.SIGSYS, result  # the filter's bad-ABI action


def test_without_libseccomp_bindings_the_sandbox_refuses(monkeypatch):
    from tinkergym.sandbox import run as sandbox

    def missing() -> bytes:
        raise SandboxUnavailableError("the sandbox's seccomp filter needs libseccomp's Python bindings ... apt-get install bubblewrap python3-seccomp")

    monkeypatch.setattr(sandbox, "seccomp_program", missing)
    sandbox._bubblewrap_problem.cache_clear()
    try:
        result = run_python("print(1)")
        assert result.output.startswith("Error:") and "python3-seccomp" in result.output and "1\n" not in result.output
    finally:
        sandbox._bubblewrap_problem.cache_clear()
