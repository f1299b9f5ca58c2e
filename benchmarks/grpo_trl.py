"""The TRL side of ``grpo_step.py``: TRL's GRPOTrainer on the step's prompts, rewards and settings, timed step by step.

Run by ``grpo_step.py``'s ``trl`` worker (see its docstring for how the two sides are matched); the precision TRL
computes in and the dtype it loads weights in are :func:`grpo_setup.trl_precision` and :func:`grpo_setup.trl_dtype`.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any
from collections.abc import Callable

from bench_machine import CpuShare, _load, sync
from grpo_setup import BenchSettings, _summary, make_env, step_prompts, trl_dtype, trl_precision

from tinkergym.results.trl_peer import env_reward_function


def _trl_reward(s: BenchSettings) -> Callable[..., list[float]]:
    """A TRL reward function that resets the env with the prompt's seed and scores the completion with ``env.step``."""
    return env_reward_function(make_env(s))


def _timed_trl_classes(device: str) -> tuple[type, type]:
    """TRL's GRPOTrainer with its generate-and-score part timed, and a callback that times whole optimizer steps."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """TRL's trainer with generation (and the whole generate-and-score part) timed, and token counts kept."""

        bench: dict[str, float] = {}

        def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                self.bench["generate_s"] = self.bench.get("generate_s", 0.0) + time.perf_counter() - start

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            start = time.perf_counter()
            output = super()._generate_and_score_completions(inputs)
            self.bench["sample_s"] = self.bench.get("sample_s", 0.0) + time.perf_counter() - start
            self.bench["prompt_tokens"] = float(output["prompt_mask"].sum())
            self.bench["completion_tokens"] = float(output["completion_mask"].sum())
            self.bench["trained_sequences"] = float(output["completion_ids"].shape[0])
            return output

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step (generation included: TRL generates inside ``training_step``)."""

        def __init__(self) -> None:
            self.records: list[dict[str, float]] = []
            self.load: dict[str, list[float]] = {}

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 1:
                self.load["start"] = _load()
            TimedGRPOTrainer.bench.clear()
            sync(device)
            self.cpu = CpuShare()
            self.started = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sync(device)
            step_s = time.perf_counter() - self.started
            cores, b = self.cpu.stop(), dict(TimedGRPOTrainer.bench)
            self.records.append({
                "step_s": step_s, "sample_s": b["sample_s"], "generate_s": b["generate_s"], "train_s": step_s - b["sample_s"],
                "prompt_tokens": b["prompt_tokens"], "completion_tokens": b["completion_tokens"],
                "trained_sequences": b["trained_sequences"], "trained_tokens": b["prompt_tokens"] + b["completion_tokens"], **cores,
            })
            self.load["end"] = _load()

    return TimedGRPOTrainer, StepTimer


def _trl_trainer(s: BenchSettings, mode: str, output_dir: str) -> tuple[Any, Any]:
    """TRL's GRPOTrainer for ``mode`` with one 8 x 8 generation batch per optimizer step, and its step timer."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig

    batch = s.prompts * s.group_size
    rows = [{"prompt": messages, "env_seed": seed} for step in range(1 + s.steps) for seed, messages in step_prompts(s, step)]
    config = GRPOConfig(
        output_dir=output_dir, use_cpu=s.device == "cpu", bf16=s.dtype == "bfloat16", model_init_kwargs={"dtype": getattr(torch, trl_dtype(s, mode)), "attn_implementation": s.attn_implementation()},
        gradient_checkpointing=s.trl_gradient_checkpointing,
        per_device_train_batch_size=s.trl_micro_batch_size, gradient_accumulation_steps=batch // s.trl_micro_batch_size,
        steps_per_generation=batch // s.trl_micro_batch_size,
        num_generations=s.group_size, max_completion_length=s.max_new_tokens, temperature=s.temperature, top_p=1.0, top_k=0,
        learning_rate=s.lr, lr_scheduler_type="constant", max_grad_norm=s.max_grad_norm, weight_decay=0.0,
        beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo", scale_rewards="group", use_vllm=False,
        max_steps=1 + s.steps, shuffle_dataset=False, seed=s.seed, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False, log_completions=False,
    )
    peft_config = None
    if mode == "lora":
        peft_config = LoraConfig(r=s.lora_rank, lora_alpha=s.lora_alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer_class, timer_class = _timed_trl_classes(s.device)
    timer = timer_class()
    trainer = trainer_class(
        model=s.model_path, reward_funcs=_trl_reward(s), args=config,
        train_dataset=Dataset.from_list(rows), peft_config=peft_config, callbacks=[timer],
    )
    return trainer, timer


def run_trl(s: BenchSettings, mode: str) -> dict[str, Any]:
    """Warm-up plus ``s.steps`` optimizer steps of TRL's GRPOTrainer, timed with a callback."""
    import torch
    import trl

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="grpo-step-trl-") as output_dir:
        trainer, timer = _trl_trainer(s, mode, output_dir)
        setup_s = time.perf_counter() - started
        trainer.train()
    model = trainer.model
    params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return _summary("trl", mode, s, timer.records, {
        "params": params, "trainable_params": trainable, "dtype": trl_precision(s, mode), "param_dtype": trl_dtype(s, mode),
        "bf16_autocast": bool(trainer.args.bf16),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "gradient_checkpointing": bool(getattr(trainer.args, "gradient_checkpointing", False)),
        "setup_s": setup_s, "load": timer.load, "threads": torch.get_num_threads(), "trl_version": trl.__version__,
    })
