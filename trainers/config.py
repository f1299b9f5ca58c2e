"""The typed configuration of a training run: ids, paths and numbers only, so it saves to and reloads from the run folder."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tinkergym.backends.types import OLD_LOGPROBS
from tinkergym.errors import ConfigError

#: Where rollouts are sampled: the training backend itself, or a vLLM engine synced from it after every step.
SAMPLERS = ("torch", "vllm")
#: Episodes that a budget (max_turns, max_context, an episode token budget) ended: trained on, or masked.
TRUNCATION_MODES = ("keep", "mask")


@dataclass
class TrainConfig:
    """Everything a run needs; the CLI only parses into this (``--config FILE.yaml`` fills the same fields)."""

    env: str = ""
    trainer: str = "grpo"
    model: str = "smollm2-135m"
    lora_rank: int = 8  # 0 trains every parameter (full fine-tuning)
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    steps: int = 20
    batch_size: int = 8  # prompts (env seeds) per step
    group_size: int = 8  # samples per prompt
    lr: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_turns: int = 4
    max_new_tokens: int = 64
    max_context: int = 2048
    temperature: float = 1.0
    seed: int = 0
    out: str = ""
    kl_coef: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    loss_aggregation: str = "token"
    eval_every: int = 0
    eval_episodes: int = 32
    checkpoint_every: int = 10
    transcripts_every: int = 5
    dtype: str = "auto"
    micro_batch_size: int = 8
    sampler: str = "torch"  # "torch" (the training backend samples) or "vllm" (a vLLM engine, synced every step)
    # The old policy of the PPO ratio: "trainer" (the policy's own logprobs of the training pass, before the
    # step's only update, as TRL does on-policy; free) or "sampler" (the sampler's logprobs, so its numerics enter
    # the ratio: in bfloat16 up to ~0.3 nats on SmolLM2, enough to clip). With tis_cap > 0 (needs "trainer") each
    # token is weighted by min(trainer/sampler ratio, tis_cap): truncated importance sampling, as verl/TRL.
    old_logprobs: str = "trainer"
    tis_cap: float = 0.0
    # Episodes a budget ended (finish reasons max_turns, max_episode_tokens, context; not the env's own
    # truncation): "keep" trains on them with their reward, "mask" leaves them out of the loss and of their
    # group's statistics. truncated_reward, when set, replaces their total reward (e.g. -1 as a penalty).
    truncation: str = "keep"
    truncated_reward: float | None = None
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    eval_env_kwargs: dict[str, Any] = field(default_factory=dict)
    trainer_args: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> "TrainConfig":
        """Raise :class:`ConfigError` for values that cannot work; return self."""
        positive = ("steps", "batch_size", "group_size", "max_turns", "max_new_tokens", "max_context", "micro_batch_size", "eval_episodes")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)}).")
        if self.lora_rank < 0:
            raise ConfigError("lora-rank must be 0 (full fine-tuning) or positive.")
        if not self.lr > 0:
            raise ConfigError(f"lr must be positive (got {self.lr}).")
        if self.loss_aggregation not in ("token", "sequence"):
            raise ConfigError("loss-aggregation must be 'token' or 'sequence'.")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"sampler must be one of {', '.join(SAMPLERS)}, not {self.sampler!r}.")
        self._validate_rl()
        if not self.env and self.trainer != "sft":
            raise ConfigError("--env is required: the env id to train on (see: tinkergym envs list).")
        return self

    def _validate_rl(self) -> None:
        if self.trainer != "sft" and not self.temperature > 0:
            raise ConfigError(
                f"temperature must be > 0 for RL training (got {self.temperature}): greedy rollouts give every sample of a "
                "group the same completion and no distribution to train on. Greedy decoding is for evaluation, which always uses it."
            )
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ConfigError(f"old-logprobs must be one of {', '.join(OLD_LOGPROBS)}, not {self.old_logprobs!r}.")
        if self.tis_cap < 0:
            raise ConfigError(f"tis-cap must be >= 0 (0 = off), not {self.tis_cap}.")
        if self.tis_cap > 0 and self.old_logprobs != "trainer":
            raise ConfigError(
                "tis-cap weighs tokens by the trainer/sampler ratio, so the PPO ratio must start from the trainer's "
                "logprobs: add --old-logprobs trainer (old_logprobs: trainer in a config file)."
            )
        if self.truncation not in TRUNCATION_MODES:
            raise ConfigError(f"truncation must be one of {', '.join(TRUNCATION_MODES)}, not {self.truncation!r}.")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable copy."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        """Build from a dict (e.g. a YAML file); unknown keys are an error that names the known ones."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known keys: {sorted(names)}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> "TrainConfig":
        """Read a YAML or JSON config file."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a mapping of config keys to values.")
        return cls.from_dict({k.replace("-", "_"): v for k, v in data.items()})

    def save(self, path: str | Path) -> None:
        """Write the resolved config as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
