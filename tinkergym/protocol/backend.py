"""The Backend protocol: Tinker-shaped compute primitives that a trainer drives.

A trainer talks to compute only through these methods, with the plain-data types of
:mod:`tinkergym.protocol.types`; a local backend and a remote one (the same protocol over HTTP) are
interchangeable.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from tinkergym.protocol.types import (
    ForwardBackwardRequest,
    ForwardBackwardResult,
    OptimParams,
    SampleRequest,
    SampleResponse,
)


@runtime_checkable
class Backend(Protocol):
    """Compute for one policy: sampling, gradients, optimizer steps, checkpoints and export."""

    def info(self) -> dict[str, Any]:
        """Plain facts: ``model`` (name or path), ``tokenizer`` (a local path the client can load), ``lora_rank`` (0: every weight trains), ``step``."""

    def sample(self, request: SampleRequest) -> SampleResponse:
        """Sample completions for token prompts; the returned ids are exactly what the policy produced."""

    def logprobs(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Per-token logprobs of whole sequences under the current policy at ``temperature`` (entry 0 is 0.0)."""

    def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardResult:
        """Compute the named loss on the batch and accumulate gradients."""

    def optim_step(self, params: OptimParams) -> dict[str, float]:
        """Apply the accumulated gradients with AdamW and clear them; returns e.g. the gradient norm."""

    def save_state(self, path: str) -> None:
        """Write weights (or adapter), optimizer, step and RNG state to ``path`` atomically."""

    def load_state(self, path: str) -> None:
        """Restore what :meth:`save_state` wrote."""

    def export(self, path: str, merged: bool = False) -> None:
        """Write an HF folder that plain transformers / peft / vLLM load: the adapter, or the merged model."""
