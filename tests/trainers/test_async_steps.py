"""``async_steps``: what is refused and why, the pure rules of staleness, and K = 0 as the synchronous step it always was.

Runs that sample ahead through a backend that can are tested in ``tests/trainers/test_async_steps_torch.py`` (the local
TorchBackend) and ``tests/tinker_api/test_async_steps_tinker.py`` (TinkerBackend against a real Tinker endpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tinkergym.config import TrainConfig
from tinkergym.errors import ConfigError
from tinkergym.protocol.types import LossSpec
from tinkergym.trainers.async_rollouts import corrects_staleness, dropped_groups, fresh_groups, staleness_metrics

ENV = "tinker/Bandit-v0"
TINKER = {"backend": "tinker", "backend_url": "http://127.0.0.1:9"}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"async_steps": -1}, "async-steps must be 0"),
        ({"async_steps": 1, "trainer": "rloo", "old_logprobs": "sampler", **TINKER}, "REINFORCE loss has no importance ratio"),
        ({"async_steps": 1, "old_logprobs": "sampler", "sampler": "vllm", "lora_rank": 0}, "the vLLM sampler holds full weights once"),
        ({"async_steps": 1, "old_logprobs": "sampler", "sampler": "vllm", "backend": "torch", "lora_rank": 0}, "leave out --full"),
        ({"async_steps": 1, "old_logprobs": "sampler", "backend": "sharded"}, "The sharded backend"),
    ],
)
def test_config_refuses_async_steps_that_would_train_uncorrected_or_cannot_sample_ahead(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match="async-steps") as refused:
        TrainConfig(env=ENV, **settings).validate()
    assert message in str(refused.value)


def test_config_takes_async_steps_with_a_correction_from_options_and_files(tmp_path: Path) -> None:
    # the default correction: the trainer's logprobs (PPO's ratio starts at 1) with the truncated weight against the sampler's
    assert TrainConfig(env=ENV, async_steps=1, **TINKER).validate().tis_cap == 2.0
    assert TrainConfig(env=ENV, async_steps=1, tis_cap=1.5, **TINKER).validate().tis_cap == 1.5
    assert TrainConfig(env=ENV, async_steps=1, trainer="rloo", **TINKER).validate().tis_cap == 2.0
    assert TrainConfig(env=ENV, async_steps=2, old_logprobs="sampler", **TINKER).validate().tis_cap == 0.0
    assert TrainConfig(env=ENV, **TINKER).validate().tis_cap == 0.0  # a synchronous run keeps its own
    assert TrainConfig(env=ENV, async_steps=2, old_logprobs="sampler", **TINKER).validate().async_steps == 2
    assert TrainConfig(env=ENV, async_steps=1, old_logprobs="trainer", tis_cap=2.0, **TINKER).validate().async_steps == 1
    assert TrainConfig(env=ENV, async_steps=1, trainer="rloo", old_logprobs="trainer", tis_cap=2.0, **TINKER).validate().async_steps == 1
    assert TrainConfig(env=ENV).validate().async_steps == 0
    assert TrainConfig(env=ENV, async_steps=2, old_logprobs="sampler").validate().async_steps == 2  # the torch backend, implied
    assert TrainConfig(env=ENV, async_steps=2, old_logprobs="sampler", backend="torch").validate().async_steps == 2
    assert TrainConfig(env=ENV, async_steps=1, old_logprobs="sampler", backend_url="http://127.0.0.1:9").validate().async_steps == 1  # remote
    (tmp_path / "c.yaml").write_text("env: tinker/Bandit-v0\nasync-steps: 3\nold-logprobs: sampler\nbackend: tinker\nbackend-url: http://127.0.0.1:9\n")
    assert TrainConfig.load(tmp_path / "c.yaml").validate().async_steps == 3
    (tmp_path / "bad.yaml").write_text("env: tinker/Bandit-v0\nasync_steps: two\n")
    with pytest.raises(ConfigError, match="async_steps must be a whole number"):
        TrainConfig.load(tmp_path / "bad.yaml")


def test_staleness_rules() -> None:
    gaps_B = [0, 0, 1, 1, 3, 3, 2, 1]
    keep_B = fresh_groups(gaps_B, group_size=2, max_gap=2)
    assert keep_B == [True, True, True, True, False, False, True, True]  # a group trains whole or not at all
    assert fresh_groups([1, 3, 1, 1], group_size=2, max_gap=2) == [False, False, True, True], "one stale member drops its group"
    assert dropped_groups(keep_B, 2) == 1
    assert staleness_metrics(gaps_B, keep_B, 1) == {"async/version_gap_mean": 5 / 6, "async/version_gap_max": 2.0, "async/dropped_groups": 1.0}
    assert staleness_metrics([4, 4], [False, False], 1)["async/version_gap_max"] == 0.0, "nothing trained: no gap to report"
    assert corrects_staleness(LossSpec(name="ppo", old_logprobs="sampler"))
    assert corrects_staleness(LossSpec(name="importance_sampling", old_logprobs="sampler"))
    assert corrects_staleness(LossSpec(name="ppo", old_logprobs="trainer", tis_cap=2.0))
    assert corrects_staleness(LossSpec(name="reinforce", tis_cap=2.0))
    assert not corrects_staleness(LossSpec(name="ppo", old_logprobs="trainer")), "the trainer's own ratio starts at 1"
    assert not corrects_staleness(LossSpec(name="reinforce")), "REINFORCE has no ratio"


def _train(out: Path, *extra: str, model: str = "tiny") -> list[str]:
    return ["train", "--env", ENV, "--model", model, "--dtype", "float32", "--steps", "2", "--batch-size", "2", "--group-size", "2",
            "--max-new-tokens", "4", "--quiet", "--out", str(out), *extra]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--async-steps", "-1"), "-1 is not in the range x>=0"),
        (("--async-steps", "1", "--trainer", "rloo", "--old-logprobs", "sampler"), "REINFORCE loss has no importance ratio"),
        (("--async-steps", "1", "--old-logprobs", "sampler", "--sampler", "vllm", "--full"), "the vLLM sampler holds full weights once"),
    ],
)
def test_cli_refuses_async_steps_before_loading_a_model(tmp_path: Path, extra: tuple[str, ...], message: str) -> None:
    result = CliRunner().invoke(_main(), _train(tmp_path / "run", *extra, model="gpt-17"))
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not (tmp_path / "run").exists()


def test_sft_and_a_backend_without_snapshots_are_refused_with_what_to_do(tiny: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tinkergym.backends.torch.backend import TorchBackend
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    sft = CliRunner().invoke(_main(), ["train", "--trainer", "sft", "--data", str(data), "--model", tiny, "--async-steps", "1", "--quiet",
                                       "--out", str(tmp_path / "sft")])
    assert sft.exit_code == 2 and "the sft trainer reads a dataset and samples nothing" in " ".join(sft.output.split()), sft.output
    assert not (tmp_path / "sft").exists(), "refused before a model was loaded or a folder made"
    from tinkergym.backends.torch.sharded import ShardedTorchBackend
    from tinkergym.trainers.async_rollouts import check_snapshots

    check_snapshots({"policy": TorchBackend}, 2)
    with pytest.raises(ConfigError, match="ShardedTorchBackend samples and trains one after the other"):
        check_snapshots({"policy": object.__new__(ShardedTorchBackend)}, 1)


def test_async_steps_0_is_the_synchronous_step(tiny: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tinkergym.trainers.reporting import read_metrics

    default, explicit = tmp_path / "default", tmp_path / "explicit"
    for out, extra in ((default, ()), (explicit, ("--async-steps", "0"))):
        result = CliRunner().invoke(_main(), _train(out, "--lr", "1e-2", "--kl-coef", "0.1", *extra, model=tiny), catch_exceptions=False)
        assert result.exit_code == 0, result.output
    a, b = read_metrics(default / "metrics.jsonl"), read_metrics(explicit / "metrics.jsonl")
    stable = [[{k: v for k, v in r.items() if not k.startswith(("time/", "tokens/per_s"))} for r in records] for records in (a, b)]
    assert stable[0] == stable[1] and all(r["batch/trained_sequences"] > 0 for r in a)
    assert all("time/rollout_s" in r and not any(k.startswith("async/") or k == "time/rollout_wait_s" for k in r) for r in a + b)


def _main():
    from tinkergym.cli import main

    return main


class _CountingBackend:
    """A learner reduced to its version (the optimizer steps taken) and its snapshots, for the pipeline's own rules: a
    snapshot asked for is the one taken ``lag`` calls before (a sampler fleet that loads new weights late)."""

    def __init__(self, lag: int, delays: list[float]) -> None:
        self.step, self.lag, self.delays, self.taken = 0, lag, delays, []

    def info(self) -> dict[str, int]:
        return {"step": self.step}

    def sampling_snapshot(self) -> Any:
        import types

        self.taken.append(self.step)
        version = self.taken[max(0, len(self.taken) - 1 - self.lag)]
        return types.SimpleNamespace(version=version, sample=lambda request: version)

    def train(self) -> None:
        import time

        time.sleep(self.delays[self.step % len(self.delays)])
        self.step += 1


def test_no_sample_trains_more_than_k_versions_after_the_one_that_drew_it_under_random_delays() -> None:
    """Property: whatever K, rollouts at once, run length, lag of the snapshots and delays of sampling and training, every group a step
    trains was drawn at most K versions before (the rest are dropped and counted), every sample drew from the snapshot
    its rollout names, and with no lag the gap is exactly min(step, K) whenever every step trains."""
    hypothesis = pytest.importorskip("hypothesis")
    import time

    from hypothesis import strategies as st

    from tinkergym.trainers.async_rollouts import POLICY, RolloutPipeline

    @hypothesis.settings(max_examples=40, deadline=None)
    @hypothesis.given(k=st.integers(1, 4), steps=st.integers(1, 8), lag=st.integers(0, 2), workers=st.integers(1, 4),
                      delays=st.lists(st.floats(0, 0.003), min_size=1, max_size=6), sample_delays=st.lists(st.floats(0, 0.003), min_size=1, max_size=6))
    def check(k: int, steps: int, lag: int, workers: int, delays: list[float], sample_delays: list[float]) -> None:
        backend = _CountingBackend(lag, delays)

        def plan(step: int, samplers: dict[str, Any]) -> Any:
            def play() -> list[int]:
                drawn = []
                for i in range(4):  # two groups of two, each sample a call of the step's snapshot
                    time.sleep(sample_delays[(step + i) % len(sample_delays)])
                    drawn.append(samplers[POLICY].sample(None))
                return drawn
            return play

        pipeline = RolloutPipeline({POLICY: backend}, k, plan, workers=min(workers, k))
        try:
            for step in range(steps):
                rollout, waited = pipeline.take(step, steps - 1)
                assert waited >= 0 and rollout.step == step
                assert rollout.output == [rollout.versions[POLICY]] * 4, "a sample drew from another snapshot than its rollout names"
                gaps = [backend.step - v for v in rollout.output]
                keep = fresh_groups(gaps, 2, k)
                assert all(g <= k for g, kept in zip(gaps, keep) if kept) and all(g > k for g, kept in zip(gaps, keep) if not kept)
                if lag == 0:
                    assert gaps == [min(step, k)] * 4
                backend.train()
        finally:
            pipeline.close()

    check()


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_pipeline_plays_as_many_rollouts_at_once_as_it_has_workers_and_never_more(workers: int) -> None:
    """Rollouts handed over together play side by side up to ``workers`` (each waits until that many are in flight, as
    envs waiting on a slow tool would), and no more: steps come back in order with their own outputs."""
    import threading

    from tinkergym.trainers.async_rollouts import POLICY, RolloutPipeline

    backend = _CountingBackend(0, [0.0])
    lock, now, most = threading.Lock(), [0], [0]
    together = threading.Barrier(workers, timeout=30)

    def plan(step: int, samplers: dict[str, Any]) -> Any:
        def play() -> int:
            with lock:
                now[0] += 1
                most[0] = max(most[0], now[0])
            if step < workers:  # the first rollouts wait for each other: they pass only if all play at once
                together.wait()
            with lock:
                now[0] -= 1
            return step * 10
        return play

    pipeline = RolloutPipeline({POLICY: backend}, 3, plan, workers=workers)
    try:
        assert [pipeline.take(step, 5)[0].output for step in range(6)] == [0, 10, 20, 30, 40, 50]
    finally:
        pipeline.close()
    assert most[0] == workers
    with pytest.raises(ValueError, match="1 to 3 of them at once"):
        RolloutPipeline({POLICY: backend}, 3, plan, workers=4)


def test_rollouts_at_once_fit_max_episodes_in_flight_in_whole_steps() -> None:
    from tinkergym.trainers.async_rollouts import rollouts_at_once

    assert rollouts_at_once(4, 256, 64) == 4  # four steps of 64 fit in 256
    assert rollouts_at_once(4, 200, 64) == 3
    assert rollouts_at_once(2, 256, 16) == 2  # never more than K
    assert rollouts_at_once(4, 10, 64) == 1  # always one, even a step larger than the bound
    with pytest.raises(ConfigError, match="max-episodes-in-flight must be a whole number"):
        TrainConfig(env="tinker/Bandit-v0", max_episodes_in_flight=0).validate()
