"""The typed configuration of a training run: ids, paths and numbers only, so it saves to and reloads from the run folder."""

from __future__ import annotations

import difflib
import json
import math
import numbers
import os
import re
import reprlib
from dataclasses import Field, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tinkergym.protocol.types import OLD_LOGPROBS
from tinkergym.errors import ConfigError

#: Where rollouts are sampled: the training backend itself, or a vLLM engine synced from it after every step.
SAMPLERS = ("torch", "vllm")
#: The truncated importance weight's cap that ``async_steps`` > 0 takes with the trainer's logprobs and no cap of its own.
ASYNC_TIS_CAP = 2.0
#: Backends that sample from a fixed snapshot of the weights while they train (``async_steps`` > 0).
SNAPSHOT_BACKENDS = ("torch", "vllm", "remote", "scheduled", "tinker")
#: Episodes that a budget (max_turns, max_context, an episode token budget) ended: trained on, or masked.
TRUNCATION_MODES = ("keep", "mask")
#: Weight dtypes a backend loads a model in ("auto": bfloat16 where the device computes it natively).
DTYPES = ("auto", "bfloat16", "float32")
#: A model a scheduler job may name: a served name or a hub id (``org/name``), never a path (and never ``..``).
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")


def is_model_name(name: object) -> bool:
    """Whether ``name`` is a model a scheduler job may name (:data:`MODEL_NAME`, and no ``..`` anywhere)."""
    return isinstance(name, str) and MODEL_NAME.match(name) is not None and ".." not in name


#: The name an inference job serves a trained run under (an OpenAI ``model``).
SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
#: Seeds a run accepts: what NumPy's legacy seeding takes.
MAX_SEED = 2**32 - 1
#: Bounds on the kwargs and trainer args a config holds (plain JSON values), so a hostile file cannot make saving it explode.
MAX_VALUE_DEPTH = 64
MAX_VALUE_NODES = 100_000


#: One default for each setting of the model and its training pass, wherever it is set: a run's config
#: (:class:`TrainConfig`), ``tinkergym serve backend``'s options, ``TorchBackendConfig`` and the server a scheduler
#: job runs on. The same names travel from the command line through the config, the job config and the server's
#: ``info`` to the worker's command line.
DEFAULT_LORA_RANK = 8
DEFAULT_LORA_ALPHA = 16
DEFAULT_MICRO_BATCH_SIZE = 8
DEFAULT_DTYPE = "auto"
#: Most episodes one evaluation plays (each has its own seed, drawn up front).
MAX_EPISODES = 1_000_000

#: The groups a run's settings fall in, in the order ``tinkergym train --help`` shows them.
SECTIONS = ("Run", "Model", "Rollouts", "Loss and optimizer", "Sampling ahead", "Sampler", "Remote compute", "Self-play",
            "Evaluation and checkpoints", "Output")


@dataclass(frozen=True)
class Setting:
    """What a config field means to the people who set it: its help, its group and the bounds the command line checks.

    It rides on the field (``field(default=..., metadata=setting(...))``), beside the field's name, type and default, so
    each is written once; ``tinkergym train`` makes its options from these (:mod:`tinkergym.cli.settings`).
    """

    help: str
    section: str
    #: The option's name: ``""`` is ``--`` and the field's name with dashes; ``None``: config files only.
    option: str | None = ""
    metavar: str | None = None
    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False
    choices: tuple[str, ...] = ()
    #: Set where a training server starts (tinkergym serve backend): a run through one takes the server's.
    server_owned: bool = False


def setting(help: str, section: str, **details: Any) -> dict[str, Any]:
    """A field's metadata: its :class:`Setting` (``help`` also under ``"help"``, the key HfArgumentParser and tyro read)."""
    return {"help": help, "setting": Setting(help, section, **details)}


def setting_of(f: Field[Any]) -> Setting | None:
    """The :class:`Setting` of a config field, ``None`` for a field that has none."""
    found = f.metadata.get("setting")
    return found if isinstance(found, Setting) else None


def option_name(name: str) -> str:
    """The command-line option that sets config field ``name`` (``eval_every`` -> ``--eval-every``, ``scheduler_url`` ->
    ``--scheduler``); the field's name itself for one that config files alone set."""
    found = {f.name: setting_of(f) for f in fields(TrainConfig)}.get(name)
    if found is not None and found.option is None:
        return name
    return found.option if found is not None and found.option else "--" + name.replace("_", "-")


