"""``tinkergym jobs logs`` prints a ``transcript`` event (tens of KiB of messages) and a ``metrics`` event (a step's tens of
numbers) as one short summary line each."""

from __future__ import annotations

import json

from tinkergym.backends.scheduled import transcript_event
from tinkergym.cli.jobs.queue import event_line


def _records(rewards: list[float]) -> list[dict]:
    long_text = "x" * 10_000  # cut to 2000 characters in the event, still far too long for one line
    return [
        {"episode": i, "messages": [{"role": "system", "content": long_text}, {"role": "user", "content": long_text},
                                    {"role": "assistant", "content": long_text}],
         "rewards": [r], "total_reward": r, "finish_reason": "stop", "error": None, "sampled_tokens": 12}
        for i, r in enumerate(rewards)
    ]


def test_a_transcript_event_is_one_short_line_naming_the_step_and_rewards() -> None:
    data = transcript_event(6, _records([0.25, -0.5, 0.9, 0.0]))
    assert len(json.dumps(data)) > 5_000  # the event is large: printing its JSON would flood the terminal
    line = event_line({"seq": 9, "type": "transcript", "data": data, "created_at": 1_700_000_000.0})
    assert len(line) < 200 and "\n" not in line
    assert "transcript" in line
    assert "step 6: 3 of 4 episodes" in line
    assert "first 0.25" in line and "best 0.9" in line and "worst -0.5" in line


def test_an_episode_picked_twice_is_named_once() -> None:
    line = event_line({"type": "transcript", "data": transcript_event(2, _records([1.0, 0.0])), "created_at": 0.0})
    assert "step 2: 2 of 2 episodes: first+best 1, worst 0" in line


def test_other_events_and_odd_transcript_data_print_their_json() -> None:
    assert event_line({"type": "metrics", "data": {"reward": 0.5}, "created_at": 0.0}).endswith('{"reward":0.5}')
    assert event_line({"type": "transcript", "data": {"note": "old"}, "created_at": 0.0}).endswith('{"note":"old"}')


def test_a_metrics_event_is_its_steps_key_numbers_in_one_line() -> None:
    data = {"step": 6, "reward/mean": 0.625, "loss": 0.01234567, "eval/reward_mean": 0.5, "eval/success_rate": 0.25,
            **{f"time/phase_{i}_s": 0.1 * i for i in range(16)}}
    line = event_line({"type": "metrics", "data": data, "created_at": 0.0})
    assert line.endswith("metrics     step 6: reward 0.625, loss 0.01235, eval reward 0.5, eval success 25.0% (--json for all 21 numbers)")
    assert "time/" not in line and "{" not in line
