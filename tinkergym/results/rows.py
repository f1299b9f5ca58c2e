"""The declared rows of the results table: each a task of the hub and the recipe that trains on it.

A row names its env and the kwargs that set its difficulty, the model, the trainer and its settings, the budget
(steps, prompts per step, samples per prompt) and its evaluation: greedy, ``eval_episodes`` episodes on held-out
seeds (:func:`tinkergym.trainers.evaluation.eval_seeds`: a range no training seed is drawn from) with
``eval_env_kwargs`` on top of ``env_kwargs`` (a test split, another dataset seed: problems training never poses),
before training, every ``steps // evals`` steps, and after the last step.

``why`` says why the difficulty and budget are what they are, and why the recipe differs from the default (GRPO with
a LoRA adapter on SmolLM2-135M-Instruct) where it does. Every number of a row was picked so that the untrained model
is neither at 0 nor at the ceiling, and a whole run (evaluations included) fits in an hour on a 2-core CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tinkergym.config import TrainConfig

#: The default recipe of every row; a row's ``settings`` override these.
DEFAULT_SETTINGS: dict[str, Any] = {
    "steps": 60, "batch_size": 8, "group_size": 8, "lr": 5e-4, "lora_rank": 8, "lora_alpha": 16, "max_turns": 1,
    "max_new_tokens": 64, "temperature": 1.0, "micro_batch_size": 16,
}
#: What ``--quick`` changes: the tiny test model and the smallest budget that still runs every part of the harness
#: (before and after evaluations, an evaluation between, two checkpoints, the table). Not a learning run.
QUICK_SETTINGS: dict[str, Any] = {"model": "tiny", "steps": 4, "batch_size": 2, "group_size": 2, "eval_episodes": 6, "evals": 2}
#: Caps on the per-episode budget in ``--quick`` (turns, tokens per turn): the tiny model writes noise, so a short
#: episode proves as much as a long one.
QUICK_CAPS = {"max_turns": 3, "max_new_tokens": 8}


@dataclass(frozen=True)
class Warmup:
    """Supervised steps before RL on demonstrations of one of the env's own agents (``demos``: ``"random"``, its random
    agent, which teaches the action format and no strategy; or ``"baseline"``, its scripted baseline, where it has no
    random agent), with a LoRA adapter of the row's rank.

    For a task whose every untrained episode fails on the format (no legal move, no answer tag), RL has no signal: every
    sample of a group scores alike, so every advantage is 0. The warm-up gives it one; the row's "before" is then the
    warmed-up model (RL's start), and its result keeps the untrained model's rate too ("base").
    """

    demos: str = "random"
    steps: int = 20
    episodes: int = 128
    lr: float = 5e-4
    batch_size: int = 8
    micro_batch_size: int = 2  # whole games are long: a pass over 8 of them at once takes over 20 GiB on a CPU
    max_context: int = 2048  # longer demonstrations are left out (a shorter bound keeps the short games: a cheaper warm-up)
    min_reward: float | None = None  # keep only the demonstrations whose return is above this (None: keep every one)


@dataclass(frozen=True)
class Row:
    """One row of the results table: a task (env, difficulty) and the recipe that trains on it."""

    name: str  # the row's id: ``tinkergym results run NAME``, and its folder docs/results/NAME/
    task: str  # the task in a few words, for the table
    env: str
    env_kwargs: dict[str, Any]
    why: str
    eval_env_kwargs: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    trainer: str = "grpo"
    model: str = "smollm2-135m"
    eval_episodes: int = 64
    evals: int = 4  # evaluations after the start: the evaluation curve's points beyond the first
    seed: int = 0
    warmup: Warmup | None = None

    @property
    def recipe(self) -> dict[str, Any]:
        """The row's training settings: :data:`DEFAULT_SETTINGS` with its own on top."""
        return {**DEFAULT_SETTINGS, **self.settings}

    def training(self, quick: bool) -> tuple[dict[str, Any], str]:
        """The training settings and the model, as given or (``quick``) on the tiny model at the smallest budget."""
        if not quick:
            return self.recipe, self.model
        recipe = {**self.recipe, **{k: v for k, v in QUICK_SETTINGS.items() if k in self.recipe}}
        recipe.update({k: min(recipe[k], cap) for k, cap in QUICK_CAPS.items()})
        return recipe, QUICK_SETTINGS["model"]

    def config(self, out: str, quick: bool = False, model: str | None = None) -> TrainConfig:
        """The RL run's :class:`TrainConfig` (``quick``: see :data:`QUICK_SETTINGS`; ``model``: the warmed-up model)."""
        recipe, base = self.training(quick)
        episodes, evals = (QUICK_SETTINGS["eval_episodes"], QUICK_SETTINGS["evals"]) if quick else (self.eval_episodes, self.evals)
        every = max(1, recipe["steps"] // evals)
        return TrainConfig(
            env=self.env, env_kwargs=dict(self.env_kwargs), eval_env_kwargs=dict(self.eval_env_kwargs), trainer=self.trainer,
            model=model or base, seed=self.seed, eval_episodes=episodes, eval_every=every, checkpoint_every=every if not quick else 1,
            out=out, transcripts_every=max(1, recipe["steps"] // 10), **recipe,
        ).validate()

    def warmup_config(self, out: str, quick: bool = False) -> TrainConfig:
        """The warm-up's SFT run (the row must have a :class:`Warmup`)."""
        assert self.warmup is not None
        recipe, model = self.training(quick)
        w = self.warmup
        # quick: a few episodes, or where only the rewarded ones are kept, enough that some are (a tenth of the math baseline's)
        steps, episodes = (2, 4 if w.min_reward is None else min(w.episodes, 64)) if quick else (w.steps, w.episodes)
        return TrainConfig(
            env=self.env, env_kwargs=dict(self.env_kwargs), trainer="sft", model=model, seed=self.seed, steps=steps,
            batch_size=min(w.batch_size, episodes), lr=w.lr, lora_rank=recipe["lora_rank"], lora_alpha=recipe["lora_alpha"],
            micro_batch_size=w.micro_batch_size, max_context=w.max_context, checkpoint_every=steps, out=out,
            trainer_args={"demos": w.demos, "demo_episodes": episodes,
                          **({} if w.min_reward is None else {"demo_min_reward": w.min_reward})},
        ).validate()


ROWS: tuple[Row, ...] = (
    Row(
        name="chain-sum",
        task="reasoning-gym chain_sum: a + b, one digit each",
        env="tinker/rg.chain_sum-v0",
        env_kwargs={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        eval_env_kwargs={"seed": 1},
        settings={"steps": 200, "max_new_tokens": 32},
        warmup=Warmup(demos="baseline", steps=10),
        why=("The easiest reasoning-gym arithmetic. The untrained model never writes the <answer> tag the grader reads "
             "(0 of 64, here and on five other reasoning-gym tasks and prompts tried), so RL would have no signal; the "
             "warm-up imitates the env's baseline, which puts the question's last number in the tag: the format, and a "
             "guess that is right only when the other term is 0 (6% after 10 steps). RL has to learn the sum. A first run "
             "of 60 steps (8 minutes) ended at +6.3 points [0.0, +14.1], rising at its end: this one takes 200. Held out: "
             "the evaluation draws its questions from another dataset seed."),
    ),
    Row(
        name="math",
        task="Math-v0 word problems, one reply with \\boxed{}",
        env="tinker/Math-v0",
        env_kwargs={"split": "train"},
        eval_env_kwargs={"split": "test"},
        settings={"steps": 120, "max_new_tokens": 64, "micro_batch_size": 8},
        warmup=Warmup(demos="baseline", steps=10, episodes=1280, min_reward=0.5),
        why=("Generated arithmetic and algebra word problems of ten kinds. The untrained model never ends with the "
             "\\boxed{} answer the grader reads (0 of 64), so RL would have no signal. The env's baseline solves only the "
             "written-out expressions (one kind in ten) and answers 0 to the rest; the warm-up imitates its solved episodes "
             "alone (those of 1,280 with reward 1), so the model learns to show a calculation and box its value, not to "
             "answer 0 (imitating every episode, it answered \\boxed{0} to all 64). It then gets about 5% right. Held out: the "
             "evaluation poses the 250 problems of the test split, training the 2,250 of the train split."),
    ),
    Row(
        name="math-tool",
        task="MathTool-v0: the same problems with a sandboxed python tool",
        env="tinker/MathTool-v0",
        env_kwargs={"split": "train", "tools": ["python"]},
        eval_env_kwargs={"split": "test"},
        settings={"steps": 20, "max_turns": 3, "max_new_tokens": 64, "micro_batch_size": 8},
        evals=2,
        warmup=Warmup(demos="baseline", steps=30, episodes=1280, min_reward=0.5),
        why=("The math row's problems with a python tool: every call the model writes runs in the bubblewrap sandbox "
             "(no network, limited time and memory, an unprivileged uid), and the env offers no other tool, so the "
             "row's every computation goes through it. The warm-up imitates the baseline's solved episodes, as the math "
             "row's: a python call that prints an expression written in the problem, then its result boxed (one kind "
             "of problem in ten); RL has to learn to write the expression of a word problem. 30 warm-up steps: after 10 the "
             "model called python but then called it again on the result instead of answering (3.1% of 64 solved), after "
             "30 it calls once and answers with the result (12.5%). Three turns (a call, a "
             "second try, the answer) of at most 64 tokens each; 20 steps, as a step takes about a minute here (each of its 64 "
             "episodes' calls starts a sandboxed process): a first run of 40 steps took 94 minutes, over the hour a row "
             "may take, and did not learn either (10.9% -> 9.4%). Held out: the test split, as the math row."),
    ),
    Row(
        name="household",
        task="Household-v0, easiest: one room, no distractors, pick and place",
        env="tinker/Household-v0",
        env_kwargs={"rooms": 1, "distractors": 0, "goal_kinds": "pick_and_place"},
        settings={"steps": 8, "batch_size": 2, "group_size": 8, "max_turns": 8, "max_new_tokens": 16, "micro_batch_size": 4,
                  "prefix_cache_mb": 4096},
        evals=1,
        warmup=Warmup(demos="baseline", steps=30),
        why=("The easiest homes the generator makes: the env's planner solves every one in 5.6 commands on average (94.5% "
             "within 8), its random admissible-command agent 0.3% within 8 (1.1% within 12). The untrained model solves none "
             "(0 of 64: it echoes the room instead of writing a command), so RL would have no signal; random play cannot give "
             "one, so the warm-up imitates the planner: 10 steps taught the format and not the task (0 of 64, one command "
             "repeated), this one takes 30 (73% of 64 homes after it). Two homes of eight samples a step, 8 steps: a step of four "
             "homes took 6 to 10 minutes on two cores (sampling 4, training on the whole games 5 to 7), so 20 of them "
             "did not fit a sitting. Eight turns; the prefix "
             "cache holds the batch's games (4 GiB): at the default 1 GiB an evaluation of 64 homes of 12 turns ran "
             "every turn's whole prompt again and did not finish in 15 minutes. Held out: each seed draws its own home "
             "and goal."),
    ),
    Row(
        name="gomoku",
        task="Gomoku-v0 7x7, four in a row, against the random opponent",
        env="tinker/Gomoku-v0",
        env_kwargs={"size": 7, "win_length": 4, "opponent": "random"},
        settings={"steps": 4, "batch_size": 2, "max_turns": 16, "max_new_tokens": 8, "micro_batch_size": 2, "prefix_cache_mb": 4096,
                  "gradient_checkpointing": True},
        evals=1,
        warmup=Warmup(demos="random", steps=10, max_context=1024),
        why=("The untrained model writes no legal move (0 of 64 games: every move is refused until the game is forfeit), so "
             "RL would have no signal: a warm-up on the random agent's games teaches the move format and no strategy. "
             "A game is long (up to 16 moves of about 100 tokens each, the board shown every turn): a training pass over "
             "one takes seconds on two cores, so a step plays 16 games (4 to 9 minutes a step here) and the run 4 steps (the hour's "
             "budget: 5 took 68 minutes), and the warm-up trains on the "
             "random games that fit 1,024 tokens. The prefix cache holds most of an evaluation's 64 games (4 GiB): at the "
             "default 1 GiB it held a third of them, and every turn ran the whole game again (an evaluation took over 10 "
             "minutes); a training pass recomputes each layer's activations (a pass over four whole games kept them, with "
             "the cache, past 24 GiB). "
             "Held out: the evaluation's seeds draw other sides and other opponent moves."),
    ),
    Row(
        name="blackjack",
        task="Blackjack-v0 against the dealer (multi-turn toy text)",
        env="tinker/Blackjack-v0",
        env_kwargs={},
        settings={"max_turns": 6, "max_new_tokens": 8},
        eval_episodes=400,
        why=("Gymnasium's Blackjack, each hand a few turns of hit or stick. The untrained model wins about a third of its "
             "hands; basic strategy wins about 43%, so the room to learn is some ten points, which 64 episodes cannot tell "
             "from noise: the evaluation plays 400 hands (the same 400 before and after, paired). Held out: every seed "
             "deals other cards."),
    ),
)

_BY_NAME = {row.name: row for row in ROWS}


def get_row(name: str) -> Row:
    """The row called ``name``; a :class:`KeyError` whose message lists the rows otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no results row {name!r}; the rows are: {', '.join(_BY_NAME)}") from None
