"""Tests of the tool sandbox: output handling, limits and the behaviour every tool call relies on.

The attacks on the isolation itself are in ``test_sandbox_attacks.py``.
"""

from __future__ import annotations

import os
import time


from tinkergym.sandbox import MAX_CODE_BYTES, run_python


def test_output_and_final_expression():
    result = run_python("x = 6 * 7\nprint('x is', x)\nx + 1")
    assert result.output == "x is 42\n43\n"
    assert result.returncode == 0 and not result.timed_out and not result.truncated
    assert result.to_text() == "x is 42\n43"


def test_stdout_and_stderr_interleave_in_order():
    code = "import sys\nprint('one')\nprint('two', file=sys.stderr)\nprint('three')"
    assert run_python(code).output == "one\ntwo\nthree\n"


def test_exception_comes_back_as_traceback_text():
    result = run_python("def f():\n    return 1 / 0\nprint('before')\nf()")
    assert result.returncode == 1
    assert result.output.startswith("before\nTraceback (most recent call last):")
    assert 'File "<python>", line 2, in f' in result.output and "return 1 / 0" in result.output
    assert result.output.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "_tinkergym" not in result.output  # the prelude stays out of the traceback
    assert "/usr/lib" not in result.output


def test_syntax_error_and_exit_code():
    result = run_python("def f(:")
    assert "SyntaxError" in result.output and "ast.py" not in result.output
    assert run_python("import sys; sys.exit(3)").to_text() == "[exit code 3]"
    assert run_python("x = 1").to_text().startswith("(no output")


def test_timeout_kills_an_infinite_loop():
    start = time.monotonic()
    result = run_python("while True:\n    pass", timeout=1.0)
    assert time.monotonic() - start < 5
    assert result.timed_out and result.returncode == -9
    assert "timed out" in result.to_text()


def test_memory_bomb_fails_cleanly():
    result = run_python("x = bytearray(4 * 1024 ** 3)\nprint('allocated')", memory_mb=256)
    assert "MemoryError" in result.output and "allocated" not in result.output
    result = run_python("a = [0] * (10 ** 9)", memory_mb=256)
    assert "MemoryError" in result.output


def test_network_is_refused():
    code = (
        "import socket, _socket\n"
        "for attempt in (lambda: socket.create_connection(('127.0.0.1', 9), timeout=1),\n"
        "                lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM),\n"
        "                lambda: _socket.socket(),\n"
        "                lambda: socket.getaddrinfo('example.com', 80)):\n"
        "    try:\n"
        "        attempt()\n"
        "        print('connected')\n"
        "    except OSError as exc:\n"
        "        print(type(exc).__name__)\n"
    )
    result = run_python(code)
    assert "connected" not in result.output
    assert result.output.split() == ["PermissionError"] * 4
    result = run_python("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9', timeout=1)")
    assert "network access is disabled" in result.output or "URLError" in result.output


def test_files_go_to_a_private_tmpfs():
    code = "import os\nopen('note.txt', 'w').write('hi')\nos.mkdir('sub')\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))"
    result = run_python(code)
    assert result.output.splitlines() == ["/tmp", "['note.txt', 'sub']"]
    assert not os.path.exists("/tmp/note.txt") and not os.path.exists("note.txt")


def test_file_size_limit():
    result = run_python("open('big', 'wb').write(b'x' * (3 * 1024 * 1024))", max_file_mb=1)
    assert "File too large" in result.output
    assert not result.truncated


def test_resource_limits_are_set_in_the_child():
    code = (
        "import resource\n"
        "for name in ('RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_NPROC', 'RLIMIT_FSIZE', 'RLIMIT_CORE'):\n"
        "    print(name, *resource.getrlimit(getattr(resource, name)))\n"
    )
    lines = dict(line.split(" ", 1) for line in run_python(code, timeout=2, memory_mb=300, max_file_mb=2).output.splitlines())
    mib = 1024 * 1024
    assert lines["RLIMIT_AS"] == f"{300 * mib} {300 * mib}"
    assert lines["RLIMIT_CPU"] == "3 4"
    assert lines["RLIMIT_FSIZE"] == f"{2 * mib} {2 * mib}"
    assert lines["RLIMIT_CORE"] == "0 0"
    assert int(lines["RLIMIT_NPROC"].split()[0]) <= 32


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("TINKERGYM_TEST_SECRET", "s3cret")
    result = run_python("import os\nprint(sorted(os.environ))\nprint(os.environ['HOME'] == os.getcwd())")
    assert "TINKERGYM_TEST_SECRET" not in result.output and "s3cret" not in result.output
    assert result.output.splitlines()[1] == "True"


def test_isolated_mode():
    assert run_python("import sys\nprint(sys.flags.isolated)").output == "1\n"


def test_output_is_truncated():
    result = run_python("print('x' * 50_000)", max_output=1000)
    assert result.truncated
    assert result.output.startswith("x" * 1000) and "[output truncated after 1,000 characters]" in result.output
    assert len(result.output) < 1100


def test_output_flood_stops_early():
    start = time.monotonic()
    result = run_python("while True:\n    print('y' * 1000)", timeout=10, max_output=500)
    assert time.monotonic() - start < 5 and result.truncated and not result.timed_out


def test_bad_bytes_and_input():
    result = run_python("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe end\\n')")
    assert result.output.startswith("ok ") and "end" in result.output
    assert "EOFError" in run_python("input()").output


def test_code_size_limit():
    result = run_python("#" * (MAX_CODE_BYTES + 1))
    assert result.returncode is None and "limit" in result.output
