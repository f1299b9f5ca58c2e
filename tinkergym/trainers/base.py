"""The Trainer plugin protocol, what a trainer is handed (:class:`TrainingContext`), and plugin lookup.

A trainer is a class found by name in the entry-point group ``tinkergym.trainers``. It is built with a
:class:`TrainingContext` and called once per step; it talks to compute only through ``ctx.backend`` (the
Backend protocol) and to envs only through ``ctx.rollout``.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import random
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import Callable

from tinkergym.protocol.backend import Backend
from tinkergym.chat import ChatRenderer
from tinkergym.registry import plugins
from tinkergym.errors import ConfigError, TinkergymError, TinkergymWarning
from tinkergym.rollouts import RolloutConfig, Sampler, Trajectory, rollout
from tinkergym.config import TrainConfig
from tinkergym.trainers.evaluation import train_seed

TRAINER_GROUP = "tinkergym.trainers"


@dataclass
class StepOutput:
    """What one training step returns: aggregated metrics and the trajectories it trained on (for transcripts)."""

    metrics: dict[str, float]
    trajectories: list[Trajectory] = field(default_factory=list)


class EnvPool:
    """Sets of envs made by ``make_env``, lent to one rollout at a time and made once: rollouts played at the same time
    (``async_steps`` > 1 plays several steps ahead at once) each get their own, as an env is never stepped by two at once.

    Thread-safe; it holds as many sets as rollouts ever ran at once (at most one per rollout in flight).
    """

    def __init__(self, make_env: Callable[[], Any]) -> None:
        self.make_env = make_env
        self._free: list[list[Any]] = []
        self._lock = threading.Lock()

    @property
    def sets(self) -> int:
        """How many sets the pool holds now (lent ones not counted): as many as rollouts have run at once."""
        with self._lock:
            return len(self._free)

    def take(self, count: int) -> list[Any]:
        """``count`` envs no other rollout holds until they are :meth:`give`-n back (made where the pool has too few)."""
        with self._lock:
            envs = max(self._free, key=len) if self._free else []
            if envs:
                self._free.remove(envs)
        while len(envs) < count:
            envs.append(self.make_env())
        return envs

    def give(self, envs: list[Any]) -> None:
        """Put back a set :meth:`take` lent (the whole set, also envs past the ``count`` asked for)."""
        with self._lock:
            self._free.append(envs)

    @contextmanager
    def lend(self, count: int) -> Iterator[list[Any]]:
        """:meth:`take` for the ``with`` block, then :meth:`give`."""
        envs = self.take(count)
        try:
            yield envs[:count]
        finally:
            self.give(envs)


@dataclass
class TrainingContext:
    """Everything a trainer may use: the config, the backend, the chat renderer and an env factory."""

    config: TrainConfig
    backend: Backend
    renderer: ChatRenderer
    make_env: Callable[[], Any] | None = None
    #: Builds another backend like ``backend`` (a local one; ``None`` for a training server or a scheduler job).
    make_backend: Callable[[], Backend] | None = None
    #: The envs ``rollout`` plays (made by ``make_env``, a set per rollout at once); None without ``make_env``.
    env_pool: EnvPool | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.make_env is not None:
            self.env_pool = EnvPool(self.make_env)

    def prompt_seeds(self, step: int, count: int | None = None, salt: str = "train") -> list[int]:
        """The env seeds of a step: a pure function of (run seed, step), so a resumed run sees the same prompts."""
        rng = random.Random(f"{salt}:{self.config.seed}:{step}")
        return [train_seed(rng) for _ in range(count or self.config.batch_size)]

    def rollout(
        self, seeds: list[int], sampling_seed: int, temperature: float | None = None, env_kwargs: dict | None = None, sampler: Sampler | None = None,
    ) -> list[Trajectory]:
        """Play one episode per seed with the current policy, or with ``sampler`` (e.g. a snapshot of it); envs are made once and reused.

        Thread-safe: rollouts at the same time each play their own envs (an :class:`EnvPool`).
        """
        if self.env_pool is None:  # made with the context from make_env
            raise ConfigError(f"the {self.config.trainer!r} trainer needs an env (--env).")
        c = self.config
        settings = RolloutConfig(
            max_turns=c.max_turns,
            max_new_tokens=c.max_new_tokens,
            max_context=c.max_context,
            temperature=c.temperature if temperature is None else temperature,
            seed=sampling_seed,
        )
        with self.env_pool.lend(len(seeds)) as envs:
            return rollout(envs, self.backend if sampler is None else sampler, self.renderer, settings, seeds=seeds)


class Trainer(Protocol):
    """A training algorithm: ``Trainer(ctx)``, then ``train_step(step)`` once per step.

    A trainer that carries state from one step to the next (an adaptive KL coefficient, a curriculum's
    level, a data position) also implements the two methods of :class:`StatefulTrainer`; the run saves that
    state in every checkpoint and hands it back on resume, so a resumed run continues exactly. A trainer
    without them is treated as stateless: everything it does at a step must then follow from the config,
    the seed and the step (e.g. :meth:`TrainingContext.prompt_seeds`).

    A trainer that samples the rollouts of the next ``async_steps`` steps while one trains sets the class attribute
    ``supports_async_steps = True`` (see :mod:`tinkergym.trainers.async_rollouts`); a run with ``async_steps`` > 0
    refuses a trainer without it, and calls its ``close()`` (when it has one) when the run ends or stops.
    """

    #: Whether the trainer plays envs (RL) or reads a dataset (SFT).
    needs_env: bool
    #: The ``trainer_args`` keys it reads; when a trainer declares them, any other key is refused before a
    #: run starts (a misspelt ``--trainer-arg`` would otherwise be ignored without a word).
    known_args: frozenset[str]

    def __init__(self, ctx: TrainingContext) -> None: ...

    def train_step(self, step: int) -> StepOutput: ...


class StatefulTrainer(Trainer, Protocol):
    """A trainer whose state is saved with each checkpoint and restored on resume.

    ``state_dict()`` is called right after the step a checkpoint is for, and returns what the trainer needs
    to continue with the next step. It must be JSON data (dicts with string keys, lists, strings, numbers,
    booleans, None): the checkpoint stores it as ``trainer_state.json``, so tuples come back as lists and
    floats exactly. ``load_state_dict(state)`` is called on a freshly built trainer, after the backend's
    state is restored and before the first resumed step; it receives what ``state_dict()`` returned.
    A checkpoint written without trainer state (an older run) leaves the trainer as built.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainerStateError(TinkergymError, TypeError):
    """A trainer's ``state_dict()`` returned something a checkpoint cannot store."""


