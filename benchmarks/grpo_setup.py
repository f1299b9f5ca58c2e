"""What the GRPO step benchmarks share: the step's settings (:class:`BenchSettings`), its prompts and env, a worker's
result with its FLOP floors, the timing of backend calls, the precision TRL runs in, and the libraries' versions.

``grpo_step.py`` (the driver and tinkergym's side), ``grpo_trl.py`` (TRL's side) and the benchmarks that run the same
step (``remote_step.py``, ``tinker_step.py``, ``decode_profile.py``, ``vllm_sampling.py``, ``grpo_collapse.py``) import
it, so none of them imports another's driver.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Callable

from bench_machine import device_extra


#: The step's shape under ``--quick`` (grpo_step.py, remote_step.py, tinker_step.py): a smoke test of every part of the step
#: on the tiny model, whose timings compare nothing, so 2 prompts x 4 samples of at most 8 new tokens (TRL's micro-batch of
#: 8 is then the whole batch) stand in for the 8 x 8 of at most 32 that a timed run keeps.
QUICK_SHAPE: dict[str, Any] = {"prompts": 2, "group_size": 4, "max_new_tokens": 8}


@dataclass
class BenchSettings:
    """The step both sides run: env, batch shape, sampling, LoRA and optimizer settings."""

    env: str = "tinker/Bandit-v0"
    env_kwargs: dict[str, Any] = field(default_factory=lambda: {"reward_mode": "expected"})
    prompts: int = 8
    group_size: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    lora_rank: int = 8
    lora_alpha: int = 16
    lr: float = 1e-5
    max_grad_norm: float = 1.0
    steps: int = 3
    seed: int = 0
    micro_batch_size: int = 8
    dtype: str = "bfloat16"  # both sides' compute precision, resolved by the driver ("auto": the device's native one)
    trl_dtype: str = "auto"  # the dtype TRL loads weights in (see trl_dtype())
    trl_micro_batch_size: int = 8
    trl_gradient_checkpointing: bool = False
    attn: str = "auto"  # both sides' attention implementation ("auto": what tinkergym's auto picks on the device)
    lora_sampling: str = "adapter"  # tinkergym's TorchBackendConfig.lora_sampling (TRL generates through its adapter)
    malloc: str = "default"
    device: str = "cpu"  # resolved by the driver: "cpu" or "cuda"
    model: str = "smollm2-135m"  # as given on the command line
    model_path: str = ""  # the folder both sides load (resolved, or random weights written by the driver)
    random_weights: bool = False
    reward: str = "env"  # "env": the env's reward; "hash": a number hashed from the completion (see the docstring)

    def lora(self, mode: str) -> int:
        """The LoRA rank of ``mode`` (0 for full fine-tuning)."""
        return self.lora_rank if mode == "lora" else 0

    def attn_implementation(self) -> str:
        """The attention implementation both sides load the model with, made known to transformers in this process."""
        import torch

        from tinkergym.backends.torch.attention import register
        from tinkergym.backends.torch.runtime import resolve_attn_implementation

        register()
        return resolve_attn_implementation(self.attn, torch.device(self.device), getattr(torch, self.dtype), self.model_path)


def step_prompts(s: BenchSettings, step: int) -> list[tuple[int, list[dict[str, str]]]]:
    """(env seed, chat messages) of the prompts of ``step``: tinkergym's seeds and the messages its rollout renders."""
    import tinkergym
    from tinkergym.config import TrainConfig
    from tinkergym.results.trl_peer import step_prompts as prompts_of_step

    env = tinkergym.make(s.env, **s.env_kwargs)
    try:
        return prompts_of_step(TrainConfig(env=s.env, batch_size=s.prompts, seed=s.seed), step, env)
    finally:
        env.close()


def flop_floor(params: int, mode: str, sampled_tokens: int, trained_tokens: int) -> float:
    """FLOPs of the step's matmuls: 2*params per sampled-pass token (prefill included), 6 (full) or 4 (LoRA) per trained token."""
    return 2.0 * params * sampled_tokens + (6.0 if mode == "full" else 4.0) * params * trained_tokens


