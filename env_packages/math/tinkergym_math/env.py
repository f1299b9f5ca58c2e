r"""``tinker/Math-v0``: answer a math word problem in one reply, graded against the dataset answer."""

from __future__ import annotations

import math
from typing import Any

from tinkergym import TextEnv
from tinkergym.core import StepResult
from tinkergym.errors import ConfigError
from tinkergym.spaces import describe_text

from tinkergym_math.data import Problem, load_problems, printable
from tinkergym_math.grading import Grade, grade

SYSTEM_PROMPT = (
    "You solve math word problems. Reason step by step if it helps, then give the final answer as "
    "\\boxed{...} at the end of your reply, e.g. \\boxed{42} or \\boxed{3/4}. The answer is a number: "
    "write fractions as a/b or \\frac{a}{b}, and leave out units."
)
ANSWER_INSTRUCTION = "Give your final answer as \\boxed{...}."


class MathEnv(TextEnv):
    r"""Single-turn math word problems with an exactly graded final answer.

    Observation: on reset, the problem text followed by a line asking for the answer in ``\boxed{}``;
    after the step, feedback that says whether the answer was right and what the expected answer was.
    Action: a reply of any length up to 16,384 characters whose final answer is the LAST ``\boxed{...}``
    or, without one, a last ``Answer: ...`` line (see :mod:`tinkergym_math.grading`).
    Reward: 1 for a correct answer, 0 otherwise (answers compare exactly as numbers: ``3/4``, ``0.75``
    and ``\frac{3}{4}`` are equal), plus ``format_reward`` when the answer came from a ``\boxed{}``
    that reads as a number, right or wrong. A reply with no extractable answer gets 0 and feedback
    that says how to give one; a non-text or over-long action also ends the episode with reward 0
    (``invalid_action_penalty = forfeit_reward = 0``, ``max_invalid_actions = 1``).
    Termination: after the one reply (single-turn). Never truncated.

    ``info`` on reset: ``system_prompt``, ``problem_id``, ``topic``, ``index`` (never the answer).
    ``info`` on the step: ``expected_answer``, ``extracted_answer`` (``None`` if none),
    ``answer_source`` (``"boxed"``, ``"answer_line"`` or ``None``), ``correct``, ``well_formed``, ``problem_id``.

    Args:
        data_files: ``None`` (the shipped dataset), a path or list of paths to ``.jsonl`` / ``.parquet``
            files (Parquet needs ``pyarrow``), or an iterable of ``{"question", "answer"}`` dicts.
        split: ``"train"`` (2,250 problems) or ``"test"`` (250) of the shipped dataset.
        format_reward: Bonus in [0, 1] for a well-formed ``\boxed{}`` numeric answer, even a wrong one
            (default 0.0: reward is correctness only).
        shuffle: ``True`` (default): each reset draws a problem uniformly from ``np_random``.
            ``False``: resets walk through the problems in order (a seeded reset starts again at the first),
            which suits evaluation over a whole split.
        render_mode: ``"ansi"``, ``"human"`` or ``None``.

    Reset options: ``{"index": i}`` poses problem ``i`` of the loaded data.
    """

    metadata = {**TextEnv.metadata, "tinkergym": {"data": "dataset", "turns": "single", "agents": 1}}
    system_prompt = SYSTEM_PROMPT
    invalid_action_penalty = 0.0
    max_invalid_actions = 1
    forfeit_reward = 0.0

    def __init__(
        self,
        data_files: Any = None,
        split: str = "train",
        format_reward: float = 0.0,
        shuffle: bool = True,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(render_mode=render_mode)
        if isinstance(format_reward, bool) or not isinstance(format_reward, (int, float)) or not (
            math.isfinite(format_reward) and 0 <= format_reward <= 1
        ):
            raise ConfigError(f"format_reward={format_reward!r}: choose a number from 0 to 1 (0 turns the bonus off).")
        if not isinstance(shuffle, bool):
            raise ConfigError(f"shuffle={shuffle!r}: use True (random problems) or False (in order).")
        self.format_reward = float(format_reward)
        self.shuffle = shuffle
        self.problems: tuple[Problem, ...] = load_problems(data_files, split)
        self.problem: Problem | None = None
        self.index = -1
        self._cursor = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Pose a new problem (see the class docstring for ``shuffle`` and ``options={"index": i}``)."""
        if seed is not None:
            self._cursor = 0
        return super().reset(seed=seed, options=options)

    def _pick(self, options: dict[str, Any]) -> int:
        """The index of the next problem."""
        if "index" in options:
            index = options["index"]
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.problems):
                raise ConfigError(f"options['index']={index!r}: choose an integer from 0 to {len(self.problems) - 1}.")
            return index
        if self.shuffle:
            return int(self.np_random.integers(len(self.problems)))
        index = self._cursor % len(self.problems)
        self._cursor += 1
        return index

    def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.index = self._pick(options)
        self.problem = self.problems[self.index]
        return self.pose(self.problem), {"problem_id": self.problem.id, "topic": self.problem.topic, "index": self.index}

    @staticmethod
    def pose(problem: Problem) -> str:
        """The first observation for ``problem``."""
        return f"{problem.question}\n\n{ANSWER_INSTRUCTION}"

    def score(self, result: Grade) -> float:
        """The reward of a graded reply: correctness plus the optional format bonus."""
        return (1.0 if result.correct else 0.0) + (self.format_reward if result.well_formed else 0.0)

    def _step(self, action: str) -> StepResult:
        assert self.problem is not None
        result = grade(action, self.problem.answer)
        return feedback(result, self.problem), self.score(result), True, False, grade_info(result, self.problem)

    def invalid_action_hint(self) -> str:
        """What a valid reply looks like."""
        return "Reply with your reasoning and end with the final answer as \\boxed{...}."


def feedback(result: Grade, problem: Problem) -> str:
    """The final observation: right or wrong, and the expected answer."""
    if result.extracted is None:
        return (
            "No final answer found: end your reply with \\boxed{your answer} (or a last line 'Answer: ...'). "
            f"The expected answer was {problem.answer}."
        )
    if result.correct:
        return f"Correct. The answer is {problem.answer}."
    return f"Incorrect. You answered {describe_text(result.extracted)}; the expected answer was {problem.answer}."


def grade_info(result: Grade, problem: Problem) -> dict[str, Any]:
    """The step ``info`` of a graded reply (JSON-serializable)."""
    return {
        "problem_id": problem.id,
        "expected_answer": problem.answer,
        "extracted_answer": None if result.extracted is None else printable(result.extracted[:1000]),
        "answer_source": result.source,
        "correct": result.correct,
        "is_success": result.correct,
        "well_formed": result.well_formed,
    }
