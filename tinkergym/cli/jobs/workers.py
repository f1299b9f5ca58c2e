"""``tinkergym jobs workers``: the capacity a tenant's key can use (the workers that serve its tenant), from any machine."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import click

from tinkergym.cli.common import age, table
from tinkergym.cli.jobs.connection import call, connect, scheduler_options


@click.command("workers")
@click.option("--alive", "only_alive", is_flag=True, help="Only the workers alive now.")
@scheduler_options
def workers_command(only_alive: bool, scheduler_url: str | None, api_key: str | None) -> None:
    """The workers your jobs can run on: name, status, models, devices (a device shared by seats counts once, its seats
    beside it), how many are busy, each device's memory at its peak as its server measured it, last seen.

    Any key with the read scope lists them; other tenants' jobs on them are never shown.

    \b
    Examples:
      export TINKERGYM_SCHEDULER=http://127.0.0.1:8780 TINKERGYM_API_KEY=tgk_...
      tinkergym jobs workers
      tinkergym jobs workers --alive
    """
    client = connect(scheduler_url, api_key)
    try:
        found = call(lambda: client.workers("alive" if only_alive else None))
    finally:
        client.close()
    if not found:
        click.echo("no workers serve your tenant" + (" now" if only_alive else "") + "; jobs wait in the queue until one registers", err=True)
        return
    now = time.time()
    rows = []
    for w in found:
        count = DeviceCount.of(w["devices"])
        status = w["status"] + (", quarantined" if w.get("quarantined") else "")
        busy = str(count.busy) + (f" ({count.busy_seats} of {plural(count.seats, 'seat')})" if count.seats else "")
        rows.append((w["name"], status, ",".join(w["models"]) or "-", count.devices_text(), busy, memory_text(w["devices"]),
                     f"{age(w['last_seen_at'], now)} ago"))
    click.echo(table(("NAME", "STATUS", "MODELS", "DEVICES", "BUSY", "MEMORY (PEAK)", "LAST SEEN"), rows))


def memory_text(devices: list[dict[str, Any]]) -> str:
    """Each measured device's peak as its server's last heartbeat measured it, of its size where the worker said it
    (``1: 3.1/24 GiB``; a shared device once, by its index); ``-`` when no server has measured one yet."""
    seen: dict[int, str] = {}
    for d in devices:
        peak = d.get("peak_bytes")
        index = d["index"] if d.get("seat_of") is None else d["seat_of"]
        if not d["active"] or peak is None or index in seen:
            continue
        size = d.get("memory_bytes")
        seen[index] = f"{index}: {peak / 2**30:.1f}" + (f"/{size / 2**30:.0f} GiB" if size else " GiB")
    return ", ".join(seen[i] for i in sorted(seen)) or "-"


def plural(n: int, word: str) -> str:
    """``1 slot``, ``2 slots``, ``2 GPUs``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


#: How a device kind is named in a count.
KIND_NAMES = {"gpu": "GPU", "slot": "slot"}


@dataclass(frozen=True)
class DeviceCount:
    """A worker's active devices, each counted once: a device whose shared training server takes jobs by the seat is listed
    by the scheduler as its seats (rows with ``seat_of``), and counts as one device here, busy when any of its seats is."""

    by_kind: dict[str, int]
    busy: int
    seats: int
    busy_seats: int

    @classmethod
    def of(cls, devices: list[dict[str, Any]]) -> DeviceCount:
        """The count of a worker's ``devices`` as the scheduler lists them (``index``, ``kind``, ``active``, ``busy``, ``seat_of``)."""
        active = [d for d in devices if d["active"]]
        seats = [d for d in active if d.get("seat_of") is not None]
        kinds: dict[int, str] = {}
        busy: set[int] = set()
        for d in active:
            index = d["index"] if d.get("seat_of") is None else d["seat_of"]
            kinds.setdefault(index, d["kind"])
            if d["busy"]:
                busy.add(index)
        by_kind: dict[str, int] = {}
        for kind in kinds.values():
            by_kind[kind] = by_kind.get(kind, 0) + 1
        return cls(by_kind, len(busy), len(seats), sum(bool(d["busy"]) for d in seats))

    @property
    def total(self) -> int:
        """The devices, seats or not."""
        return sum(self.by_kind.values())

    def devices_text(self) -> str:
        """``2 slots``, ``1 GPU``, ``2 slots (3 seats)``; ``0`` for none."""
        text = ", ".join(plural(n, KIND_NAMES.get(kind, kind)) for kind, n in sorted(self.by_kind.items())) or "0"
        return text + (f" ({plural(self.seats, 'seat')})" if self.seats else "")
