"""``tinkergym results run ROW --peer trl``: the same row trained by TRL's GRPOTrainer, evaluated by the same protocol.

Matched to tinkergym's run of the row: the same model (after the same warm-up, whose adapter is merged into the model
TRL trains), the same LoRA (rank, alpha, dropout 0, every linear layer), the same prompts in the same order (each
step's env seeds from :meth:`TrainingContext.prompt_seeds`, rendered as the rollout renders them: the env's system
prompt and first observation), the same samples per step (prompts x group, one generation batch per optimizer step,
one update per batch), temperature, completion length, a constant learning rate, gradient clipping, PPO clip 0.2, no
KL term, group-normalised advantages and a token-mean loss (TRL's ``dapo``). The reward is the env's: it is reset with
the prompt's seed and steps with the completion. TRL runs at its fastest setting here: no gradient checkpointing (TRL
>= 1.0 turns it on by default), bfloat16 where the machine computes it natively, the attention tinkergym picks.

What differs, and cannot be matched: TRL samples with ``model.generate`` (each sample of a group runs its prompt again;
tinkergym shares a group's prompt), and TRL drives single-turn envs only (its multi-turn rollouts need a rollout
function per env), so a multi-turn row is refused.

Writes ``OUT/ROW/trl/``: ``result.json`` (as the row's, with ``peer: "trl"``), ``adapter/``, and ``OUT/ROW/vs_trl.png``:
training reward against episodes sampled and against wall seconds, both sides on one figure.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from tinkergym.config import TrainConfig
from tinkergym.errors import ConfigError
from tinkergym.results.rows import Row
from tinkergym.results.stats import paired_bootstrap_difference


def check_single_turn(row: Row) -> None:
    """Refuse a row TRL's GRPOTrainer cannot drive: a multi-turn one."""
    if row.recipe["max_turns"] != 1:
        raise ConfigError(f"--peer trl: row {row.name} is multi-turn ({row.recipe['max_turns']} turns), and TRL's GRPOTrainer "
                          "drives single-turn envs here; compare a single-turn row (tinkergym results list --json shows each row's max_turns).")


def step_prompts(config: TrainConfig, step: int, env: Any) -> list[tuple[int, list[dict[str, str]]]]:
    """(env seed, chat messages) of ``step``'s prompts: the trainer's own seeds, rendered as the rollout renders them (the
    env's system prompt and its first observation after a seeded reset of ``env``)."""
    from tinkergym.trainers.base import TrainingContext

    context = TrainingContext(config=config, backend=None, renderer=None)  # type: ignore[arg-type]  # seeds need neither
    rows = []
    for seed in context.prompt_seeds(step):
        observation, info = env.reset(seed=seed)
        system = [{"role": "system", "content": info["system_prompt"]}] if info.get("system_prompt") else []
        rows.append((seed, [*system, {"role": "user", "content": observation}]))
    return rows


def _prompts(config: TrainConfig) -> list[dict[str, Any]]:
    """Every step's prompts in order (as chat messages), with the env seed their reward resets the env with."""
    import tinkergym

    env = tinkergym.make(config.env, **config.env_kwargs)
    try:
        return [{"prompt": messages, "env_seed": seed} for step in range(config.steps) for seed, messages in step_prompts(config, step, env)]
    finally:
        env.close()


def env_reward_function(env: Any) -> Any:
    """A TRL reward function that plays ``env``: reset with the prompt's seed (the dataset's ``env_seed`` column), stepped
    with the completion; its reward is the completion's."""

    def env_reward(prompts: list, completions: list, env_seed: list[int], **_: Any) -> list[float]:
        rewards = []
        for completion, seed in zip(completions, env_seed):
            env.reset(seed=seed)
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            rewards.append(float(env.step(text)[1]))
        return rewards

    return env_reward