def floors(params: int, mode: str, median: dict[str, float], group_size: int) -> dict[str, float]:
    """The step's FLOP floors: every prompt once per sample (``per_sample``), and once per group (``shared``, the
    work left when a group's samples share their prompt's forward pass in sampling and in training)."""
    prompt, completion = median["prompt_tokens"], median["completion_tokens"]
    trained_prompt = median["trained_tokens"] - completion  # the prompts of the sequences trained on
    return {
        "per_sample": flop_floor(params, mode, int(prompt + completion), int(median["trained_tokens"])),
        "shared": flop_floor(params, mode, int(prompt / group_size + completion), int(trained_prompt / group_size + completion)),
    }


def hash_reward(text: str) -> float:
    """A reward in [0, 1) that depends on the completion's text alone (for models with random weights)."""
    return zlib.crc32(text.encode("utf-8", "replace")) % 10_007 / 10_007


class HashRewardEnv:
    """``env`` stepped as usual, but paying :func:`hash_reward` of the action: rewards vary within every group."""

    def __init__(self, env: Any) -> None:
        self.env = env

    def reset(self, *args: Any, **kwargs: Any) -> Any:
        return self.env.reset(*args, **kwargs)

    def step(self, action: str) -> Any:
        observation, _, terminated, truncated, info = self.env.step(action)
        return observation, hash_reward(action), terminated, truncated, info

    def close(self) -> None:
        self.env.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)


def make_env(s: BenchSettings) -> Any:
    """The benchmark's env: ``s.env`` with ``s.env_kwargs``, paying :func:`hash_reward` with ``--reward hash``."""
    import tinkergym

    env = tinkergym.make(s.env, **s.env_kwargs)
    return HashRewardEnv(env) if s.reward == "hash" else env


def _summary(side: str, mode: str, s: BenchSettings, steps: list[dict[str, float]], extra: dict[str, Any]) -> dict[str, Any]:
    """A worker's result: per-step records, medians of the timed steps, FLOP floor, peak RSS and peak GPU memory."""
    timed = steps[1:] or steps
    median = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
    flops = floors(extra["params"], mode, median, s.group_size)
    return {
        "side": side, "mode": mode, "settings": asdict(s), "steps": steps, "median": median, "flop_floor": flops["per_sample"],
        "flop_floor_shared": flops["shared"],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **device_extra(s.device), **extra,
    }


def _timed(obj: Any, name: str, seconds: dict[str, float]) -> None:
    """Replace ``obj.name`` (on this instance only) by a wrapper that adds its wall time to ``seconds[name]``."""
    original: Callable = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def trl_dtype(s: BenchSettings, mode: str) -> str:
    """The dtype TRL loads the model in: ``auto`` the compute precision (bfloat16 weights under bfloat16, TRL's fastest
    layout on a CPU); ``tinkergym`` tinkergym's layout (a LoRA base in the compute precision, float32 full-tuning weights)."""
    if s.trl_dtype == "auto":
        return s.dtype
    if s.trl_dtype == "tinkergym":
        return s.dtype if mode == "lora" else "float32"
    return s.trl_dtype


def trl_precision(s: BenchSettings, mode: str) -> str:
    """TRL's compute precision: bfloat16 under ``bf16=True`` (autocast) or with bfloat16 weights, else float32."""
    return "bfloat16" if "bfloat16" in (s.dtype, trl_dtype(s, mode)) else "float32"


def versions() -> dict[str, str]:
    """Versions of the libraries in the comparison."""
    from tinkergym.backends.torch.machine import library_versions

    out = {"python": sys.version.split()[0], **library_versions(("tinkergym", "torch", "transformers", "peft", "accelerate", "trl", "datasets"))}
    try:
        import torch

        out["cuda"] = torch.version.cuda or "none"
    except ImportError:
        pass
    return out
