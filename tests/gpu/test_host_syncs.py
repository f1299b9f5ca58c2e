"""How often sampling and training make the host wait for the device, and that waiting less changed no result.

A host sync (``.item()``, ``.tolist()``, ``bool(tensor)``, a blocking copy, ``nonzero``) stalls a GPU's queue of
kernels until the host has read the value back. The decode loop reads its stop flags once every
``STOP_CHECK_INTERVAL`` steps and the training pass reads its metrics once per call. On CUDA the syncs are counted
by ``torch.cuda.set_sync_debug_mode``; elsewhere the same code runs under a counter of the tensor methods that
read device values back on the host. The results are compared with a reference decoder that checks every step
(the loop as it was before) and with a training pass that reads every metric back as it goes.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch

from tinkergym.backends.torch import losses
from tinkergym.backends.torch import sampling as torch_sampling
from tinkergym.backends.torch.cache_names import cache_kwargs, cache_of
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.backends.torch.sampling import STOP_CHECK_INTERVAL, prefill, sample_batch, sample_next
from tinkergym.backends.torch.scoring import sequence_logprobs
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, SampledSequence, SamplingParams
from tinkergym.errors import NonFiniteError

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
#: Tensor methods (and torch functions) that read a device value back on the host.
READ_BACKS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero")
BACKENDS_DIR = os.path.dirname(torch_sampling.__file__)


class SyncCounter:
    """Host syncs seen inside :meth:`counting`: all of them, and those made by tinkergym's backend code itself."""

    def __init__(self) -> None:
        self.where: collections.Counter[tuple[str, str]] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.where.values())

    @property
    def ours(self) -> int:
        return sum(n for (path, _), n in self.where.items() if path.startswith(BACKENDS_DIR))

    def _wrap(self, owner: object, name: str, saved: list) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            frame = sys._getframe(1)
            self.where[(frame.f_code.co_filename, f"{name}:{frame.f_lineno}")] += 1
            return original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, counted)

    @contextlib.contextmanager
    def counting(self) -> Iterator[SyncCounter]:
        """On CUDA: the sync debug mode's warnings; elsewhere: calls of :data:`READ_BACKS` (the same code path)."""
        if CUDA:
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield self
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            for w in caught:
                if "synchroniz" in str(w.message):
                    self.where[(w.filename, f"sync:{w.lineno}")] += 1
            return
        saved: list = []
        for name in READ_BACKS:
            self._wrap(torch.Tensor, name, saved)
        self._wrap(torch, "nonzero", saved)
        try:
            yield self
        finally:
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)


def count(fn) -> SyncCounter:
    counter = SyncCounter()
    with counter.counting():
        fn()
    return counter


@pytest.fixture(scope="module")
def backends(tiny: str) -> dict[str, TorchBackend]:
    """A LoRA backend (non-zero adapter) and a full fine-tuning one, float32, on the GPU when there is one."""
    out = {}
    for name, rank in (("lora", 4), ("full", 0)):
        backend = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=rank, dtype="float32", device=DEVICE, seed=0, micro_batch_size=2))
        if rank:
            with torch.no_grad():
                for key, param in backend.model.named_parameters():
                    if "lora_B" in key:
                        param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        out[name] = backend
    return out


def prompts(lengths: tuple[int, ...], seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 200, (n,), generator=gen).tolist() for n in lengths]


# ----- the reference: the decode loop that reads every step's results back --------------------------------------
@torch.inference_mode()
def reference_sample_batch(model, prompts_, params, stop_ids, pad_id, generator=None, share_prompts=True) -> list[SampledSequence]:
    """The decode loop as it was before the stop flags stayed on the device: several reads back per step."""
    device = next(model.parameters()).device
    logits_BV, cache, attention, positions = prefill(model, prompts_, pad_id, device, share_prompts)
    stop_B = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    tokens: list[list[int]] = [[] for _ in prompts_]
    logprobs: list[list[float]] = [[] for _ in prompts_]
    finished = torch.zeros(len(prompts_), dtype=torch.bool, device=device)
    next_position = positions[:, -1:] + 1
    for step in range(params.max_new_tokens):
        tokens_B, logprobs_B = sample_next(logits_BV, params, generator)
        tokens_B = torch.where(finished, torch.full_like(tokens_B, pad_id), tokens_B)
        for row, (token, logprob, done) in enumerate(zip(tokens_B.tolist(), logprobs_B.tolist(), finished.tolist())):
            if not done:
                tokens[row].append(token)
                logprobs[row].append(logprob)
        finished |= torch.isin(tokens_B, stop_B)
        if bool(finished.all()) or step + 1 == params.max_new_tokens:
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        out = model(input_ids=tokens_B[:, None], attention_mask=attention, position_ids=next_position, **cache_kwargs(cache), use_cache=True)
        logits_BV, cache = out.logits[:, -1], cache_of(out)
        next_position = next_position + 1
    stops = set(stop_ids)
    return [SampledSequence(tokens=t, logprobs=lp, finish_reason="stop" if t and t[-1] in stops else "length") for t, lp in zip(tokens, logprobs)]


