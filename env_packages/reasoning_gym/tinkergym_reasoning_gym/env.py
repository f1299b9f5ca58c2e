"""One reasoning-gym dataset as a single-turn text env, graded by the dataset's own scorer."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
from typing import Any, ClassVar

from tinkergym import TextEnv
from tinkergym.core import StepResult
from tinkergym.errors import ConfigError, InvalidAction
from tinkergym.spaces import describe_text

#: The datasets a composite env mixes when it is given no ``datasets``: three quick ones, equally weighted.
COMPOSITE_DEFAULT = (
    {"name": "basic_arithmetic", "weight": 1.0, "config": {}},
    {"name": "leg_counting", "weight": 1.0, "config": {}},
    {"name": "word_sorting", "weight": 1.0, "config": {}},
)
#: Longest expected or extracted answer shown in an observation or info.
SHOWN_ANSWER = 1_000


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() or c in "\n\t" else "?" for c in text)


def _clip(text: str, limit: int = SHOWN_ANSWER) -> str:
    return _printable(text if len(text) <= limit else text[:limit] + "...")


class ReasoningGymEnv(TextEnv):
    """One reasoning-gym dataset as a single-turn text env, graded by the dataset's own ``score_answer``.

    Observation: on reset, one of the dataset's questions and a line asking for the answer inside
    ``<answer>...</answer>``; after the step, the score and (where the dataset has one) the expected answer.
    Action: a reply of up to 16,384 characters; its LAST ``<answer>...</answer>`` is the answer
    (``answer_tag=None``: the whole reply is).
    Reward: the dataset's score of the answer, from 0 to 1 (1: correct; some datasets give part marks).
    ``info["is_success"]``: a score of 1. A scorer that fails or passes ``score_timeout`` scores 0 (and
    ``info["scorer_error"]`` says why). A reply without an answer tag, not text or too long is a bad
    action: ``invalid_action_penalty`` (-0.1), and the episode ends.
    Termination: after the one reply. Never truncated.

    Seeds: each reset draws the question's index in the dataset (``size`` questions, made from the
    dataset's ``seed``) from its own seed, so a seeded reset poses the same question.

    Args:
        dataset: The reasoning-gym dataset's name (the per-dataset classes set it).
        difficulty: A level of the dataset's curriculum (0 = easiest; ``None``: the dataset's defaults).
            Datasets without a curriculum refuse it.
        answer_tag: The tag around the answer (default ``"answer"``), or ``None`` for the whole reply.
        system_prompt: A reasoning-gym system prompt by name (``"default"``, ``"DeepSeekZero"``, ``"simple"``,
            ``"direct"``, ``"chain_of_draft"``) or any other text, used as given.
        score_timeout: Seconds a scorer may take (in a child process); ``None`` scores in this process, unbounded.
        invalid_action_penalty: The reward of a reply without an answer (default -0.1).
        render_mode: ``"ansi"``, ``"human"`` or ``None``.
        **config: Fields of the dataset's config (reasoning-gym's ``<Name>Config``), e.g. ``seed`` (default 0),
            ``size`` (the number of distinct questions; the dataset's default, usually 500), and its
            difficulty ranges. They override ``difficulty``'s values.
    """

    dataset_name: ClassVar[str] = ""
    metadata = {**TextEnv.metadata, "tinkergym": {"data": "procedural", "turns": "single", "agents": 1}}
    invalid_action_penalty = -0.1
    max_invalid_actions = 1
    max_observation_length = 65_536

    def __init__(
        self,
        dataset: str | None = None,
        *,
        difficulty: int | None = None,
        answer_tag: str | None = "answer",
        system_prompt: str = "default",
        score_timeout: float | None = 5.0,
        invalid_action_penalty: float = -0.1,
        render_mode: str | None = None,
        **config: Any,
    ) -> None:
        super().__init__(render_mode=render_mode)
        import reasoning_gym  # noqa: F401 - registers every dataset
        from reasoning_gym.factory import DATASETS
        from reasoning_gym.utils import SYSTEM_PROMPTS

        self.name = dataset or self.dataset_name
        if self.name not in DATASETS:
            close = difflib.get_close_matches(str(self.name), list(DATASETS), n=3)
            raise ConfigError(f"dataset={self.name!r} is not a reasoning-gym dataset" + (f"; did you mean {', '.join(close)}?" if close else "."))
        if answer_tag is not None and (not isinstance(answer_tag, str) or not answer_tag.isidentifier()):
            raise ConfigError(f"answer_tag={answer_tag!r}: use a tag name such as 'answer', or None for the whole reply.")
        if score_timeout is not None and (isinstance(score_timeout, bool) or not isinstance(score_timeout, (int, float)) or not 0 < score_timeout < 3600):
            raise ConfigError(f"score_timeout={score_timeout!r}: choose seconds between 0 and 3600, or None to score in this process.")
        if isinstance(invalid_action_penalty, bool) or not isinstance(invalid_action_penalty, (int, float)) or not math.isfinite(invalid_action_penalty):
            raise ConfigError(f"invalid_action_penalty={invalid_action_penalty!r}: choose a finite number.")
        if not isinstance(system_prompt, str):
            raise ConfigError(f"system_prompt={system_prompt!r}: name one of {sorted(SYSTEM_PROMPTS)} or give the text.")
        self.answer_tag = answer_tag
        self.score_timeout = score_timeout
        self.invalid_action_penalty = float(invalid_action_penalty)
        self.system_prompt = SYSTEM_PROMPTS.get(system_prompt, system_prompt)
        dataset_cls, config_cls = DATASETS[self.name]
        self._dataset_cls = dataset_cls
        self.config = self._config(config_cls, difficulty, config)
        try:
            self.dataset = dataset_cls(config=self.config)
        except (AssertionError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"{self.name}: the config {self._shown_config()} is refused by reasoning-gym: {exc}") from exc
        # The dataset's name in the scoring process: envs of one dataset and config share one copy there.
        self._key = hashlib.sha256(f"{self.name} {self.config!r}".encode()).hexdigest()
        self.entry: dict[str, Any] | None = None
        self.index = -1

    # ----- configuration --------------------------------------------------------------------------
    def _config(self, config_cls: type, difficulty: int | None, overrides: dict[str, Any]) -> Any:
        fields = {f.name for f in dataclasses.fields(config_cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ConfigError(f"{self.name}: {', '.join(unknown)} {'is not a field' if len(unknown) == 1 else 'are not fields'} of "
                              f"{config_cls.__name__}; its fields are {', '.join(sorted(fields))}.")
        values: dict[str, Any] = {}
        if difficulty is not None:
            values = self._curriculum_values(difficulty)
        if "seed" in fields:
            values["seed"] = 0
        if self.name == "composite":
            values["datasets"] = self._composite_specs(overrides.pop("datasets", COMPOSITE_DEFAULT))
        values.update(overrides)
        try:
            made = config_cls(**values)
            if hasattr(made, "validate"):
                made.validate()
        except (AssertionError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"{self.name}: {config_cls.__name__}({', '.join(f'{k}={v!r}' for k, v in overrides.items())}) is refused: {exc}") from exc
        return made

    def _curriculum_values(self, difficulty: int) -> dict[str, Any]:
        from reasoning_gym.factory import create_curriculum, has_curriculum

        if not has_curriculum(self.name):
            raise ConfigError(f"{self.name} has no curriculum, so difficulty={difficulty!r} means nothing; set its config fields instead.")
        curriculum = create_curriculum(self.name)
        levels = max((len(a.levels) for a in curriculum.attributes.values()), default=1)
        if isinstance(difficulty, bool) or not isinstance(difficulty, int) or not 0 <= difficulty < levels:
            raise ConfigError(f"difficulty={difficulty!r}: {self.name}'s curriculum has levels 0 to {levels - 1}.")
        curriculum.set_global_level(difficulty)
        made = curriculum.generate_configuration({})
        return {f.name: getattr(made, f.name) for f in dataclasses.fields(made)}

    def _composite_specs(self, datasets: Any) -> list[Any]:
        from reasoning_gym.composite import DatasetSpec

        try:
            return [d if isinstance(d, DatasetSpec) else DatasetSpec(**dict(d)) for d in datasets]
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"composite: datasets={datasets!r}: give a list of {{'name', 'weight', 'config'}} dicts ({exc}).") from exc

    def _shown_config(self) -> str:
        return ", ".join(f"{f.name}={getattr(self.config, f.name)!r}" for f in dataclasses.fields(self.config))[:300]

    # ----- the episode ----------------------------------------------------------------------------
    def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        size = len(self.dataset)
        if "index" in options:
            index = options["index"]
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
                raise ConfigError(f"options['index']={index!r}: choose an integer from 0 to {size - 1}.")
        else:
            index = int(self.np_random.integers(size))
        self.index, self.entry = index, self.dataset[index]
        question = _printable(str(self.entry["question"]).strip())
        ask = f"\n\nGive your final answer as <{self.answer_tag}>...</{self.answer_tag}>." if self.answer_tag else ""
        room = self.max_observation_length - len(ask)
        observation = (question if len(question) <= room else question[: room - 3] + "...") + ask
        return observation, {"dataset": self.name, "index": index, "answer_tag": self.answer_tag}

    def _extract(self, action: str) -> str:
        if self.answer_tag is None:
            return action
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(action, tag_name=self.answer_tag)
        if answer is None:
            raise InvalidAction(f"{describe_text(action)} has no <{self.answer_tag}>...</{self.answer_tag}>; end your reply with "
                                f"<{self.answer_tag}>your answer</{self.answer_tag}>.")
        return answer

    def _score(self, answer: str) -> tuple[float, str | None]:
        """The dataset's score of ``answer`` (0 to 1), and what went wrong if the scorer failed."""
        assert self.entry is not None
        from tinkergym_reasoning_gym.scoring import ScorerFailed, ScorerTimeout, shared_scorer

        try:
            if self.score_timeout is None:
                score = float(self.dataset.score_answer(answer, self.entry))
            else:
                score = shared_scorer().score(self._key, self._dataset_cls, self.config, answer, self.entry, self.score_timeout)
        except ScorerTimeout:
            return 0.0, f"the scorer took more than {self.score_timeout:g} s and was stopped"
        except ScorerFailed as exc:
            return 0.0, f"the scorer failed: {exc}"
        except Exception as exc:  # noqa: BLE001 - a scorer failing on an odd answer (or its process dying) scores 0, never ends the run
            return 0.0, f"the scorer failed: {type(exc).__name__}: {exc}"[:500]
        if not math.isfinite(score):
            return 0.0, f"the scorer returned {score!r}"
        return min(max(score, 0.0), 1.0), None

    def _step(self, action: str) -> StepResult:
        assert self.entry is not None
        answer = self._extract(action)
        score, error = self._score(answer)
        expected = self.entry.get("answer")
        shown = None if expected is None else _clip(str(expected))
        if score >= 1.0:
            text = "Correct (score 1)."
        elif shown is None:
            text = f"Score {score:.3g}: the dataset's checker did not accept {describe_text(answer)}. This question has no single expected answer."
        else:
            text = f"Score {score:.3g}. You answered {describe_text(answer)}; the expected answer was: {shown}"
        info: dict[str, Any] = {
            "dataset": self.name, "index": self.index, "score": score, "is_success": score >= 1.0,
            "extracted_answer": _clip(answer), "expected_answer": shown,
        }
        if error is not None:
            info["scorer_error"] = error
        return text, score, True, False, info

    def invalid_action_hint(self) -> str:
        """What a valid reply looks like."""
        if self.answer_tag is None:
            return "Reply with your answer as text."
        return f"End your reply with <{self.answer_tag}>your answer</{self.answer_tag}>."
