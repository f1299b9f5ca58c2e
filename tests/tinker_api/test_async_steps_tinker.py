"""``async_steps`` through a real Tinker endpoint (serve tinker on the tiny model): rollouts sampled ahead from snapshots.

The backend is the real :class:`~tinkergym.backends.tinker_client.TinkerBackend`, instrumented (:class:`WatchedTinker`):
every completion a snapshot samples is recorded with the snapshot's version, every training request with the version
it trains, and training is slowed down so the sampling thread runs ahead. From those records, not from the trainer's
own metrics, the tests check that no sample trains more than K versions after the one that drew it, that stale
samples train only with a correction, and that groups a lagging sampler makes too old are dropped.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("tinker")

from click.testing import CliRunner  # noqa: E402

from testkit import GRADED_ENV, Watched, add_graded_env, check_bounded_staleness, metrics, prompts  # noqa: E402  # registered by tests/conftest.py

from tinkergym.backends.tinker_client import TinkerBackend  # noqa: E402
from tinkergym.config import TrainConfig  # noqa: E402
from tinkergym.protocol.types import OptimParams  # noqa: E402
from tinkergym.trainers.session import TrainingRun  # noqa: E402

ENV = GRADED_ENV


@pytest.fixture
def graded(fake_site: Any) -> str:
    """``fake/Graded-v0``: random replies of the tiny model get rewards that differ within a group, so every step trains."""
    return add_graded_env(fake_site)


class WatchedTinker(Watched, TinkerBackend):
    """The real TinkerBackend, watched (:class:`testkit.Watched`)."""


def config(cluster: Any, out: Path, **changes: Any) -> TrainConfig:
    settings = dict(env=ENV, trainer="grpo", backend="tinker", backend_url=cluster.url, model=cluster.model, lora_rank=4, steps=5,
                    batch_size=2, group_size=4, max_turns=1, max_new_tokens=6, lr=5e-2, checkpoint_every=1, transcripts_every=1,
                    old_logprobs="sampler", out=str(out))
    return TrainConfig(**{**settings, **changes})


def backend(cluster: Any, who: str = "alice", **kwargs: Any) -> WatchedTinker:
    return WatchedTinker(cluster.url, cluster.keys[who], cluster.model, lora_rank=4, seed=0, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize(("trainer", "k", "loss"), [("grpo", 1, {"old_logprobs": "sampler"}), ("grpo", 2, {"old_logprobs": "trainer", "tis_cap": 2.0}),
                                                    ("rloo", 1, {"old_logprobs": "trainer", "tis_cap": 2.0})])
def test_every_trained_sample_is_at_most_k_versions_old_and_corrected(cluster: Any, graded: str, tmp_path: Path, trainer: str, k: int,
                                                                      loss: dict[str, Any]) -> None:
    watched = backend(cluster, delay=0.3)
    out = tmp_path / "run"
    TrainingRun(config(cluster, out, trainer=trainer, async_steps=k, **loss), backend=watched).run(progress=False)
    check_bounded_staleness(watched, out, k, steps=5)


@pytest.mark.slow
def test_prompts_stay_the_steps_own_and_k0_never_takes_a_snapshot(cluster: Any, graded: str, tmp_path: Path) -> None:
    sync, ahead = tmp_path / "sync", tmp_path / "ahead"
    plain = backend(cluster)
    TrainingRun(config(cluster, sync, steps=3), backend=plain).run(progress=False)
    assert plain.snapshots == [], "async_steps 0 samples as before, through the backend itself"
    assert not any(k.startswith("async/") for m in metrics(sync) for k in m)
    TrainingRun(config(cluster, ahead, steps=3, async_steps=2), backend=backend(cluster, who="bob")).run(progress=False)
    for step in range(3):
        assert prompts(sync, step) == prompts(ahead, step), f"step {step} played other prompts"
    first = [metrics(sync)[0], metrics(ahead)[0]]  # step 0 samples the same weights with the same seed either way
    assert first[0]["reward/mean"] == first[1]["reward/mean"]


@pytest.mark.slow
def test_groups_a_lagging_sampler_made_too_old_are_dropped_not_trained(cluster: Any, graded: str, tmp_path: Path) -> None:
    watched = backend(cluster, lag=2)
    out = tmp_path / "run"
    TrainingRun(config(cluster, out, steps=6, async_steps=1), backend=watched).run(progress=False)
    logged = [m for m in metrics(out) if m["step"] >= 0]
    assert sum(m["async/dropped_groups"] for m in logged) > 0, "the lagging sampler made no group too old"
    for version, request in watched.trained:
        for datum in request.data:
            assert version - watched.sampled_version(datum.tokens)[0] <= 1
    for m in logged:
        if m["async/dropped_groups"] == 2:  # every group of the step was too old: nothing trained, the step took no update
            assert m["batch/trained_sequences"] == 0 and "grad_norm" not in m
        assert m["async/version_gap_max"] <= 1


@pytest.mark.slow
def test_cli_async_steps_resumes_with_the_setting_and_refuses_to_change_it(cluster: Any, graded: str, tmp_path: Path) -> None:
    from tinkergym.cli import main

    key = tmp_path / "key"
    key.write_text(cluster.keys["alice"])
    key.chmod(0o600)
    out = tmp_path / "run"
    args = ["train", "--env", ENV, "--backend", "tinker", "--backend-url", cluster.url, "--backend-token-file", str(key), "--model", cluster.model,
            "--lora-rank", "4", "--steps", "2", "--batch-size", "2", "--group-size", "4", "--max-turns", "1", "--max-new-tokens", "4",
            "--checkpoint-every", "1", "--quiet", "--out", str(out), "--async-steps", "1"]
    done = CliRunner().invoke(main, args, catch_exceptions=False)  # the default correction: the trainer's logprobs, --tis-cap 2
    assert done.exit_code == 0, done.output
    saved = json.loads((out / "config.json").read_text())
    assert (saved["async_steps"], saved["old_logprobs"], saved["tis_cap"]) == (1, "trainer", 2.0)
    changed = CliRunner().invoke(main, ["train", "--resume", str(out), "--steps", "3", "--async-steps", "0", "--backend-token-file", str(key)])
    assert changed.exit_code == 2 and "--async-steps (from 1 to 0)" in changed.output, changed.output
    more = CliRunner().invoke(main, ["train", "--resume", str(out), "--steps", "3", "--backend-token-file", str(key), "--quiet"], catch_exceptions=False)
    assert more.exit_code == 0, more.output
    logged = [m for m in metrics(out) if m["step"] >= 0]
    assert [m["step"] for m in logged] == [0, 1, 2] and all("async/version_gap_max" in m for m in logged)
    assert logged[2]["async/version_gap_max"] == 0, "a resume samples its first steps again from the checkpoint's weights"


@pytest.mark.slow
def test_a_stopped_run_drops_its_rollouts_in_flight_and_resumes_from_its_checkpoint(cluster: Any, graded: str, tmp_path: Path) -> None:
    class Stop(WatchedTinker):
        def optim_step(self, params: OptimParams) -> dict[str, float]:
            if self.step == 2:
                raise KeyboardInterrupt
            return super().optim_step(params)

    out = tmp_path / "run"
    stopped = Stop(cluster.url, cluster.keys["bob"], cluster.model, lora_rank=4, seed=0, delay=0.2)
    with pytest.raises(KeyboardInterrupt):
        TrainingRun(config(cluster, out, steps=6, async_steps=2), backend=stopped).run(progress=False)
    deadline = time.time() + 30
    while any(t.name.startswith("rollouts-ahead") for t in threading.enumerate()) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(t.name.startswith("rollouts-ahead") for t in threading.enumerate()), "the sampling thread outlived the run"
    stopped.close()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000000", "step_000001"]
    resumed = TrainingRun.resume(out, backend=backend(cluster, who="bob"))
    assert resumed.start_step == 2
    resumed.run(progress=False)
    logged = [m for m in metrics(out) if m["step"] >= 0]
    assert [m["step"] for m in logged] == list(range(6))
    assert [m["async/version_gap_max"] for m in logged[2:]] == [0.0, 1.0, 2.0, 2.0], "steps after the resume sample from its weights"


DUEL = "fake/VowelDuel-v0"
VOWEL_DUEL = '''
from tinkergym import TextAECEnv

class VowelDuel(TextAECEnv):
    """Each player says one thing; each is paid the share of vowels in what it said (so games differ in reward)."""

    metadata = {**TextAECEnv.metadata, "tinkergym": {"data": "free", "turns": "multi", "agents": 2}}

    def _reset_game(self, options):
        self.said = {}
        return "player_0"

    def _observe(self, agent):
        return f"round {int(self.np_random.integers(100))}: say something"

    def _play(self, agent, action):
        self.said[agent] = sum(c in "aeiou" for c in action.lower()) / max(len(action), 1)
        return dict(self.said) if len(self.said) == 2 else None
'''
DUEL_MANIFEST = '''
["fake/VowelDuel-v0"]
kind = "aec"
agents = 2
turns = "multi"
'''


@pytest.mark.slow
def test_selfplay_plays_ahead_from_snapshots_within_k_versions(cluster: Any, fake_site: Any, tmp_path: Path) -> None:
    import tinkergym

    fake_site.add("fakeenv-duel", {DUEL: "fakeenv_duel:VowelDuel"}, module_code=VOWEL_DUEL, manifest=DUEL_MANIFEST)
    tinkergym.register_installed_envs(refresh=True)
    watched = backend(cluster, who="bob", delay=0.2)
    out = tmp_path / "duel"
    settings = config(cluster, out, env=DUEL, trainer="selfplay", opponents="random", steps=4, batch_size=2, group_size=4, max_turns=1,
                      max_new_tokens=4, async_steps=1)
    TrainingRun(settings, backend=watched).run(progress=False)
    trained = [(version, datum) for version, request in watched.trained for datum in request.data]
    assert len({version for version, _ in trained}) >= 3, "the learner hardly trained"
    for version, datum in trained:  # every move of a trained game came from one snapshot, at most K versions back
        drawn = {v for key, (v, _) in watched.sampled.items() if tuple(datum.tokens[: len(key)]) == key}
        assert len(drawn) == 1 and 0 <= version - drawn.pop() <= 1
    logged = [m for m in metrics(out) if m["step"] >= 0]
    assert all(m["async/version_gap_max"] <= 1 and m["async/dropped_groups"] == 0 and m["selfplay/games"] == 8 for m in logged)
    assert logged[0]["async/version_gap_max"] == 0 and max(m["async/version_gap_max"] for m in logged) == 1


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tinker", "scheduled"])  # torch, remote: the async path itself is tests/trainers/test_async_steps*.py's
def test_the_async_rollouts_benchmark_runs_quick(backend: str) -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "async_rollouts.py"
    done = subprocess.run([sys.executable, str(script), "--quick", "--json", "--backend", backend, "--env-latency", "0.05"], capture_output=True,
                          text=True, timeout=900, cwd=script.parents[1])
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["backend"] == backend and result["env_latency"] == 0.05
    assert set(result["by_k"]) == {"0", "1"} and all(result["by_k"][k]["steps_per_hour"] > 0 for k in ("0", "1"))
    assert all(0 <= result["by_k"][k]["idle_fraction"] <= 1.0 + 1e-9 for k in ("0", "1"))
    assert [r["k"] for r in result["runs"]] == [0, 1] and all(len(r["reward"]) == 2 for r in result["runs"])
    assert result["by_k"]["0"]["version_gap"] == 0 and result["by_k"]["1"]["version_gap"] <= 1
