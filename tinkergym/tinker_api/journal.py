"""The Tinker front door's memory on disk, so that a restart keeps what its clients hold names for.

``serve tinker --scheduler`` keeps, in one SQLite file (``<run-dir>/front_door.sqlite``, write-ahead logged), its
sessions, training runs (with each run's job, the newest state the scheduler holds and the log of the calls that
changed the run since), samplers, checkpoints and the request ids it answered with. A front door that starts on the
file of one that stopped (or was killed) serves the same ``session_id``s, ``model_id``s, sampler ids and ``tinker://``
paths; a run's first request (or its session's first heartbeat) after the restart carries its key, with which the
front door reattaches to the run's job
and brings its server back to what the log says (:meth:`tinkergym.tinker_api.cluster.ClusterEngine.attach`).

A request's result is kept once it is done, for the calls of training runs (``create_model``, ``forward``,
``forward_backward``, ``optim_step``, saves and loads): after a restart ``retrieve_future`` answers it as before (a
``ForwardBackwardOutput`` is kept as the protobuf the SDK reads, so it is answered as it would have been). A request that was
still running when the front door stopped answers 410, and took no effect (the run's server is brought back to its log,
which holds only finished calls), so the SDK's client may send it again. Samplers' results are not kept (a sample changes
no run: sending it again is safe), and answer 410 too.

What is kept is bounded: one result at most :data:`MAX_RESULT_BYTES` (a forward_backward's per-token outputs at the
service's default ``Limits.max_tokens`` fit), all of them at most :data:`KEEP_RESULT_BYTES` (the newest finished kept). A
request whose result is not kept (too large, or dropped for newer ones) answers 410 after a restart saying that it was done
and took effect, so that it is not sent again; a result too large is logged once, when it is done
(``tinker_result_not_kept``).

Besides :class:`Journal` (the tables), this module holds what a restart does with them: :func:`restore_records` rebuilds a
:class:`~tinkergym.tinker_api.service.TinkerService`'s sessions, runs, samplers and checkpoints
(:mod:`tinkergym.tinker_api.records`) from :meth:`Journal.load`, and :func:`encode_result` and :func:`decode_result`
turn a request's result into the JSON kept for it and back.

The file holds no API key: a key is the client's, sent with each request. It holds the calls' data (the tokens of a
run's calls since its newest stored state), like the run folder it lives in.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import sqlite3
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from tinkergym.tinker_api.engines import EngineError, Saved
from tinkergym.tinker_api.records import Checkpoint, Run, Sampler, Session

#: The file's name in the front door's run folder.
FILE = "front_door.sqlite"
#: Request ids kept (the newest); an older one answers 404 after a restart, as it would have once forgotten in memory.
KEEP_REQUESTS = 8192
#: The largest result kept, in bytes of its JSON: a forward_backward's output is 8 bytes a token (float32 logprobs and
#: elementwise loss), so at ``Limits.max_tokens`` (4,194,304 tokens) its protobuf is 32 MiB, 43 MiB in base64.
MAX_RESULT_BYTES = 48 << 20
#: The kept results' bytes in all: past it the oldest are dropped (a client retrieves its results as they finish, so only the
#: newest are ever asked for after a restart).
KEEP_RESULT_BYTES = 1 << 30

SCHEMA = """
create table if not exists sessions (session_id text primary key, tenant text not null, created real not null);
create table if not exists runs (model_id text primary key, tenant text not null, session_id text not null, base_model text not null,
    rank integer not null, user_metadata text, closed integer not null default 0, handle text not null);
create table if not exists checkpoints (model_id text not null, checkpoint_id text not null, kind text not null, location text not null,
    size integer, time text not null, user_metadata text, primary key (model_id, checkpoint_id));
create table if not exists samplers (sampler_id text primary key, tenant text not null, session_id text not null, base_model text not null,
    model_path text, handle text not null);
create table if not exists calls (owner text not null, n integer not null, method text not null, args text not null, primary key (owner, n));
create table if not exists requests (request_id text primary key, tenant text not null, result text);
create table if not exists results (request_id text primary key, size integer not null, result text not null);
"""
# ``results`` holds the kept results and ``size``, their bytes (0 for a note that one was not kept), first so that summing it
# reads no result; ``requests.result`` is read for the results of files written before it.


class ResultNotKept(ValueError):
    """A done request's result was too large to keep: :meth:`Journal.put_result` recorded that instead."""


