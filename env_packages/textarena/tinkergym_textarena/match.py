"""One TextArena game in play: creation (never reaching the network), seeding, messages per player, invalid moves.

TextArena seeds and draws from the process-wide ``random`` (and a few games from ``numpy.random``); a
:class:`Match` keeps a random state of its own and swaps it in for each call into TextArena, under one lock, so
a seeded game plays the same whatever other envs do meanwhile. Some games call ``nltk.download`` when their
module is imported or the game is made; here that call only checks that the data is installed and otherwise
raises :class:`GameUnavailableError` at once, naming the command that installs it: nothing is downloaded.

TextArena ends a game after a player's second invalid move in a row (its ``error_allowance``). Here the
limit is lifted: every invalid move TextArena reports comes back from :meth:`Match.play` as its reason, and the
env turns it into tinkergym's penalty, turn kept, and forfeit after ``max_invalid_actions``.
"""

from __future__ import annotations

import contextlib
import importlib
import random
import re
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from tinkergym.adapters import plain_text
from tinkergym.errors import ConfigError, EnvUnavailableError

#: The pattern of TextArena's ids: ``Game-v0`` and its variants ``Game-v0-hard`` (``-raw``/``-train`` are wrapper choices).
TA_ID = re.compile(r"^(?P<game>.+?)-v(?P<version>\d+)(?:-(?P<variant>.+))?$")
_WRAPPER_CHOICES = ("raw", "train")
_REASON = re.compile(r"attempted an invalid move\. Reason: (?P<reason>.*?)(?: Please resubmit a valid move.*)?$", re.DOTALL)
#: Where NLTK keeps each kind of data package (``nltk.data.find`` looks there; it never downloads).
_NLTK_FOLDERS = ("corpora", "taggers", "tokenizers", "chunkers", "grammars", "misc", "models", "sentiment", "stemmers")
#: A TextArena game calls only this code while holding it: their randomness is the process's.
_TEXTARENA_LOCK = threading.RLock()
_LIMITLESS = 10**9


class GameUnavailableError(EnvUnavailableError):
    """A TextArena game cannot run here (data it would download is not installed); the message says how to fix it."""


def parse_ta_id(ta_id: str) -> tuple[str, str, str] | None:
    """``(game, version, variant)`` of a TextArena id (variant ``""`` for the default), or ``None`` for a wrapper choice."""
    match = TA_ID.match(ta_id)
    if match is None:
        return None
    variant = match.group("variant") or ""
    if any(part in _WRAPPER_CHOICES for part in variant.split("-")):
        return None
    return match.group("game"), match.group("version"), variant


def variants(game: str, version: str) -> dict[str, Any]:
    """TextArena's registered specs of ``game`` by variant name (``""``: the default)."""
    from textarena.envs.registration import ENV_REGISTRY

    found = {}
    for ta_id, spec in ENV_REGISTRY.items():
        parsed = parse_ta_id(ta_id)
        if parsed is not None and parsed[:2] == (game, version):
            found[parsed[2]] = spec
    return found


def nltk_data_installed(resource: str) -> bool:
    """Whether NLTK's data package ``resource`` (``"words"``) is installed (looked up on disk only)."""
    import nltk

    for folder in _NLTK_FOLDERS:
        for name in (f"{folder}/{resource}", f"{folder}/{resource}.zip"):
            try:
                nltk.data.find(name)
                return True
            except LookupError:
                continue
    return False


def _requested(info_or_id: Any) -> list[str]:
    items = info_or_id if isinstance(info_or_id, (list, tuple)) else [info_or_id]
    return [str(getattr(item, "id", item)) for item in items if item is not None]


def missing_data(what: str, resources: Any) -> None:
    """Raise :class:`GameUnavailableError` naming the NLTK data among ``resources`` that is not installed (and how to install it)."""
    missing = [r for r in resources if not nltk_data_installed(r)]
    if missing:
        raise GameUnavailableError(
            f"{what} needs the NLTK data {', '.join(repr(m) for m in missing)}, which is not installed here; tinkergym never "
            f"downloads while making an env. Install it once with: python -m nltk.downloader {' '.join(missing)}"
        )


@contextlib.contextmanager
def offline_downloads(what: str) -> Iterator[None]:
    """``nltk.download`` checks instead of downloading: installed data passes, missing data raises :class:`GameUnavailableError`."""
    try:
        import nltk
    except ImportError:
        yield
        return

    def check(info_or_id: Any = None, *args: Any, **kwargs: Any) -> bool:
        missing_data(what, _requested(info_or_id))
        return True

    original = nltk.download
    nltk.download = check
    try:
        yield
    finally:
        nltk.download = original


def _parts(message: tuple[Any, ...]) -> tuple[int, str, str]:
    """``(sender, text, kind name)`` of a TextArena message, also where a game passed ``add_observation`` its
    arguments in another order (``(ObservationType, sender, text)`` then)."""
    sender, text, kind = message
    if isinstance(sender, int) and not isinstance(sender, bool):
        return sender, str(text), str(getattr(kind, "name", kind))
    parts = list(message)
    kinds = [p for p in parts if hasattr(p, "name")]
    senders = [p for p in parts if isinstance(p, int) and not isinstance(p, bool)]
    texts = [p for p in parts if isinstance(p, str)]
    return (senders[0] if senders else -1), (texts[0] if texts else ""), (kinds[0].name if kinds else "")


def format_message(state: Any, sender: int, text: str) -> str:
    """One TextArena message as ``[GAME] ...`` or ``[Player 1] ...``."""
    name = "GAME" if sender < 0 else state.role_mapping.get(sender, f"Player {sender}")
    return f"[{name}] {text}"


