"""Automatic prefix caching for :func:`~tinkergym.backends.torch.sampling.sample_batch`: multi-turn prompts run once.

A multi-turn episode's prompt at turn ``t`` is its prompt at turn ``t - 1``, that turn's sampled ids, and the
env's reply (the rollout never re-tokenizes). Without a cache every turn prefills the whole conversation again:
the prefill grows with the square of the turns, and a game of 25 moves a seat spends nearly all its time there.

:class:`PrefixCache` keeps, after every ``sample_batch``, each row's keys and values for its prompt and the
sampled ids the model has run (a row's last sampled id is run only when other rows go on). A later prompt
that continues an entry takes that entry's keys and values and runs only the rest. Entries are dropped least
recently used past ``max_bytes``, an entry that a newer one extends first.

The reused keys and values are those the same weights computed for the same tokens at the same positions,
so the results equal a full prefill up to floating-point summation order (a decode step computes a token's
keys in a batch of one query each, the prefill in a batch of many). The cache must be cleared whenever the
weights change: :class:`~backends.torch_backend.TorchBackend` clears it on every optimizer step and state load,
at every state save (so a resumed run and the run it resumes sample from the same cache contents), and at the
start of every training pass (its memory goes to the activations). Only models whose
cache layers are all plain full-attention layers are cached: sliding-window layers keep only their window.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

import numpy as np
import torch


@dataclass(eq=False)
class CachedPrefix:
    """One entry: ``tokens`` and their keys and values, ``[(keys [H, L, D], values [H, L, D])]`` per layer, under weights ``scope``."""

    tokens: np.ndarray
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    scope: Any = None

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)


@dataclass
class PrefixCacheStats:
    """Prompt tokens asked for, and how many of them came from the cache instead of a forward pass."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    stored: int = 0
    evicted: int = 0


@dataclass
class PrefixCache:
    """Keys and values of earlier samples' prompts and completions, by their tokens (see the module docstring).

    ``max_bytes`` bounds what it holds; 0 turns it off (nothing is stored, nothing matches). ``scope`` names the
    weights computing now (e.g. which LoRA adapter is active, or none): entries match and are stored under it
    only, so a model that switches adapters between requests never reads one adapter's keys under another.
    """

    max_bytes: int
    scope: Any = None
    entries: OrderedDict[int, CachedPrefix] = field(default_factory=OrderedDict)  # least recently used first
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    _next_key: int = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def clear(self) -> None:
        """Drop every entry (the weights changed: their keys and values are stale)."""
        self.entries.clear()

    def drop_scope(self, scope: Any) -> None:
        """Drop the entries of one scope (its weights changed: a shared base's session stepped or loaded a state)."""
        for key in [k for k, e in self.entries.items() if e.scope == scope]:
            del self.entries[key]

    def match(self, prompt: Sequence[int], scope: Any = ...) -> tuple[CachedPrefix | None, int]:
        """The longest entry whose tokens ``prompt`` continues, and its length (``(None, 0)``: none), under ``scope``
        (default: :attr:`scope`; a shared base passes each row's own).

        Only an entry the prompt strictly extends matches (a later turn of its conversation): the prompt's
        last token always runs, its logits start the decode, and a prompt asked for again finds no entry of
        its own, so a seeded request repeats bit for bit.
        """
        scope = self.scope if scope is ... else scope
        limit = len(prompt) - 1
        if limit <= 0 or not self.entries:
            return None, 0
        ids = np.asarray(prompt, dtype=np.int64)
        best_key, best = None, 0
        for key, entry in self.entries.items():
            n = len(entry.tokens)
            if best < n <= limit and entry.scope == scope and np.array_equal(entry.tokens, ids[:n]):
                best_key, best = key, n
        if best_key is None:
            return None, 0
        self.entries.move_to_end(best_key)
        return self.entries[best_key], best

    def store(self, tokens: Sequence[int], layers: list[tuple[torch.Tensor, torch.Tensor]], scope: Any = ...) -> None:
        """Keep ``layers`` (each ``[H, len(tokens), D]``, owned by the cache from now on) as the entry for ``tokens``
        under ``scope`` (default: :attr:`scope`).

        Entries the new one extends are evicted first from now on (the new one holds all they hold); they
        stay while there is room, so a request asked for again starts from the same entry as before.
        """
        if self.max_bytes <= 0 or len(tokens) == 0:
            return
        scope = self.scope if scope is ... else scope
        entry = CachedPrefix(np.asarray(tokens, dtype=np.int64), layers, scope)
        size = entry.nbytes
        if size > self.max_bytes:
            return
        n = len(entry.tokens)
        for key, old in list(self.entries.items()):
            m = len(old.tokens)
            if old.scope != scope:
                continue
            if m >= n and np.array_equal(old.tokens[:n], entry.tokens):
                self.entries.move_to_end(key)  # already held
                return
            if m < n and np.array_equal(old.tokens, entry.tokens[:m]):
                self.entries.move_to_end(key, last=False)  # superseded: the first to go
        total = self.nbytes
        while self.entries and total + size > self.max_bytes:
            total -= self.entries.popitem(last=False)[1].nbytes
            self.stats.evicted += 1
        self.entries[self._next_key] = entry
        self._next_key += 1
        self.stats.stored += 1


def adapter_scope(model: torch.nn.Module) -> tuple[tuple[str, ...], bool] | None:
    """The :attr:`PrefixCache.scope` of ``model`` now: its active peft adapters and whether adapters are off; None without any.

    Read off the first adapter layer: peft's ``set_adapter`` and ``disable_adapter`` change every layer alike.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layer = next((m for m in model.modules() if isinstance(m, BaseTunerLayer)), None)
    return None if layer is None else (tuple(layer.active_adapters), bool(layer.disable_adapters))