class Journal:
    """The front door's tables (see the module docstring); every write is its own transaction, safe from any thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600, exist_ok=True)  # the calls' data: the server's user alone (SQLite gives its -wal file the same mode)
        os.chmod(path, 0o600)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("pragma journal_mode=wal")
        self._db.execute("pragma synchronous=normal")  # with WAL: durable across a killed process
        self._db.execute(f"pragma journal_size_limit={2 * MAX_RESULT_BYTES}")  # the -wal file shrinks back after a large result
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()
        self._written_requests = 0
        self._result_bytes = self._rows("select coalesce(sum(size), 0) from results")[0][0]

    def _write(self, *statements: tuple[str, tuple[Any, ...]]) -> None:
        with self._lock:
            self._write_locked(*statements)

    def _write_locked(self, *statements: tuple[str, tuple[Any, ...]]) -> None:
        self._db.execute("begin immediate")
        try:
            for sql, params in statements:
                self._db.execute(sql, params)
        except BaseException:
            self._db.execute("rollback")
            raise
        self._db.execute("commit")

    def _rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ----- sessions ------------------------------------------------------------------------------------
    def put_session(self, session_id: str, tenant: str, created: float) -> None:
        self._write(("insert or replace into sessions values (?, ?, ?)", (session_id, tenant, created)))

    def drop_session(self, session_id: str) -> None:
        self._write(("delete from sessions where session_id = ?", (session_id,)))

    # ----- runs and samplers --------------------------------------------------------------------------------
    def put_run(self, model_id: str, tenant: str, session_id: str, base_model: str, rank: int, user_metadata: Any, handle: dict[str, Any]) -> None:
        self._write(("insert or replace into runs values (?, ?, ?, ?, ?, ?, 0, ?)",
                     (model_id, tenant, session_id, base_model, rank, json.dumps(user_metadata), json.dumps(handle))))

    def close_run(self, model_id: str) -> None:
        self._write(("update runs set closed = 1 where model_id = ?", (model_id,)), ("delete from calls where owner = ?", (model_id,)))

    def drop_run(self, model_id: str) -> None:
        self._write(("delete from runs where model_id = ?", (model_id,)), ("delete from checkpoints where model_id = ?", (model_id,)),
                    ("delete from calls where owner = ?", (model_id,)))

    def put_sampler(self, sampler_id: str, tenant: str, session_id: str, base_model: str, model_path: str | None, handle: dict[str, Any]) -> None:
        self._write(("insert or replace into samplers values (?, ?, ?, ?, ?, ?)",
                     (sampler_id, tenant, session_id, base_model, model_path, json.dumps(handle))))

    def drop_sampler(self, sampler_id: str) -> None:
        self._write(("delete from samplers where sampler_id = ?", (sampler_id,)))

    def put_handle(self, owner: str, handle: dict[str, Any], call: tuple[int, str, Any] | None = None, clear_calls: bool = False) -> None:
        """A run's or sampler's job handle as it is now; with it, in the same transaction, the call the run's log gained
        (``(n, method, args)``) or the log's end (``clear_calls``: a state the scheduler holds replaces it)."""
        text = json.dumps(handle)
        statements: list[tuple[str, tuple[Any, ...]]] = [("update runs set handle = ? where model_id = ?", (text, owner)),
                                                         ("update samplers set handle = ? where sampler_id = ?", (text, owner))]
        if clear_calls:
            statements.append(("delete from calls where owner = ?", (owner,)))
        if call is not None:
            statements.append(("insert or replace into calls values (?, ?, ?, ?)", (owner, call[0], call[1], json.dumps(call[2]))))
        self._write(*statements)

    # ----- checkpoints -------------------------------------------------------------------------------------
    def put_checkpoint(self, model_id: str, checkpoint_id: str, kind: str, location: Any, size: int | None, time: str, user_metadata: Any) -> None:
        self._write(("insert or replace into checkpoints values (?, ?, ?, ?, ?, ?, ?)",
                     (model_id, checkpoint_id, kind, json.dumps(location), size, time, json.dumps(user_metadata))))

    def drop_checkpoint(self, model_id: str, checkpoint_id: str) -> None:
        self._write(("delete from checkpoints where model_id = ? and checkpoint_id = ?", (model_id, checkpoint_id)))

    # ----- requests ----------------------------------------------------------------------------------------
    def put_request(self, request_id: str, tenant: str) -> None:
        statements: list[tuple[str, tuple[Any, ...]]] = [("insert into requests values (?, ?, null)", (request_id, tenant))]
        with self._lock:
            self._written_requests += 1
            if self._written_requests % 256 == 0:
                oldest = "(select request_id from requests where rowid <= (select max(rowid) from requests) - ?)"
                statements += [(f"delete from results where request_id in {oldest}", (KEEP_REQUESTS,)),
                               ("delete from requests where rowid <= (select max(rowid) from requests) - ?", (KEEP_REQUESTS,))]
            self._write_locked(*statements)
            if len(statements) > 1:
                self._result_bytes = self._db.execute("select coalesce(sum(size), 0) from results").fetchone()[0]

    def put_result(self, request_id: str, result: dict[str, Any]) -> None:
        """Keep a done request's result (:func:`encode_result`'s JSON data), dropping the oldest kept past
        :data:`KEEP_RESULT_BYTES`. One over :data:`MAX_RESULT_BYTES` is not kept: the request is recorded as done with its
        result not kept (after a restart it answers 410 saying so), and :class:`ResultNotKept` says why."""
        text = json.dumps(result, separators=(",", ":"))
        too_large = len(text) > MAX_RESULT_BYTES
        if too_large:
            text = json.dumps({"not_kept": f"its result ({len(text):,} bytes) is larger than the {MAX_RESULT_BYTES:,} bytes this server keeps "
                                           "of one result"})
        with self._lock:
            size = 0 if too_large else len(text)
            self._write_locked(("insert or replace into results (request_id, size, result) select ?, ?, ? where exists "
                                "(select 1 from requests where request_id = ?)", (request_id, size, text, request_id)))  # not one forgotten
            self._result_bytes += size
            if self._result_bytes > KEEP_RESULT_BYTES:
                self._drop_oldest_results()
        if too_large:
            raise ResultNotKept(f"request {request_id} was done, but {json.loads(text)['not_kept']}: after a restart it answers 410")

    def _drop_oldest_results(self) -> None:
        """Under the lock: the oldest results, past the newest :data:`KEEP_RESULT_BYTES`, replaced by a note that they were dropped."""
        dropped = json.dumps({"not_kept": f"its result was dropped for newer ones (this server keeps the newest {KEEP_RESULT_BYTES:,} bytes "
                                          "of results)"})
        cut = self._db.execute("select rowid from (select rowid, sum(size) over (order by rowid desc) as newer from results) where newer > ? "
                               "order by rowid desc limit 1", (KEEP_RESULT_BYTES,)).fetchone()
        if cut is not None:
            self._write_locked(("update results set result = ?, size = 0 where rowid <= ? and size > 0", (dropped, cut[0])))
        self._result_bytes = self._db.execute("select coalesce(sum(size), 0) from results").fetchone()[0]

    def request(self, request_id: str) -> tuple[str, dict[str, Any] | None] | None:
        """``(tenant, result or None)`` of a request this front door answered with, or None. The result is :func:`encode_result`'s
        data, or ``{"not_kept": why}`` for a request done whose result was not kept (:func:`decode_result` refuses it with a 410)."""
        rows = self._rows("select r.tenant, coalesce(k.result, r.result) from requests r left join results k on k.request_id = r.request_id "
                          "where r.request_id = ?", (request_id,))
        if not rows:
            return None
        return rows[0][0], (json.loads(rows[0][1]) if rows[0][1] is not None else None)

    # ----- what a restart reads ----------------------------------------------------------------------------------
    def load(self) -> dict[str, list[dict[str, Any]]]:
        """Everything but the requests, as dicts of plain data; each run's and sampler's ``calls`` in order."""
        calls: dict[str, list[tuple[str, Any]]] = {}
        for owner, _n, method, args in self._rows("select owner, n, method, args from calls order by owner, n"):
            calls.setdefault(owner, []).append((method, json.loads(args)))
        return {
            "sessions": [{"session_id": s, "tenant": t, "created": c} for s, t, c in self._rows("select * from sessions")],
            "runs": [{"model_id": m, "tenant": t, "session_id": s, "base_model": b, "rank": r, "user_metadata": json.loads(u), "closed": bool(c),
                      "handle": json.loads(h), "calls": calls.get(m, [])}
                     for m, t, s, b, r, u, c, h in self._rows("select * from runs order by rowid")],
            "checkpoints": [{"model_id": m, "checkpoint_id": i, "kind": k, "location": json.loads(loc), "size": size, "time": time,
                             "user_metadata": json.loads(u)}
                            for m, i, k, loc, size, time, u in self._rows("select * from checkpoints order by rowid")],
            "samplers": [{"sampler_id": i, "tenant": t, "session_id": s, "base_model": b, "model_path": p, "handle": json.loads(h),
                          "calls": calls.get(i, [])}
                         for i, t, s, b, p, h in self._rows("select * from samplers order by rowid")],
        }