def trainer_state(trainer: Any) -> dict[str, Any] | None:
    """The trainer's ``state_dict()``, or ``None`` for a trainer without one (stateless)."""
    state_dict = getattr(trainer, "state_dict", None)
    if not callable(state_dict):
        return None
    state = state_dict()
    if not isinstance(state, dict):
        raise TrainerStateError(f"{type(trainer).__name__}.state_dict() returned {type(state).__name__}; return a dict of JSON data.")
    return state


def restore_trainer_state(trainer: Any, state: dict[str, Any]) -> None:
    """Hand ``state`` to the trainer's ``load_state_dict``; a trainer without one has nothing to restore."""
    load_state_dict = getattr(trainer, "load_state_dict", None)
    if callable(load_state_dict):
        load_state_dict(state)
    elif state:
        warnings.warn(
            f"the checkpoint holds trainer state but {type(trainer).__name__} has no load_state_dict(); it starts from its "
            "initial state. Install the trainer version that wrote the run to continue it exactly.",
            TinkergymWarning,
            stacklevel=2,
        )


def available_trainers() -> dict[str, md.EntryPoint]:
    """Installed trainer plugins by name (metadata only)."""
    return plugins.available(TRAINER_GROUP)


def check_trainer_args(trainer_class: type, args: dict[str, Any], name: str) -> None:
    """Refuse ``trainer_args`` keys that ``trainer_class`` does not read (when it declares ``known_args``)."""
    known = getattr(trainer_class, "known_args", None)
    if known is None:
        return
    for key in args:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            choices = ", ".join(sorted(known)) or "none"
            raise ConfigError(f"trainer arg {key!r} is not one the {name} trainer reads.{hint} It reads: {choices}.")


def check_async_steps(trainer_class: type, config: TrainConfig) -> None:
    """Refuse ``async_steps`` > 0 for a trainer that does not sample rollouts ahead (``supports_async_steps``)."""
    if config.async_steps and not getattr(trainer_class, "supports_async_steps", False):
        what = "reads a dataset and samples nothing" if not getattr(trainer_class, "needs_env", True) else "samples each step's rollouts when it trains"
        raise ConfigError(
            f"async-steps {config.async_steps}: the {config.trainer} trainer {what}, so there are no rollouts to sample ahead; "
            "leave out --async-steps (async_steps: 0), or use a trainer that has it (grpo, rloo, selfplay)."
        )


def load_trainer(name: str) -> type:
    """The trainer class registered as ``name``; an unknown name lists the installed ones."""
    return plugins.load(TRAINER_GROUP, name, "trainer")