def train_trl(config: TrainConfig, model_path: str, folder: Path, progress: bool) -> list[dict[str, float]]:
    """TRL's GRPOTrainer on ``config``'s recipe from ``model_path``; its adapter into ``folder/adapter``; per-step records."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import tinkergym
    from tinkergym.backends.torch.attention import register
    from tinkergym.backends.torch.runtime import load_causal_lm, resolve_attn_implementation, resolve_dtype

    register()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(config.dtype, device)
    attention = resolve_attn_implementation("auto", device, dtype, model_path)
    model = load_causal_lm(model_path, dtype, attn_implementation=attention)  # a warm-up adapter is merged in, as tinkergym loads it
    batch = config.batch_size * config.group_size
    micro = min(config.micro_batch_size, batch)
    while batch % micro:
        micro -= 1
    args = GRPOConfig(
        output_dir=str(folder / "trainer"), use_cpu=device.type == "cpu", bf16=dtype == torch.bfloat16,
        gradient_checkpointing=False, per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro, num_generations=config.group_size, max_completion_length=config.max_new_tokens,
        temperature=config.temperature, top_p=1.0, top_k=0, learning_rate=config.lr, lr_scheduler_type="constant",
        max_grad_norm=config.max_grad_norm, weight_decay=config.weight_decay, beta=0.0, num_iterations=1, epsilon=0.2,
        loss_type="dapo", scale_rewards="group", use_vllm=False, max_steps=config.steps, shuffle_dataset=False, seed=config.seed,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=not progress, dataloader_pin_memory=False,
        log_completions=False,
    )
    records: list[dict[str, float]] = []

    class Timer(TrainerCallback):
        """Wall seconds of each optimizer step (TRL generates inside it) and the step's mean reward from TRL's log."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.started = time.perf_counter()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
            if logs and "reward" in logs:
                records.append({"step": state.global_step - 1, "reward_mean": float(logs["reward"]),
                                "step_s": time.perf_counter() - self.started})

    trainer = GRPOTrainer(
        model=model,  # type: ignore[arg-type]  # a PreTrainedModel (load_causal_lm's annotation is nn.Module)
        reward_funcs=env_reward_function(tinkergym.make(config.env, **config.env_kwargs)), args=args, train_dataset=Dataset.from_list(_prompts(config)),
        peft_config=LoraConfig(
            r=config.lora_rank, lora_alpha=config.lora_alpha,  # type: ignore[arg-type]  # peft scales by a float alpha too
            lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM",
        ),
        callbacks=[Timer()],
    )
    with contextlib.redirect_stdout(sys.stderr):  # TRL prints each step's log; stdout is the command's one JSON line a row
        trainer.train()
    trainer.model.save_pretrained(str(folder / "adapter"))  # type: ignore[union-attr,operator]  # the PeftModel it trained
    return records


