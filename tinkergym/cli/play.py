"""``tinkergym play``: a person plays an env in the terminal, or watches a scripted agent play it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import click

from tinkergym.agents import RandomTextAgent
from tinkergym.cli.common import SEED, SafePath, construct_env, parse_kwargs, shorten
from tinkergym.episodes import Transcript, run_aec_episode, run_episode
from tinkergym.errors import EnvUnavailableError
from tinkergym.registry import EnvSpec, list_envs, load_baseline, make, make_aec, spec


class HumanAgent:
    """Shows the observation and reads the action from the terminal."""

    def __init__(self, seat: str = "you") -> None:
        self.seat = seat
        self._shown_prompt = False

    def __call__(self, observation: str, info: dict[str, Any]) -> str:
        if not self._shown_prompt and info.get("system_prompt"):
            click.secho(f"[system]\n{info['system_prompt']}\n", fg="cyan")
            self._shown_prompt = True
        click.echo(observation)
        try:
            return click.prompt(click.style(f"{self.seat}>", fg="yellow"), default="", show_default=False, prompt_suffix=" ")
        except click.Abort as exc:  # click.prompt turns both Ctrl-C and the end of input into Abort; its context says which
            if isinstance(exc.__context__, KeyboardInterrupt):
                raise KeyboardInterrupt from None
            raise click.ClickException("input ended; the game is abandoned") from None


class ModelAgent:
    """A trained model or adapter (a run's ``final``, a league player's ``final/players/p1``, a snapshot) playing a
    seat greedily: the conversation so far (the env's system prompt, each observation and reply) in the model's chat
    template, one reply of at most ``max_new_tokens`` a move."""

    def __init__(self, path: str, max_new_tokens: int = 64) -> None:
        from tinkergym.chat import ChatTemplateRenderer
        from tinkergym.trainers.session import load_backend_for_eval

        self.backend = load_backend_for_eval(model=path)
        self.renderer = ChatTemplateRenderer(self.backend.info()["tokenizer"])
        self.max_new_tokens = max_new_tokens
        self.messages: list[dict[str, Any]] = []

    def __call__(self, observation: str, info: dict[str, Any]) -> str:
        from tinkergym.protocol.types import SampleRequest, SamplingParams

        if not self.messages and info.get("system_prompt"):
            self.messages.append({"role": "system", "content": info["system_prompt"]})
        self.messages.append({"role": "user", "content": observation})
        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0, stop_token_ids=list(self.renderer.stop_token_ids))
        response = self.backend.sample(SampleRequest(prompts=[self.renderer.render(self.messages, add_generation_prompt=True)], params=params))
        tokens = [t for t in response.sequences[0][0].tokens if t not in self.renderer.stop_token_ids]
        reply = self.renderer.decode(tokens).strip()
        self.messages.append({"role": "assistant", "content": reply})
        return reply


def _opponent_kind(value: str) -> str:
    """``--opponent``: baseline, random, or model:PATH (the folder is looked for when the game starts)."""
    if value in ("baseline", "random") or (value.startswith("model:") and len(value) > len("model:")):
        return value
    raise _bad_opponent(value)


def _bad_opponent(value: str) -> click.BadParameter:
    return click.BadParameter(f"{value!r}: give baseline, random or model:PATH (a model or adapter folder that exists, e.g. a "
                              "league's model:runs/league/final/players/p1)", param_hint="--opponent")


def _scripted(s: EnvSpec, kind: str, seed: int | None) -> Any:
    if kind == "random":
        return RandomTextAgent(seed=seed)
    factory = load_baseline(s)
    if factory is None:
        raise click.UsageError(f"{s.distribution} declares no baseline agent for {s.id}; use --agent random or human.")
    return factory(seed=seed)


def play_one(s: EnvSpec, agent: str, opponent: str, seats: tuple[str, ...], seed: int | None, kwargs: dict, max_steps: int) -> Transcript:
    """Play one episode of ``s`` and return its transcript."""
    def player(kind: str, seat: str, offset: int) -> Any:
        if kind == "human":
            return HumanAgent(seat)
        if kind.startswith("model:"):
            if not Path(kind[len("model:"):]).is_dir():
                raise _bad_opponent(kind)
            return ModelAgent(kind[len("model:"):])
        return _scripted(s, kind, None if seed is None else seed + offset)

    if s.kind == "aec":
        env = construct_env(make_aec, s.id, kwargs)
        unknown = set(seats) - set(env.possible_agents)
        if unknown:
            raise click.BadParameter(f"{sorted(unknown)}; this env's seats are {env.possible_agents}", param_hint="--seat")
        chosen = set(seats or env.possible_agents[:1])
        agents = {a: player(agent if a in chosen else opponent, a, i) for i, a in enumerate(env.possible_agents)}
        return run_aec_episode(env, agents, seed=seed, max_steps=max_steps)
    if seats:
        raise click.BadParameter("--seat applies to multi-agent envs only", param_hint="--seat")
    env = construct_env(make, s.id, kwargs)
    return run_episode(env, player(agent, "you", 0), seed=seed, max_steps=max_steps)


@click.command()
@click.argument("env_id", required=False)
@click.option("--all", "play_all", is_flag=True, help="Play one episode of every installed env (needs --agent baseline or random).")
@click.option("--agent", type=click.Choice(["human", "baseline", "random"]), default="human", show_default=True, help="Who plays: you, the package's scripted baseline, or random text.")
@click.option("--seat", "seats", multiple=True, metavar="AGENT", help="Multi-agent envs: the seat(s) --agent plays (default player_0); --opponent plays the rest.")
@click.option("--opponent", default="baseline", show_default=True, callback=lambda ctx, param, value: _opponent_kind(value), metavar="WHO",
              help="Multi-agent envs: who plays the other seats: baseline, random, or model:PATH, a trained model or adapter folder "
                   "playing greedily (a run's final/, a league player's final/players/p1, a snapshot).")
@click.option("--seed", type=SEED, default=None, help="Seed of the episode (and of scripted agents).")
@click.option("--kwarg", "kwargs", multiple=True, metavar="KEY=VALUE", help="Keyword argument for the env, e.g. size=7 (repeatable).")
@click.option("--max-steps", default=1_000, show_default=True, type=click.IntRange(1), help="Stop an episode after this many actions.")
@click.option("--jsonl", "jsonl", type=SafePath(dir_okay=False, path_type=Path), default=None, help="Also append the transcripts to this JSONL file.")
def play(env_id: str | None, play_all: bool, agent: str, seats: tuple[str, ...], opponent: str, seed: int | None, kwargs: tuple[str, ...], max_steps: int, jsonl: Path | None) -> None:
    """Play ENV_ID in the terminal, or watch a scripted agent play it.

    \b
    Examples:
      tinkergym play tinker/Gomoku-v0 --kwarg size=7
      tinkergym play tinker/GomokuDuel-v0 --seat player_1
      tinkergym play tinker/GomokuDuel-v0 --opponent model:runs/league/final/players/p1
      tinkergym play tinker/Math-v0 --agent baseline --seed 3
      tinkergym play --all --agent baseline --seed 0

    Ctrl-C abandons the game (exit code 130); the end of input (Ctrl-D) too (exit code 1).
    """
    try:
        _play(env_id, play_all, agent, seats, opponent, seed, kwargs, max_steps, jsonl)
    except KeyboardInterrupt:
        from tinkergym.cli.interrupts import interrupted

        click.echo("", err=True)  # off the line of the prompt
        interrupted("interrupted: the game is abandoned" + (f" (any episode that ended is in {jsonl})" if jsonl else ""))


def _play(env_id: str | None, play_all: bool, agent: str, seats: tuple[str, ...], opponent: str, seed: int | None, kwargs: tuple[str, ...],
          max_steps: int, jsonl: Path | None) -> None:
    """The play command's work."""
    if bool(env_id) == play_all:
        raise click.UsageError("give an ENV_ID or --all (not both).")
    if play_all and agent == "human":
        raise click.UsageError("--all plays every env unattended: add --agent baseline or --agent random.")
    specs = [spec(env_id)] if env_id else list_envs(refresh=True)  # env_id is given exactly when --all is not
    env_kwargs = parse_kwargs(kwargs)
    with _open_transcripts(jsonl) as transcripts:  # opened first: a path that cannot be written fails before the game
        for s in specs:
            try:
                transcript = play_one(s, agent, opponent, seats, seed, {} if play_all else env_kwargs, max_steps)
            except EnvUnavailableError as exc:
                if not play_all:
                    raise
                click.secho(f"===== {s.id} ({s.distribution} {s.version}): skipped: {exc}", fg="yellow")
                continue
            if agent != "human":
                click.secho(f"===== {s.id} ({s.distribution} {s.version}) =====", bold=True)
                click.echo(transcript.format())
            else:
                click.echo(transcript.turns[-1].observation if transcript.turns else "")
                click.secho("returns: " + ", ".join(f"{k} {v:+g}" for k, v in transcript.returns.items()), bold=True)
            if transcripts is not None:
                transcripts.write(json.dumps({"env_id": s.id, **transcript.to_dict()}) + "\n")
                transcripts.flush()


def _open_transcripts(path: Path | None) -> Any:
    """``path`` opened for appending (a usage error naming --jsonl when it cannot be), or a null context for ``None``."""
    if path is None:
        return contextlib.nullcontext()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("a", encoding="utf-8")
    except OSError as exc:
        raise click.BadParameter(f"cannot write {shorten(str(path))!r}: {exc.strerror or exc}.", param_hint="--jsonl") from exc
