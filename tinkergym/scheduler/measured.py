"""What servers measured, kept where placement reads it: a heartbeat's ``memory`` on the job's device rows, and the
learned factor of what seat jobs really keep on each worker (:mod:`tinkergym.scheduler.memory` prices them).

A whole device's server measures its own device; a seat's heartbeat carries its shared server's figures, stored on
every seat row of that device (each seat reads its device's). A shared server's heartbeat that says how many adapters
it holds, when that is the number of seat jobs the scheduler has there, also teaches that worker's factor of the model
(a worker's measures move no other worker's placement): the
server's growth since its base alone over what those jobs were priced to keep (:func:`~tinkergym.scheduler.memory.learned_factor`).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from tinkergym.scheduler import memory
from tinkergym.scheduler.seats import model_of
from tinkergym.scheduler.db import allocations, devices, jobs, memory_factors, workers

#: Heartbeat fields -> device columns.
COLUMNS = {"device_bytes": "used_bytes", "device_peak_bytes": "peak_bytes", "device_total_bytes": "measured_total_bytes",
           "host_bytes": "host_bytes", "host_peak_bytes": "host_peak_bytes", "base_bytes": "base_bytes"}


def device_memory(row: Any) -> memory.SharedMemory:
    """A device row's last measure (``memory_bytes`` the worker registered, else the size the server measured)."""
    total = row.memory_bytes if row.memory_bytes is not None else row.measured_total_bytes
    return memory.SharedMemory(total=total, used=row.used_bytes, peak=row.peak_bytes, base=row.base_bytes)


def factors(conn: Connection, worker_id: str) -> dict[str, float]:
    """The learned factor of each model of ``worker_id`` that has one (1.0 for the others: :func:`factor_of`)."""
    rows = conn.execute(select(memory_factors.c.model, memory_factors.c.factor).where(memory_factors.c.worker_id == worker_id))
    return {model: factor for model, factor in rows}


def factor_of(found: dict[str, float], model: Any) -> float:
    return found.get(model, 1.0) if isinstance(model, str) else 1.0


def record(conn: Connection, worker_id: str, job_id: str, measured: dict[str, Any], now: float) -> None:
    """Keep a heartbeat's ``measured`` on the job's devices (a seat's: every seat of its device) and learn from it."""
    values: dict[str, Any] = {column: measured.get(field) for field, column in COLUMNS.items()}
    values["measured_at"] = now
    held = conn.execute(
        select(devices.c.id, devices.c.seat_of).join(allocations, allocations.c.device_id == devices.c.id).where(allocations.c.job_id == job_id)
    ).all()
    seats_of = {row.seat_of for row in held if row.seat_of is not None}
    whole = [row.id for row in held if row.seat_of is None]
    if whole:
        conn.execute(update(devices).where(devices.c.id.in_(whole)).values(**values))
    for device in seats_of:
        conn.execute(update(devices).where(devices.c.worker_id == worker_id, devices.c.seat_of == device).values(**values))
        _learn(conn, worker_id, device, measured, now)


def _learn(conn: Connection, worker_id: str, device: int, measured: dict[str, Any], now: float) -> None:
    used, base, sessions = measured.get("device_bytes"), measured.get("base_bytes"), measured.get("sessions")
    if not isinstance(used, int) or not isinstance(base, int) or not isinstance(sessions, int) or sessions < 1:
        return
    sitting = conn.execute(
        select(jobs.c.config).join(allocations, allocations.c.job_id == jobs.c.id).join(devices, devices.c.id == allocations.c.device_id)
        .where(devices.c.worker_id == worker_id, devices.c.seat_of == device)
    ).scalars().all()
    if len(sitting) != sessions:
        return  # a job opening or closing its adapter now: the measure and the seats do not match yet
    shapes = memory.parse_shapes(conn.execute(select(workers.c.model_shapes).where(workers.c.id == worker_id)).scalar_one_or_none()) or {}
    kind = conn.execute(select(devices.c.kind).where(devices.c.worker_id == worker_id, devices.c.seat_of == device).limit(1)).scalar_one()
    models = {model_of(config) for config in sitting}
    if len(models) != 1:
        return
    model = models.pop()
    parts = [memory.seat_parts(config, shapes.get(model), kind) for config in sitting]
    if not isinstance(model, str) or any(p is None for p in parts):
        return
    mine = (memory_factors.c.worker_id == worker_id, memory_factors.c.model == model)
    row = conn.execute(select(memory_factors).where(*mine)).mappings().first()
    factor, samples = (row["factor"], row["samples"]) if row is not None else (1.0, 0)
    learned = memory.learned_factor(factor, samples, used - base, sum(p[0] for p in parts if p is not None))
    if learned is None:
        return
    if row is None:
        try:
            with conn.begin_nested():  # two first measures at once: one inserts, the other's is dropped (never the heartbeat)
                conn.execute(insert(memory_factors).values(worker_id=worker_id, model=model, factor=learned[0], samples=learned[1], updated_at=now))
        except IntegrityError:
            pass
    else:
        conn.execute(update(memory_factors).where(*mine).values(factor=learned[0], samples=learned[1], updated_at=now))


