"""The name transformers gives a model's KV cache, in a forward's keyword arguments and in its output.

transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name still works, with a deprecation warning at
every process start, and goes in 5.40); the versions before it know only ``past_key_values``. Every forward with a
cache goes through :func:`cache_kwargs` and :func:`cache_of`, so it speaks the installed version's name.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def cache_name() -> str:
    """``"cache"`` where the installed transformers names it so, else ``"past_key_values"``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{name: cache}``, to pass a KV cache to a forward."""
    return {cache_name(): cache}


def cache_of(output: Any) -> Any:
    """The KV cache a forward returned."""
    return getattr(output, cache_name())
