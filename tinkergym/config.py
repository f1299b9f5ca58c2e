"""The typed configuration of a training run: ids, paths and numbers only, so it saves to and reloads from the run folder."""

from __future__ import annotations

import difflib
import json
import math
import numbers
import os
import re
import reprlib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tinkergym.protocol.types import OLD_LOGPROBS
from tinkergym.errors import ConfigError

#: Where rollouts are sampled: the training backend itself, or a vLLM engine synced from it after every step.
SAMPLERS = ("torch", "vllm")
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
#: (:class:`TrainConfig`), ``tinkergym serve-backend``'s options, ``TorchBackendConfig`` and the server a scheduler
#: job runs on. The same names travel from the command line through the config, the job config and the server's
#: ``info`` to the worker's command line.
DEFAULT_LORA_RANK = 8
DEFAULT_LORA_ALPHA = 16
DEFAULT_MICRO_BATCH_SIZE = 8
DEFAULT_DTYPE = "auto"


@dataclass
class TrainConfig:
    """Everything a run needs; the CLI only parses into this (``--config FILE.yaml`` fills the same fields)."""

    env: str = ""
    trainer: str = "grpo"
    model: str = "smollm2-135m"
    lora_rank: int = DEFAULT_LORA_RANK  # 0 trains every parameter (full fine-tuning)
    lora_alpha: float = DEFAULT_LORA_ALPHA
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
    dtype: str = DEFAULT_DTYPE
    micro_batch_size: int = DEFAULT_MICRO_BATCH_SIZE
    # Deterministic kernels (torch.use_deterministic_algorithms), so a run and its resume repeat bit for bit on a GPU
    # too; on CPU they already do. Slower; eager attention on a GPU.
    deterministic: bool = False
    # Recompute each decoder layer's activations in the backward pass instead of keeping them (less memory, about a
    # third more compute; same gradients). Prompts shared by a group stay shared.
    gradient_checkpointing: bool = False
    # Memory (MiB) for the torch sampler's automatic prefix caching: a multi-turn episode's or game's next turn runs only
    # its new tokens, not the whole conversation again. Emptied at every update; 0 turns it off.
    prefix_cache_mb: float = 1024.0
    # How a LoRA policy samples with the torch sampler: "adapter" (as the training pass computes) or "merged" (a copy with
    # the adapter merged in: faster on a CPU; in bfloat16 updates under half a weight's rounding step are lost to it).
    lora_sampling: str = "adapter"
    sampler: str = "torch"  # "torch" (the training backend samples) or "vllm" (a vLLM engine, synced every step)
    # The vLLM sampler's engine (sampler "vllm" only; None: chosen from the platform): the fraction of its GPU's memory
    # (default 0.3), CUDA graphs and compilation off (eager; default on CPU only), its device ("cuda:N", "cpu"; default
    # vLLM's first visible GPU), and sleep mode during training passes (default where vLLM has it: GPU).
    sampler_gpu_memory: float | None = None
    sampler_eager: bool | None = None
    sampler_device: str | None = None
    sampler_sleep: bool | None = None
    # A training server (tinkergym serve-backend) that computes instead of a local model: its model, LoRA
    # rank, dtype and micro-batch size are the server's (a new run records them here). The token is never saved.
    backend_url: str | None = None
    # A scheduler (tinkergym scheduler serve) that leases a worker's devices for the run: the run becomes job
    # scheduler_job (recorded once submitted, so --resume reattaches to it) on `gpus` devices. The key is never saved.
    scheduler_url: str | None = None
    scheduler_job: str | None = None
    gpus: int = 1
    # The old policy of the PPO ratio: "trainer" (the policy's own logprobs of the training pass, before the
    # step's only update, as TRL does on-policy; free) or "sampler" (the sampler's logprobs, so its numerics enter
    # the ratio: in bfloat16 up to ~0.3 nats on SmolLM2, enough to clip). With tis_cap > 0 (needs "trainer") each
    # token is weighted by min(trainer/sampler ratio, tis_cap): truncated importance sampling, as verl/TRL.
    old_logprobs: str = "trainer"
    tis_cap: float = 0.0
    # Rollouts sampled ahead (prime-rl's max_async_level, tinker-cookbook's max_steps_off_policy): the rollouts of the
    # next K steps are sampled from a snapshot of the weights while the current step trains, so a step trains on samples
    # of a policy up to K updates old, corrected by the ratio to the sampler's logprobs (old_logprobs "sampler") or by
    # tis_cap. 0: each step samples with the current weights, then trains. Needs a backend that samples from snapshots
    # (SNAPSHOT_BACKENDS; the vLLM sampler for a LoRA policy) and an RL trainer that plays envs (grpo, rloo, selfplay).
    async_steps: int = 0
    # With async_steps K > 1: the most episodes the rollouts sampled ahead play at once. Up to K steps' rollouts play side
    # by side (their env steps and tool calls wait together, their sample calls take turns on the backend), as many as
    # fit in this bound in whole steps (batch_size x group_size episodes each), and always one.
    max_episodes_in_flight: int = 256
    # Seconds every env step waits (plus up to env_latency_jitter more, uniform): a stand-in for a slow tool, API or judge
    # (tinkergym.wrappers.LatencyWrapper), to measure a setting where the env's time matters. 0: none.
    env_latency: float = 0.0
    env_latency_jitter: float = 0.0
    # Episodes a budget ended (finish reasons max_turns, max_episode_tokens, context; not the env's own
    # truncation): "keep" trains on them with their reward, "mask" leaves them out of the loss and of their
    # group's statistics. truncated_reward, when set, replaces their total reward (e.g. -1 as a penalty).
    truncation: str = "keep"
    truncated_reward: float | None = None
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    eval_env_kwargs: dict[str, Any] = field(default_factory=dict)
    trainer_args: dict[str, Any] = field(default_factory=dict)
    # Self-play (trainer "selfplay", --selfplay): the league's opponents and how often the learner is snapshotted into it.
    opponents: str = "baseline,random,snapshots"
    snapshot_every: int = 10
    # A Weights & Biases project to log every step's numbers to as well (None: metrics.jsonl and TensorBoard only).
    wandb_project: str | None = None
    # The backend plugin (entry-point group tinkergym.backends) the run trains through; None: the one its settings
    # imply (scheduled with scheduler_url, remote with backend_url, vllm with sampler "vllm", else torch).
    backend: str | None = None

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
        if self.trainer == "rloo" and self.tis_cap == 0:
            raise ConfigError(
                f"async-steps {k}: the rloo trainer's REINFORCE loss has no importance ratio, so samples up to {k} updates old "
                "would train as if the current policy drew them; add --old-logprobs trainer --tis-cap C (e.g. 2) to weight "
                "each token by min(current/sampler ratio, C), or use --async-steps 0."
            )
        if self.old_logprobs == "trainer" and self.tis_cap == 0:
            raise ConfigError(
                f"async-steps {k} trains samples of a policy up to {k} updates old, and --old-logprobs trainer starts the "
                "importance ratio at 1 (the trainer's own logprobs), so they would train uncorrected. Use --old-logprobs "
                "sampler (the ratio against the sampler's logprobs: PPO's off-policy correction), or keep trainer and add "
                "--tis-cap C (e.g. 2) to weight each token by min(current/sampler ratio, C)."
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
                f"snapshot of the weights: {', '.join(SNAPSHOT_BACKENDS)} (--backend torch, --backend-url URL of a serve-backend, --scheduler "
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
        return {k: getattr(self, k) for k in keep}

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
