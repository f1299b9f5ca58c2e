r"""``tinker/Geometry-v0`` and ``tinker/ColourSquare-v0``: single-turn questions about a drawn image."""

from __future__ import annotations

import re
from typing import Any

from tinkergym.errors import ConfigError
from tinkergym.spaces import describe_text

from tinkergym_geometry.drawing import draw_figure, draw_square
from tinkergym_geometry.figures import KINDS, Problem, generate
from tinkergym_geometry.grading import NumericGrade, grade_number
from tinkergym_geometry.visual import VisualStepResult, VisualTextEnv

SYSTEM_PROMPT = (
    "You answer geometry questions about the figure in the image. The given lengths and angles are written "
    "in the figure. Reason step by step if it helps, then give the final answer as \\boxed{...} at the end "
    "of your reply, e.g. \\boxed{42} or \\boxed{12.57}: a number without units, rounded as the question says."
)


def _check_kinds(kinds: Any) -> tuple[str, ...]:
    names = (kinds,) if isinstance(kinds, str) else tuple(kinds) if isinstance(kinds, (list, tuple)) else ()
    if not names or any(k not in KINDS for k in names) or len(set(names)) != len(names):
        raise ConfigError(f"kinds={kinds!r}: choose one or more of {list(KINDS)}.")
    return names