class Match:
    """A TextArena game of one registered variant, played through :meth:`reset` and :meth:`play`."""

    def __init__(self, label: str, game: str, version: str, variant: str | None, kwargs: dict[str, Any], needs_nltk: tuple[str, ...] = ()) -> None:
        missing_data(label, needs_nltk)
        found = variants(game, version)
        chosen = variant if variant is not None else ("" if "" in found else sorted(found)[0])
        if chosen not in found:
            listed = ", ".join(repr(v) for v in sorted(found) if v) or "none"
            raise ConfigError(f"{label}: variant={variant!r} is not one of TextArena's variants of {game} ({listed}); None is the default.")
        self.label, self.variant, self.spec = label, chosen, found[chosen]
        self.ta_id = f"{game}-v{version}" + (f"-{chosen}" if chosen else "")
        self._random_state = random.Random(0).getstate()
        self._numpy_state = np.random.RandomState(0).get_state()
        self.kwargs = kwargs
        with self._own_randomness():
            self.env = self._build(kwargs)  # made now, so a bad kwarg or missing data is an error at once
        self.pending: dict[int, list[str]] = {}
        self.num_players = 0

    def _build(self, kwargs: dict[str, Any]) -> Any:
        module_name, _, class_name = str(self.spec.entry_point).partition(":")
        env_class = getattr(importlib.import_module(module_name), class_name)
        try:
            env = env_class(**{**self.spec.kwargs, **kwargs})
        except TypeError as exc:
            raise ConfigError(f"{self.label}: {exc}. The kwargs are those of TextArena's {class_name}.") from exc
        from textarena.wrappers import ActionFormattingWrapper

        if ActionFormattingWrapper in (self.spec.default_wrappers or []):
            env = ActionFormattingWrapper(env)  # "e2e4" is played as "[e2e4]", as TextArena's own default does
        return env

    @contextlib.contextmanager
    def _own_randomness(self) -> Iterator[None]:
        with _TEXTARENA_LOCK, offline_downloads(self.label):
            outer, outer_numpy = random.getstate(), np.random.get_state()
            random.setstate(self._random_state)
            np.random.set_state(self._numpy_state)
            try:
                yield
            finally:
                self._random_state, self._numpy_state = random.getstate(), np.random.get_state()
                random.setstate(outer)
                np.random.set_state(outer_numpy)

    @property
    def state(self) -> Any:
        """TextArena's game state."""
        return self.env.state

    def reset(self, num_players: int, seed: int) -> None:
        """Start a game of ``num_players`` from ``seed`` (on a game made afresh: some keep a random generator of their own)."""
        with self._own_randomness():
            random.seed(seed)
            np.random.seed(seed % 2**32)
            self.env = self._build(self.kwargs)
            self.env.reset(num_players=num_players, seed=seed)
        self.num_players = num_players
        self.state.error_allowance = _LIMITLESS
        self.pending = {pid: [] for pid in range(num_players)}
        self._collect()

    def _collect(self) -> list[tuple[int, str]]:
        """Move TextArena's new messages to ``pending``; return the invalid-move notices among them."""
        notices = []
        for pid, messages in self.state.observations.items():
            for message in messages:
                sender, text, kind = _parts(message)
                if kind == "PLAYER_ACTION" and sender == pid:
                    continue  # a player's own move, echoed back
                if kind == "GAME_ADMIN" and "attempted an invalid move" in str(text):
                    notices.append((pid, str(text)))
                    continue
                self.pending[pid].append(plain_text(format_message(self.state, sender, str(text))))
            messages.clear()
        return notices

    @property
    def current(self) -> int:
        """The player to move."""
        return int(self.state.current_player_id)

    @property
    def done(self) -> bool:
        """Whether the game is over."""
        return bool(self.state.done)

    def play(self, action: str) -> str | None:
        """Play ``action`` for the player to move; the reason TextArena gives when the move is invalid, else ``None``."""
        player, before = self.current, self.state.error_count
        seen = len(self.pending[player])
        try:
            with self._own_randomness():
                self.env.step(action)
        except GameUnavailableError:
            raise
        except Exception as exc:  # noqa: BLE001 - a game that chokes on odd text has been sent an invalid move, not a reason to stop
            return plain_text(f"TextArena's game could not read it ({type(exc).__name__}: {str(exc)[:200]})")
        notices = self._collect()
        if not self.done and (self.state.error_count > before or notices):
            own = [text for pid, text in notices if pid == player] or [text for _, text in notices]
            found = _REASON.search(own[0]) if own else None
            return plain_text(found.group("reason").strip() if found else "") or "TextArena refused the move"
        del self.pending[player][:seen]  # what the player saw before this move
        return None

    def take(self, player: int) -> str:
        """The messages ``player`` has not seen yet, as text; they count as seen."""
        text = self.peek(player)
        self.pending[player] = []
        return text

    def peek(self, player: int) -> str:
        """The messages ``player`` has not seen yet, as text."""
        return "\n".join(self.pending.get(player, []))

    def rewards(self) -> dict[int, float]:
        """The final reward of each player (0 for each where TextArena gives none)."""
        given = self.state.rewards or {}
        return {pid: float(given.get(pid, 0.0)) for pid in range(self.num_players)}

    def outcome(self, player: int) -> str:
        """TextArena's reason the game ended, as ``player`` was told it."""
        info = getattr(self.state, "game_info", {}).get(player, {})
        return plain_text(str(info.get("reason") or "The game is over."))
