"""Seats: LoRA jobs packed onto a shared training server, one seat a job, instead of a whole device each.

A worker may run some of its devices as shared servers (``tinkergym worker --shared-devices 0 --seats 4``): one
``serve shared`` process per such device holds one base model once, and each of its seats is a place the scheduler
leases like a device. A seat is a row of ``devices`` with ``seat_of`` (the index of the device it sits on) and
``shared`` (the server's base: model, dtype, max_lora_rank, as JSON); its own ``index`` is :func:`seat_index`, so the
database's constraints (one allocation a place, one place an index per worker) hold seats as they hold devices, and a
seat's lease has its own epoch that fences that job's session alone.

The placement rule (:func:`fits`), the same for the grant and for the wait reasons:

- the job is a LoRA ``train`` or ``sft`` job on one device (``gpus: 1``, ``lora_rank`` above 0): full fine-tuning and
  jobs of several devices never get a seat;
- its model is the seat's base model, and its dtype the server's (``auto`` takes the server's);
- its rank is at most the server's ``max_lora_rank``, so a server's sessions hold at most ``seats`` adapters of that
  rank (the operator sizes ``--seats`` to the device's memory);
- it asks for nothing a shared base does not offer: no LoRA dropout, no gradient checkpointing, no deterministic
  algorithms (such a job takes a whole device);
- a seat is free (no allocation), and the memory its shared server last measured leaves room for the job
  (:func:`tinkergym.scheduler.memory.seat_refusal`; not checked before the server's first measure). A packable job
  takes a seat before a whole device, on any worker: a worker with whole devices free does not take a job that a free
  seat of another live worker fits, its memory included (:func:`tinkergym.scheduler.granting.free_seats_of_others`).

A league (a ``train`` job of the league trainer, its config's ``players`` above 1: N adapters of one base trained
together) takes N seats of one shared server at once, never whole devices: its players' calls share that server's
passes. Its N seats count as one device toward the tenant's ``max_gpus`` (one job); a league larger than any shared
server's seats is refused at submission (``too_few_devices``), never split over servers (the players' passes could not
be shared). Otherwise a seat counts as one device toward the tenant's ``max_gpus``. Standard library only.
"""

from __future__ import annotations

import json
from typing import Any

from tinkergym.config import DEFAULT_LORA_RANK

#: Seat indexes start here (whole devices are numbered below it), ``MAX_SEATS`` a device.
SEAT_BASE = 1024
MAX_SEATS = 64
#: Job kinds whose server can be a session on a shared server.
PACKABLE_KINDS = ("train", "sft")


def seat_index(device: int, seat: int) -> int:
    """The place index of seat ``seat`` (0-based) on device ``device``: unique on its worker, above every device's."""
    return SEAT_BASE + device * MAX_SEATS + seat


def parse_shared(text: str | None) -> dict[str, Any] | None:
    """A seat's stored base (``model``, ``dtype``, ``max_lora_rank``); None for a whole device."""
    if not text:
        return None
    try:
        found = json.loads(text)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def shared_json(model: str, dtype: str, max_lora_rank: int) -> str:
    return json.dumps({"model": model, "dtype": dtype, "max_lora_rank": max_lora_rank}, sort_keys=True)


def config_of(config: Any) -> dict[str, Any] | None:
    """A job's config as a dict (it is stored as JSON text); None when it is not one."""
    try:
        found = json.loads(config) if isinstance(config, str) else config
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def model_of(config: Any) -> Any:
    """A job config's ``model`` (None when the config cannot be read)."""
    return (config_of(config) or {}).get("model")


def _config(config: Any) -> dict[str, Any]:
    return config_of(config) or {}


def packable(kind: str, gpus: int, config: Any) -> bool:
    """Whether a job could ever sit on a shared server: a LoRA train or sft job on one device with nothing a shared base lacks."""
    found = _config(config)
    rank = found.get("lora_rank")
    rank = DEFAULT_LORA_RANK if rank is None else rank
    return (kind in PACKABLE_KINDS and gpus == 1 and isinstance(rank, int) and rank > 0 and not found.get("lora_dropout")
            and not found.get("gradient_checkpointing") and not found.get("deterministic"))


def players(config: Any) -> int:
    """The adapters a job trains at once: its config's ``players`` (a league), else 1."""
    found = _config(config).get("players")
    return found if isinstance(found, int) and not isinstance(found, bool) and 1 <= found <= MAX_SEATS else 1


def league_seats(free: list[tuple[Any, dict[str, Any]]], kind: str, gpus: int, config: Any) -> dict[int, list[Any]]:
    """The seats of ``free`` (rows with ``seat_of``, and their bases) that a job fits, by the device they sit on, in order."""
    found: dict[int, list[Any]] = {}
    for row, shared in free:
        if fits(shared, kind, gpus, config):
            found.setdefault(row.seat_of, []).append(row)
    return found


def fits(shared: dict[str, Any], kind: str, gpus: int, config: Any) -> bool:
    """Whether a job (its kind, devices and config) may take a seat of a server with base ``shared`` (the module's rule)."""
    if not packable(kind, gpus, config):
        return False
    found = _config(config)
    rank = found.get("lora_rank") or DEFAULT_LORA_RANK
    dtype = found.get("dtype") or "auto"
    return (found.get("model") == shared.get("model") and dtype in ("auto", shared.get("dtype"))
            and rank <= int(shared.get("max_lora_rank") or 0))
