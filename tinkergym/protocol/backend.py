"""The Backend protocol: Tinker-shaped compute primitives that a trainer drives.

A trainer talks to compute only through these methods, with the plain-data types of
:mod:`tinkergym.protocol.types`; a local backend and a remote one (the same protocol over HTTP) are
interchangeable. :class:`SnapshotBackend` is an optional capability beside them: sampling from a fixed snapshot of
the weights concurrently with training, which sampling the next steps ahead (``async_steps``) needs.
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


@runtime_checkable
class SnapshotSampler(Protocol):
    """A sampler bound to one fixed version of a policy's weights: it samples from them however the policy trains on.

    ``version`` is the number of optimizer steps those weights had taken (on the scale of the backend's
    ``info()["step"]``). ``sample`` may be called from any thread, concurrently with the backend's training calls.
    """

    version: int

    def sample(self, request: SampleRequest) -> SampleResponse:
        """Sample completions with the snapshot's weights (the returned logprobs are theirs)."""


@runtime_checkable
class SnapshotBackend(Backend, Protocol):
    """A Backend that can sample concurrently with training: the optional capability ``async_steps`` needs.

    A backend that samples and trains on the same weights in one engine, one call after another (a local model,
    a training server), does not implement it; one whose samplers hold saved copies of the weights (a Tinker
    sampling client) does.
    """

    def sampling_snapshot(self) -> SnapshotSampler:
        """A sampler of the current weights that keeps them while this backend trains on (cheap to call once per step).

        Taken between training calls (never in the middle of a forward_backward/optim_step pair); sampling from it
        may overlap any later call of this backend. A backend whose samplers lag behind its weights (a fleet that
        loads new weights late) may hand out older ones: ``version`` says which, and a trainer drops what is too old.
        """
