"""TinkerBackend: tinkergym's Backend protocol through the tinker SDK equals the same LoRA session run locally, call for
call and metric for metric, for every loss a trainer sends; and `tinkergym train --backend tinker` trains through it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("tinker")

from click.testing import CliRunner  # noqa: E402

from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams  # noqa: E402

ROWS = [list(range(5, 21)), [7, 3, 9, 11, 40, 41, 42, 43, 44], list(range(100, 112)), [9, 8, 7, 6, 5]]
PROMPT = 4  # the first tokens of each row are its prompt


def local_session(cluster: Any, rank: int, seed: int) -> Any:
    """The same adapter the endpoint makes for a LoRA training client of this rank and seed, opened in-process."""
    from tinkergym.backends.torch.shared import LoraSessionConfig

    return cluster.base.open_session(LoraSessionConfig(lora_rank=rank, lora_alpha=32.0, seed=seed))


def batch(scored: list[list[float]], rng: np.random.Generator, spec: LossSpec) -> ForwardBackwardRequest:
    data = []
    for tokens, lp in zip(ROWS, scored):
        n = len(tokens)
        mask = [0.0] * PROMPT + [1.0] * (n - PROMPT)
        sampled = [0.0] + list(np.asarray(lp[1:]) + rng.uniform(-0.4, 0.4, n - 1))  # a sampler whose numerics differ
        advantages = list(np.repeat(rng.normal(0, 1), n))
        data.append(Datum(tokens=tokens, loss_mask=mask, advantages=advantages, sampling_logprobs=sampled))
    return ForwardBackwardRequest(data=data, loss=spec)


SPECS = {
    "cross_entropy-token": LossSpec(name="cross_entropy"),
    "cross_entropy-sequence": LossSpec(name="cross_entropy", aggregation="sequence"),
    "reinforce": LossSpec(name="reinforce"),
    "reinforce-tis": LossSpec(name="reinforce", tis_cap=1.2),
    "importance_sampling": LossSpec(name="importance_sampling"),
    "ppo": LossSpec(name="ppo", clip_low=0.2, clip_high=0.28),
    "ppo-trainer": LossSpec(name="ppo", old_logprobs="trainer"),  # on policy: one cross-entropy pass, no forward first
    "importance_sampling-trainer-sequence": LossSpec(name="importance_sampling", old_logprobs="trainer", aggregation="sequence"),
    "ppo-trainer-tis-scaled": LossSpec(name="ppo", old_logprobs="trainer", tis_cap=1.5, loss_scale=0.5),
}


@pytest.mark.parametrize("case", list(SPECS))
def test_calls_equal_a_local_session_metric_for_metric(cluster: Any, case: str) -> None:
    from tinkergym.backends.tinker_client import TinkerBackend

    remote = TinkerBackend(cluster.url, cluster.keys["alice"], cluster.model, lora_rank=8, seed=21)
    local = local_session(cluster, 8, 21)
    try:
        np.testing.assert_allclose(np.concatenate([np.asarray(r) for r in remote.logprobs(ROWS)]),
                                   np.concatenate([np.asarray(r) for r in local.logprobs(ROWS)]), atol=1e-5)
        rng = np.random.default_rng(4)
        params = OptimParams(learning_rate=5e-2, max_grad_norm=1.0)
        for _ in range(2):
            request = batch(local.logprobs(ROWS), rng, SPECS[case])
            here, there = local.forward_backward(request).metrics, remote.forward_backward(request).metrics
            assert set(here) == set(there), (sorted(here), sorted(there))
            for key in here:
                assert there[key] == pytest.approx(here[key], rel=2e-4, abs=1e-6), key
            stepped_here, stepped_there = local.optim_step(params), remote.optim_step(params)
            assert stepped_there["grad_norm"] == pytest.approx(stepped_here["grad_norm"], rel=2e-4)
        np.testing.assert_allclose(np.concatenate([np.asarray(r) for r in remote.logprobs(ROWS)]),
                                   np.concatenate([np.asarray(r) for r in local.logprobs(ROWS)]), atol=1e-4)
        asked = SampleRequest(prompts=[r[:PROMPT] for r in ROWS[:2]], num_samples=2, params=SamplingParams(max_new_tokens=5, seed=3))
        sampled = remote.sample(asked)
        # one Tinker request per prompt, each seeded with its group's seed: the tokens a local request draws
        assert [[s.tokens for s in row] for row in sampled.sequences] == [[s.tokens for s in row] for row in local.sample(asked).sequences]
        for prompt, sequences in zip(ROWS[:2], sampled.sequences):
            for seq in sequences:  # the sampler holds the current weights: its logprobs are the trainer's
                np.testing.assert_allclose(seq.logprobs, local.logprobs([prompt[:PROMPT] + seq.tokens])[0][PROMPT:], atol=1e-4)
    finally:
        cluster.base.close_session(local)
        remote.close()


def test_what_tinker_cannot_express_is_refused(cluster: Any) -> None:
    from tinkergym.backends.tinker_client import TinkerBackend
    from tinkergym.errors import ConfigError

    with pytest.raises(ConfigError, match="does not offer the model 'nope'"):
        TinkerBackend(cluster.url, cluster.keys["alice"], "nope", lora_rank=8)
    remote = TinkerBackend(cluster.url, cluster.keys["alice"], cluster.model, lora_rank=8)
    try:
        request = batch(remote.logprobs(ROWS), np.random.default_rng(0), LossSpec(name="ppo", kl_coef=0.1))
        with pytest.raises(ConfigError, match="put the KL penalty into the reward"):
            remote.forward_backward(request)
        with pytest.raises(ConfigError, match="temperature 1"):
            remote.logprobs(ROWS, temperature=0.7)
    finally:
        remote.close()


@pytest.mark.slow
def test_train_cli_runs_grpo_and_resumes_through_a_tinker_endpoint(cluster: Any, tmp_path: Path) -> None:
    from tinkergym.cli import main

    key = tmp_path / "key"
    key.write_text(cluster.keys["alice"])
    key.chmod(0o600)
    out = tmp_path / "run"
    args = ["train", "--env", "tinker/Bandit-v0", "--trainer", "grpo", "--backend", "tinker", "--backend-url", cluster.url,
            "--backend-token-file", str(key), "--model", cluster.model, "--lora-rank", "4", "--steps", "2", "--batch-size", "2",
            "--group-size", "4", "--max-new-tokens", "4", "--checkpoint-every", "1", "--out", str(out)]
    done = CliRunner().invoke(main, args, catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert [r["step"] for r in metrics(out) if "reward/mean" in r] == [0, 1]
    state = json.loads(next(out.glob("checkpoints/*/tinker_state.json")).read_text())
    assert state["path"].startswith("tinker://") and "/weights/" in state["path"]
    assert "/external_weights/" in json.loads((out / "final" / "tinker_export.json").read_text())["path"]
    exported = json.loads((out / "final" / "adapter_config.json").read_text())  # the adapter itself, downloaded
    assert exported["r"] == 4 and (out / "final" / "adapter_model.safetensors").stat().st_size > 0
    more = CliRunner().invoke(main, ["train", "--resume", str(out), "--steps", "3", "--backend-token-file", str(key)], catch_exceptions=False)
    assert more.exit_code == 0, more.output
    assert [r["step"] for r in metrics(out) if "reward/mean" in r] == [0, 1, 2]


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_train_cli_sft_loss_falls_through_a_tinker_endpoint(cluster: Any, tmp_path: Path) -> None:
    from tinkergym.cli import main

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}) + "\n"
                            for w in ("red", "green", "blue", "red")))
    args = ["train", "--trainer", "sft", "--data", str(data), "--backend", "tinker", "--backend-url", cluster.url, "--model", cluster.model,
            "--lora-rank", "8", "--steps", "6", "--batch-size", "4", "--lr", "2e-2", "--quiet", "--out", str(tmp_path / "sft")]
    done = CliRunner(env={"TINKER_API_KEY": cluster.keys["bob"]}).invoke(main, args, catch_exceptions=False)
    assert done.exit_code == 0, done.output
    losses = [r["loss"] for r in metrics(tmp_path / "sft") if r.get("step", -1) >= 0 and "loss" in r]
    assert len(losses) == 6 and losses[-1] < 0.7 * losses[0], losses


@pytest.mark.slow
def test_one_lora_job_gives_one_result_locally_on_a_whole_server_on_a_seat_and_through_the_tinker_api(cluster: Any, tiny: str,
                                                                                                       tmp_path: Path) -> None:
    """The same GRPO run (config, seed) in four places: a local TorchBackend, `serve backend`, a seat (an adapter of
    `serve shared`) and `train --backend tinker` against `serve tinker`: the same metrics, step for step (float32)."""
    from testkit import serving

    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig
    from tinkergym.cli import main
    from tinkergym.serve.auth import token_digest
    from tinkergym.serve.training.app import create_app
    from tinkergym.serve.training.shared import create_shared_app

    rank, alpha, seed = 4, 32.0, 5  # Tinker's LoRA has alpha 32
    # A server's adapter is set where it starts; the client names it for a local run and for the Tinker API (alpha 32 there).
    run = ["train", "--env", "tinker/Bandit-v0", "--trainer", "grpo", "--seed", str(seed), "--steps", "4", "--batch-size", "2",
           "--group-size", "4", "--max-new-tokens", "6", "--lr", "3e-2", "--quiet"]

    def token(name: str, text: str) -> str:
        path = tmp_path / name
        path.write_text(text)
        path.chmod(0o600)
        return str(path)

    def train(place: str, *extra: str) -> list[dict[str, Any]]:
        done = CliRunner().invoke(main, [*run, *extra, "--out", str(tmp_path / place)], catch_exceptions=False)
        assert done.exit_code == 0, done.output
        return metrics(tmp_path / place)

    server_token = "s" * 40
    runs = {"local": train("local", "--model", tiny, "--dtype", "float32", "--lora-rank", str(rank), "--lora-alpha", str(alpha))}
    whole = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=rank, lora_alpha=alpha, dtype="float32", seed=seed))
    with serving(create_app(whole, run_dir=tmp_path / "server", token_digest=token_digest(server_token))) as url:
        runs["server"] = train("server", "--backend-url", url, "--backend-token-file", token("server.token", server_token))
    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32"))
    with serving(create_shared_app(base, run_dir=tmp_path / "shared", token_digest=token_digest(server_token))) as url:
        import httpx

        opened = httpx.post(f"{url}/v1/adapters", headers={"Authorization": f"Bearer {server_token}"},
                            json={"lora_rank": rank, "lora_alpha": alpha, "seed": seed}).json()
        runs["seat"] = train("seat", "--backend-url", url, "--backend-token-file", token("seat.token", opened["token"]))
    runs["tinker"] = train("tinker", "--backend", "tinker", "--backend-url", cluster.url, "--model", cluster.model, "--lora-rank", str(rank),
                           "--backend-token-file", token("tinker.key", cluster.keys["alice"]))

    def steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in records if r.get("step", -1) >= 0 and "reward/mean" in r]

    def stable(record: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in record.items() if not k.startswith(("time/", "tokens/per_s", "memory/"))}

    local = [stable(r) for r in steps(runs["local"])]
    assert [r["step"] for r in local] == [0, 1, 2, 3] and any("grad_norm" in r for r in local), local
    for place, records in runs.items():
        theirs = [stable(r) for r in steps(records)]
        assert [sorted(r) for r in theirs] == [sorted(r) for r in local], place
        for mine, other in zip(local, theirs):
            for key, value in mine.items():
                if isinstance(value, float) or isinstance(other[key], float):
                    assert other[key] == pytest.approx(value, rel=1e-4, abs=1e-4), (place, mine["step"], key)
                else:
                    assert other[key] == value, (place, mine["step"], key)