class GeometryEnv(VisualTextEnv):
    r"""Single-turn geometry questions about a procedurally drawn figure (the kind of task of Geometry3K).

    Observation (:class:`~tinkergym.spaces.TextWithImages`, images 256x256 RGB): on reset, the figure
    (one image) and the question, which names what to find and how to round it; the given values are
    only in the figure (and in ``info["figure_description"]``). After the step, text-only feedback.
    Action: a reply whose final answer is the LAST ``\boxed{...}`` or, without one, a last ``Answer:`` line.
    Reward: 1 for a correct answer, else 0. Whole-degree angles and exact lengths and areas compare
    exactly (``45/2`` = ``22.5``); answers asked to two decimal places accept any number within 0.005 of
    the truth. A non-text or over-long action ends the episode with 0 (``max_invalid_actions = 1``).
    Termination: after the one reply. Never truncated.

    ``info`` on reset: ``system_prompt``, ``kind``, ``question``, ``figure_description`` (the figure in
    words, every given value included: the fallback for text models and baselines) and ``given`` (those
    values by name). Never the answer. ``info`` on the step: ``expected_answer``, ``extracted_answer``,
    ``answer_source``, ``correct``, ``is_success``, ``kind``.

    Args:
        kinds: Problem kinds to draw from (default all of :data:`~tinkergym_geometry.figures.KINDS`).
        render_mode: ``"ansi"``, ``"human"``, ``"rgb_array"`` or ``None``.

    Reset options: ``{"kind": name}`` poses a problem of that kind. Seeded resets are pixel-identical.
    """

    metadata = {**VisualTextEnv.metadata, "tinkergym": {"data": "free", "turns": "single", "agents": 1, "modality": "text+images"}}
    system_prompt = SYSTEM_PROMPT
    invalid_action_penalty = 0.0
    max_invalid_actions = 1
    forfeit_reward = 0.0
    max_observation_length = 4_096

    def __init__(self, kinds: Any = KINDS, render_mode: str | None = None) -> None:
        super().__init__(render_mode=render_mode)
        self.kinds = _check_kinds(kinds)
        self.problem: Problem | None = None

    def _reset(self, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:  # type: ignore[override]
        kinds = self.kinds
        if "kind" in options:
            kinds = _check_kinds(options["kind"] if isinstance(options["kind"], str) else ())
        self.problem = generate(self.np_random, kinds, self.image_shape)
        self.figure = draw_figure(self.problem.shapes, self.image_shape)
        info = {
            "kind": self.problem.kind,
            "question": self.problem.question,
            "figure_description": self.problem.description,
            "given": dict(self.problem.given),
        }
        return {"text": self.pose(), "images": (self.figure,)}, info

    def pose(self) -> str:
        """The text of the first observation."""
        assert self.problem is not None
        return f"{self.problem.question}\n\nGive your final answer as \\boxed{{...}}."

    def grade(self, reply: str) -> NumericGrade:
        """Grade a reply against the current problem."""
        assert self.problem is not None
        return grade_number(reply, self.problem.exact, self.problem.value, self.problem.decimals)

    def _step(self, action: str) -> VisualStepResult:  # type: ignore[override]
        return self._final(action, note="")

    def _final(self, action: str, note: str) -> VisualStepResult:
        assert self.problem is not None
        result = self.grade(action)
        answer = self.problem.answer
        if result.extracted is None:
            text = f"No final answer found: end your reply with \\boxed{{your answer}}. The expected answer was {answer}."
        elif result.correct:
            text = f"Correct. The answer is {answer}."
        else:
            text = f"Incorrect. You answered {describe_text(result.extracted)}; the expected answer was {answer}."
        info = {
            "kind": self.problem.kind,
            "expected_answer": answer,
            "extracted_answer": None if result.extracted is None else describe_text(result.extracted, 200),
            "answer_source": result.source,
            "correct": result.correct,
            "is_success": result.correct,
        }
        text = f"{note}\n{text}" if note else text
        return {"text": text, "images": ()}, 1.0 if result.correct else 0.0, True, False, info

    def invalid_action_hint(self) -> str:
        """What a valid reply looks like."""
        return "Reply with your reasoning and end with the final answer as \\boxed{...}."


#: Colour names and the RGB they are drawn with.
COLOURS = {"red": (220, 40, 40), "blue": (40, 80, 220), "green": (40, 170, 60), "yellow": (235, 200, 30)}


class ColourSquareEnv(VisualTextEnv):
    """Which of two colours fills the square? A trivial visual task, for learning tests of vision models.

    Observation (:class:`~tinkergym.spaces.TextWithImages`, images 64x64 RGB): on reset, a white image
    with one square (random position and size) filled with one of the two colours, and the question
    naming both; after the step, text-only feedback.
    Action: a reply; its answer is the colour name (of the two asked about) that appears LAST in it,
    case-insensitive, as a whole word.
    Reward: 1 if that is the square's colour, else 0 (also when neither name appears). A non-text or
    over-long action ends the episode with 0. Termination: after the one reply. Never truncated.

    ``info`` on reset: ``system_prompt``, ``colours`` (the two names, in the order asked) and
    ``figure_description`` (the text fallback: the square's colour in words). On the step:
    ``expected_answer``, ``extracted_answer``, ``correct``, ``is_success``.

    Args:
        colours: The two colour names asked about (default ``("red", "blue")``), from :data:`COLOURS`.
        render_mode: ``"ansi"``, ``"human"``, ``"rgb_array"`` or ``None``.
    """

    metadata = {**VisualTextEnv.metadata, "tinkergym": {"data": "free", "turns": "single", "agents": 1, "modality": "text+images"}}
    system_prompt = "Look at the image and answer with the colour name only."
    invalid_action_penalty = 0.0
    max_invalid_actions = 1
    forfeit_reward = 0.0
    max_observation_length = 1_024
    image_shape = (64, 64)

    def __init__(self, colours: Any = ("red", "blue"), render_mode: str | None = None) -> None:
        super().__init__(render_mode=render_mode)
        names = tuple(colours) if isinstance(colours, (list, tuple)) else ()
        if len(names) != 2 or len(set(names)) != 2 or any(c not in COLOURS for c in names):
            raise ConfigError(f"colours={colours!r}: choose two different names of {list(COLOURS)}.")
        self.colours: tuple[str, str] = (names[0], names[1])
        self.colour = ""
        self._pattern = re.compile(r"\b(" + "|".join(self.colours) + r")\b", re.IGNORECASE)

    def _reset(self, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:  # type: ignore[override]
        self.colour = self.colours[int(self.np_random.integers(2))]
        height, width = self.image_shape
        side = int(self.np_random.integers(min(height, width) // 3, min(height, width) * 3 // 4))
        left, top = int(self.np_random.integers(2, width - side - 1)), int(self.np_random.integers(2, height - side - 1))
        self.figure = draw_square(self.image_shape, (left, top, left + side, top + side), COLOURS[self.colour])
        a, b = self.colours
        info = {"colours": list(self.colours), "figure_description": f"A square filled with {self.colour} on a white background."}
        return {"text": f"Which colour fills the square: {a} or {b}? Answer with the colour name.", "images": (self.figure,)}, info

    def _step(self, action: str) -> VisualStepResult:  # type: ignore[override]
        found = self._pattern.findall(action)
        answer = found[-1].lower() if found else None
        correct = answer == self.colour
        if answer is None:
            text = f"No colour named: answer {self.colours[0]} or {self.colours[1]}. The square was {self.colour}."
        else:
            text = f"{'Correct' if correct else 'Incorrect'}. The square was {self.colour}."
        info = {"expected_answer": self.colour, "extracted_answer": answer, "correct": correct, "is_success": correct}
        return {"text": text, "images": ()}, 1.0 if correct else 0.0, True, False, info

    def invalid_action_hint(self) -> str:
        """What a valid reply looks like."""
        return f"Reply with the colour name: {self.colours[0]} or {self.colours[1]}."
