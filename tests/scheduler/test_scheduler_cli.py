"""``tinkergym scheduler``: keys create/list/revoke, tenants, db upgrade/current, bad input (exit 2), and a real
``serve`` process on 127.0.0.1 that refuses requests without a key, takes a made key, stores no key in clear,
and refuses a revoked key at once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import click
import pytest
import testkit
import sqlalchemy as sa
from alembic.script import ScriptDirectory
from click.testing import CliRunner, Result

from testkit import log_text, wait_until_answers  # registered by tests/conftest.py

from tinkergym.cli import main
from tinkergym.scheduler.auth import KEY_PATTERN, key_digest
from tinkergym.scheduler.db import alembic_config, current_revision, make_engine


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, ["scheduler", *args])


def _create_key(db_url: str, data_dir: Path, tenant: str = "acme", scopes: str = "read,write") -> tuple[str, str]:
    made = cli("keys", "create", "--tenant", tenant, "--scopes", scopes, "--name", "laptop", "--db", db_url, "--data-dir", str(data_dir))
    assert made.exit_code == 0, made.output
    key = made.stdout.strip()
    assert KEY_PATTERN.match(key), made.stdout
    return KEY_PATTERN.match(key).group(1), key


def test_keys_create_list_revoke(db_url: str, tmp_path: Path) -> None:
    made = cli("keys", "create", "--tenant", "acme", "--scopes", "write,read", "--name", "laptop", "--db", db_url, "--data-dir", str(tmp_path))
    assert made.exit_code == 0, made.output
    key = made.stdout.strip()
    assert made.stdout.count("tgk_") == 1 and KEY_PATTERN.match(key)  # the key alone on stdout, once
    key_id = KEY_PATTERN.match(key).group(1)
    assert key_id in made.stderr and "shown once" in made.stderr and "tgk_" not in made.stderr
    _create_key(db_url, tmp_path, tenant="other", scopes="read")

    listed = cli("keys", "list", "--db", db_url)
    assert listed.exit_code == 0, listed.output
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["ID", "TENANT", "SCOPES", "NAME", "CREATED", "REVOKED"]
    assert len(rows) == 2
    mine = next(r for r in rows if r.startswith(key_id))
    assert mine.split()[1:4] == ["acme", "read,write", "laptop"] and mine.rstrip().endswith("-")
    assert key not in listed.output and key_digest(key) not in listed.output and "tgk_" not in listed.output
    only = cli("keys", "list", "--tenant", "other", "--db", db_url)
    assert only.exit_code == 0 and key_id not in only.stdout and len(only.stdout.splitlines()) == 2

    revoked = cli("keys", "revoke", key_id, "--db", db_url)
    assert revoked.exit_code == 0 and f"revoked key {key_id}" in revoked.stdout
    again = cli("keys", "revoke", key_id, "--db", db_url)
    assert again.exit_code == 0 and "already revoked" in again.stdout
    listed = cli("keys", "list", "--tenant", "acme", "--db", db_url)
    assert not listed.stdout.splitlines()[1].rstrip().endswith("-")  # REVOKED holds a time now
    unknown = cli("keys", "revoke", "ffffffffffff", "--db", db_url)
    assert unknown.exit_code == 2 and "no key with id 'ffffffffffff'" in unknown.output and "keys list" in unknown.output


def test_tenants_set_and_list(db_url: str) -> None:
    made = cli("tenants", "set", "acme", "--max-gpus", "3", "--max-queued", "7", "--db", db_url)
    assert made.exit_code == 0 and "max_gpus=3 max_queued=7" in made.stdout, made.output
    changed = cli("tenants", "set", "acme", "--max-gpus", "5", "--db", db_url)
    assert changed.exit_code == 0 and "max_gpus=5 max_queued=7" in changed.stdout, changed.output
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            assert tuple(conn.execute(sa.text("SELECT max_gpus, max_queued FROM tenants WHERE id = 'acme'")).one()) == (5, 7)
    finally:
        engine.dispose()
    listed = cli("tenants", "list", "--db", db_url)
    assert listed.exit_code == 0 and listed.stdout.splitlines()[1].split()[:3] == ["acme", "5", "7"]


def test_db_current_and_upgrade(empty_db_url: str) -> None:
    empty = cli("db", "current", "--db", empty_db_url)
    assert empty.exit_code == 0 and "empty database" in empty.stdout, empty.output
    upgraded = cli("db", "upgrade", "--db", empty_db_url)
    head = ScriptDirectory.from_config(alembic_config(None)).get_current_head()
    assert upgraded.exit_code == 0 and f"empty -> {head}" in upgraded.stdout, upgraded.output
    current = cli("db", "current", "--db", empty_db_url)
    assert current.exit_code == 0 and current.stdout.strip() == f"{head} (newest)"
    again = cli("db", "upgrade", "--db", empty_db_url)
    assert again.exit_code == 0 and "nothing to do" in again.stdout
    engine = make_engine(empty_db_url)
    try:
        assert current_revision(engine) == head
    finally:
        engine.dispose()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (("keys", "create", "--tenant", "acme", "--scopes", "read,root"), "unknown scope 'root'"),
    (("keys", "create", "--tenant", "acme", "--scopes", " , "), "no scope given"),
    (("keys", "create", "--tenant", "Not A Tenant", "--scopes", "read"), "is not a tenant name"),
    (("keys", "create", "--tenant", "acme"), "Missing option '--scopes'"),
    (("keys", "list", "--tenant", "../x"), "is not a tenant name"),
    (("tenants", "set", "UPPER", "--max-gpus", "1"), "is not a tenant name"),
    (("tenants", "set", "acme", "--max-gpus", "-1"), "--max-gpus"),
    (("keys", "list", "--db", "postgresql://nobody@127.0.0.1:{port}/none"), "cannot use the database postgresql://nobody@127.0.0.1"),
    (("serve", "--db", "postgresql://nobody:secret@127.0.0.1:{port}/none"), "cannot use the database postgresql://nobody:***@127.0.0.1"),
    (("db", "current", "--db", "nosuchdialect://x"), "cannot use the database nosuchdialect://x"),
    (("keys", "list", "--db", "sqlite:////no/such/folder/s.db"), "unable to open database file"),
    (("serve", "--lease-ttl", "0"), "--lease-ttl"),
    (("serve", "--port", "70000"), "--port"),
])
def test_bad_input_is_a_clear_message_and_exit_2(args: tuple[str, ...], message: str, tmp_path: Path) -> None:
    port = str(_closed_port())
    result = cli(*(a.replace("{port}", port) for a in args), "--data-dir", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert "secret" not in result.output


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [prefix]
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found += _commands(command, (*prefix, name))
        else:
            found.append((*prefix, name))
    return found


def test_every_scheduler_command_has_help_with_an_example() -> None:
    group = main.commands["scheduler"]
    commands = _commands(group)
    assert {("serve",), ("keys", "create"), ("keys", "list"), ("keys", "revoke"), ("tenants", "set"), ("db", "upgrade"),
            ("db", "current")} <= set(commands)
    for command in commands:
        result = cli(*command, "--help")
        assert result.exit_code == 0 and "Usage:" in result.output, command
        assert "Example" in result.output and "tinkergym scheduler" in result.output, command


# A real server process.


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, key: str | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def _text_values(db_url: str) -> list[str]:
    """Every text value of every column of every table."""
    engine = make_engine(db_url)
    try:
        values = []
        with engine.connect() as conn:
            for table in sa.inspect(engine).get_table_names():
                reflected = sa.Table(table, sa.MetaData(), autoload_with=conn)
                for row in conn.execute(sa.select(reflected)):
                    values += [v for v in row if isinstance(v, str)]
        return values
    finally:
        engine.dispose()


@pytest.mark.slow
def test_a_served_scheduler_takes_made_keys_and_refuses_revoked_ones(db_url: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "sched"
    key_id, key = _create_key(db_url, data_dir)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "stderr.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "tinkergym", "scheduler", "serve", "--db", db_url, "--data-dir", str(data_dir),
             "--port", str(port), "--sweep-interval", "0.2"],
            stdout=subprocess.DEVNULL, stderr=stderr, env=env,
        )
    try:
        wait_until_answers(f"{base}/healthz", timeout=60, every=0.1, process=process, output=log_text(log))
        assert _get(f"{base}/readyz") == (200, {"status": "ready"})
        status, body = _get(f"{base}/v1/jobs")
        assert status == 401 and body["error"]["type"] == "unauthorized"
        assert _get(f"{base}/v1/jobs", "tgk_" + key_id + "_" + "x" * 43)[0] == 401  # the right id, a wrong secret
        status, body = _get(f"{base}/v1/jobs", key)
        assert status == 200 and body["jobs"] == []

        # No key in clear anywhere the scheduler writes: its tables, the SQLite file and its WAL, its log.
        values = _text_values(db_url)
        assert key_digest(key) in values
        assert not [v for v in values if key in v or "tgk_" in v]
        if db_url.startswith("sqlite"):
            path = Path(db_url.removeprefix("sqlite:///"))
            for file in (path, path.with_name(path.name + "-wal")):
                if file.exists():
                    raw = file.read_bytes()
                    assert key.encode() not in raw and KEY_PATTERN.match(key).group(2).encode() not in raw
        logged = (data_dir / "scheduler.log").read_text()
        assert key not in logged and key_id not in logged
        lines = [json.loads(line) for line in logged.splitlines()]
        assert {(line["route"], line["status"]) for line in lines} >= {("/healthz", 200), ("/v1/jobs", 401), ("/v1/jobs", 200)}
        assert all(line["request_id"] for line in lines)

        revoked = cli("keys", "revoke", key_id, "--db", db_url, "--data-dir", str(data_dir))
        assert revoked.exit_code == 0, revoked.output
        status, body = _get(f"{base}/v1/jobs", key)  # at once: no cache between the key and the database
        assert status == 401
    finally:
        testkit.stop(process)
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught.
    assert process.returncode in (0, -signal.SIGTERM), log.read_text(errors="replace")[-3000:]
    assert "Traceback" not in log.read_text(errors="replace")


def test_every_file_the_scheduler_writes_is_its_owners_alone_whatever_the_umask(tmp_path: Path) -> None:
    """Started under umask 022 (the usual default), the scheduler's database, its WAL, its log and its secret are 0600
    in a 0700 folder; a file an older version left 0644 in the folder is taken back too."""
    data_dir = tmp_path / "sched"
    data_dir.mkdir(mode=0o755)
    os.chmod(data_dir, 0o755)
    stale = data_dir / "scheduler.log"
    stale.write_text("")
    os.chmod(stale, 0o644)
    port = _free_port()
    log = tmp_path / "stderr.log"
    with open(log, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "tinkergym", "scheduler", "serve", "--data-dir", str(data_dir), "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=stderr, preexec_fn=lambda: os.umask(0o022),
        )
    try:
        wait_until_answers(f"http://127.0.0.1:{port}/healthz", timeout=60, every=0.1, process=process, output=log_text(log))
        assert _get(f"http://127.0.0.1:{port}/v1/jobs")[0] == 401  # a request: the log has a line, the database a read
        written = sorted(p.relative_to(data_dir).as_posix() for p in data_dir.rglob("*"))
        assert {"scheduler.db", "scheduler.log"} <= set(written), written  # (the secret is made at the first lease: 0600 itself)
        modes = {name: oct((data_dir / name).stat().st_mode & 0o777) for name in written}
        assert modes == {name: "0o700" if (data_dir / name).is_dir() else "0o600" for name in written}
        assert oct(data_dir.stat().st_mode & 0o777) == "0o700"
    finally:
        testkit.stop(process)


def test_the_commands_that_keep_their_files_private_are_the_services() -> None:
    """The private-umask commands are real command names (a renamed command would silently lose it)."""
    from tinkergym.plumbing.folders import PRIVATE_COMMANDS

    assert PRIVATE_COMMANDS <= set(main.commands), sorted(PRIVATE_COMMANDS - set(main.commands))
    assert {name for name in main.commands if name.startswith("serve-")} <= PRIVATE_COMMANDS
