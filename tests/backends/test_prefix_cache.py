"""Automatic prefix caching: a multi-turn prompt runs only its new tokens, and sampling gives what it gave without the cache."""

from __future__ import annotations

import pytest
import torch

from tinkergym.backends.models import build_tiny_model
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.backends.torch.prefix_cache import PrefixCache
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams
from tinkergym.errors import ConfigError

FIRST_PROMPTS = [[1, 5, 9, 12, 7, 30, 31], [1, 5, 9, 3], [1, 5, 2, 2, 2, 2, 8, 40, 41, 42]]


def make_backend(model: str, cache_mb: float, lora_rank: int = 4, dtype: str = "float32") -> TorchBackend:
    return TorchBackend(TorchBackendConfig(model=model, lora_rank=lora_rank, dtype=dtype, seed=0, prefix_cache_mb=cache_mb))


class WidestPass:
    """Records the widest ``input_ids`` of each forward pass of ``model`` since the last :meth:`take`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.widths: list[int] = []
        model.get_input_embeddings().register_forward_hook(lambda module, args, out: self.widths.append(args[0].shape[-1]))

    def take(self) -> int:
        widest, self.widths = max(self.widths), []
        return widest


def converse(backend: TorchBackend, turns: int = 4, temperature: float = 0.0, num_samples: int = 1) -> tuple[list, list[int], list[int]]:
    """Multi-turn sampling: each turn's prompts are the last prompts, their completions and a reply of 1-3 ids.

    Returns every turn's sequences, the widest forward pass of each turn, and each turn's longest new part
    (what a turn adds to the conversation that the model has not run yet: the reply and the last sampled id).
    """
    widest = WidestPass(backend._sampling_model())
    prompts = [list(p) for p in FIRST_PROMPTS for _ in range(num_samples)]
    turns_out, widths, new = [], [], [max(len(p) for p in prompts)]
    for turn in range(turns):
        params = SamplingParams(max_new_tokens=5 + turn, temperature=temperature, seed=11 + turn if temperature > 0 else None)
        response = backend.sample(SampleRequest(prompts=prompts, params=params))
        sequences = [row[0] for row in response.sequences]
        turns_out.append(sequences)
        widths.append(widest.take())
        replies = [[4, 40 + i, 11][: 1 + (i + turn) % 3] for i in range(len(prompts))]
        prompts = [p + s.tokens + r for p, s, r in zip(prompts, sequences, replies)]
        new.append(max(len(r) + 1 for r in replies))
    return turns_out, widths, new[:-1]


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_later_turns_run_only_their_new_tokens_and_sample_what_a_full_prefill_samples(tiny: str, lora_rank: int) -> None:
    cached, cached_widths, new = converse(make_backend(tiny, 64, lora_rank))
    plain, plain_widths, _ = converse(make_backend(tiny, 0, lora_rank))
    for cached_turn, plain_turn in zip(cached, plain):
        for c, p in zip(cached_turn, plain_turn):
            assert c.tokens == p.tokens
            assert c.logprobs == pytest.approx(p.logprobs, abs=1e-5)
    # The first turn has nothing to reuse; every later one runs at most its new tokens, a full prefill all of them.
    assert cached_widths[0] == plain_widths[0] == len(max(FIRST_PROMPTS, key=len))
    for turn in range(1, len(new)):
        assert cached_widths[turn] <= new[turn] < plain_widths[turn]


def test_sampled_turns_match_the_policy_and_repeat_exactly(tiny: str) -> None:
    backend = make_backend(tiny, 64)
    turns, _, _ = converse(backend, turns=3, temperature=1.0, num_samples=2)
    assert backend.prefix_cache.stats.reused_tokens > 0
    prompts = [list(p) for p in FIRST_PROMPTS for _ in range(2)]
    for sequences in turns[:-1]:
        prompts = [p + s.tokens + [4, 40 + i, 11][: 1 + (i + turns.index(sequences)) % 3] for i, (p, s) in enumerate(zip(prompts, sequences))]
    # The last turn's sampler logprobs are the policy's (scored in a training pass without any cache).
    for prompt, sequence in zip(prompts, turns[-1]):
        scored = backend.logprobs([prompt + sequence.tokens])[0][len(prompt) :]
        assert sequence.logprobs == pytest.approx(scored, abs=1e-4)
    # A seeded request asked again gives the same bits: it starts from the same entries as before.
    params = SamplingParams(max_new_tokens=7, temperature=1.0, seed=13)
    again = [backend.sample(SampleRequest(prompts=prompts, params=params)) for _ in range(2)]
    assert again[0] == again[1]


def test_the_cache_is_emptied_whenever_the_weights_change(tiny: str, tmp_path) -> None:
    backend = make_backend(tiny, 64)
    backend.save_state(str(tmp_path / "start"))
    prompt = FIRST_PROMPTS[0]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)

    def first_turn() -> list[int]:
        completion = backend.sample(SampleRequest(prompts=[prompt], params=greedy)).sequences[0][0].tokens
        assert backend.prefix_cache.entries
        return prompt + completion + [4, 5]

    def assert_second_turn_is_the_policys(conversation: list[int]) -> None:
        sequence = backend.sample(SampleRequest(prompts=[conversation], params=greedy)).sequences[0][0]
        scored = backend.logprobs([conversation + sequence.tokens])[0][len(conversation) :]
        assert sequence.logprobs == pytest.approx(scored, abs=1e-4)

    conversation = first_turn()
    data = [Datum(tokens=conversation, loss_mask=[0.0] * len(prompt) + [1.0] * (len(conversation) - len(prompt)), advantages=[1.0] * len(conversation))]
    backend.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="reinforce")))
    assert not backend.prefix_cache.entries  # the training pass takes its memory
    conversation = first_turn()
    backend.optim_step(OptimParams(learning_rate=0.5))
    assert not backend.prefix_cache.entries
    assert_second_turn_is_the_policys(conversation)  # the new weights' keys, not the old ones'
    conversation = first_turn()
    backend.load_state(str(tmp_path / "start"))
    assert not backend.prefix_cache.entries
    assert_second_turn_is_the_policys(conversation)
    first_turn()
    backend.save_state(str(tmp_path / "again"))
    assert not backend.prefix_cache.entries


def test_sliding_window_models_are_not_cached(tmp_path) -> None:
    model = build_tiny_model(tmp_path / "sliding", model_type="mistral", sliding_window=6)
    cached, _, _ = converse(make_backend(model, 64), turns=3)
    plain, _, _ = converse(make_backend(model, 0), turns=3)
    assert [[s.tokens for s in turn] for turn in cached] == [[s.tokens for s in turn] for turn in plain]
    assert make_backend(model, 64).prefix_cache.stats.stored == 0


def test_entries_are_bounded_least_recently_used_and_superseded_first() -> None:
    def layers(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.zeros(2, n, 4), torch.zeros(2, n, 4))]  # 64 bytes a token

    cache = PrefixCache(max_bytes=64 * 19)
    cache.store([1, 2, 3], layers(3))
    cache.store([7, 8, 9, 10], layers(4))
    cache.store([1, 2, 3, 4, 5], layers(5))  # extends the first: it is the first to go from now on
    first = cache.entries[0]
    assert cache.match([1, 2, 3, 4]) == (first, 3)  # kept while there is room
    assert cache.match([1, 2, 3, 4, 5, 6]) == (cache.entries[2], 5)
    assert cache.match([1, 2, 3, 4, 5]) == (first, 3)  # a prompt never matches all of itself
    assert cache.match([7, 8, 9]) == (None, 0) and cache.match([2, 3, 4]) == (None, 0)
    cache.store([1, 2, 3, 4, 5, 6, 7, 8], layers(8))  # 20 tokens in all: room for it once one entry goes
    assert sorted(len(e.tokens) for e in cache.entries.values()) == [4, 5, 8] and cache.stats.evicted == 1
    cache.store([5] * 9, layers(9))
    assert [len(e.tokens) for e in cache.entries.values()] == [8, 9] and cache.stats.evicted == 3 and cache.nbytes <= cache.max_bytes
    cache.store([6] * 21, layers(21))  # larger than the whole cache: not kept, nothing evicted for it
    assert len(cache.entries) == 2
    off = PrefixCache(max_bytes=0)
    off.store([1, 2], layers(2))
    assert not off.entries and off.match([1, 2, 3]) == (None, 0)
    with pytest.raises(ConfigError):
        TorchBackendConfig(prefix_cache_mb=-1)


def test_a_prompt_never_reuses_keys_another_adapter_computed(tiny: str) -> None:
    """One model serving several adapters (snapshots, served adapters) keeps each adapter's entries to itself."""
    backends = {mb: make_backend(tiny, mb) for mb in (64, 0)}
    for backend in backends.values():
        with torch.no_grad():
            for name, param in backend.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    cached = backends[64]

    def sample(backend: TorchBackend, prompt: list[int]):
        return backend.sample(SampleRequest(prompts=[prompt], params=greedy)).sequences[0][0]

    first = sample(cached, FIRST_PROMPTS[0])
    conversation = FIRST_PROMPTS[0] + first.tokens + [4, 5]
    with cached.model.disable_adapter():  # the base model now: the adapter's entry must not serve it
        got = sample(cached, conversation)
    assert cached.prefix_cache.stats.reused_tokens == 0
    with backends[0].model.disable_adapter():
        want = sample(backends[0], conversation)
    assert got.tokens == want.tokens and got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    sample(cached, conversation)  # the adapter again: its own entry serves it
    assert cached.prefix_cache.stats.reused_tokens > 0