def run_trl_peer(
    row: Row, out: Path, work: Path, quick: bool = False, progress: bool = True, command: str = "", steps: int | None = None,
) -> dict[str, Any]:
    """The row trained by TRL (after tinkergym's own run of the row, whose warm-up and evaluation it shares); ``steps``: only
    the first so many steps of the row's recipe, compared with tinkergym's evaluation after as many (one of its points)."""
    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.torch.machine import library_versions
    from tinkergym.results.runner import WallClock, arm, copy_adapter, eval_outcomes, evaluate_model, machine, name_adapter_base, samples_through

    check_single_turn(row)
    ours_path = out / row.name / "result.json"
    if not ours_path.is_file():
        raise ConfigError(f"--peer trl compares with tinkergym's run of {row.name}: run `tinkergym results run {row.name}"
                          f"{' --quick' if quick else ''}` first (it makes the warm-up both sides start from, and the evaluation before).")
    ours = json.loads(ours_path.read_text(encoding="utf-8"))
    folder = work / row.name
    config = row.config("unused", quick=quick)
    if steps is not None and (steps > config.steps or steps % config.eval_every):
        raise ConfigError(f"--steps {steps}: tinkergym evaluated {row.name} after every {config.eval_every} steps up to {config.steps}; "
                          f"give one of those, so that both sides are compared after as many samples.")
    config.steps = steps or config.steps
    trl_folder = folder / f"trl-{config.steps}-steps"
    trl_folder.mkdir(parents=True, exist_ok=True)
    config.out = str(trl_folder)
    start = str((folder / "warmup" / "final").resolve()) if row.warmup is not None else resolve_model(row.training(quick)[1])
    steps_file = trl_folder / "steps.json"
    clock = WallClock(trl_folder / "wall.json")
    try:
        if not steps_file.is_file():  # TRL's run is not resumed: one stopped before its end starts over
            steps_file.write_text(json.dumps(train_trl(config, start, trl_folder, progress)), encoding="utf-8")
        # peft names the base under the warm-up (the merged model's own name): evaluated on it, the warm-up would be left out
        name_adapter_base(trl_folder / "adapter", start)
        evaluated = trl_folder / "eval_after.jsonl"
        if not evaluated.is_file():
            evaluate_model(str(trl_folder / "adapter"), config, evaluated)
    finally:
        wall = clock.stop()
    records = json.loads(steps_file.read_text(encoding="utf-8"))
    before = eval_outcomes(folder / "rl", -1)
    after = eval_outcomes(folder, -1, evaluated)
    assert before is not None and after is not None  # ours ran (checked above); the evaluation was just written
    change, low, high = paired_bootstrap_difference(before[0], after[0])
    ours_after = eval_outcomes(folder / "rl", config.steps - 1)  # tinkergym after as many steps
    assert ours_after is not None
    versus, v_low, v_high = paired_bootstrap_difference(after[0], ours_after[0])
    elapsed = 0.0
    curve = []
    for record in records:
        elapsed += record["step_s"]
        curve.append({"step": record["step"], "samples": samples_through(config, record["step"]),
                      "reward_mean": record["reward_mean"], "train_s": round(elapsed, 2)})
    result = {
        "peer": "trl", "row": row.name, "quick": quick, "command": command, "steps": config.steps,
        "tinkergym_after_as_many_samples": arm(*ours_after), "machine": {**machine(), "other_cores": round(clock.other_cores(), 2)},
        "versions": library_versions(("tinkergym", "torch", "transformers", "peft", "trl")), "before": arm(*before), "after": arm(*after),
        "change": {"success_rate": change, "success_interval": [low, high]},
        "tinkergym_minus_trl": {"success_rate": versus, "success_interval": [v_low, v_high],
                                "interval": "paired bootstrap over the same evaluation episodes, 95%"},
        "samples": config.steps * config.batch_size * config.group_size, "wall_s": round(wall, 1),
        "train_s": round(elapsed, 1), "reward_curve": curve,
    }
    dest = out / row.name / "trl"
    dest.mkdir(parents=True, exist_ok=True)
    copy_adapter(trl_folder / "adapter", dest / "adapter", "../../warmup_adapter" if row.warmup is not None else ours["base_model"])
    (dest / "result.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    plot_versus({**ours, "reward_curve": [p for p in ours["reward_curve"] if p["step"] < config.steps]}, result, out / row.name / "vs_trl.png")
    return result


def plot_versus(ours: dict[str, Any], trl: dict[str, Any], path: Path) -> None:
    """Training reward against episodes sampled and against training seconds, tinkergym and TRL on one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_samples, by_time) = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for name, result in (("tinkergym", ours), ("TRL", trl)):
        curve = result["reward_curve"]
        by_samples.plot([p["samples"] for p in curve], [p["reward_mean"] for p in curve], label=name)
        by_time.plot([p.get("train_s", 0.0) for p in curve], [p["reward_mean"] for p in curve], label=name)
    by_samples.set_xlabel("episodes sampled for training")
    by_time.set_xlabel("training wall seconds (sampling included)")
    by_samples.set_ylabel("mean training reward")
    for axis in (by_samples, by_time):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"{ours['row']}: tinkergym and TRL's GRPOTrainer, same recipe")
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
