"""ScheduledBackend: the Backend protocol through a scheduler job (``tinkergym train --scheduler URL``).

The client submits a job (or reattaches to one), waits in the queue while the scheduler shows its position,
and once a worker runs the job's training server it talks to that server directly with
:class:`~tinkergym.backends.remote.RemoteBackend` and the token of the lease's epoch; the scheduler never
carries compute traffic. Standard library only, like RemoteBackend: no torch on the client.

When the server goes away (its worker died, the lease expired and the job was queued again), a call fails
with :class:`BackendLost`. :meth:`ScheduledBackend.reconnect` waits for the job's next lease and connects to
the new server; :class:`~tinkergym.trainers.session.TrainingRun` then loads its newest checkpoint that the
new server has (the worker restores checkpoints from the scheduler's artifact store) and goes on from there.
At the end of the run, :meth:`complete` ends the job, which frees its devices at once.

While it trains, the run's progress goes to the job's event stream: each step's numbers (a ``metrics`` event) and,
when the run writes transcripts, a few of the step's episodes (a ``transcript`` event, :func:`transcript_event`), which
the job's page on the dashboard shows. Either report failing never stops the run.
"""

from __future__ import annotations

import json
import math
import time
import types
from pathlib import Path
from typing import Any
from collections.abc import Callable

from tinkergym.plumbing import timeline
from tinkergym.backends.remote import RemoteBackend, RemoteBackendError, server_name
from tinkergym.client import TERMINAL_STATES as TERMINAL  # noqa: F401 - importable from here
from tinkergym.client import JobEnded, player_token, print_stderr  # noqa: F401 - JobEnded: raised by wait_running; importable from here
from tinkergym.errors import ConfigError

#: Seconds :meth:`ScheduledBackend.reconnect` waits for a new lease before it tries again the server of a lease the job still
#: holds (the scheduler says the lease lives: the failed call met a passing fault, not a dead server).
SAME_SERVER_RETRY_S = 5.0

#: Seconds :meth:`ScheduledBackend.complete` waits for the worker to store the run's last checkpoint.
STORE_TIMEOUT_S = 600.0

#: A ``transcript`` event's data as JSON (as the scheduler measures it) at most: under a tenant's default
#: ``max_event_bytes`` (64 KiB) with room to spare. A scheduler that refuses it (413: a smaller quota) gets a quarter.
TRANSCRIPT_EVENT_BYTES = 48 * 1024
#: Characters of a message's text kept at first (its head and tail, a marker between); halved until the event fits.
TRANSCRIPT_MESSAGE_CHARS = 2000
#: ... but never below this many; then messages, then episodes are left out instead.
TRANSCRIPT_MIN_CHARS = 100
#: Messages of an episode kept at most (the first and the last ones; a ``{"left_out": n}`` marker between).
TRANSCRIPT_MESSAGES = 24
#: Per-turn rewards of an episode kept at most.
TRANSCRIPT_REWARDS = 64


class BackendLost(RemoteBackendError):
    """The job's server stopped answering (lease lost or worker gone); :meth:`ScheduledBackend.reconnect` waits for the next one."""


class ScheduledSnapshot:
    """A snapshot held by the server of one lease epoch of a scheduler job (see :meth:`ScheduledBackend.sampling_snapshot`)."""

    def __init__(self, backend: ScheduledBackend, snapshot: Any, epoch: int | None) -> None:
        self.backend, self.snapshot, self.epoch, self.version = backend, snapshot, epoch, snapshot.version

    def sample(self, request: Any) -> Any:
        """Sampled with the snapshot's weights on the server that holds it; :class:`BackendLost` once that server is not the job's."""
        if self.backend.epoch != self.epoch:
            raise BackendLost(f"job {self.backend.job_id}: its server changed (lease epoch {self.epoch} -> {self.backend.epoch}) since this "
                              "snapshot was taken")
        try:
            return self.snapshot.sample(request)
        except RemoteBackendError as exc:
            raise BackendLost(f"job {self.backend.job_id}: {exc}") from exc
        except ConfigError as exc:
            if "refused the token" in str(exc) or "is not held" in str(exc):
                raise BackendLost(f"job {self.backend.job_id}: {exc}") from exc
            raise


