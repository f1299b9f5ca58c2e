"""The ``transcript`` event a scheduled run reports (:func:`tinkergym.backends.scheduled.transcript_event`): which episodes
it carries, its shape, its size bound with huge messages (cut more rather than be refused), and a run that goes on when
reporting fails. The scheduler's side (the route accepts it within the tenant's quota; the job page shows it) is
tests/scheduler/test_dashboard_live.py's."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tinkergym.backends.scheduled import (
    TRANSCRIPT_EVENT_BYTES,
    TRANSCRIPT_MESSAGE_CHARS,
    ScheduledBackend,
    cut_text,
    pick_episodes,
    transcript_event,
)
from tinkergym.client import SchedulerError


def record(episode: int, reward: float, *messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A transcript line as :func:`tinkergym.trainers.evaluation.transcript_record` writes it."""
    return {"episode": episode, "messages": list(messages) or [{"role": "user", "content": f"prompt {episode}"},
                                                                  {"role": "assistant", "content": f"answer {episode}"}],
            "rewards": [reward], "total_reward": reward, "finish_reason": "terminated", "error": None, "sampled_tokens": 5, **extra}


def size(data: dict[str, Any]) -> int:
    return len(json.dumps(data).encode("utf-8"))  # as the scheduler measures an event (repository.append_event)


class FakeClient:
    """Records each report; ``refuse`` is a list of errors raised by the next reports, in order."""

    url = "http://scheduler.invalid"

    def __init__(self, *refuse: Exception) -> None:
        self.refuse = list(refuse)
        self.sent: list[tuple[str, str, dict[str, Any]]] = []

    def report(self, job_id: str, type_: str, data: dict[str, Any]) -> int:
        if self.refuse:
            raise self.refuse.pop(0)
        self.sent.append((job_id, type_, json.loads(json.dumps(data))))
        return len(self.sent)


def test_it_carries_the_first_the_best_and_the_worst_episode_once_each() -> None:
    records = [record(0, 0.5), record(1, 1.0), record(2, -1.0), record(3, 1.0), record(4, 0.2)]
    data = transcript_event(7, records)
    assert data["step"] == 7 and data["of"] == 5
    assert [(e["episode"], e["picked"]) for e in data["episodes"]] == [(0, ["first"]), (1, ["best"]), (2, ["worst"])]
    first = data["episodes"][0]
    assert first == {"episode": 0, "picked": ["first"], "total_reward": 0.5, "finish_reason": "terminated", "error": None,
                     "sampled_tokens": 5, "rewards": [0.5],
                     "messages": [{"role": "user", "content": "prompt 0"}, {"role": "assistant", "content": "answer 0"}]}
    same = [record(0, 1.0), record(1, 1.0)]
    assert pick_episodes(same) == [(0, ["first", "best", "worst"])]
    assert pick_episodes([]) == [] and transcript_event(0, [])["episodes"] == []


def test_tool_messages_and_odd_values_become_json_text() -> None:
    call = [{"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "{\"expression\": \"2+2\"}"}}]
    data = transcript_event(1, [record(0, math.nan,
                                       {"role": "assistant", "content": None, "tool_calls": call},
                                       {"role": "tool", "name": "calculator", "content": "4"},
                                       {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]},
                                       "not a message", rewards=[math.inf, 1], sampled_tokens=True)])
    episode = data["episodes"][0]
    assert episode["total_reward"] is None and episode["rewards"] == [None, 1] and episode["sampled_tokens"] is None  # JSON has no NaN
    assert episode["messages"][0] == {"role": "assistant", "content": "", "tool_calls": json.dumps(call)}
    assert episode["messages"][1] == {"role": "tool", "content": "4", "name": "calculator"}
    assert episode["messages"][2]["content"] == "part one\ntwo"
    assert episode["messages"][3] == {"role": "", "content": "not a message"}
    json.dumps(data, allow_nan=False)