# ----- what a restart rebuilds -------------------------------------------------------------------------------
def restore_records(data: dict[str, list[dict[str, Any]]], engine: Any, sessions: dict[str, Session], runs: dict[str, Run],
            samplers: dict[str, Sampler]) -> None:
    """Add to ``sessions``, ``runs`` and ``samplers`` what :meth:`Journal.load` answered (``data``): sessions (their heartbeat
    clocks start now), runs and samplers (their handles, from ``engine.restore``, not connected until a request reattaches
    them) and the runs' checkpoints."""
    now = time.monotonic()
    for row in data["sessions"]:
        sessions[row["session_id"]] = Session(row["session_id"], row["tenant"], now, now)
    for row in data["runs"]:
        handle = engine.restore(row["model_id"], row["handle"], row["calls"])
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tinker-{row['model_id']}")
        run = Run(row["model_id"], row["tenant"], row["session_id"], row["base_model"], int(row["rank"]), handle, executor,
                  row["user_metadata"], closed=row["closed"])
        runs[run.model_id] = run
        if not run.closed and run.session_id in sessions:
            sessions[run.session_id].runs.add(run.model_id)
    for row in data["checkpoints"]:
        owner = runs.get(row["model_id"])
        if owner is not None:
            where = row["location"]
            saved = Saved(Path(where["path"]) if "path" in where else (str(where["job"]), str(where["name"])), row["size"])
            owner.checkpoints[row["checkpoint_id"]] = Checkpoint(row["checkpoint_id"], row["kind"], saved, datetime.fromisoformat(row["time"]),
                                                               row["user_metadata"])
    for row in data["samplers"]:
        handle = engine.restore(row["sampler_id"], row["handle"], row["calls"])
        samplers[row["sampler_id"]] = Sampler(row["sampler_id"], row["tenant"], row["session_id"], row["base_model"], row["model_path"], handle)
        if row["session_id"] in sessions:
            sessions[row["session_id"]].samplers.add(row["sampler_id"])