def as_tuples(sequences: list[SampledSequence]) -> list[tuple]:
    return [(s.tokens, s.logprobs, s.finish_reason) for s in sequences]


CASES = {
    "greedy": SamplingParams(max_new_tokens=20, temperature=0.0),
    "greedy_stops": SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=list(range(0, 1100, 3))),
    "t1": SamplingParams(max_new_tokens=21, temperature=1.0, seed=5),
    "t1_stops": SamplingParams(max_new_tokens=30, temperature=1.0, seed=5, stop_token_ids=list(range(0, 1100, 9))),
    "t1_unseeded_stops": SamplingParams(max_new_tokens=25, temperature=1.0, stop_token_ids=list(range(0, 1100, 11))),
    "t07_top": SamplingParams(max_new_tokens=19, temperature=0.7, top_k=30, top_p=0.9, seed=2, stop_token_ids=list(range(0, 1100, 13))),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("drop", [False, True], ids=["whole-batch", "stopped-rows-leave"])
def test_sampling_matches_the_reference_decoder(backends: dict[str, TorchBackend], mode: str, case: str, drop: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Same tokens, logprobs, finish reasons and random numbers drawn, for every check interval, seeded or not.

    Bit for bit while every row stays in the batch; once stopped rows leave it, the rows that stay run in a smaller
    batch, whose matrix products may round differently in the last bit: their logprobs are held to 1e-5."""
    if not drop:
        monkeypatch.setattr(torch_sampling, "COMPACT_SHARE", 2.0)  # never reached: every row decodes to the end
    backend = backends[mode]
    params = CASES[case]
    model = backend._sampling_model()
    stop_ids = list(params.stop_token_ids) or [backend.tokenizer.eos_token_id]
    longest = []  # per call, the most tokens a row got
    # The reference takes no check interval: it runs once per batch and prompt sharing, and each interval is held to it.
    references: dict[tuple[tuple[int, ...], bool], tuple[tuple[list, list], list[float]]] = {}
    for lengths, samples in (((4, 9, 6), 4), ((7, 7), 3)):  # padded groups; one prompt length (no padding)
        batch = [p for p in prompts(lengths) for _ in range(samples)]
        for share, interval in ((True, STOP_CHECK_INTERVAL), (True, 3), (False, 1), (False, 64)):
            seeded = params.seed is not None
            results, after = [], []
            for fn in (reference_sample_batch, sample_batch):
                if fn is reference_sample_batch and (lengths, share) in references:
                    result, drawn = references[lengths, share]
                    results.append(result)
                    after.append(drawn)
                    continue
                gen = torch.Generator(device=DEVICE).manual_seed(params.seed) if seeded else None
                torch.manual_seed(99)
                kwargs = {"check_interval": interval} if fn is sample_batch else {}
                with backend._compute():
                    # Twice in a row: the second call starts from the generator state the first one left.
                    first = fn(model, batch, params, stop_ids, backend.pad_id, gen, share, **kwargs)
                    second = fn(model, batch[::-1], params, stop_ids, backend.pad_id, gen, share, **kwargs)
                results.append((as_tuples(first), as_tuples(second)))
                longest.extend(max(len(s.tokens) for s in out) for out in (first, second))
                after.append(torch.rand(4, generator=gen, device=DEVICE).tolist())
                if fn is reference_sample_batch:
                    references[lengths, share] = (results[-1], after[-1])
            if drop:
                for got, want in zip(results[1], results[0]):
                    assert [(t, f) for t, _, f in got] == [(t, f) for t, _, f in want], (case, lengths, share, interval)
                    assert all(math.isclose(a, b, abs_tol=1e-5) for g, w in zip(got, want) for a, b in zip(g[1], w[1]))
            else:
                assert results[1] == results[0], (case, lengths, share, interval)
            assert after[1] == after[0], (case, lengths, share, interval)
    if case.endswith("stops"):  # some whole batch stops early: the steps decoded past its stop are discarded
        assert min(longest) < params.max_new_tokens


class _DivergingModel(torch.nn.Module):
    """The model, with NaN logits from its ``nan_from``-th forward pass on (0 is the prefill)."""

    def __init__(self, model: torch.nn.Module, nan_from: int) -> None:
        super().__init__()
        self.model, self.nan_from, self.calls = model, nan_from, 0

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        if self.calls >= self.nan_from:
            out.logits = torch.full_like(out.logits, float("nan"))
        self.calls += 1
        return out


@pytest.mark.parametrize("nan_from", [0, 2, 9])
def test_diverged_logits_raise_as_when_every_step_was_checked(backends: dict[str, TorchBackend], nan_from: int) -> None:
    model = backends["lora"]._sampling_model()
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1)
    batch = prompts((5, 8))
    with pytest.raises(NonFiniteError, match="diverged"):
        sample_batch(_DivergingModel(model, nan_from), batch, params, [], backends["lora"].pad_id)
    # Past the step at which every row stopped, NaN logits are never drawn from, so nothing is raised.
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    stop_all = list(range(2000))
    expected = as_tuples(reference_sample_batch(model, batch, greedy, stop_all, 0))
    assert as_tuples(sample_batch(_DivergingModel(model, 1), batch, greedy, stop_all, 0)) == expected


# ----- sync counts -------------------------------------------------------------------------------------------
def sample_syncs(backend: TorchBackend, lengths: tuple[int, ...], new_tokens: int) -> SyncCounter:
    model = backend._sampling_model()
    never = [len(backend.tokenizer) + 5]  # no row stops: every call decodes all of its tokens
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=3, stop_token_ids=never)
    batch = [p for p in prompts(lengths) for _ in range(4)]

    def run() -> None:
        with backend._compute():
            out = sample_batch(model, batch, params, never, backend.pad_id)
        assert all(len(s.tokens) == new_tokens for s in out)

    run()  # warm-up: one-off work (lazy initializations) is not counted
    return count(run)


def test_decode_reads_back_once_per_check_interval(backends: dict[str, TorchBackend]) -> None:
    """Prompts of one length (no padding mask for transformers to inspect): every sync in the call is counted."""
    short, long = (sample_syncs(backends["lora"], (6, 6), n) for n in (STOP_CHECK_INTERVAL, 5 * STOP_CHECK_INTERVAL))
    per_call = short.total
    extra_tokens = 4 * STOP_CHECK_INTERVAL
    # The reference loop read back about five times per token; now once per check interval plus a few per call.
    assert long.total - per_call <= extra_tokens // STOP_CHECK_INTERVAL, long.where
    assert per_call <= 4, short.where


def test_decode_of_padded_prompts_reads_back_once_per_check_interval_in_tinkergym_code(backends: dict[str, TorchBackend]) -> None:
    """With left padding transformers itself inspects the padding mask on each forward pass; our own reads stay bounded."""
    short, long = (sample_syncs(backends["full"], (3, 8), n) for n in (STOP_CHECK_INTERVAL, 5 * STOP_CHECK_INTERVAL))
    assert long.ours - short.ours <= 4 and short.ours <= 4, long.where


def training_batch() -> list[Datum]:
    """Two groups sharing prompts of different lengths, and rows of their own; advantages of both signs."""
    data = []
    for g, (prompt, own) in enumerate(((prompts((6,), 1)[0], (5, 3, 7, 4)), (prompts((9,), 2)[0], (2, 6, 4)))):
        for k, n in enumerate(own):
            tokens = prompt + prompts((n,), 10 * g + k)[0]
            mask = [0.0] * len(prompt) + [1.0] * n
            data.append(Datum(tokens=tokens, loss_mask=mask, advantages=[(-1.0) ** k * (0.3 + 0.2 * k)] * len(tokens),
                              sampling_logprobs=[0.0] * len(prompt) + [-2.0 - 0.1 * t for t in range(n)]))
    for n, first in ((8, 3), (11, 5), (6, 1)):
        tokens = prompts((n,), 50 + n)[0]
        data.append(Datum(tokens=tokens, loss_mask=[0.0] * first + [1.0] * (n - first), advantages=[0.4] * n, sampling_logprobs=[-1.5] * n))
    return data


SPECS = {
    "ppo": LossSpec(name="ppo"),
    "ppo_kl_tis": LossSpec(name="ppo", kl_coef=0.1, tis_cap=2.0, old_logprobs="trainer"),
    "is_sequence": LossSpec(name="importance_sampling", aggregation="sequence", temperature=0.8),
}


def test_training_reads_back_once_per_call(backends: dict[str, TorchBackend]) -> None:
    backend = backends["lora"]
    data = training_batch()
    micro_batches = len(backend.plan(data))
    assert micro_batches >= 4
    for spec in SPECS.values():
        request = ForwardBackwardRequest(data=data, loss=spec)
        backend.forward_backward(request)
        counter = count(lambda request=request: backend.forward_backward(request))
        backend.optimizer.zero_grad(set_to_none=True)
        # One read of every micro-batch's metric sums; indices come from the host, not from nonzero or tolist.
        assert counter.ours <= 1, counter.where
        if CUDA:  # transformers inspects each padding mask (one read per forward pass)
            assert counter.total <= 1 + 3 * micro_batches * (2 if spec.kl_coef else 1), counter.where


def reference_forward_backward(backend: TorchBackend, request: ForwardBackwardRequest) -> dict[str, float]:
    """The training pass as it was: lengths and the first read position read back, metrics read per micro-batch."""
    spec, data = request.loss, request.data
    total_mask = sum(sum(d.loss_mask[1:]) for d in data)
    num_sequences = sum(1 for d in data if any(m != 0 for m in d.loss_mask[1:]))
    backend.model.train()
    sums: dict[str, float] = {}
    for micro in backend.plan(data):
        batch = backend._collate([data[i] for i in micro.indices])
        with backend._compute():
            logprobs = sequence_logprobs(backend.model, batch.tokens, batch.attention, batch.mask, micro, spec.temperature)
        reference = None
        if spec.kl_coef > 0:
            with torch.no_grad(), backend._compute(), backend.model.disable_adapter():
                reference = sequence_logprobs(backend.model, batch.tokens, batch.attention, batch.mask, micro, spec.temperature)
        weights = losses.aggregation_weights(batch.mask, spec.aggregation, total_mask, num_sequences)
        loss, micro_sums = losses.compute_loss(spec, logprobs, batch.mask, weights, batch.advantages, batch.sampling_logprobs, reference)
        loss.backward()
        sums = losses.add_sums(sums, micro_sums)
    return losses.finalize_metrics(sums)


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_training_pass_matches_the_reference(backends: dict[str, TorchBackend], spec_name: str, share: bool) -> None:
    backend = backends["lora"]
    request = ForwardBackwardRequest(data=training_batch(), loss=SPECS[spec_name])
    backend.config.share_prefixes = share
    try:
        results = []
        for fn in (reference_forward_backward, lambda b, r: b.forward_backward(r).metrics):
            backend.optimizer.zero_grad(set_to_none=True)
            metrics = fn(backend, request)
            results.append((metrics, {n: p.grad.clone() for n, p in backend._trainable if p.grad is not None}))
    finally:
        backend.config.share_prefixes = True
        backend.optimizer.zero_grad(set_to_none=True)
    (expected, expected_grads), (metrics, grads) = results
    assert metrics == expected and all(math.isfinite(v) for v in metrics.values())
    assert expected_grads.keys() == grads.keys() and expected_grads
    for name, grad in grads.items():
        assert torch.equal(grad, expected_grads[name]), name


def test_sums_to_floats_reads_what_float_reads() -> None:
    sums = [{"a": torch.tensor(0.1), "n": torch.tensor(7)}, {"b": torch.tensor(1 / 3, dtype=torch.float64), "c": torch.tensor(2.5, dtype=torch.bfloat16)}]
    assert losses.sums_to_floats(sums) == [{key: float(value) for key, value in d.items()} for d in sums]
    assert losses.sums_to_floats([{}, {}]) == [{}, {}]
