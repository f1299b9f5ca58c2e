"""Tests of tinker/Math-v0, its data loading and the shipped dataset."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import gymnasium as gym
import pytest

import tinkergym
from tinkergym.errors import ConfigError
from tinkergym.testing import check_text_env
from tinkergym_math import BaselineMathAgent, MathEnv
from tinkergym_math.data import DATA_DIR, load_problems, load_split
from tinkergym_math.generate import TOPICS, generate, main as generate_main

RECORDS = [
    {"question": "What is 2 + 2?", "answer": "4"},
    {"question": "What is half of 3?", "answer": "3/2", "id": "half", "topic": "fractions"},
    {"question": "What is 10% of 5?", "answer": 0.5},
]


# ----- the shipped dataset ------------------------------------------------------------------------
def test_shipped_dataset_shape():
    train, test = load_split("train"), load_split("test")
    assert len(train) == 2250 and len(test) == 250
    assert len({p.question for p in train + test}) == 2500
    assert not {p.id for p in train} & {p.id for p in test}
    assert Counter(p.topic for p in test) == {topic: 25 for topic in TOPICS}
    assert any("/" in p.answer for p in train) and any(p.answer.startswith("-") for p in train)


def test_generator_reproduces_shipped_files_byte_for_byte(tmp_path):
    assert generate_main(["--out", str(tmp_path), "--seed", "0"]) == 0
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA_DIR / name).read_bytes(), name


def test_generator_command_line_and_other_seeds(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tinkergym_math.generate", "--out", str(tmp_path), "--seed", "3", "--per-topic", "20"],
        capture_output=True, text=True, check=True,
    )
    assert "wrote 180 problems" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert set(rows[0]) == {"id", "topic", "question", "answer"}
    assert generate(3, 20) == generate(3, 20)
    assert generate(3, 20) != generate(4, 20)


# ----- loading data -------------------------------------------------------------------------------
def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_load_jsonl_paths_and_iterables(tmp_path):
    first = _write_jsonl(tmp_path / "a.jsonl", RECORDS[:2])
    second = _write_jsonl(tmp_path / "b.jsonl", RECORDS[2:])
    assert [p.answer for p in load_problems(str(first))] == ["4", "3/2"]
    assert [p.answer for p in load_problems([first, second])] == ["4", "3/2", "0.5"]
    problems = load_problems(iter(RECORDS))
    assert [p.id for p in problems] == ["record-0", "half", "record-2"]
    assert problems[1].topic == "fractions"
    gsm = load_problems([{"question": "q?", "answer": "3 + 4 = 7\n#### 7"}])
    assert gsm[0].answer == "7"


def test_load_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "problems.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": r["question"], "answer": str(r["answer"])} for r in RECORDS]), path)
    assert [p.answer for p in load_problems(path)] == ["4", "3/2", "0.5"]
    env = MathEnv(data_files=str(path))
    obs, _ = env.reset(seed=0, options={"index": 0})
    assert obs.startswith("What is 2 + 2?")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match="bad.parquet: cannot read it as Parquet"):
        load_problems(bad)


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "p.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match="pip install pyarrow"):
        load_problems(path)


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"question": "q", "answer": "1"}\n{"question": "q2", "answer": \n', "bad.jsonl, line 2: not valid JSON"),
        ('{"question": "q", "answer": "1"}\n\n{"answer": "2"}\n', "bad.jsonl, line 3: 'question' must be non-empty text"),
        ('{"question": "q", "answer": null}\n', "bad.jsonl, line 1: 'answer' must be text or a number"),
        ('{"question": "q", "answer": "  "}\n', "line 1: 'answer' is empty"),
        ('["q", "a"]\n', "line 1: expected an object"),
        ("\n\n", "no problems found"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        MathEnv(data_files=path)


def test_bad_data_arguments(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        MathEnv(data_files=tmp_path / "missing.jsonl")
    (tmp_path / "data.csv").write_text("question,answer\n")
    with pytest.raises(ConfigError, match="unknown format .csv"):
        MathEnv(data_files=tmp_path / "data.csv")
    (tmp_path / "latin.jsonl").write_bytes(b'{"question": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        MathEnv(data_files=tmp_path / "latin.jsonl")
    with pytest.raises(ConfigError, match="data_files record 1"):
        MathEnv(data_files=[RECORDS[0], {"question": "no answer"}])
    with pytest.raises(ConfigError, match="pass a path"):
        MathEnv(data_files=42)
    with pytest.raises(ConfigError, match="split='dev'"):
        MathEnv(split="dev")


@pytest.mark.parametrize("kwargs", [{"format_reward": -0.1}, {"format_reward": 2}, {"format_reward": float("nan")}, {"format_reward": True}, {"shuffle": "yes"}, {"render_mode": "rgb"}])
def test_bad_kwargs(kwargs):
    with pytest.raises(ConfigError):
        MathEnv(**kwargs)


# ----- episodes -----------------------------------------------------------------------------------
@pytest.fixture
def env():
    return MathEnv(data_files=RECORDS)


def test_correct_answer(env):
    obs, info = env.reset(seed=0, options={"index": 1})
    assert obs == "What is half of 3?\n\nGive your final answer as \\boxed{...}."
    assert info["problem_id"] == "half" and info["index"] == 1
    assert set(info) == {"system_prompt", "problem_id", "topic", "index"}  # never the answer
    assert "\\boxed" in info["system_prompt"]
    obs, reward, terminated, truncated, info = env.step("Half of 3 is 1.5, i.e. \\boxed{\\frac{3}{2}}")
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info == {
        "problem_id": "half", "expected_answer": "3/2", "extracted_answer": "\\frac{3}{2}",
        "answer_source": "boxed", "correct": True, "is_success": True, "well_formed": True,
    }
    assert obs == "Correct. The answer is 3/2."


def test_wrong_answer_and_format_reward():
    env = MathEnv(data_files=RECORDS, format_reward=0.25)
    env.reset(seed=0, options={"index": 0})
    obs, reward, terminated, _, info = env.step("\\boxed{5}")
    assert reward == 0.25 and terminated and not info["correct"] and info["is_success"] is False  # a format bonus is no success
    assert obs == "Incorrect. You answered '5'; the expected answer was 4."
    env.reset(options={"index": 0})
    assert env.step("\\boxed{4}")[1] == 1.25
    env.reset(options={"index": 0})
    assert env.step("Answer: 4")[1] == 1.0  # correct, but not boxed: no format bonus


@pytest.mark.parametrize("action", ["", "I have no idea.", "\\boxed{", "4"])
def test_no_extractable_answer_ends_with_zero(env, action):
    env.reset(seed=0, options={"index": 0})
    obs, reward, terminated, truncated, info = env.step(action)
    assert (reward, terminated, truncated) == (0.0, True, False)
    assert "No final answer found" in obs and "\\boxed{your answer}" in obs and "expected answer was 4" in obs
    assert info["extracted_answer"] is None and info["correct"] is False


@pytest.mark.parametrize("action", [None, 12, ["x"], "A" * 20_000])
def test_non_text_or_huge_action_ends_with_zero(env, action):
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step(action)
    assert reward == 0.0 and terminated and info["invalid_action"]
    assert obs.startswith("Invalid action:")


def test_step_after_the_end(env):
    env.reset(seed=0)
    env.step("\\boxed{1}")
    obs, reward, terminated, _, _ = env.step("\\boxed{1}")
    assert terminated and reward == 0.0 and "reset()" in obs


def test_seeded_resets_are_deterministic_and_cover_the_data():
    env = MathEnv()
    first = [env.reset(seed=s)[0] for s in range(20)]
    assert first == [env.reset(seed=s)[0] for s in range(20)]
    assert len(set(first)) > 15
    env.reset(seed=1)
    unseeded = [env.reset()[1]["index"] for _ in range(5)]
    env.reset(seed=1)
    assert unseeded == [env.reset()[1]["index"] for _ in range(5)]


def test_in_order_mode_walks_the_data():
    env = MathEnv(data_files=RECORDS, shuffle=False)
    assert [env.reset(seed=0 if i == 0 else None)[1]["index"] for i in range(5)] == [0, 1, 2, 0, 1]
    assert env.reset(seed=9)[1]["index"] == 0


def test_bad_index_option(env):
    for index in (-1, 3, "0", True):
        with pytest.raises(ConfigError, match="options\\['index'\\]"):
            env.reset(options={"index": index})


def test_made_through_the_hub():
    env = gym.make("tinker/Math-v0", split="test", format_reward=0.5)
    obs, info = env.reset(seed=0)
    assert "\\boxed" in obs and info["problem_id"]
    spec = tinkergym.spec("tinker/Math-v0")
    assert spec.data == "dataset" and spec.turns == "single" and spec.distribution == "tinkergym-math"
    assert spec.baseline == "tinkergym_math.agents:BaselineMathAgent"


def test_baseline_solves_the_order_of_operations_problems():
    env = MathEnv(split="test", shuffle=False)
    solved = Counter()
    for i, problem in enumerate(env.problems):
        obs, info = env.reset(options={"index": i})
        reward = env.step(BaselineMathAgent(seed=0)(obs, info))[1]
        solved[problem.topic] += reward
    assert solved["order_of_operations"] == 25
    assert sum(solved.values()) < 60  # a plumbing baseline, not a solver


def test_conformance():
    check_text_env(MathEnv(), baseline=BaselineMathAgent)
    check_text_env(MathEnv(data_files=RECORDS, format_reward=0.1, shuffle=False), baseline=BaselineMathAgent)
    check_text_env(gym.make("tinker/Math-v0", split="test"), baseline=BaselineMathAgent)


def test_import_is_light():
    code = "import sys, tinkergym_math; print(any(m in sys.modules for m in ('torch', 'pyarrow', 'transformers')))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
