"""``async_steps`` on the local torch backend: snapshots of the weights that later steps leave alone, sampled on the
rollout thread while the trainer trains, with every trained sample at most K versions old and corrected.

The run tests watch the real :class:`~tinkergym.backends.torch.backend.TorchBackend` (:class:`testkit.Watched`): every
completion a snapshot samples is recorded with its version, every training request with the version it trains, and the
trainer is held outside the backend (as a slow tool would hold it) so the sampling thread runs ahead.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from testkit import Watched, add_graded_env, check_bounded_staleness, metrics  # noqa: E402  # registered by tests/conftest.py
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig  # noqa: E402
from tinkergym.config import TrainConfig  # noqa: E402
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams  # noqa: E402
from tinkergym.trainers.session import TrainingRun  # noqa: E402


class WatchedTorch(Watched, TorchBackend):
    """The real TorchBackend, watched (:class:`testkit.Watched`)."""


def _tokens(response: Any) -> list[list[list[int]]]:
    return [[s.tokens for s in row] for row in response.sequences]


@pytest.mark.parametrize("lora_rank", [4, 0], ids=["lora", "full"])
def test_a_snapshot_samples_the_weights_it_was_taken_with_while_the_backend_trains_on(tiny: str, lora_rank: int) -> None:
    """A snapshot samples what the backend sampled when it was taken, after optimizer steps changed the backend's own
    samples, also from another thread while the backend trains; a new snapshot samples the new weights; one snapshot per
    version is made."""
    backend = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=lora_rank, lora_alpha=8.0, dtype="float32", seed=0))
    request = SampleRequest([[5, 6, 7], [9, 10]], SamplingParams(max_new_tokens=6, temperature=1.0, seed=3), num_samples=3)
    before = backend.sample(request)
    snapshot = backend.sampling_snapshot()
    assert snapshot.version == 0 and backend.sampling_snapshot() is snapshot
    train = ForwardBackwardRequest([Datum([5, 6, 7, 8, 9, 10], [0.0] + [1.0] * 5)], LossSpec("cross_entropy"))

    def step() -> None:
        backend.forward_backward(train)
        backend.optim_step(OptimParams(learning_rate=0.5 if lora_rank else 0.05))

    step()
    after = backend.sample(request)
    assert _tokens(after) != _tokens(before), "the step did not change what the backend samples"
    from_snapshot = snapshot.sample(request)
    assert _tokens(from_snapshot) == _tokens(before)
    for row, old in zip(from_snapshot.sequences, before.sequences):
        for seq, old_seq in zip(row, old):
            assert seq.logprobs == pytest.approx(old_seq.logprobs, abs=1e-6)
    assert _tokens(backend.sample(request)) == _tokens(after), "sampling the snapshot left the backend's weights as they were"

    drawn: list[Any] = []
    thread = threading.Thread(target=lambda: drawn.extend(snapshot.sample(request) for _ in range(3)))
    thread.start()
    for _ in range(3):
        step()  # trains while the other thread samples the snapshot
    thread.join(60)
    assert len(drawn) == 3 and all(_tokens(d) == _tokens(before) for d in drawn)
    newer = backend.sampling_snapshot()
    assert newer.version == backend.step == 4 and _tokens(newer.sample(request)) == _tokens(backend.sample(request))


def _config(out: Path, tiny: str, **changes: Any) -> TrainConfig:
    settings = dict(env="fake/Graded-v0", trainer="grpo", backend="torch", model=tiny, dtype="float32", lora_rank=4, steps=5, batch_size=2,
                    group_size=4, max_turns=1, max_new_tokens=6, lr=5e-2, checkpoint_every=1, transcripts_every=1, old_logprobs="sampler",
                    out=str(out))
    return TrainConfig(**{**settings, **changes})


@pytest.mark.parametrize(("k", "loss"), [(2, {"old_logprobs": "sampler"}),
                                         pytest.param(1, {"old_logprobs": "trainer", "tis_cap": 2.0}, marks=pytest.mark.slow)])
def test_every_trained_sample_is_at_most_k_versions_old_and_corrected(tiny: str, fake_site: Any, tmp_path: Path, k: int, loss: dict) -> None:
    add_graded_env(fake_site)
    out = tmp_path / "run"
    watched = WatchedTorch(TorchBackendConfig(model=tiny, lora_rank=4, dtype="float32", seed=0), delay=0.3)
    TrainingRun(_config(out, tiny, async_steps=k, **loss), backend=watched).run(progress=False)
    check_bounded_staleness(watched, out, k, steps=5)
    for step in range(5):  # every transcript names the version that sampled it: the weights of the start of step - K
        rows = [json.loads(line) for line in (out / "transcripts" / f"train_step_{step:06d}.jsonl").read_text().splitlines()]
        assert {row["policy_version"] for row in rows} == {max(0, step - k)}, step


@pytest.mark.slow
def test_full_fine_tuning_samples_ahead_from_copies_of_the_model(tiny: str, fake_site: Any, tmp_path: Path) -> None:
    add_graded_env(fake_site)
    out = tmp_path / "full"
    watched = WatchedTorch(TorchBackendConfig(model=tiny, lora_rank=0, dtype="float32", seed=0), delay=0.2)
    TrainingRun(_config(out, tiny, lora_rank=0, lr=1e-3, steps=4, async_steps=1), backend=watched).run(progress=False)
    check_bounded_staleness(watched, out, 1, steps=4)


def test_the_cli_trains_ahead_on_the_torch_backend(tiny: str, fake_site: Any, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from tinkergym.cli import main

    add_graded_env(fake_site)
    out = tmp_path / "cli"
    args = ["train", "--env", "fake/Graded-v0", "--model", tiny, "--dtype", "float32", "--lora-rank", "4", "--steps", "3", "--batch-size", "2",
            "--group-size", "2", "--max-new-tokens", "4", "--async-steps", "2", "--old-logprobs", "sampler", "--env-latency", "0.05", "--quiet", "--out", str(out)]
    done = CliRunner().invoke(main, args, catch_exceptions=False)
    assert done.exit_code == 0, done.output
    import json

    assert json.loads((out / "config.json").read_text())["env_latency"] == 0.05
    logged = [m for m in metrics(out) if m["step"] >= 0]
    assert [m["async/version_gap_max"] for m in logged] == [0.0, 1.0, 2.0]


def test_the_latency_wrapper_delays_every_step_and_changes_nothing_else() -> None:
    import time

    from gymnasium.utils.env_checker import check_env

    import tinkergym
    from tinkergym.wrappers import LatencyWrapper

    plain, slow = tinkergym.make("tinker/Bandit-v0"), LatencyWrapper(tinkergym.make("tinker/Bandit-v0"), delay=0.05, jitter=0.05, seed=1)
    check_env(slow.unwrapped)
    assert plain.reset(seed=3) == slow.reset(seed=3)
    started = time.perf_counter()
    for action in ("arm 1", "pull the second arm", "\x00??"):
        assert plain.step(action)[:4] == slow.step(action)[:4]
        plain.reset(seed=4), slow.reset(seed=4)
    assert 0.15 <= slow.waited < 0.3 and time.perf_counter() - started >= slow.waited
    with pytest.raises(ValueError, match="finite seconds"):
        LatencyWrapper(tinkergym.make("tinker/Bandit-v0"), delay=float("nan"))


def test_the_aec_latency_wrapper_delays_every_move_passes_api_test_and_changes_nothing_else() -> None:
    import random
    import time

    import tinkergym
    from tinkergym.testing import check_text_aec_env
    from tinkergym.wrappers import AECLatencyWrapper

    check_text_aec_env(AECLatencyWrapper(tinkergym.make_aec("tinker/GomokuDuel-v0", size=7), delay=0.0, jitter=0.001, seed=0))
    plain, slow = tinkergym.make_aec("tinker/GomokuDuel-v0", size=7), AECLatencyWrapper(tinkergym.make_aec("tinker/GomokuDuel-v0", size=7), delay=0.02)
    plain.reset(seed=5), slow.reset(seed=5)
    moves, rng = 0, random.Random(0)
    started = time.perf_counter()
    while plain.agents and moves < 6:
        action = rng.choice(["A1", "d4", "B2", "\x00??", "pass", "g7"])  # random text, bad moves among them
        plain.step(action), slow.step(action)
        moves += 1
        assert plain.agent_selection == slow.agent_selection and plain.rewards == slow.rewards
        assert plain.observe(plain.agent_selection) == slow.observe(slow.agent_selection)
    assert slow.waited == pytest.approx(0.02 * moves) and time.perf_counter() - started >= slow.waited


def test_env_latency_wraps_a_runs_envs_and_is_refused_where_it_cannot_apply(tmp_path: Path) -> None:
    from tinkergym.errors import ConfigError
    from tinkergym.trainers.session import env_factory
    from tinkergym.wrappers import AECLatencyWrapper, LatencyWrapper

    env = env_factory("tinker/Bandit-v0", {}, latency=0.5)()
    assert isinstance(env, LatencyWrapper) and env.delay == 0.5
    assert not isinstance(env_factory("tinker/Bandit-v0", {})(), LatencyWrapper)
    game = env_factory("tinker/GomokuDuel-v0", {"size": 7}, multi_agent=True, latency=0.5)()
    assert isinstance(game, AECLatencyWrapper) and game.delay == 0.5
    with pytest.raises(ConfigError, match="env-latency must be seconds"):
        TrainConfig(env="tinker/Bandit-v0", env_latency=-1.0).validate()


@pytest.mark.slow
def test_a_stopped_run_drops_its_rollouts_in_flight_and_resumes_without_losing_or_repeating_a_step(tiny: str, fake_site: Any,
                                                                                                    tmp_path: Path) -> None:
    import time

    class Stop(WatchedTorch):
        def optim_step(self, params: OptimParams) -> dict[str, float]:
            if self.step == 2:
                raise KeyboardInterrupt
            return super().optim_step(params)

    add_graded_env(fake_site)
    out = tmp_path / "run"
    config = TorchBackendConfig(model=tiny, lora_rank=4, dtype="float32", seed=0)
    with pytest.raises(KeyboardInterrupt):
        TrainingRun(_config(out, tiny, steps=6, async_steps=2), backend=Stop(config, delay=0.2)).run(progress=False)
    deadline = time.time() + 30
    while any(t.name.startswith("rollouts-ahead") for t in threading.enumerate()) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(t.name.startswith("rollouts-ahead") for t in threading.enumerate()), "the sampling thread outlived the run"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000000", "step_000001"]
    resumed = TrainingRun.resume(out, backend=WatchedTorch(config))
    assert resumed.start_step == 2
    resumed.run(progress=False)
    logged = [m for m in metrics(out) if m["step"] >= 0]
    assert [m["step"] for m in logged] == list(range(6)), "a step lost or repeated"
    assert [m["async/version_gap_max"] for m in logged[2:]] == [0.0, 1.0, 2.0, 2.0], "steps after the resume sample from its weights"


@pytest.mark.parametrize(("in_flight", "sets"), [(16, 2), (15, 1)])
def test_rollouts_ahead_play_side_by_side_within_max_episodes_in_flight(tiny: str, fake_site: Any, tmp_path: Path, in_flight: int, sets: int) -> None:
    """K = 2 with a slow env: two steps' rollouts (8 episodes each) play at once where 16 episodes may be in flight, each
    with envs of its own (the pool holds a set per rollout that ran at once), one at a time where 15 may; every trained
    sample stays at most K versions old either way."""
    add_graded_env(fake_site)
    out = tmp_path / "run"
    watched = WatchedTorch(TorchBackendConfig(model=tiny, lora_rank=4, dtype="float32", seed=0), delay=0.05)
    run = TrainingRun(_config(out, tiny, steps=4, async_steps=2, env_latency=0.3, max_episodes_in_flight=in_flight), backend=watched)
    run.run(progress=False)
    check_bounded_staleness(watched, out, 2, steps=4)
    assert run.ctx.env_pool is not None and run.ctx.env_pool.sets == sets


def test_a_rollout_whose_thread_dies_is_played_again_and_trains_what_it_would_have_none_twice(tiny: str, fake_site: Any,
                                                                                              tmp_path: Path) -> None:
    """K = 2: the thread playing step 1's rollout dies after its sample came back (a crash outside the episodes' env
    code). The step is played again from the same snapshot, once, so every step trains the very sequences a run without
    the crash trains, each once, and ``async/rollout_retries`` counts it; a rollout that dies twice ends the run."""

    class Dying(WatchedTorch):
        def __init__(self, *args: Any, die_at: int = 0, again: bool = False, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.die_at, self.again, self.calls = die_at, again, 0

        def sampling_snapshot(self) -> Any:
            snapshot, owner = super().sampling_snapshot(), self

            class DiesAfterSampling:
                version = snapshot.version

                def sample(self, request: SampleRequest) -> Any:
                    response = snapshot.sample(request)
                    owner.calls += 1
                    played_again = threading.current_thread() is threading.main_thread()  # the trainer's thread
                    if owner.calls == owner.die_at or (owner.again and played_again):
                        raise RuntimeError("the rollout runner died")
                    return response

            return DiesAfterSampling()

    def trained(watched: WatchedTorch) -> list[list[tuple[int, ...]]]:
        return [sorted(tuple(d.tokens) for d in request.data) for _, request in watched.trained]

    add_graded_env(fake_site)
    config = TorchBackendConfig(model=tiny, lora_rank=4, dtype="float32", seed=0)
    settings = dict(steps=5, async_steps=2, max_episodes_in_flight=8)  # one rollout at a time: the run repeats exactly
    clean = WatchedTorch(config, delay=0.1)
    TrainingRun(_config(tmp_path / "clean", tiny, **settings), backend=clean).run(progress=False)
    dying = Dying(config, delay=0.1, die_at=2)  # the second sample call: step 1's rollout, on the rollout thread
    TrainingRun(_config(tmp_path / "crash", tiny, **settings), backend=dying).run(progress=False)
    assert dying.calls == 6, "step 1's rollout was not played again (one sample call a rollout, five steps)"
    assert len(dying.trained) == 5 and trained(dying) == trained(clean), "a step lost, doubled or changed its samples"
    assert all(len(request.data) == 8 for _, request in dying.trained)
    logged = [m for m in metrics(tmp_path / "crash") if m["step"] >= 0]
    assert [m["async/rollout_retries"] for m in logged] == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert [m["async/version_gap_max"] for m in logged] == [m["async/version_gap_max"] for m in metrics(tmp_path / "clean") if m["step"] >= 0]

    twice = Dying(config, die_at=2, again=True)  # step 1's rollout dies, and so does its second play
    with pytest.raises(RuntimeError, match="the rollout runner died"):
        TrainingRun(_config(tmp_path / "twice", tiny, **settings), backend=twice).run(progress=False)
    assert [m["step"] for m in metrics(tmp_path / "twice") if m["step"] >= 0] == [0]
