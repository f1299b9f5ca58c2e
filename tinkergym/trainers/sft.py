"""SFT: supervised fine-tuning on chat transcripts, so a model can be warmed up before RL.

Data (``trainer_args``):

- ``data_files``: JSONL files of ``{"messages": [...], "tools": [...]?}`` chat transcripts, or
- ``demos: "baseline"`` (CLI ``--demos baseline``): transcripts that the env's scripted baseline agent plays
  (``"random"``, ``--demos random``: its random agent, which teaches the action format and no strategy)
  (``demo_episodes``, default 256; only episodes with reward above ``demo_min_reward``, default -inf, are kept).
  On a multi-agent env the baseline plays itself, and each seat's side of a game (its own view as user
  turns, its moves as assistant turns) is one conversation.

Each conversation is rendered with the model's chat template; the loss (mean negative log-likelihood) covers
the assistant turns only, each up to and including its end-of-turn token, so the model also learns to stop. A
conversation longer than ``max_context`` is cut after its last assistant turn that fits (one whose first assistant
turn does not fit is left out).
Every step trains on ``batch_size`` conversations drawn by a (seed, step)-seeded shuffle.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tinkergym.plumbing import timeline
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams
from tinkergym.errors import ConfigError
from tinkergym.trainers.base import StepOutput, TrainingContext


def load_transcripts(paths: list[str]) -> list[dict[str, Any]]:
    """Read chat transcripts from JSONL files; a bad line is an error naming the file and line."""
    conversations = []
    for path in paths:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ConfigError(f"cannot read SFT data file {path}: {exc}") from exc
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                assert isinstance(record["messages"], list) and record["messages"]
            except (ValueError, KeyError, TypeError, AssertionError):
                raise ConfigError(f"{path}:{number}: expected a JSON object with a non-empty 'messages' list") from None
            conversations.append({"messages": record["messages"], "tools": record.get("tools")})
    if not conversations:
        raise ConfigError(f"no conversations in {paths}")
    return conversations


#: The agents whose episodes ``demos`` names: the env's scripted baseline (its play), or its random agent (legal actions
#: chosen at random: the action format alone, so that RL from there has a reward signal and still everything to learn).
DEMO_AGENTS = ("baseline", "random")


def baseline_demos(
    env_id: str, env_kwargs: dict[str, Any], episodes: int, seed: int, min_reward: float, agent: str = "baseline",
) -> list[dict[str, Any]]:
    """Transcripts of the env's scripted baseline agent (or its random agent: ``agent="random"``), as chat conversations."""
    import tinkergym
    from tinkergym.episodes import run_episode
    from tinkergym.registry import load_baseline, load_random_agent

    env_spec = tinkergym.spec(env_id)
    factory = (load_random_agent if agent == "random" else load_baseline)(env_spec)
    if factory is None:
        raise ConfigError(f"{env_spec.distribution} declares no {agent} agent for {env_id}; pass SFT data files instead.")
    if env_spec.kind == "aec":
        return _duel_demos(tinkergym.make_aec(env_id, **env_kwargs), factory, episodes, seed, min_reward)
    env = tinkergym.make(env_id, **env_kwargs)
    conversations = []
    for i in range(episodes):
        transcript = run_episode(env, factory(seed=seed + i), seed=seed + i)
        if transcript.returns["agent"] <= min_reward:
            continue
        messages = [{"role": "system", "content": transcript.system_prompt}] if transcript.system_prompt else []
        messages.append({"role": "user", "content": transcript.first_observation})
        for turn in transcript.turns:
            messages.append({"role": "assistant", "content": turn.action})
            if not (turn.terminated or turn.truncated):
                messages.append({"role": "user", "content": turn.observation})
        conversations.append({"messages": messages, "tools": transcript.tools})
    if not conversations:
        raise ConfigError(f"the {agent} agent of {env_id} produced no episode with reward above {min_reward}.")
    return conversations


def _duel_demos(env: Any, factory: Any, episodes: int, seed: int, min_reward: float) -> list[dict[str, Any]]:
    """Games of the baseline against itself on a multi-agent env: each seat's own view and moves is one conversation."""
    conversations = []
    for i in range(episodes):
        env.reset(seed=seed + i)
        agents = {a: factory(seed=(seed + i) * 7919 + k) for k, a in enumerate(env.possible_agents)}
        messages = {a: ([{"role": "system", "content": env.infos[a]["system_prompt"]}] if env.infos[a].get("system_prompt") else []) for a in agents}
        returns = dict.fromkeys(agents, 0.0)
        for _ in range(10_000):
            if not env.agents or all(env.terminations.get(a) or env.truncations.get(a) for a in env.agents):
                break
            agent = env.agent_selection
            observation = env.observe(agent)
            action = agents[agent](observation, dict(env.infos[agent]))
            messages[agent] += [{"role": "user", "content": observation}, {"role": "assistant", "content": action}]
            env.step(action)
            for a, reward in env.rewards.items():
                returns[a] += float(reward)
        conversations += [{"messages": messages[a], "tools": None} for a in agents if returns[a] > min_reward and len(messages[a]) > 1]
    if not conversations:
        raise ConfigError(f"the baseline's games produced no seat with a return above {min_reward}.")
    return conversations