class ScheduledBackend:
    """The Backend protocol computed by the server of scheduler job ``job_id``.

    Args:
        client: a :class:`tinkergym.client.SchedulerClient`.
        job_id: the job (see :meth:`submit`).
        poll: seconds between looks at a job that is not running yet.
        wait_timeout: seconds to wait for the job to run (None: as long as it takes).
        say: where progress lines go (queue position, connections); default stderr.
        remote: keyword arguments for each :class:`RemoteBackend` (timeouts, retries).
        players: a league job's players (its config's ``players``): this backend is player 0, and :attr:`joint` opens the
            others (:class:`LeagueJoint`); None for any other job.
    """

    def __init__(
        self, client: Any, job_id: str, *, poll: float = 1.0, wait_timeout: float | None = None, say: Callable[[str], None] = print_stderr,
        remote: dict[str, Any] | None = None, players: int | None = None,
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.poll = poll
        self.wait_timeout = wait_timeout
        self.say = say
        self.remote_options = {"retries": 4, "backoff": 0.5, **(remote or {})}
        self.epoch: int | None = None
        self.last_state: str | None = None  # the name of the state last saved on the job's server
        self.players_last_states: dict[int, str] = {}  # a league's players': the name each last saved
        self._remote: RemoteBackend | None = None
        self._others: list[RemoteBackend] = []  # a league's players 1..N-1, on the same server
        self.players = players
        self.joint = LeagueJoint(self, players) if players is not None else None

    def __repr__(self) -> str:
        return f"ScheduledBackend({self.client.url!r}, job={self.job_id!r}, epoch={self.epoch})"

    @classmethod
    def submit(cls, client: Any, kind: str, config: dict[str, Any], *, gpus: int = 1, priority: int = 0, name: str = "",
               idempotency_key: str | None = None, **options: Any) -> ScheduledBackend:
        """Queue a job for ``config`` and return its backend (not yet connected: the first call waits for the lease)."""
        job = client.submit(kind, config, gpus=gpus, priority=priority, name=name, idempotency_key=idempotency_key)
        return cls(client, job["id"], **options)

    # ----- the job's lifecycle ------------------------------------------------------------------------
    def wait_running(self, after_epoch: int | None = None, same_epoch_after: float | None = None) -> dict[str, Any]:
        """Wait until the job runs (at an epoch above ``after_epoch``, or at it after ``same_epoch_after`` seconds); its
        connection (url, token, epoch)."""
        from tinkergym.client import wait_running

        return wait_running(self.client, self.job_id, after_epoch=after_epoch, timeout=self.wait_timeout, poll=self.poll, say=self.say,
                            still_queued="it stays queued: reattach later with tinkergym train --resume", same_epoch_after=same_epoch_after)

    def connect(self, after_epoch: int | None = None, same_epoch_after: float | None = None) -> None:
        """Wait for the job to run and connect to its server (the wait is the run's ``queue`` span)."""
        with timeline.span("queue", "setup", epoch=after_epoch):
            connection = self.wait_running(after_epoch, same_epoch_after)
        for remote in [self._remote, *self._others]:
            if remote is not None:
                remote.close()
        self._remote = RemoteBackend(connection["url"], connection["token"], **self.remote_options)
        self._others = [RemoteBackend(connection["url"], player_token(connection["token"], i), **self.remote_options)
                        for i in range(1, self.players or 1)]
        self.epoch = int(connection["epoch"])
        self.say(f"job {self.job_id}: connected to its server at {connection['url']} (lease epoch {self.epoch})")

    def reconnect(self) -> None:
        """After :class:`BackendLost`: wait for the job's next lease (a new epoch) and connect to that server; while the job
        still holds the lease of the lost server after :data:`SAME_SERVER_RETRY_S` seconds, connect to that server again (the
        lease says it lives; if it is gone after all, the next call fails again and the wait goes on). A job that was cancelled
        (or has ended) meanwhile raises :class:`JobEnded` at once, saying so: no lease will come."""
        from tinkergym.client import ENDING_STATES, SchedulerError, ended_message

        try:
            job = self.client.show(self.job_id)
        except (SchedulerError, OSError):  # the scheduler cannot say now: wait for the next lease (the wait asks it again)
            job = None
        if job is not None and job["state"] in ENDING_STATES:  # cancelled (or ended) while the run trained: no lease comes
            raise JobEnded(ended_message(job))
        self.say(f"job {self.job_id}: its server at epoch {self.epoch} did not answer; waiting for the job's next lease")
        self.connect(after_epoch=self.epoch, same_epoch_after=SAME_SERVER_RETRY_S)

    def report_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """Send a step's numbers to the job's event stream; a failure to do so never stops the run."""
        from tinkergym.client import SchedulerError

        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        try:
            self.client.report(self.job_id, "metrics", {**numbers, "step": step})  # the run's step wins over the backend's counter
        except (SchedulerError, OSError) as exc:
            self.say(f"job {self.job_id}: could not report step {step}'s metrics to the scheduler ({exc})")

    def report_transcripts(self, step: int, records: list[dict[str, Any]]) -> None:
        """Send a few of a step's episodes (``records``: :func:`~tinkergym.trainers.evaluation.transcript_record` dicts) to
        the job's event stream as a ``transcript`` event, cut to fit (:func:`transcript_event`); a failure never stops the run."""
        from tinkergym.client import SchedulerError

        budget = TRANSCRIPT_EVENT_BYTES
        while True:
            try:
                self.client.report(self.job_id, "transcript", transcript_event(step, records, budget))
                return
            except SchedulerError as exc:
                if exc.status == 413 and budget > 4 * 1024:  # the tenant's max_event_bytes is smaller than ours: cut more
                    budget //= 4
                    continue
                problem: Exception = exc
            except (OSError, TypeError, ValueError) as exc:  # TypeError, ValueError: a record that does not make JSON
                problem = exc
            self.say(f"job {self.job_id}: could not report step {step}'s transcripts to the scheduler ({problem})")
            return

    def complete(self, store_timeout: float = STORE_TIMEOUT_S, reason: str | None = None) -> None:
        """End the job (it succeeds; its devices are freed at once), once the worker has stored its last saved state;
        ``reason`` says why to the job's owner (the job's ``end_reason``).

        The worker uploads each state the server saves to the scheduler's artifact store; ending the job stops the
        server, so the run's last checkpoint (the one a later ``--resume`` or ``serve model --scheduler`` starts
        from) is waited for first, up to ``store_timeout`` seconds.

        Raises :class:`BackendLost` where the lease moved on before that checkpoint was stored (the worker died at the
        end of the run): the job then runs at another epoch, which this lease cannot end, and the caller recovers on the
        next lease's server as after any lost call (a training run redoes its steps since its newest stored checkpoint).
        """
        if self.epoch is None:
            return
        deadline = time.monotonic() + store_timeout
        for name in [self.last_state, *self.players_last_states.values()]:  # a league's players' last states too
            if name is not None and not self.wait_stored(name, max(deadline - time.monotonic(), 0.0)):
                self.say(f"job {self.job_id}: ending the job without checkpoint {name}")
        self.client.complete(self.job_id, self.epoch, reason=reason)

    def wait_stored(self, name: str, timeout: float) -> bool:
        """Wait until the scheduler holds the job's checkpoint ``name``, saved on the server of this lease epoch; whether it
        does (False: not within ``timeout`` seconds, or the scheduler could not say).

        Raises :class:`BackendLost` as soon as the job no longer runs at this epoch without holding the checkpoint: the
        worker that would upload it lost the lease (it died, or froze), and the scheduler records no checkpoint from a
        lease it has moved past, so it never will be stored. The caller saves it again on the next lease's server.
        """
        from tinkergym.client import SchedulerError

        deadline, said = time.monotonic() + timeout, False
        while True:
            try:
                if self._holds(name):
                    return True
                job = self.client.show(self.job_id)
                if job["state"] != "running" or job.get("lease_epoch") != self.epoch:
                    if self._holds(name):  # recorded between the two looks: a lease it has moved past records nothing more
                        return True
                    raise BackendLost(f"job {self.job_id}: its server at lease epoch {self.epoch} lost the lease before its worker stored "
                                      f"checkpoint {name} (the job is {job['state']} at epoch {job.get('lease_epoch')})")
            except (SchedulerError, OSError) as exc:
                self.say(f"job {self.job_id}: could not list its checkpoints ({exc})")
                return False
            if time.monotonic() > deadline:
                self.say(f"job {self.job_id}: checkpoint {name} was not stored by the worker within {timeout:g} s")
                return False
            if not said:
                self.say(f"job {self.job_id}: waiting for the worker to store checkpoint {name}")
                said = True
            time.sleep(min(self.poll, 0.25))

    def _holds(self, name: str) -> bool:
        """Whether the scheduler has recorded the job's checkpoint ``name``."""
        return any(c["name"] == name for c in self.client.checkpoints(self.job_id))

    # ----- the Backend protocol ---------------------------------------------------------------------
    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.call_player(0, method, *args, **kwargs)

    def call_player(self, index: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` of player ``index``'s adapter on the job's server (0: this backend's own; a league's others 1..N-1)."""
        if self._remote is None:
            self.connect()
        remote = self._remote if index == 0 else self._others[index - 1]
        try:
            return getattr(remote, method)(*args, **kwargs)
        except RemoteBackendError as exc:  # no answer after the retries: the server is gone
            raise BackendLost(f"job {self.job_id}: {exc}") from exc
        except ConfigError as exc:
            if "refused the token" in str(exc):  # another server (a new epoch) answers on that address
                raise BackendLost(f"job {self.job_id}: {exc}") from exc
            raise

    def info(self) -> dict[str, Any]:
        return {**self._call("info"), "job_id": self.job_id, "scheduler": self.client.url}

    def ping(self) -> None:
        """Tell the job's server its client is alive (see :meth:`RemoteBackend.ping`); never connects (nothing to keep alive
        before a connection, and a reconnection is the calls' to make)."""
        if self._remote is None:
            return
        try:
            for remote in [self._remote, *self._others]:
                remote.ping()
        except RemoteBackendError as exc:
            raise BackendLost(f"job {self.job_id}: {exc}") from exc

    def sample(self, request: Any) -> Any:
        return self._call("sample", request)

    def sampling_snapshot(self) -> ScheduledSnapshot:
        """A snapshot of the job's server's weights (:meth:`RemoteBackend.sampling_snapshot`), fenced as every call is: once
        the job moves to another server (a new lease epoch), its samples raise :class:`BackendLost`, and the run goes on
        from its newest checkpoint, whose rollouts sample again from the new server's snapshots."""
        return ScheduledSnapshot(self, self._call("sampling_snapshot"), self.epoch)

    def logprobs(self, sequences: list[list[int]], temperature: float = 1.0, images: list[list[Any]] | None = None) -> list[list[float]]:
        """Per-token logprobs on the job's server; ``images`` (one list per sequence) pass through as they are."""
        if images is None:
            return self._call("logprobs", sequences, temperature)
        return self._call("logprobs", sequences, temperature, images=images)

    def forward_backward(self, request: Any) -> Any:
        return self._call("forward_backward", request)

    def optim_step(self, params: Any) -> dict[str, float]:
        return self._call("optim_step", params)

    def save_state(self, path: str) -> None:
        self._call("save_state", path)
        self.last_state = server_name(path)

    def load_state(self, path: str) -> None:
        self._call("load_state", path)

    def export(self, path: str, merged: bool = False) -> None:
        self._call("export", path, merged)

    def close(self) -> None:
        for remote in [self._remote, *self._others]:
            if remote is not None:
                remote.close()


class ScheduledPlayer:
    """Player ``index`` of a league job: its own adapter on the job's shared server, called through the job's
    :class:`ScheduledBackend` (so a reconnection moves every player to the new server)."""

    def __init__(self, backend: ScheduledBackend, index: int) -> None:
        self.backend, self.index = backend, index

    @property
    def joint(self) -> LeagueJoint | None:
        return self.backend.joint

    def info(self) -> dict[str, Any]:
        return {**self.backend.call_player(self.index, "info"), "job_id": self.backend.job_id, "player": self.index}

    def sample(self, request: Any) -> Any:
        return self.backend.call_player(self.index, "sample", request)

    def logprobs(self, sequences: list[list[int]], temperature: float = 1.0, images: list[list[Any]] | None = None) -> list[list[float]]:
        if images is None:
            return self.backend.call_player(self.index, "logprobs", sequences, temperature)
        return self.backend.call_player(self.index, "logprobs", sequences, temperature, images=images)

    def forward_backward(self, request: Any) -> Any:
        return self.backend.call_player(self.index, "forward_backward", request)

    def optim_step(self, params: Any) -> dict[str, float]:
        return self.backend.call_player(self.index, "optim_step", params)

    def save_state(self, path: str) -> None:
        """The player's state on its adapter under the checkpoint's name and its own (``step_000004.p1``: every checkpoint
        keeps its own), noted in ``path``."""
        folder = Path(path)
        name = f"{server_name(folder.parent.parent)}.{server_name(folder)}"
        self.backend.call_player(self.index, "save_state", path, name=name)
        self.backend.players_last_states[self.index] = name

    def load_state(self, path: str) -> None:
        try:
            self.backend.call_player(self.index, "load_state", path)
        except ConfigError as exc:  # e.g. a new server whose worker could not restore this player's state: an older checkpoint is tried
            raise ConfigError(f"player {self.index} of league job {self.backend.job_id}: {exc}") from exc

    def export(self, path: str, merged: bool = False) -> None:
        self.backend.call_player(self.index, "export", path, merged)

    def close(self) -> None:
        """Nothing to free here: the job's end closes every player's adapter."""


class LeagueJoint:
    """The players of a league job together (``joint`` of each): :meth:`open_session` hands out players 1..N-1, and
    :meth:`sample_many` / :meth:`forward_backward_many` send the players' calls at once, each on its own connection, so
    the shared server takes them into one round (one decode loop, one mixed-adapter pass). Standard library only."""

    #: Frozen snapshots would need adapters the job was not granted: a league through the scheduler plays its players alone.
    holds_snapshots = False

    def __init__(self, backend: ScheduledBackend, players: int) -> None:
        self.backend, self.players = backend, players
        self.free = set(range(1, players))  # players not handed out (a trainer built again after a lost lease takes them anew)
        #: What a league asks of its base: the adapters it holds (``max_sessions``), the job's players.
        self.config = types.SimpleNamespace(max_sessions=players)

    def open_session(self, config: Any = None) -> ScheduledPlayer:
        """The next player (1, 2, ...): its adapter was opened by the job's worker, with the job's rank and seed + its index."""
        if not self.free:
            raise ConfigError(f"league job {self.backend.job_id} has {self.players} players (adapters); all are open")
        index = min(self.free)
        self.free.discard(index)
        return ScheduledPlayer(self.backend, index)

    def close_session(self, session: Any) -> None:
        """Hand the player back (its adapter stays open on the server until the job ends)."""
        if isinstance(session, ScheduledPlayer) and 0 < session.index < self.players:
            self.free.add(session.index)

    def sample_many(self, calls: list[tuple[Any, Any]]) -> list[Any]:
        return self._together("sample", calls)

    def forward_backward_many(self, calls: list[tuple[Any, Any]]) -> list[Any]:
        return self._together("forward_backward", calls)

    @staticmethod
    def _together(method: str, calls: list[tuple[Any, Any]]) -> list[Any]:
        """Each call's result or the exception it raised, the calls sent at once (one thread a call)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=max(len(calls), 1), thread_name_prefix="league") as pool:
            futures = [pool.submit(getattr(session, method), request) for session, request in calls]
        return [future.exception() or future.result() for future in futures]


# ----- the transcript event ----------------------------------------------------------------------------
def transcript_event(step: int, records: list[dict[str, Any]], max_bytes: int = TRANSCRIPT_EVENT_BYTES) -> dict[str, Any]:
    """The data of a step's ``transcript`` event: its first, best and worst episodes by ``total_reward`` (one entry per
    episode, ``picked`` saying why), each message's text cut to a bound with a marker, the whole at most ``max_bytes`` as
    JSON.

    To fit, the messages' texts are cut shorter (down to :data:`TRANSCRIPT_MIN_CHARS`), then the middle messages of each
    episode are left out, then the last picked episodes, then the messages of the one left; only a ``max_bytes`` below
    what an episode's summary needs (a few KiB) gives a larger event.
    """
    picks = pick_episodes(records)
    chars, messages = TRANSCRIPT_MESSAGE_CHARS, TRANSCRIPT_MESSAGES
    while True:
        data = {"step": step, "episodes": [_episode(records[i], why, chars, messages) for i, why in picks], "of": len(records)}
        if len(json.dumps(data).encode("utf-8")) <= max_bytes:  # as the scheduler measures it (ASCII, non-ASCII escaped)
            return data
        if chars > TRANSCRIPT_MIN_CHARS:
            chars = max(TRANSCRIPT_MIN_CHARS, chars // 2)
        elif messages > 2:
            messages //= 2
        elif len(picks) > 1:
            picks = picks[:-1]
        elif messages:
            messages = 0
        else:
            return data


def pick_episodes(records: list[dict[str, Any]]) -> list[tuple[int, list[str]]]:
    """``[(index, why)]``: the first record, the best and the worst by ``total_reward`` (``why`` names each role an
    episode plays, so one episode is sent once)."""
    if not records:
        return []
    rewards = [_number(r.get("total_reward")) for r in records]
    scored = [i for i, reward in enumerate(rewards) if reward is not None]
    picked: dict[int, list[str]] = {0: ["first"]}
    if scored:
        picked.setdefault(max(scored, key=lambda i: (rewards[i], -i)), []).append("best")
        picked.setdefault(min(scored, key=lambda i: (rewards[i], i)), []).append("worst")
    return list(picked.items())


def cut_text(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its head and tail with ``[... N characters cut ...]`` between."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - head - tail:,} characters cut ...]\n{text[len(text) - tail:]}"


def _episode(record: dict[str, Any], why: list[str], chars: int, max_messages: int) -> dict[str, Any]:
    given = list(record.get("messages") or [])
    messages = [_message(m, chars) for m in given[:max_messages]]
    if len(given) > max_messages:  # the first and the last ones, a marker of how many were left out between
        head = (max_messages + 1) // 2
        tail = [_message(m, chars) for m in given[len(given) - (max_messages - head):]]
        messages = [*messages[:head], {"left_out": len(given) - max_messages}, *tail]
    error = record.get("error")
    return {
        "episode": record.get("episode"), "picked": why, "total_reward": _number(record.get("total_reward")),
        "finish_reason": cut_text(str(record.get("finish_reason") or ""), 64), "error": None if error is None else cut_text(str(error), chars),
        "sampled_tokens": _number(record.get("sampled_tokens")),
        "rewards": [_number(r) for r in list(record.get("rewards") or [])[:TRANSCRIPT_REWARDS]],
        "messages": messages,
    }


def _message(message: Any, chars: int) -> dict[str, Any]:
    """A chat message as the event carries it: its role, its text cut to ``chars``, and its OpenAI-style tool fields as text."""
    if not isinstance(message, dict):
        return {"role": "", "content": cut_text(_text(message), chars)}
    out = {"role": cut_text(str(message.get("role") or ""), 32), "content": cut_text(_text(message.get("content")), chars)}
    if message.get("tool_calls"):
        out["tool_calls"] = cut_text(_text(message["tool_calls"]), chars)
    if message.get("name"):
        out["name"] = cut_text(str(message["name"]), 64)
    return out


def _text(content: Any) -> str:
    """A message's content as text: a string as is, a list of parts' ``text`` joined, anything else as JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return json.dumps(content, ensure_ascii=False, default=str)


def _number(value: Any) -> float | None:
    """A finite number, else None (JSON has no NaN)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def build(request: Any) -> ScheduledBackend:
    """The ``scheduled`` backend plugin: the run's job at ``scheduler_url`` (reattached while it waits or runs), else a
    new job, which starts from the ended one's checkpoints when the run had one."""
    from tinkergym.client import SchedulerClient

    c = request.config
    client = SchedulerClient(c.scheduler_url, request.api_key)
    job_config = c.job_config()
    if c.scheduler_job:
        if client.show(c.scheduler_job)["state"] not in TERMINAL:
            return ScheduledBackend(client, c.scheduler_job, players=job_config.get("players"))  # reattach: the job waits or runs
        # The job ended (its client went quiet, or the run is extended): a new job starts from its checkpoints.
        job_config["resume_job"] = c.scheduler_job
    kind = "sft" if c.trainer == "sft" else "train"
    return ScheduledBackend.submit(client, kind, job_config, gpus=c.gpus, name=request.name, players=job_config.get("players"))
