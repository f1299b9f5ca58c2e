"""Rows that have stopped leave the decode batch: later steps run the rows still decoding, the results stay the same.

A batch whose rows stop at different steps used to decode every row until its last one stopped. Now, at a stop check
where at least half of the rows still in the batch have stopped, those leave it (their keys and values kept in the
prefix cache first). The rows that stay run in a smaller batch, so their logprobs are held to the whole-batch run
within 1e-5 (a smaller matrix product may round differently in the last bit); tokens, finish reasons and the random
numbers drawn are the same. The reference decoder comparison for every sampling mode is in
``tests/gpu/test_host_syncs.py``; rows of several adapters in ``tests/backends/test_shared_lora.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tinkergym.backends.torch import sampling  # noqa: E402
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig  # noqa: E402
from tinkergym.protocol.types import SampleRequest, SamplingParams  # noqa: E402

#: Stop ids that end rows at many different steps of the tiny model's decode.
STOPS = list(range(0, 1024, 11))
PARAMS = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, stop_token_ids=STOPS)


class BatchSizes:
    """The number of rows of each of a model's forward passes (the prefill first)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.rows: list[int] = []
        self.handle = model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self.rows.append(int(kwargs["input_ids"].shape[0]))


def sample_both_ways(backend: TorchBackend, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch, num_samples: int = 4):
    """The same request sampled with rows leaving (and the model's passes' row counts) and with every row to the end."""
    request = SampleRequest(prompts=prompts, num_samples=num_samples, params=PARAMS)
    sizes = BatchSizes(backend._sampling_model())
    leaving = backend.sample(request)
    sizes.handle.remove()
    with monkeypatch.context() as patch:
        patch.setattr(sampling, "COMPACT_SHARE", 2.0)  # never reached
        whole = backend.sample(request)
    return leaving, whole, sizes.rows


def assert_same(leaving, whole) -> None:
    for got_row, want_row in zip(leaving.sequences, whole.sequences):
        for got, want in zip(got_row, want_row):
            assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason)
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


@pytest.mark.parametrize("lengths", [(5, 5), (3, 8, 6)], ids=["one-length", "padded"])
def test_stopped_rows_leave_and_the_samples_stay_the_same(tiny: str, lengths: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    backend = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=4, dtype="float32", seed=0, prefix_cache_mb=0))
    prompts = [list(range(20 + 3 * i, 20 + 3 * i + n)) for i, n in enumerate(lengths)]
    leaving, whole, rows = sample_both_ways(backend, prompts, monkeypatch)
    assert_same(leaving, whole)
    lengths_out = sorted(len(s.tokens) for row in whole.sequences for s in row)
    assert lengths_out[0] < sampling.STOP_CHECK_INTERVAL and lengths_out[-1] > 2 * sampling.STOP_CHECK_INTERVAL, lengths_out
    batch = len(prompts) * 4
    decode = rows[1:]  # the prefill runs each distinct prompt once
    assert decode[0] == batch and min(decode) < batch // 2 + 1, decode
    assert decode == sorted(decode, reverse=True)  # rows only ever leave
    # Each pass runs at least the rows that had not stopped before it: none left too early.
    for step, size in enumerate(decode, start=1):
        assert size >= sum(len(s.tokens) > step for row in whole.sequences for s in row)


def test_rows_that_leave_keep_their_keys_in_the_prefix_cache(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=4, dtype="float32", seed=0, prefix_cache_mb=64))
    prompts = [[21, 22, 23, 24], [40, 41, 42, 43, 44, 45, 46]]
    request = SampleRequest(prompts=prompts, num_samples=4, params=PARAMS)
    out = backend.sample(request)
    assert min(len(s.tokens) for row in out.sequences for s in row) < sampling.STOP_CHECK_INTERVAL
    cache = backend.prefix_cache
    assert cache is not None
    for prompt, row in zip(prompts, out.sequences):
        for seq in row:
            entry, matched = cache.match([*prompt, *seq.tokens, 1])  # the next turn's prompt goes on from the completion
            # Every id the model ran is kept: the prompt and the completion, but for a last id never fed back.
            assert entry is not None and matched >= len(prompt) + len(seq.tokens) - 1, (matched, len(prompt), len(seq.tokens))
    # What a row kept is what a full prefill of its prompt and completion computes.
    prompt, seq = prompts[0], min((s for s in out.sequences[0]), key=lambda s: len(s.tokens))
    tokens = [*prompt, *seq.tokens]
    entry, matched = cache.match([*tokens, 1])
    assert entry is not None
    model = backend._sampling_model()
    with torch.inference_mode(), backend._compute():
        full = model(input_ids=torch.tensor([tokens[:matched]]), use_cache=True).past_key_values
    keys = full.layers[0].keys[0]
    assert torch.allclose(entry.layers[0][0][:, :matched], keys, atol=1e-5)
