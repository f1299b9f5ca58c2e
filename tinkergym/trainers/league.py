"""The opponent pool of self-play: members, their openskill ratings, and whom the learner plays next.

No torch here: a :class:`League` is plain data the trainer saves with each checkpoint (``state_dict``).
Ratings come from openskill's Plackett-Luce model (one rating per member and one for the learner).
"""

from __future__ import annotations

import difflib
import math
import random
from dataclasses import asdict, dataclass
from typing import Any
from collections.abc import Iterable

from tinkergym.errors import ConfigError, TinkergymError
from tinkergym.plumbing.install import pip_install

LEARNER = "learner"
KINDS = ("snapshot", "baseline", "random", "policy")
_OUTCOME_KEYS = {1.0: "wins", 0.5: "draws", 0.0: "losses"}
_STATE_VERSION = 1


class UnknownOpponentError(TinkergymError, KeyError):
    """A name that is not a member of the league."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


@dataclass
class LeagueMember:
    """One opponent: a frozen snapshot of the learner, a scripted baseline, a random player or a named policy.

    ``fixed`` members never leave the league and share the ``fixed_share`` floor of :class:`League`; left as
    ``None`` it follows the kind (snapshots are not fixed, every other kind is). ``source`` says where the
    policy comes from (a snapshot's checkpoint path), ``step`` the training step a snapshot was taken at.
    """

    name: str
    kind: str
    fixed: bool | None = None
    source: str | None = None
    step: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a league member needs a non-empty name, got {self.name!r}.")
        if self.kind not in KINDS:
            raise ConfigError(f"league member {self.name!r} has kind {self.kind!r}; use one of {', '.join(KINDS)}.")
        if self.fixed is None:
            self.fixed = self.kind != "snapshot"


class League:
    """The learner, its opponents, their ratings and the learner's results against each.

    Whom to play (prioritized fictitious self-play, as in AlphaStar): for member ``m`` with the learner's
    ``wins``, ``draws`` and ``games`` against it, the learner's win probability is
    ``p_m = (wins + 0.5 * draws + 1) / (games + 2)`` (an unplayed member has ``p = 0.5``), its PFSP weight is
    ``f_m = (1 - p_m) ** exponent`` ("hard" weighting: the members the learner loses to are played most), and
    ``q_m = f_m / sum(f)`` over all members. Let ``Q`` be the mass ``q`` gives the fixed members and ``s`` the
    ``fixed_share``. When at least one member is fixed and ``Q < s``, the weights are
    ``(1 - λ) * q_m + λ * [m fixed] / n_fixed`` with ``λ = (s - Q) / (1 - Q)``: the fixed members together get
    exactly ``s``, the added mass spread evenly over them. Otherwise the weights are ``q`` (the floor
    already holds, or there is nothing fixed to give it to).

    Ratings: every game updates the two players' openskill ratings (a win ranks the winner first, a draw is
    a tie). A new snapshot starts from the learner's current rating, since it is the learner at that step.
    With ``max_snapshots`` set, adding a snapshot beyond it drops the snapshot that was added first; fixed
    members are never dropped.
    """

    def __init__(self, members: Iterable[LeagueMember] = (), *, max_snapshots: int | None = None, fixed_share: float = 0.2, exponent: float = 2.0) -> None:
        if max_snapshots is not None and (isinstance(max_snapshots, bool) or not isinstance(max_snapshots, int) or max_snapshots < 1):
            raise ConfigError(f"max_snapshots must be a whole number of at least 1 (or None for no cap), got {max_snapshots!r}.")
        _check_share(fixed_share)
        if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or not 0 <= exponent < math.inf:
            raise ConfigError(f"exponent must be a number >= 0 (2 is AlphaStar's hard weighting, 0 plays every member alike), got {exponent!r}.")
        self.max_snapshots = max_snapshots
        self.exponent = float(exponent)
        self._fixed_share = float(fixed_share)
        self._model = plackett_luce()
        self._members: dict[str, LeagueMember] = {}
        self._ratings = {LEARNER: self._model.rating()}
        self._results: dict[str, dict[str, int]] = {LEARNER: _no_results()}
        for member in members:
            self.add(member)

    # Members

    @property
    def members(self) -> list[LeagueMember]:
        """The opponents, in the order they were added (the learner is not one)."""
        return list(self._members.values())

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, name: object) -> bool:
        return name in self._members

    def get(self, name: str) -> LeagueMember:
        """The member called ``name``; :class:`UnknownOpponentError` names close matches when there is none."""
        try:
            return self._members[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), list(self._members), n=3)
            hint = f"did you mean {', '.join(close)}?" if close else f"members: {', '.join(self._members) or 'none yet; add one with League.add'}."
            raise UnknownOpponentError(f"{name!r} is not in the league; {hint}") from None

    def add(self, member: LeagueMember, mu: float | None = None, sigma: float | None = None) -> LeagueMember:
        """Add an opponent with a fresh rating (or ``mu``/``sigma``), then apply the snapshot cap."""
        if member.name == LEARNER:
            raise ConfigError(f"{LEARNER!r} is the learner's own name; give the member another name.")
        if member.name in self._members:
            raise ConfigError(f"the league already has a member called {member.name!r}; give the new one another name.")
        self._members[member.name] = member
        self._ratings[member.name] = self._model.rating(mu=mu, sigma=sigma)
        self._results[member.name] = _no_results()
        self._apply_snapshot_cap()
        return member

    def add_snapshot(self, step: int, source: str | None = None) -> LeagueMember:
        """Add the learner as of ``step`` (named ``snapshot:<step>``), rated as the learner is now."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"a snapshot's step must be a whole number >= 0, got {step!r}.")
        learner = self._ratings[LEARNER]
        member = LeagueMember(f"snapshot:{step}", "snapshot", fixed=False, source=source, step=step)
        return self.add(member, mu=learner.mu, sigma=learner.sigma)

    def _apply_snapshot_cap(self) -> None:
        if self.max_snapshots is None:
            return
        snapshots = [m.name for m in self._members.values() if m.kind == "snapshot" and not m.fixed]
        for name in snapshots[: max(len(snapshots) - self.max_snapshots, 0)]:
            del self._members[name], self._ratings[name], self._results[name]

    # Whom to play

    @property
    def fixed_share(self) -> float:
        """The least probability mass the fixed members get together when opponents are sampled."""
        return self._fixed_share

    def boost_fixed(self, share: float) -> float:
        """Raise the fixed share to ``share`` (never lowers it; used when collapse is detected); returns it."""
        _check_share(share)
        self._fixed_share = max(self._fixed_share, float(share))
        return self._fixed_share

    def win_probability(self, name: str) -> float:
        """The learner's estimated chance of beating ``name``: its results with one win and one loss of prior."""
        self.get(name)
        r = self._results[name]
        return (r["wins"] + 0.5 * r["draws"] + 1) / (_games(r) + 2)

    def opponent_weights(self) -> dict[str, float]:
        """The probability of sampling each member, by the rule in the class docstring (sums to 1)."""
        names = list(self._members)
        if not names:
            return {}
        f = [(1.0 - self.win_probability(n)) ** self.exponent for n in names]
        total = sum(f)
        q = [x / total for x in f] if total > 0 else [1.0 / len(names)] * len(names)
        fixed = [bool(self._members[n].fixed) for n in names]  # set by LeagueMember.__post_init__
        mass = sum(x for x, is_fixed in zip(q, fixed) if is_fixed)
        if any(fixed) and mass < self._fixed_share:
            mix = (self._fixed_share - mass) / (1.0 - mass)
            q = [(1.0 - mix) * x + (mix / sum(fixed) if is_fixed else 0.0) for x, is_fixed in zip(q, fixed)]
        return dict(zip(names, q))

    def sample_opponents(self, n: int, rng: random.Random) -> list[str]:
        """``n`` opponent names drawn with replacement from :meth:`opponent_weights` with ``rng``."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"the number of opponents to sample must be a whole number >= 0, got {n!r}.")
        weights = self.opponent_weights()
        if not weights:
            raise ConfigError("the league has no members to sample; add a baseline or a snapshot with League.add first.")
        return rng.choices(list(weights), weights=list(weights.values()), k=n)

    # Results

    def record(self, opponent: str, outcome: float) -> None:
        """One finished game of the learner against ``opponent``: 1 a win, 0.5 a draw, 0 a loss for the learner."""
        key = outcome_key(outcome)
        self.get(opponent)
        self._rate(LEARNER, opponent, outcome)
        self._results[opponent][key] += 1
        self._results[LEARNER][key] += 1

    def record_pair(self, a: str, b: str, outcome_for_a: float) -> None:
        """One game between two players (e.g. a snapshot against the baseline): updates their ratings only.

        Either may be ``"learner"``, which counts as :meth:`record` of the learner's game.
        """
        outcome_key(outcome_for_a)
        if a == b:
            raise ConfigError(f"a game needs two different players, got {a!r} twice.")
        if a == LEARNER:
            return self.record(b, outcome_for_a)
        if b == LEARNER:
            return self.record(a, 1.0 - float(outcome_for_a))
        self.get(a)
        self.get(b)
        self._rate(a, b, outcome_for_a)

    def _rate(self, a: str, b: str, outcome_for_a: float) -> None:
        ranks = {1.0: [0, 1], 0.5: [0, 0], 0.0: [1, 0]}[float(outcome_for_a)]
        (new_a,), (new_b,) = self._model.rate([[self._ratings[a]], [self._ratings[b]]], ranks=ranks)
        self._ratings[a], self._ratings[b] = new_a, new_b

    # Reports

    def ratings(self) -> dict[str, dict[str, Any]]:
        """Per player (the learner first): mu, sigma, ordinal (mu - 3 sigma), the learner's games, wins,
        draws and losses against it, its observed win rate (None before any game) and its sampling weight."""
        weights = self.opponent_weights()
        out = {}
        for name, rating in self._ratings.items():
            r = self._results[name]
            games = _games(r)
            out[name] = {
                "kind": LEARNER if name == LEARNER else self._members[name].kind,
                "mu": rating.mu,
                "sigma": rating.sigma,
                "ordinal": rating.ordinal(),
                "games": games,
                **r,
                "winrate": (r["wins"] + 0.5 * r["draws"]) / games if games else None,
                "weight": weights.get(name),
            }
        return out

    def table(self) -> str:
        """A plain text table of :meth:`ratings`, best ordinal first, for printing."""
        rows = sorted(self.ratings().items(), key=lambda item: (-item[1]["ordinal"], item[0]))
        header = ("name", "kind", "ordinal", "mu", "sigma", "games", "W/D/L", "winrate", "weight")
        lines = [
            (name, r["kind"], f"{r['ordinal']:.2f}", f"{r['mu']:.2f}", f"{r['sigma']:.2f}", str(r["games"]),
             f"{r['wins']}/{r['draws']}/{r['losses']}", "-" if r["winrate"] is None else f"{r['winrate']:.3f}",
             "-" if r["weight"] is None else f"{r['weight']:.3f}")
            for name, r in rows
        ]
        widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *lines])

    def metrics(self) -> dict[str, float]:
        """Flat numbers for logging: ``rating/<name>`` (ordinal) of every player, ``league/winrate_vs_<name>``
        of every member played so far, ``league/fixed_share`` and ``league/members``."""
        out: dict[str, float] = {}
        for name, r in self.ratings().items():
            out[f"rating/{name}"] = float(r["ordinal"])
            if name != LEARNER and r["winrate"] is not None:
                out[f"league/winrate_vs_{name}"] = float(r["winrate"])
        out["league/fixed_share"] = self._fixed_share
        out["league/members"] = float(len(self._members))
        return out

    # Checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything the league is, as JSON data (settings, members, ratings, results)."""
        return {
            "version": _STATE_VERSION,
            "max_snapshots": self.max_snapshots,
            "fixed_share": self._fixed_share,
            "exponent": self.exponent,
            "members": [asdict(m) for m in self._members.values()],
            "ratings": {name: [r.mu, r.sigma] for name, r in self._ratings.items()},
            "results": {name: dict(r) for name, r in self._results.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Become the league ``state`` describes (settings included), replacing members, ratings and results."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ConfigError(f"not a League state of version {_STATE_VERSION} (got {type(state).__name__}); pass what League.state_dict() returned.")
        try:
            fresh = League((LeagueMember(**m) for m in state["members"]), max_snapshots=state["max_snapshots"], fixed_share=state["fixed_share"], exponent=state["exponent"])
            ratings = {name: self._model.rating(mu=float(mu), sigma=float(sigma)) for name, (mu, sigma) in state["ratings"].items()}
            results = {name: {k: int(r[k]) for k in _no_results()} for name, r in state["results"].items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"the League state is incomplete or malformed ({exc!r}); pass what League.state_dict() returned.") from exc
        if set(ratings) != set(fresh._ratings) or set(results) != set(fresh._results):
            raise ConfigError("the League state's ratings or results do not match its members; pass what League.state_dict() returned.")
        self.__dict__.update(fresh.__dict__)
        self._ratings = {name: ratings[name] for name in fresh._ratings}
        self._results = {name: results[name] for name in fresh._results}


def plackett_luce() -> Any:
    try:
        from openskill.models import PlackettLuce
    except ImportError as exc:
        raise ImportError(f"the league's ratings need openskill; install it with: {pip_install('train')}") from exc
    return PlackettLuce()


def _check_share(share: float) -> None:
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise ConfigError(f"fixed_share must be a fraction between 0 and 1, got {share!r}.")


def outcome_key(outcome: float) -> str:
    try:
        return _OUTCOME_KEYS[float(outcome)]
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"a game's outcome must be 1 (win), 0.5 (draw) or 0 (loss), got {outcome!r}.") from None


def _no_results() -> dict[str, int]:
    return {"wins": 0, "draws": 0, "losses": 0}


def _games(results: dict[str, int]) -> int:
    return results["wins"] + results["draws"] + results["losses"]