# ----- kept results -------------------------------------------------------------------------------------------
def encode_result(result: Any) -> dict[str, Any]:
    """A request's result as JSON data for :meth:`Journal.put_result`: a ``ForwardBackwardOutput`` as the protobuf the SDK
    reads (``retrieve_future`` answers it so; base64), another SDK type's name and fields, or plain data (a dict) as it is.
    Raises ``TypeError`` for anything else."""
    from tinker import types

    if isinstance(result, types.ForwardBackwardOutput):
        from tinkergym.tinker_api.wire import encode_forward_backward_output

        return {"tinker_type": "ForwardBackwardOutput", "proto": base64.b64encode(encode_forward_backward_output(result)).decode("ascii")}
    if hasattr(result, "model_dump"):
        return {"tinker_type": type(result).__name__, "data": result.model_dump(mode="json")}
    if result is None or isinstance(result, (dict, list, str, int, float, bool)):
        return {"tinker_type": None, "data": result}
    raise TypeError(f"a result of type {type(result).__name__} cannot be kept: encode_result knows ForwardBackwardOutput, the SDK's "
                    "pydantic types and plain data")


def decode_result(kept: dict[str, Any]) -> Any:
    """The result :func:`encode_result` kept, as the SDK type it was (or the plain data); a request done whose result was not kept
    (``{"not_kept": why}``, :meth:`Journal.put_result`) raises a 410 that says it took effect."""
    from tinker import types

    if "not_kept" in kept:
        raise EngineError(410, f"this request was done before this server restarted, and what it changed stays changed (a forward_backward's "
                               f"gradients added, an optim_step taken), but {kept['not_kept']}: sending it again would apply it twice; go on "
                               "with the next call (or load the run's last saved state to redo it)")
    if kept.get("tinker_type") is None:
        return kept["data"]
    if kept["tinker_type"] == "ForwardBackwardOutput":
        from tinker.proto.response_conv import deserialize_forward_backward_output

        return deserialize_forward_backward_output(base64.b64decode(kept["proto"]))
    return getattr(types, kept["tinker_type"]).model_validate(kept["data"])