def conversation_to_datum(renderer: Any, conversation: dict[str, Any]) -> Datum:
    """Render a conversation; mask 1 on assistant turns (through their end-of-turn token), 0 elsewhere."""
    messages, tools = conversation["messages"], conversation.get("tools")
    tokens = renderer.render(messages, tools)
    mask = [0.0] * len(tokens)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(renderer.render(messages[:i], tools, add_generation_prompt=True))
        end = len(renderer.render(messages[: i + 1], tools))
        stop = max((j for j in range(start, end) if tokens[j] in renderer.stop_token_ids), default=end - 1)
        for j in range(start, stop + 1):
            mask[j] = 1.0
    return Datum(tokens=tokens, loss_mask=mask)


def fit_conversation(renderer: Any, conversation: dict[str, Any], max_tokens: int) -> dict[str, Any] | None:
    """``conversation``, or where it renders to more than ``max_tokens`` its longest start that ends on an assistant turn
    and fits (as TRL's SFT truncates at ``max_length``, but on a turn's end, so that no turn is cut in half); ``None``
    when not even its first assistant turn fits."""
    messages, tools = conversation["messages"], conversation.get("tools")
    if len(renderer.render(messages, tools)) <= max_tokens:
        return conversation
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"]
    low, high = 0, len(ends)  # ends[:low] fit; find the last one that does (lengths grow with the prefix)
    while low < high:
        middle = (low + high + 1) // 2
        if len(renderer.render(messages[: ends[middle - 1]], tools)) <= max_tokens:
            low = middle
        else:
            high = middle - 1
    return None if low == 0 else {**conversation, "messages": messages[: ends[low - 1]]}


class SFTTrainer:
    """Cross-entropy on assistant tokens of transcripts or baseline demonstrations."""

    needs_env = False
    known_args = frozenset({"data_files", "demos", "demo_episodes", "demo_min_reward"})
    #: Either kind of env: demonstrations of a multi-agent env are each seat's side of the baseline's games.
    multi_agent = None

    def __init__(self, ctx: TrainingContext) -> None:
        self.ctx = ctx
        args = ctx.config.trainer_args
        if args.get("data_files"):
            files = args["data_files"]
            conversations = load_transcripts([files] if isinstance(files, str) else list(files))
        elif args.get("demos") in DEMO_AGENTS:
            if not ctx.config.env:
                raise ConfigError(f"--demos {args['demos']} needs --env: the env whose {args['demos']} agent plays the demonstrations.")
            conversations = baseline_demos(
                ctx.config.env, ctx.config.env_kwargs, int(args.get("demo_episodes", 256)), ctx.config.seed,
                float(args.get("demo_min_reward", float("-inf"))), agent=args["demos"],
            )
        elif args.get("demos") is not None:
            raise ConfigError(f"demos={args['demos']!r}: the demonstrations are one of {', '.join(DEMO_AGENTS)} (the env's agent that plays them).")
        else:
            raise ConfigError("the sft trainer needs data: --data FILE.jsonl (chat transcripts) or --demos baseline|random with --env.")
        fitted = [fit_conversation(ctx.renderer, c, ctx.config.max_context) for c in conversations]
        self.data = [conversation_to_datum(ctx.renderer, c) for c in fitted if c is not None]
        self.data = [d for d in self.data if sum(d.loss_mask) != 0]  # fit_conversation kept only what fits the context
        if not self.data:
            raise ConfigError("no SFT example fits --max-context with at least one assistant token.")

    def train_step(self, step: int) -> StepOutput:
        """One optimizer step on a seeded batch of conversations."""
        c = self.ctx.config
        rng = random.Random(f"sft:{c.seed}:{step}")
        batch = [self.data[rng.randrange(len(self.data))] for _ in range(c.batch_size)]
        with timeline.span("update"):
            with timeline.span("forward_backward", "backend", sequences=len(batch)):
                result = self.ctx.backend.forward_backward(ForwardBackwardRequest(data=batch, loss=LossSpec(name="cross_entropy")))
            metrics = dict(result.metrics)
            with timeline.span("optim_step", "backend"):
                metrics.update(self.ctx.backend.optim_step(OptimParams(learning_rate=c.lr, weight_decay=c.weight_decay, max_grad_norm=c.max_grad_norm)))
        metrics["examples"] = float(len(self.data))
        return StepOutput(metrics)

    def state_dict(self) -> dict:
        """``{}``: the data is rebuilt from the config and each batch is drawn by a (seed, step)-seeded shuffle."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore; see :meth:`state_dict`."""
