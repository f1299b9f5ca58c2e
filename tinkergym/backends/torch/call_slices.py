"""A call worked in slices: one session's large call cut into the units a shared base runs it in, so that a server can
run other sessions' calls between them (:class:`~tinkergym.serve.training.shared.SharedWorker`).

The units are those the base would run the whole call in anyway, so the slices together give what the call gives in
one go:

- ``sample``: batches of ``max_sample_batch`` sequences of the call's sequences in order (a prompt's index once per
  sample; one prompt with many samples is several batches, as :class:`~tinkergym.backends.torch.backend.TorchBackend`
  batches it). Each slice asks for its sequences as prompts of one sample each; a seeded call's samples draw from their
  own streams (:attr:`CallSlices.carry` hands each slice its samples' seeds), an unseeded call's from the session's
  generator where the call's last slice left it, so the call gets the tokens it gets in one go.
- ``forward_backward``: micro-batches of the call's rows as the base plans them alone. Each slice's request carries the
  whole call's loss normalizers (``num_tokens``, ``num_sequences``), so its gradient is its share of the whole call's;
  its loss sums add up in :class:`FitCarry`, whose metrics are the whole call's after the last slice. A slice that fails
  puts the session's gradients back as they were before the first (:meth:`~tinkergym.backends.torch.shared.SharedBase.abandon`).
- ``logprobs``: micro-batches of the call's sequences (each sequence's logprobs are its own).

Prompts with images are not sliced (each is sampled on its own, in batches of ``max_sample_batch``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tinkergym.protocol.types import ForwardBackwardRequest, ForwardBackwardResult, SampleRequest, SampleResponse, SamplingParams

@dataclass
class FitCarry:
    """What a ``forward_backward`` call worked in slices carries from one slice to the next: its loss sums so far, and its
    session's state before the first slice (put back if a slice fails)."""

    totals: dict[str, float] = field(default_factory=dict)
    saved: Any = None


@dataclass
class CallSlices:
    """One call's units in the order they run (each: the call's rows in it, and the tokens it puts through the model),
    what the base carries across slices (``carry``: a seeded sample call's streams, a training call's :class:`FitCarry`,
    nothing for scoring), and the results of the rows done so far."""

    method: str
    args: Any  # the call's SampleRequest, ForwardBackwardRequest or (sequences, temperature[, images])
    units: deque[tuple[list[int], int]]
    carry: Any = None
    normalizers: tuple[float, int] | None = None  # a training call's: the whole call's, on each slice's request
    done: dict[int, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        """Every unit taken."""
        return not self.units

    def take(self, budget: int, anyway: bool) -> tuple[list[int], int]:
        """The next slice's rows, whole units within ``budget`` tokens (one unit at least when ``anyway``), and its tokens."""
        rows: list[int] = []
        used = 0
        while self.units:
            unit, cost = self.units[0]
            if used + cost > budget and not (anyway and not rows):
                break
            self.units.popleft()
            rows, used = rows + unit, used + cost
        return rows, used

    def part(self, rows: list[int]) -> Any:
        """The call's args for the slice ``rows``, as the base's ``*_many`` method of the call takes them."""
        args = self.args
        if self.method == "sample":
            params = SamplingParams(**{**args.params.to_dict(), "seed": None})  # the carried generator holds the seed's draws
            return SampleRequest(prompts=[args.prompts[i] for i in rows], params=params, num_samples=1)
        if self.method == "forward_backward":
            assert self.normalizers is not None
            return ForwardBackwardRequest(data=[args.data[i] for i in rows], loss=args.loss, num_tokens=self.normalizers[0],
                                          num_sequences=self.normalizers[1], return_logprobs=args.return_logprobs)
        sequences, temperature, *images = args
        picked = [sequences[i] for i in rows]
        return (picked, temperature, [images[0][i] for i in rows]) if images else (picked, temperature)

    def carry_for(self, rows: list[int]) -> Any:
        """What the slice ``rows`` carries into its pass: a seeded sample call's streams of the slice's samples (its rows'
        next samples, each the one sample of its prompt in the slice's request); else :attr:`carry` itself."""
        if self.method == "sample" and self.carry is not None:
            return self.carry.slice(rows)
        return self.carry

    def add(self, rows: list[int], result: Any) -> None:
        """Keep the results of the slice ``rows``."""
        if self.method == "sample":
            for i, sequences in zip(rows, result.sequences):
                self.done.setdefault(i, []).extend(sequences)
        elif self.method == "forward_backward":
            self.metrics = result.metrics  # the whole call's so far (see FitCarry)
            for i, logprobs in zip(rows, result.logprobs or ()):
                self.done[i] = logprobs
        else:
            self.done.update(zip(rows, result))

    def result(self) -> Any:
        """The whole call's result, after its last slice."""
        if self.method == "sample":
            return SampleResponse(sequences=[self.done[i] for i in range(len(self.args.prompts))])
        if self.method == "forward_backward":
            logprobs = [self.done[i] for i in range(len(self.args.data))] if self.args.return_logprobs else None
            return ForwardBackwardResult(metrics=self.metrics, logprobs=logprobs)
        return [self.done[i] for i in range(len(self.args[0]))]