def seat_memory(conn: Connection, worker_id: str, row: Any, shapes: dict[str, Any], found: dict[str, float]) -> memory.SharedMemory:
    """A seat row's device as placement sees it: its last measure, plus what the seat jobs granted there since then are
    priced to keep (their adapters may not be open yet at the measure: two grants between heartbeats do not both see room)."""
    measure = device_memory(row)
    if not measure.measured:
        return measure
    since = row.measured_at or 0.0
    pending = conn.execute(
        select(jobs.c.config).join(allocations, allocations.c.job_id == jobs.c.id).join(devices, devices.c.id == allocations.c.device_id)
        .where(devices.c.worker_id == worker_id, devices.c.seat_of == row.seat_of, allocations.c.granted_at > since)
    ).scalars().all()
    extra = 0
    for config in pending:
        model = model_of(config)
        parts = memory.seat_parts(config, shapes.get(model), row.kind)
        if parts is not None:
            extra += int(parts[0] * factor_of(found, model))
    return memory.SharedMemory(total=measure.total, used=(measure.used or 0) + extra, peak=(measure.peak or 0) + extra, base=measure.base)


#: The device columns placement reads for a seat's memory (:func:`seat_memory`), beside ``memory_bytes``, ``kind`` and ``seat_of``.
SEAT_COLUMNS = (devices.c.measured_total_bytes, devices.c.used_bytes, devices.c.peak_bytes, devices.c.base_bytes, devices.c.measured_at)


class SeatRoom:
    """Whether a free seat's device holds a job now, by what its server measured: one read of each device, of each
    worker's model shapes and of the learned factors per instance (one grant, one placement read)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._factors: dict[str, dict[str, float]] = {}
        self._shapes: dict[str, dict[str, Any]] = {}
        self._devices: dict[tuple[str, int], memory.SharedMemory] = {}

    def refusal(self, worker_id: str, row: Any, job: dict[str, Any]) -> str | None:
        """Why ``job`` (a row with ``config``) does not fit the device of seat ``row`` (with :data:`SEAT_COLUMNS`) now;
        None when it does or cannot be told (:func:`tinkergym.scheduler.memory.seat_refusal`)."""
        if row.used_bytes is None:
            return None  # not measured yet: the seat count alone places it
        if worker_id not in self._factors:
            self._factors[worker_id] = factors(self.conn, worker_id)
        found = self._factors[worker_id]
        if worker_id not in self._shapes:
            text = self.conn.execute(select(workers.c.model_shapes).where(workers.c.id == worker_id)).scalar_one_or_none()
            self._shapes[worker_id] = memory.parse_shapes(text) or {}
        key = (worker_id, row.seat_of)
        if key not in self._devices:
            self._devices[key] = seat_memory(self.conn, worker_id, row, self._shapes[worker_id], found)
        model = model_of(job["config"])
        return memory.seat_refusal(job["config"], self._shapes[worker_id].get(model), self._devices[key], factor_of(found, model),
                                   row.kind, where=f" on device {row.seat_of} of worker {worker_id}")

    def forget(self, worker_id: str, row: Any) -> None:
        """Read ``row``'s device again at its next question (a job was just granted a seat there: it is priced in then)."""
        if row.seat_of is not None:
            self._devices.pop((worker_id, row.seat_of), None)