def test_a_long_message_keeps_its_head_and_tail_with_a_marker() -> None:
    text = "A" * 5000 + "Z" * 5000
    cut = cut_text(text, 300)
    assert cut.startswith("A" * 200) and cut.endswith("Z" * 100) and "[... 9,700 characters cut ...]" in cut
    assert cut_text("short", 300) == "short"
    data = transcript_event(0, [record(0, 1.0, {"role": "assistant", "content": text})])
    assert len(data["episodes"][0]["messages"][0]["content"]) < TRANSCRIPT_MESSAGE_CHARS + 60


@pytest.mark.parametrize("max_bytes", [TRANSCRIPT_EVENT_BYTES, 16 * 1024, 4 * 1024])
def test_huge_episodes_are_cut_to_the_bound(max_bytes: int) -> None:
    """Megabytes of non-ASCII text (6 bytes each as the scheduler's JSON), hundreds of turns, 64 episodes: within the bound."""
    turns = [{"role": "user" if i % 2 else "assistant", "content": f"turn {i} " + "\u00e9\U0001f600" * 50_000} for i in range(300)]
    records = [record(i, float((i + 3) % 7), *turns, error="x" * 100_000) for i in range(64)]
    data = transcript_event(3, records, max_bytes)
    assert size(data) <= max_bytes
    assert data["episodes"], "at least one episode's summary always goes"
    first = data["episodes"][0]
    assert first["episode"] == 0 and first["finish_reason"] == "terminated"
    if max_bytes == TRANSCRIPT_EVENT_BYTES:  # room for every picked episode, the first and last turns of each
        assert len(data["episodes"]) == 3
        messages = first["messages"]
        gap = [m for m in messages if "left_out" in m]
        assert len(gap) == 1 and gap[0]["left_out"] == 300 - (len(messages) - 1)
        assert messages[0]["content"].startswith("turn 0 ") and messages[-1]["content"].startswith("turn 299 ")
        assert "characters cut ...]" in messages[0]["content"]


def test_the_backend_reports_a_transcript_event() -> None:
    client = FakeClient()
    backend = ScheduledBackend(client, "job_1", say=lambda line: None)
    backend.report_transcripts(4, [record(0, 0.0), record(1, 1.0)])
    [(job_id, type_, data)] = client.sent
    assert (job_id, type_, data["step"]) == ("job_1", "transcript", 4)
    assert [e["episode"] for e in data["episodes"]] == [0, 1]


def test_a_smaller_tenant_quota_gets_a_smaller_event() -> None:
    """A 413 (the tenant's max_event_bytes is below ours): the event is cut to a quarter and sent again."""
    client = FakeClient(SchedulerError("the event is too large", 413))
    backend = ScheduledBackend(client, "job_1", say=lambda line: None)
    turns = [{"role": "assistant", "content": "y" * 5000} for _ in range(20)]
    backend.report_transcripts(0, [record(i, float(i), *turns) for i in range(4)])
    [(_, _, data)] = client.sent
    assert size(data) <= TRANSCRIPT_EVENT_BYTES // 4


@pytest.mark.parametrize("failure", [SchedulerError("the scheduler answered 503", 503), SchedulerError("job is cancelled", 409),
                                     SchedulerError("too large", 413), ConnectionRefusedError("refused")])
def test_a_failure_to_report_never_stops_the_run(failure: Exception) -> None:
    said: list[str] = []
    client = FakeClient(*[failure] * 10)
    backend = ScheduledBackend(client, "job_1", say=said.append)
    backend.report_transcripts(2, [record(0, 1.0)])  # does not raise
    assert client.sent == [] and len(said) == 1 and "could not report step 2's transcripts" in said[0]


def test_a_record_that_is_not_json_is_said_not_raised() -> None:
    said: list[str] = []
    client = FakeClient()
    backend = ScheduledBackend(client, "job_1", say=said.append)
    backend.report_transcripts(0, [{"episode": 0, "messages": [], "total_reward": 1.0, "finish_reason": 42}])  # text of it
    assert client.sent[0][2]["episodes"][0]["finish_reason"] == "42" and said == []
    backend.report_transcripts(1, [{"episode": {1, 2}, "messages": [], "total_reward": 1.0}])
    assert len(client.sent) == 1 and len(said) == 1 and "could not report step 1's transcripts" in said[0]

