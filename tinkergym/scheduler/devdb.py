"""A throwaway PostgreSQL cluster on 127.0.0.1, for the scheduler's tests and benchmarks (and for trying it out).

:func:`private_postgres` runs ``initdb`` into a temporary folder and ``pg_ctl start`` on a free port, as an
unprivileged user when called as root (PostgreSQL refuses root), with ``trust`` for one role on 127.0.0.1
only and the superuser only through a private socket folder; ``new_database()`` gives a fresh database's URL.
Durability is off (``fsync=off``): never keep data in it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterator

#: The role the tests connect as: trusted on 127.0.0.1 only, allowed to create databases, not a superuser.
PG_ROLE = "tinkergym_test"
#: Where Debian (``/usr/lib/postgresql/<version>/bin``) and the PGDG RPMs (``/usr/pgsql-<version>/bin``) put the binaries.
PG_BIN_GLOBS = ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin", "/usr/local/pgsql/bin")


def find_pg_bin() -> Path | None:
    """The folder holding ``initdb`` and ``pg_ctl``: ``$TINKERGYM_PG_BIN``, then ``PATH``, then the newest packaged version."""
    if os.environ.get("TINKERGYM_PG_BIN"):
        given = Path(os.environ["TINKERGYM_PG_BIN"])
        return given if (given / "initdb").is_file() and (given / "pg_ctl").is_file() else None
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(os.path.realpath(initdb)).parent
    found = [Path(p) for pattern in PG_BIN_GLOBS for p in glob.glob(pattern) if (Path(p) / "initdb").is_file()]

    def version(path: Path) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", str(path))) or (0,)

    return max(found, key=version) if found else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class PostgresServer:
    """A private PostgreSQL cluster on 127.0.0.1: ``new_database()`` -> a URL; ``drop_database(url)``."""

    port: int
    socket_dir: Path
    superuser: str

    def _admin(self, role: str | None = None) -> Any:
        import psycopg

        if role is None:  # the superuser, through the private socket folder
            return psycopg.connect(host=str(self.socket_dir), port=self.port, user=self.superuser, dbname="postgres", autocommit=True)
        return psycopg.connect(host="127.0.0.1", port=self.port, user=role, dbname="postgres", autocommit=True)

    def new_database(self, template: str | None = None) -> str:
        """A new, empty database (or a copy of the database ``template``, which no one may be connected to); its URL."""
        name = f"t_{secrets.token_hex(6)}"
        with self._admin(PG_ROLE) as conn:
            if template is None:
                conn.execute(f'CREATE DATABASE "{name}"')
            else:
                conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        return f"postgresql://{PG_ROLE}@127.0.0.1:{self.port}/{name}"

    def drop_database(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        # As the superuser: FORCE terminates the database's other backends, an autovacuum worker among them, which
        # only a superuser may signal (the test role's DROP ... FORCE then fails with InsufficientPrivilege).
        with self._admin() as conn:  # FORCE: engines a test left open do not keep the database alive
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _cluster_user() -> pwd.struct_passwd | None:
    """The unprivileged user the cluster runs as when we are root (PostgreSQL refuses to run as root)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root, PostgreSQL needs an unprivileged user: none of postgres, nobody exists")


def _run_as(user: pwd.struct_passwd | None, args: list[str], cwd: Path, log: Path | None = None) -> None:
    as_user: dict[str, Any] = {}
    if user is not None:  # drop root: its uid, its group, no supplementary groups
        as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "LANG": "C"}
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, **as_user)
    if out.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
        raise RuntimeError(f"{' '.join(args[:2])} failed ({out.returncode}): {out.stdout[-2000:]}{out.stderr[-2000:]}{tail}")


@contextlib.contextmanager
def private_postgres(settings: dict[str, str] | None = None) -> Iterator[PostgresServer]:
    """Start a private cluster (see the module docstring), with these server ``settings`` too (``-c name=value``, such as
    ``shared_preload_libraries``); stopped and removed on exit. RuntimeError when it cannot start."""
    bin_dir = find_pg_bin()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL is not installed (no initdb/pg_ctl): run `make install` (it installs the postgresql package)")
    user = _cluster_user()
    # Not under pytest's tmp folder: it is private to the user running the tests, and the cluster's user must enter it.
    root = Path(tempfile.mkdtemp(prefix="tinkergym-pg-"))
    data, socket_dir, log = root / "data", root / "sock", root / "server.log"
    socket_dir.mkdir(mode=0o700)
    if user is not None:
        for path in (root, socket_dir):
            os.chown(path, user.pw_uid, user.pw_gid)
    superuser = user.pw_name if user is not None else pwd.getpwuid(os.geteuid()).pw_name
    _run_as(user, [str(bin_dir / "initdb"), "-D", str(data), "-U", superuser, "--auth=reject", "--encoding=UTF8",
                   "--locale=C", "--no-sync"], cwd=root)
    # The superuser only through the private socket folder (mode 700); over TCP only the test role, from 127.0.0.1.
    hba = data / "pg_hba.conf"
    hba.write_text(
        "local all all trust\n"
        f"host all {PG_ROLE} 127.0.0.1/32 trust\n"
    )
    if user is not None:
        os.chown(hba, user.pw_uid, user.pw_gid)
    port = 0
    for attempt in range(3):  # the free port can be taken between the probe and the start
        port = _free_port()
        options = f"-k {socket_dir} -p {port} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off -c max_connections=200"
        options += "".join(f" -c {name}={value}" for name, value in (settings or {}).items())
        try:
            _run_as(user, [str(bin_dir / "pg_ctl"), "start", "-D", str(data), "-w", "-t", "60", "-l", str(log), "-o", options],
                    cwd=root, log=log)
            break
        except RuntimeError:
            if attempt == 2:
                raise
            time.sleep(0.5)
    server = PostgresServer(port=port, socket_dir=socket_dir, superuser=superuser)
    try:
        with server._admin() as conn:
            conn.execute(f"CREATE ROLE {PG_ROLE} LOGIN CREATEDB")
        yield server
    finally:
        _run_as(user, [str(bin_dir / "pg_ctl"), "stop", "-D", str(data), "-m", "immediate", "-w"], cwd=root)
        shutil.rmtree(root, ignore_errors=True)