@dataclass
class TrainConfig:
    """Everything a run needs; the CLI only parses into this (``--config FILE.yaml`` fills the same fields).

    Each field's help, group and command-line bounds are its :class:`Setting`, in its metadata: ``tinkergym train``'s
    options are made from them, so a field's name, type, default and help are written once, here.
    """

    # Run
    env: str = field(default="", metadata=setting("Env id to train on (see: tinkergym envs list).", "Run"))
    env_kwargs: dict[str, Any] = field(default_factory=dict, metadata=setting(
        "Env keyword argument (repeatable), e.g. size=7.", "Run", option="--kwarg", metavar="KEY=VALUE"))
    trainer: str = field(default="grpo", metadata=setting("Trainer plugin: grpo, rloo, sft, selfplay, or any installed one.", "Run"))
    trainer_args: dict[str, Any] = field(default_factory=dict, metadata=setting(
        "Trainer-specific setting (repeatable).", "Run", option="--trainer-arg", metavar="KEY=VALUE"))
    model: str = field(default="smollm2-135m", metadata=setting(
        "smollm2-135m, tiny (a test-sized model), a local HF folder, or a hub id.", "Run", server_owned=True))
    steps: int = field(default=20, metadata=setting("Optimizer steps.", "Run", min=1))
    seed: int = field(default=0, metadata=setting("Run seed.", "Run", min=0, max=MAX_SEED))
    out: str = field(default="", metadata=setting("Run folder (default runs/<env>-<trainer>-<time>).", "Run"))

    # Model
    lora_rank: int = field(default=DEFAULT_LORA_RANK, metadata=setting(
        "LoRA rank (--full, or 0 in a config file: train every parameter).", "Model", min=1, server_owned=True))
    lora_alpha: float = field(default=DEFAULT_LORA_ALPHA, metadata=setting(
        "LoRA alpha: the adapter's update is scaled by alpha / rank.", "Model", min=0, min_open=True, server_owned=True))
    lora_dropout: float = field(default=0.0, metadata=setting(
        "Dropout on the LoRA adapter's input while it trains.", "Model", min=0, max=1, max_open=True, server_owned=True))
    dtype: str = field(default=DEFAULT_DTYPE, metadata=setting(
        "Weights dtype (auto: bf16 where supported).", "Model", choices=DTYPES, server_owned=True))
    micro_batch_size: int = field(default=DEFAULT_MICRO_BATCH_SIZE, metadata=setting(
        "Sequences per forward pass (bounds memory; groups sharing a prompt pack into the same token budget).", "Model", min=1,
        server_owned=True))
    deterministic: bool = field(default=False, metadata=setting(
        "Deterministic kernels only (torch.use_deterministic_algorithms), so the run and its resume repeat bit for bit on a "
        "GPU too (slower, eager attention on a GPU; on CPU they already do).", "Model", server_owned=True))
    gradient_checkpointing: bool = field(default=False, metadata=setting(
        "Recompute layer activations in the backward pass instead of keeping them: less memory, about a third more compute, "
        "same gradients (prompts shared by a group stay shared).", "Model", server_owned=True))

    # Rollouts
    batch_size: int = field(default=8, metadata=setting("Prompts (env seeds) per step.", "Rollouts", min=1))
    group_size: int = field(default=8, metadata=setting("Samples per prompt.", "Rollouts", min=1))
    max_turns: int = field(default=4, metadata=setting("Turns per episode.", "Rollouts", min=1))
    max_new_tokens: int = field(default=64, metadata=setting("New tokens per turn.", "Rollouts", min=1))
    max_context: int = field(default=2048, metadata=setting("Context length bound.", "Rollouts", min=16))
    temperature: float = field(default=1.0, metadata=setting(
        "Sampling temperature of the rollouts; the loss scores the same tempered distribution.", "Rollouts", min=0, max=100,
        min_open=True))
    truncation: str = field(default="keep", metadata=setting(
        "Episodes a budget ended (max turns, max context, an episode's token budget; not the env's own truncation): keep "
        "them (trained on with their reward) or mask them out of the loss and of their group's statistics.", "Rollouts",
        choices=TRUNCATION_MODES))
    truncated_reward: float | None = field(default=None, metadata=setting(
        "Reward given to episodes a budget ended instead of what they collected.", "Rollouts"))
    env_latency: float = field(default=0.0, metadata=setting(
        "Every env step waits this long first: a stand-in for a slow tool, API or judge (tinkergym.wrappers.LatencyWrapper), "
        "to measure settings such as --async-steps where the env's time matters.", "Rollouts", min=0, max=3600,
        metavar="SECONDS"))
    env_latency_jitter: float = field(default=0.0, metadata=setting(
        "Up to this many seconds more per env step, uniform (with --env-latency: a random delay).", "Rollouts", min=0,
        max=3600, metavar="SECONDS"))

    # Loss and optimizer
    lr: float = field(default=1e-4, metadata=setting("Learning rate.", "Loss and optimizer", min=0, min_open=True))
    weight_decay: float = field(default=0.0, metadata=setting("AdamW's decoupled weight decay.", "Loss and optimizer", min=0))
    max_grad_norm: float = field(default=1.0, metadata=setting("Gradient clipping norm (0 = off).", "Loss and optimizer", min=0))
    kl_coef: float = field(default=0.0, metadata=setting("KL penalty to the reference policy.", "Loss and optimizer", min=0))
    clip_low: float = field(default=0.2, metadata=setting(
        "PPO clipping below: a token's ratio is clipped at 1 - CLIP_LOW.", "Loss and optimizer", min=0))
    clip_high: float = field(default=0.2, metadata=setting(
        "PPO clipping above: a token's ratio is clipped at 1 + CLIP_HIGH.", "Loss and optimizer", min=0))
    loss_aggregation: str = field(default="token", metadata=setting(
        "Average the loss per token or per sequence.", "Loss and optimizer", choices=("token", "sequence")))
    old_logprobs: str = field(default="trainer", metadata=setting(
        "Old policy of the PPO ratio: the trainer's own logprobs of the training pass, before the step's only update (as TRL "
        "does on-policy; free), or the sampler's (its numerics then enter the ratio: in bfloat16 up to ~0.3 nats on SmolLM2, "
        "enough to clip).", "Loss and optimizer", choices=OLD_LOGPROBS))
    tis_cap: float = field(default=0.0, metadata=setting(
        "Truncated importance weight min(trainer/sampler ratio, CAP) on every token, as verl and TRL (0 = off; needs "
        "--old-logprobs trainer). 2 is usual with --sampler vllm, and what --async-steps K > 0 takes when it is 0 (with "
        "--old-logprobs trainer, the default: AReaL's decoupled correction).", "Loss and optimizer", min=0))

    # Sampling ahead (prime-rl's max_async_level, tinker-cookbook's max_steps_off_policy)
    async_steps: int = field(default=0, metadata=setting(
        "Sample the rollouts of the next K steps from a snapshot of the weights while a step trains (0: sample, then train). "
        "A step then trains on samples up to K updates old, corrected by the truncated importance weight (--tis-cap, 2 unless "
        "given) or by --old-logprobs sampler; needs a backend "
        "that samples from snapshots (torch, the default; a serve backend or --scheduler; tinker; --sampler vllm with LoRA) "
        "and grpo, rloo or selfplay.", "Sampling ahead", min=0, metavar="K"))
    max_episodes_in_flight: int = field(default=256, metadata=setting(
        "With --async-steps K: up to K steps' rollouts play at once, as many as fit in N episodes in whole steps "
        "(--batch-size x --group-size each; always one). Their env steps and tool calls wait side by side.", "Sampling ahead",
        min=1, metavar="N"))

    # Sampler
    sampler: str = field(default="torch", metadata=setting(
        "Who samples rollouts: torch (the training model) or vllm (a vLLM engine synced after every step; needs vllm "
        "installed).", "Sampler", choices=SAMPLERS, server_owned=True))
    prefix_cache_mb: float = field(default=1024.0, metadata=setting(
        "Memory for the torch sampler's prefix cache: a multi-turn episode's next turn runs only its new tokens, not the "
        "whole conversation again (emptied at every update; 0 = off).", "Sampler", min=0, metavar="MIB", server_owned=True))
    lora_sampling: str = field(default="adapter", metadata=setting(
        "How LoRA samples: adapter (as the training pass computes) or merged (a merged copy of the weights: faster on a "
        "CPU, one more copy of them in memory; in bfloat16 the sampler loses updates under the weights' rounding).",
        "Sampler", choices=("adapter", "merged"), server_owned=True))
    sampler_gpu_memory: float | None = field(default=None, metadata=setting(
        "With --sampler vllm: fraction of its GPU's memory vLLM may take (default 0.3).", "Sampler", min=0, max=1,
        min_open=True, metavar="FRACTION"))
    sampler_eager: bool | None = field(default=None, metadata=setting(
        "With --sampler vllm: skip CUDA graphs and compilation (faster start, slower steps); default on CPU only.", "Sampler"))
    sampler_device: str | None = field(default=None, metadata=setting(
        "With --sampler vllm: the engine's device, e.g. cuda:1 to keep it off the training GPU (default: vLLM's first GPU).",
        "Sampler", metavar="DEVICE"))
    sampler_sleep: bool | None = field(default=None, metadata=setting(
        "With --sampler vllm: free vLLM's GPU memory during training passes (sleep mode; default on GPU, unavailable on "
        "CPU).", "Sampler"))

    # Remote compute
    backend: str | None = field(default=None, metadata=setting(
        "A backend plugin (entry-point group tinkergym.backends) to train through; default: the one --scheduler, "
        "--backend-url and --sampler imply (scheduled, remote, vllm, else torch).", "Remote compute", metavar="NAME"))
    backend_url: str | None = field(default=None, metadata=setting(
        "Train through a training server (tinkergym serve backend) at URL: its model computes, envs and the trainer run "
        "here. Its model, LoRA rank, dtype and micro-batch size are the server's (the run records them).", "Remote compute",
        metavar="URL"))
    scheduler_url: str | None = field(default=None, metadata=setting(
        "Train as a job of a scheduler (tinkergym scheduler serve): it leases a worker's devices, whose training server "
        "computes; envs and the trainer run here.", "Remote compute", option="--scheduler", metavar="URL"))
    scheduler_job: str | None = field(default=None, metadata=setting(
        "The scheduler job the run trains as, recorded once submitted so that --resume reattaches to it.", "Remote compute",
        option=None))
    gpus: int = field(default=1, metadata=setting(
        "Devices the scheduler job needs, all on one worker; on more than one its training server runs one rank per device, "
        "the model sharded over them (FSDP2), and trains as on one.", "Remote compute", min=1, max=64))

    # Self-play (trainer "selfplay", --selfplay)
    opponents: str = field(default="baseline,random,snapshots", metadata=setting(
        "Self-play league, comma-separated: baseline, random, snapshots (of the learner), run:DIR.", "Self-play",
        metavar="LIST"))
    snapshot_every: int = field(default=10, metadata=setting(
        "Self-play: add a frozen snapshot of the learner every N steps (0 = never).", "Self-play", min=0))

    # Evaluation and checkpoints
    eval_every: int = field(default=0, metadata=setting(
        "Evaluate every N steps on held-out seeds (0 = off).", "Evaluation and checkpoints", min=0))
    eval_episodes: int = field(default=32, metadata=setting(
        "Episodes per evaluation.", "Evaluation and checkpoints", min=1, max=MAX_EPISODES))
    eval_env_kwargs: dict[str, Any] = field(default_factory=dict, metadata=setting(
        "Env keyword argument of the evaluation's envs, over --kwarg (repeatable), e.g. split=test.",
        "Evaluation and checkpoints", option="--eval-kwarg", metavar="KEY=VALUE"))
    checkpoint_every: int = field(default=10, metadata=setting(
        "Checkpoint every N steps.", "Evaluation and checkpoints", min=1))
    transcripts_every: int = field(default=5, metadata=setting(
        "Write the episodes' transcripts every N steps and at the last (0 = never).", "Evaluation and checkpoints", min=0))

    # Output
    wandb_project: str | None = field(default=None, metadata=setting(
        "Also log every step to this Weights & Biases project (needs the wandb extra; WANDB_MODE=offline logs locally).",
        "Output", option="--wandb", metavar="PROJECT"))

    def validate(self) -> TrainConfig:
        """Raise :class:`ConfigError` for values that cannot work; return self."""
        self.check_types()
        positive = ("steps", "batch_size", "group_size", "max_turns", "max_new_tokens", "max_context", "micro_batch_size", "eval_episodes", "checkpoint_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)}).")
        for name in ("weight_decay", "max_grad_norm", "kl_coef", "clip_low", "clip_high", "lora_dropout", "eval_every", "transcripts_every", "snapshot_every",
                     "prefix_cache_mb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name.replace('_', '-')} must be 0 or more (got {getattr(self, name)}).")
        if self.lora_rank < 0:
            raise ConfigError("lora-rank must be 0 (full fine-tuning) or positive.")
        if not self.lora_alpha > 0:
            raise ConfigError(f"lora-alpha must be above 0 (got {self.lora_alpha}): the adapter's update is scaled by alpha / rank.")
        if self.lora_sampling not in ("adapter", "merged"):
            raise ConfigError(f"lora-sampling must be 'adapter' or 'merged' (got {self.lora_sampling!r}).")
        if not self.lr > 0:
            raise ConfigError(f"lr must be positive (got {self.lr}).")
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed must be from 0 to {MAX_SEED} (got {self.seed}).")
        if self.lora_dropout >= 1:
            raise ConfigError(f"lora-dropout must be below 1 (got {self.lora_dropout}).")
        if self.loss_aggregation not in ("token", "sequence"):
            raise ConfigError("loss-aggregation must be 'token' or 'sequence'.")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"sampler must be one of {', '.join(SAMPLERS)}, not {self.sampler!r}.")
        self._validate_sampler_engine()
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}.")
        if self.backend_url is not None:
            self._validate_remote(self.backend_url)
        if self.scheduler_url is not None:
            self._validate_scheduled()
        if "\0" in self.out:
            raise ConfigError(f"out {self.out!r} contains a NUL byte, which no folder name may hold.")
        self._validate_rl()
        if self.trainer == "selfplay":

            parse_opponents(self.opponents)
        if not self.env and self.trainer != "sft":
            raise ConfigError("--env is required: the env id to train on (see: tinkergym envs list).")
        return self

    def check_types(self) -> TrainConfig:
        """Raise :class:`ConfigError` naming the first field whose value has the wrong type; return self.

        Numbers must be finite; a float field also takes an int and a numeric string (YAML 1.1 reads ``1e-4``
        as text); paths are turned into text; kwargs and trainer args must be plain JSON values.
        """
        for f in fields(self):
            setattr(self, f.name, _checked(f.name, str(f.type), getattr(self, f.name)))
        return self

    def _validate_rl(self) -> None:
        if not self.temperature <= 100:
            raise ConfigError(f"temperature must be at most 100 (got {self.temperature}): past it every distribution is uniform.")
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
        self._validate_async_steps()
        if isinstance(self.max_episodes_in_flight, bool) or not isinstance(self.max_episodes_in_flight, int) or self.max_episodes_in_flight < 1:
            raise ConfigError(f"max-episodes-in-flight must be a whole number of episodes, at least 1, not {self.max_episodes_in_flight!r}.")
        for name in ("env_latency", "env_latency_jitter"):
            if not 0 <= getattr(self, name) <= 3600:
                raise ConfigError(f"{name.replace('_', '-')} must be seconds between 0 and 3600, not {getattr(self, name)}.")

    def _validate_async_steps(self) -> None:
        """``async_steps`` trains samples of an older policy: refuse settings that would train them uncorrected, or cannot sample ahead."""
        k = self.async_steps
        if k < 0:
            raise ConfigError(f"async-steps must be 0 (each step samples, then trains) or more (steps sampled ahead), not {k}.")
        if k == 0 or self.trainer == "sft":  # the trainer's own check says sft does not sample (see trainers.base)
            return
        if self.old_logprobs == "trainer" and self.tis_cap == 0:
            # The default correction of samples up to K updates old: PPO's ratio from the trainer's own logprobs, times the
            # truncated weight against the sampler's (AReaL's decoupled PPO). Measured against the ratio to the sampler's
            # logprobs (SmolLM2, Bandit-v0 behind a 10 s judge, 20 steps, 3 seeds, K = 2): reward per sample 0.43 against
            # K = 0's 0.45 [0.37, 0.50], where the sampler's ratio gave 0.28 (its clip cuts the gradient of stale tokens).
            self.tis_cap = ASYNC_TIS_CAP
        if self.trainer == "rloo" and self.tis_cap == 0:
            raise ConfigError(
                f"async-steps {k}: the rloo trainer's REINFORCE loss has no importance ratio, so samples up to {k} updates old "
                "would train as if the current policy drew them; add --old-logprobs trainer --tis-cap C (e.g. 2) to weight "
                "each token by min(current/sampler ratio, C), or use --async-steps 0."
            )
        implied = self.backend or ("scheduled" if self.scheduler_url else "remote" if self.backend_url else "torch")
        if self.sampler == "vllm":  # the vLLM engine samples, whatever trains: its snapshots are adapters, one per version
            implied = "vllm"
            if self.lora_rank == 0:
                raise ConfigError(
                    f"async-steps {k} samples older versions of the policy beside the newest, and the vLLM sampler holds full "
                    "weights once (replaced at every sync): train a LoRA policy (leave out --full; each version is then its own "
                    "adapter in the engine), sample with --sampler torch, or leave out --async-steps."
                )
        if implied not in SNAPSHOT_BACKENDS:
            raise ConfigError(
                f"async-steps {k} samples the next steps while one trains, which needs a backend that samples from a fixed "
                f"snapshot of the weights: {', '.join(SNAPSHOT_BACKENDS)} (--backend torch, --backend-url URL of a serve backend, --scheduler "
                f"URL, or --backend tinker --backend-url URL). "
                f"The {implied} backend these settings train through samples and trains one after the other: leave out "
                "--async-steps, or train through one of those."
            )

    def _validate_sampler_engine(self) -> None:
        given = [f.name for f in fields(self) if f.name.startswith("sampler_") and getattr(self, f.name) is not None]
        if given and self.sampler != "vllm":
            names = ", ".join(n.replace("_", "-") for n in given)
            raise ConfigError(f"{names} set the vLLM sampler's engine: add --sampler vllm (sampler: vllm in a config file) or leave them out.")
        if self.sampler_gpu_memory is not None and not 0 < self.sampler_gpu_memory <= 1:
            raise ConfigError(f"sampler-gpu-memory is a fraction of the GPU's memory, above 0 and at most 1 (got {self.sampler_gpu_memory}).")
        if self.sampler_device is not None and not re.fullmatch(r"cpu|cuda(:[0-9]{1,3})?", self.sampler_device):
            raise ConfigError(f"sampler-device must be cuda:N (a visible GPU's index, e.g. cuda:1), cuda or cpu (got {self.sampler_device!r}).")

    def _validate_remote(self, backend_url: str) -> None:
        from tinkergym.plumbing.urls import check_backend_url

        self.backend_url = check_backend_url(backend_url)
        if self.sampler != "torch":
            raise ConfigError(f"sampler {self.sampler!r} cannot be combined with backend-url: the training server samples with its own model.")

    def _validate_scheduled(self) -> None:
        from tinkergym.plumbing.urls import check_scheduler_url

        if self.backend_url is not None:
            raise ConfigError("scheduler and backend-url exclude each other: the scheduler finds the training server itself.")
        self.scheduler_url = check_scheduler_url(self.scheduler_url)
        if self.sampler != "torch":
            raise ConfigError(f"sampler {self.sampler!r} cannot be combined with scheduler: the job's server samples with its own model.")
        if self.gpus < 1:
            raise ConfigError("gpus must be at least 1: the devices the job's server runs on.")

    def job_config(self) -> dict[str, Any]:
        """What a scheduler job needs of this config: the model settings its worker starts the server with, and the run's shape.

        Folders of this machine (``out``, data files) stay here: the client runs the trainer.
        """
        keep = ("env", "trainer", "model", "lora_rank", "lora_alpha", "lora_dropout", "dtype", "seed", "micro_batch_size", "deterministic",
                "gradient_checkpointing", "steps", "batch_size", "group_size", "max_new_tokens", "max_context")
        found = {k: getattr(self, k) for k in keep}
        if self.trainer == "league":  # its players: that many adapters of one shared server (tinkergym.scheduler.seats)
            found["players"] = self.trainer_args.get("players", 2)
        return found

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable copy."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from a dict (e.g. a YAML file); unknown keys and values of the wrong type are errors that name them."""
        names = [f.name for f in fields(cls)]
        odd = [k for k in data if not isinstance(k, str)]
        if odd:
            raise ConfigError(f"config keys are setting names such as steps or lr, not {odd[0]!r} ({type(odd[0]).__name__}).")
        unknown = sorted(set(data) - set(names))
        if unknown:
            close = difflib.get_close_matches(unknown[0], names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown config keys {unknown}{hint}; known keys: {', '.join(names)}.")
        return cls(**data).check_types()

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        """Read a YAML (``.yaml``/``.yml``) or JSON (``.json``) config file; any problem is a :class:`ConfigError` naming the file."""
        path = Path(path)
        if path.suffix.lower() not in (".yaml", ".yml", ".json"):
            raise ConfigError(f"{path}: name a config file .yaml, .yml or .json (the suffix says how to read it).")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8.") from exc
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}.") from exc
        data = _parse(path, text)
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a mapping of config keys to values (such as 'steps: 20'), not a {type(data).__name__}.")
        try:
            return cls.from_dict({k.replace("-", "_") if isinstance(k, str) else k: v for k, v in data.items()})
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc

    def save(self, path: str | Path) -> None:
        """Write the resolved config as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")


def _parse(path: Path, text: str) -> Any:
    """The data of a config file's text, read as JSON or YAML by the file's suffix."""
    import yaml

    try:
        if path.suffix.lower() == ".json":
            return json.loads(text)
        data = yaml.safe_load(text)
        return {} if data is None else data
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}.") from exc
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path} is not valid YAML: {exc.problem or exc.context}{where}.") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(exc).split())}.") from exc
    except RecursionError as exc:
        raise ConfigError(f"{path} is nested too deeply to read; a config holds setting names and plain values.") from exc


def _checked(name: str, annotation: str, value: Any) -> Any:
    """``value`` as field ``name`` of type ``annotation`` holds it, or a :class:`ConfigError` that says what it must be."""
    shown = reprlib.repr(value)  # bounded: a YAML alias bomb must not be expanded to be quoted
    if annotation in ("float | None", "str | None", "bool | None") and value is None:
        return None
    if annotation == "bool | None":
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, or left out to be chosen from the platform (got {shown}).")
        return value
    if annotation in ("float", "float | None"):
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number (got {shown}).")
        return value if isinstance(value, (int, float)) else float(value)  # NumPy scalars become plain numbers
    if annotation == "int":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ConfigError(f"{name} must be a whole number (got {shown}).")
        return int(value)
    if annotation in ("str", "str | None"):
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be text (got {shown}).")
        return value
    if annotation.startswith("dict"):
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a mapping of names to values, such as {{'size': 7}} (got {shown}).")
        _check_plain(name, value, [MAX_VALUE_NODES], 0)
    return value


def _check_plain(name: str, value: Any, budget: list[int], depth: int) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a plain JSON value (text keys) of bounded depth and size."""
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_VALUE_DEPTH:
        raise ConfigError(f"{name} is too large or nested too deeply (at most {MAX_VALUE_DEPTH} levels and {MAX_VALUE_NODES:,} values).")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(f"{name}: keys must be text, not {key!r} ({type(key).__name__}).")
            _check_plain(name, item, budget, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_plain(name, item, budget, depth + 1)
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise ConfigError(f"{name} holds {type(value).__name__} {reprlib.repr(value)}; use text, numbers, true/false, lists and mappings.")


#: The names ``--opponents`` takes (besides ``run:DIR``).
OPPONENT_KINDS = ("baseline", "random", "snapshots")


def parse_opponents(text: str) -> list[str]:
    """``"baseline,random,snapshots,run:DIR"`` as a list; unknown names are a :class:`ConfigError`."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in OPPONENT_KINDS and not (name.startswith("run:") and len(name) > 4):
            raise ConfigError(f"opponent {name!r}: choose from {', '.join(OPPONENT_KINDS)} or run:DIR (a trained run's folder).")
    if len(set(names)) != len(names):
        raise ConfigError(f"opponents {text!r} names one twice.")
    return names
