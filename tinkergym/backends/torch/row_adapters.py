"""Which adapter each row of a model call goes through: the per-row index of a mixed-adapter batch.

A shared base (:mod:`tinkergym.backends.torch.shared`) runs rows of several LoRA sessions in one pass. The
code that calls the model (scoring, sampling) knows which rows it passes; the LoRA layers
(:class:`~tinkergym.backends.torch.multi_lora.MultiLoraLinear`) see only hidden states. :func:`rows_through`
says, for the duration of one model call, which adapter each row of that call's batch belongs to; the layers
read it with :func:`current`. The batch of each call differs (a shared prompt runs once for its group, decode
runs every row), so the callers set it call by call.

Outside :func:`rows_through` (and with ``None``) the layers run the base alone, which is what a KL reference
needs. Gradient checkpointing would recompute a layer after the call's context is gone, so a shared base
refuses it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class RowPlan:
    """The rows of one call by adapter: ``only`` when every row has the same one, else index tensors per adapter."""

    adapters: tuple[int, ...]
    only: int | None = None
    _segments: list[tuple[int, torch.Tensor]] | None = field(default=None, repr=False)
    _scales: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def present(self) -> tuple[int, ...]:
        """The distinct adapters of the call's rows, in first-appearance order (read by every layer of the call)."""
        return tuple(dict.fromkeys(self.adapters))

    def scales(self, blocks: tuple[tuple[int, int, float], ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, total rank]`` for adapters stacked as ``blocks`` (``(adapter, rank, scaling)`` in stacking order): row
        ``r``'s entries in its own adapter's block hold that adapter's scaling, every other entry 0. Built once per call."""
        key = (blocks, device, dtype)
        if key not in self._scales:
            where, start = {}, 0
            for adapter, rank, scaling in blocks:
                where[adapter] = (start, rank, scaling)
                start += rank
            table = torch.zeros(len(self.adapters), start)
            for row, adapter in enumerate(self.adapters):
                if adapter in where:
                    first, rank, scaling = where[adapter]
                    table[row, first : first + rank] = scaling
            self._scales[key] = table.to(device=device, dtype=dtype)
        return self._scales[key]

    def segments(self, device: torch.device) -> list[tuple[int, torch.Tensor]]:
        """``[(adapter, row index on device)]`` in first-appearance order; built once per call."""
        if self._segments is None:
            by_adapter: dict[int, list[int]] = {}
            for row, adapter in enumerate(self.adapters):
                by_adapter.setdefault(adapter, []).append(row)
            self._segments = [(a, torch.tensor(rows, dtype=torch.long).to(device)) for a, rows in by_adapter.items()]
        return self._segments


_CURRENT: contextvars.ContextVar[RowPlan | None] = contextvars.ContextVar("tinkergym_row_adapters", default=None)


def current() -> RowPlan | None:
    """The plan of the model call under way, or None (rows run through the base alone)."""
    return _CURRENT.get()


@contextlib.contextmanager
def rows_through(adapters: Sequence[int] | None) -> Iterator[None]:
    """Run the model calls inside with row ``i`` of the batch through adapter ``adapters[i]``; None leaves the model as it is."""
    if adapters is None:
        yield
        return
    values = tuple(adapters)
    plan = RowPlan(values, only=values[0] if values and all(a == values[0] for a in values) else None)
    token = _CURRENT.set(plan)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def pick(adapters: Sequence[int] | None, rows: Sequence[int]) -> list[int] | None:
    """The adapters of ``rows`` (a call's rows as indices into the batch), or None when there are none."""
    return None if adapters is None else [adapters[r] for r in rows]
