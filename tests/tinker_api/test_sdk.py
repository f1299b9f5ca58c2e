"""The official ``tinker`` SDK (0.38) against tinkergym's Tinker API on the tiny model: training, sampling, resume,
every built-in loss against its documented definition, custom losses, and tenants kept apart."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")
pytest.importorskip("sqlalchemy")

import torch  # noqa: E402
from tinker import types  # noqa: E402

from tinkergym.tinker_api.service import TinkerError  # noqa: E402



def datum(tokens: list[int], **inputs: Any) -> Any:
    """A Tinker datum of ``tokens`` as the SDK's docs build them: input all but the last, targets all but the first."""
    n = len(tokens) - 1
    fields = {"target_tokens": tokens[1:], **{k: (v if len(v) == n else v[1:]) for k, v in inputs.items()}}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=fields)


SEQUENCES = [list(range(5, 21)), [7, 3, 9, 11, 40, 41, 42, 43, 44], list(range(100, 112))]


def sft_batch() -> list[Any]:
    return [datum(s, weights=[0.0] * 4 + [1.0] * (len(s) - 4)) for s in SEQUENCES]


def logprobs_of(training: Any, data: list[Any]) -> list[np.ndarray]:
    out = training.forward(data, "cross_entropy").result()
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def test_capabilities_and_a_lora_run_whose_loss_falls(cluster: Any, connect: Any) -> None:
    service = connect()
    models = service.get_server_capabilities().supported_models
    assert [m.model_name for m in models] == [cluster.model] and models[0].trainable and models[0].sampleable
    training = service.create_lora_training_client(base_model=cluster.model, rank=8).result()
    info = training.get_info()
    assert info.lora_rank == 8 and info.model_data.model_name == cluster.model
    assert training.get_tokenizer().encode("hello")  # the tokenizer the server names loads
    batch = sft_batch()
    losses = []
    for _ in range(8):
        fb = training.forward_backward(batch, "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=2e-2))  # submitted before the first result is read
        losses.append(fb.result().metrics["loss:sum"])
        assert step.result().metrics["grad_norm:mean"] > 0
    assert losses[-1] < 0.5 * losses[0], losses
    # loss:sum is the weighted NLL summed over tokens (no mean): the forward's own logprobs give it back
    out = training.forward(batch, "cross_entropy").result()
    summed = sum(float(-(o["logprobs"].to_numpy() * np.asarray(d.loss_fn_inputs["weights"].to_numpy())).sum())
                 for o, d in zip(out.loss_fn_outputs, batch))
    assert out.metrics["loss:sum"] == pytest.approx(summed, rel=1e-5)


def trained_client(service: Any, model: str, seed: int, steps: int = 2) -> Any:
    """A rank-4 LoRA training client after ``steps`` SFT steps on :func:`sft_batch` (its adapter's B factors no longer zero)."""
    training = service.create_lora_training_client(base_model=model, rank=4, seed=seed).result()
    for _ in range(steps):
        training.forward_backward(sft_batch(), "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=2e-2))
    return training


def test_sampler_logprobs_equal_compute_logprobs_and_the_trainers(cluster: Any, connect: Any) -> None:
    service = connect()
    training = trained_client(service, cluster.model, seed=3)
    path = training.save_weights_for_sampler("after-two").result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/after-two")
    sampler = service.create_sampling_client(model_path=path)
    prompt = [5, 6, 7, 8, 9]
    response = sampler.sample(types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)).result()
    assert len(response.sequences) == 3 and len({s.sequence_id for s in response.sequences}) == 3
    for seq in response.sequences:
        full = prompt + seq.tokens
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
        assert scored[0] is None
        np.testing.assert_allclose(scored[len(prompt):], seq.logprobs, atol=1e-4)
        trainer = logprobs_of(training, [datum(full, weights=[1.0] * len(full))])[0]
        np.testing.assert_allclose(trainer[len(prompt) - 1:], seq.logprobs, atol=1e-4)
    # the same seed samples the same tokens; a snapshot does not follow later training
    again = sampler.sample(types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in response.sequences]


def test_the_servers_metrics_count_its_calls_tokens_and_routes(cluster: Any, connect: Any) -> None:
    import testkit

    training = connect().create_lora_training_client(base_model=cluster.model, rank=4).result()
    training.forward_backward(sft_batch(), "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2, types.SamplingParams(max_tokens=3)).result()
    testkit.check_training_metrics(cluster.metrics.render().decode(), "tinker", route="/api/v1/forward_backward", calls=1)


def test_async_interface(cluster: Any, connect: Any) -> None:
    async def main() -> tuple[float, float, list[float | None]]:
        service = connect()
        training = await service.create_lora_training_client(base_model=cluster.model, rank=8)
        first = await training.forward_backward(sft_batch(), "cross_entropy")
        await training.optim_step(types.AdamParams(learning_rate=2e-2))
        second = await training.forward_backward(sft_batch(), "cross_entropy")
        sampler = await training.save_weights_and_get_sampling_client()
        scored = await sampler.compute_logprobs(types.ModelInput.from_ints(SEQUENCES[0]))
        return first.metrics["loss:sum"], second.metrics["loss:sum"], scored

    first, second, scored = asyncio.run(main())
    assert second < first and scored[0] is None and all(isinstance(v, float) for v in scored[1:])


def test_resume_with_optimizer_state_continues_as_if_never_stopped(cluster: Any, connect: Any) -> None:
    service = connect()
    adam = types.AdamParams(learning_rate=2e-2)
    first = service.create_lora_training_client(base_model=cluster.model, rank=8, seed=5).result()
    for _ in range(2):
        first.forward_backward(sft_batch(), "cross_entropy")
        first.optim_step(adam)
    state = first.save_state("mid").result().path
    assert "/weights/mid" in state
    for _ in range(2):
        first.forward_backward(sft_batch(), "cross_entropy")
        first.optim_step(adam).result()
    straight = logprobs_of(first, sft_batch())

    resumed = service.create_training_client_from_state_with_optimizer(state).result()
    weights_only = service.create_training_client_from_state(state).result()
    for client in (resumed, weights_only):
        for _ in range(2):
            client.forward_backward(sft_batch(), "cross_entropy")
            client.optim_step(adam).result()
    for a, b in zip(straight, logprobs_of(resumed, sft_batch())):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # without the Adam moments the run goes elsewhere: the test can tell the two apart
    assert max(float(np.abs(a - b).max()) for a, b in zip(straight, logprobs_of(weights_only, sft_batch()))) > 1e-3
    runs = tinker.RestClient(base_url=cluster.url, api_key=cluster.keys["alice"]).list_checkpoints(first.model_id).result().checkpoints
    assert {c.checkpoint_id for c in runs} >= {"weights/mid"}


def test_a_finished_session_frees_its_runs_and_samplers(cluster: Any) -> None:
    before = len(cluster.base.sessions)
    with cluster.client() as service:
        training = service.create_lora_training_client(base_model=cluster.model, rank=4).result()
        training.save_weights_and_get_sampling_client().result()
        assert len(cluster.base.sessions) == before + 2  # the run's adapter and the sampler's snapshot
    assert len(cluster.base.sessions) == before
    gone = httpx.get(f"{cluster.url}/api/v1/training_runs/{training.model_id}", headers={"X-API-Key": cluster.keys["alice"]})
    assert gone.status_code == 404


def test_a_finish_sent_again_answers_as_the_first_and_only_to_its_tenant(cluster: Any) -> None:
    """The SDK sends a finish again when its first answer does not come in time (a session whose jobs take long to end): the
    session is ended by then, and the retry must not fail the client's close. Another tenant learns nothing of it."""
    def post(who: str, route: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(cluster.url + route, json=body, headers={"X-API-Key": cluster.keys[who]}, timeout=30)

    session = post("alice", "/api/v1/create_session", {"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}).json()["session_id"]
    finish, reason = f"/api/v1/sessions/{session}/finish", {"reason": {"type": "success"}, "detail": None}
    assert post("bob", finish, reason).status_code == 404  # not bob's to end
    assert session in cluster.service.sessions
    assert [post("alice", finish, reason).status_code for _ in range(2)] == [200, 200]
    assert session not in cluster.service.sessions
    assert post("alice", "/api/v1/session_heartbeat", {"session_id": session}).status_code == 410
    assert post("bob", finish, reason).status_code == 404  # an ended session is still not bob's
    assert post("alice", "/api/v1/sessions/session-0123456789abcdef/finish", reason).status_code == 404  # never opened
    for hostile in ("%00", "a%00b", "x" * 5000, "%ED%A0%80", "..%2F..%2Fetc"):  # a NUL, a huge id, a lone surrogate, a path with ..
        answer = post("alice", f"/api/v1/sessions/{hostile}/finish", reason).status_code  # a NUL is refused at the door (400)
        assert answer == (400 if "%00" in hostile else 404), (hostile, answer)
    assert httpx.post(cluster.url + finish, json=reason, timeout=30).status_code == 401  # no key


# ----- losses ------------------------------------------------------------------------------------------------------
def reference_loss(name: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    """Each loss as the Tinker docs define it (elementwise), written here apart from the server's."""
    if name == "cross_entropy":
        return -lp * inputs["weights"]
    q, adv = inputs["logprobs"], inputs["advantages"]
    ratio = torch.exp(lp - q)
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if name == "importance_sampling":
        return -ratio * adv
    if name == "ppo":
        return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)
    if name == "cispo":
        return -torch.clamp(ratio, low, high).detach() * lp * adv
    if name == "dro":
        return -(lp * adv - 0.5 * config.get("beta", 0.05) * (lp - q) ** 2)
    if name == "gspo":
        mask = inputs["sequence_ratio_mask"] != 0
        seq_ratio = torch.exp((lp.detach() - q)[mask].mean())
        token_ratio = seq_ratio * torch.exp(lp - lp.detach())
        return -torch.minimum(token_ratio * adv, torch.clamp(token_ratio, low, high) * adv)
    raise AssertionError(name)


LOSS_CASES = [("cross_entropy", {}), ("importance_sampling", {}), ("ppo", {}), ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
              ("cispo", {}), ("dro", {"beta": 0.3}), ("gspo", {})]


def rl_batch(name: str, current: list[np.ndarray], rng: np.random.Generator) -> list[Any]:
    """RL data whose sampler logprobs differ from the learner's by up to +-0.5 (so clipping bites) and mixed-sign advantages."""
    batch = []
    for tokens, lp in zip(SEQUENCES, current):
        n = len(tokens) - 1
        if name == "cross_entropy":
            batch.append(datum(tokens, weights=list(rng.uniform(0, 1, n))))
            continue
        inputs = {"logprobs": list(lp + rng.uniform(-0.5, 0.5, n)), "advantages": list(rng.normal(0, 1, n) * (np.arange(n) >= 3))}
        if name == "gspo":
            inputs["sequence_ratio_mask"] = list((np.arange(n) >= 3).astype(float))
        batch.append(datum(tokens, **inputs))
    return batch


# Adam with a huge eps is plain gradient descent (step = lr * g / eps): weights after one step show the gradient itself.
LINEAR_ADAM = types.AdamParams(learning_rate=50.0, eps=1e4, beta1=0.9, beta2=0.999)


@pytest.mark.parametrize("name,config", LOSS_CASES, ids=[f"{n}{'-config' if c else ''}" for n, c in LOSS_CASES])
def test_each_loss_equals_its_definition_in_value_and_gradient(cluster: Any, connect: Any, name: str, config: dict[str, float]) -> None:
    service = connect()
    builtin = service.create_lora_training_client(base_model=cluster.model, rank=4, seed=9).result()
    custom = service.create_lora_training_client(base_model=cluster.model, rank=4, seed=9).result()
    batch = rl_batch(name, logprobs_of(builtin, sft_batch()), np.random.default_rng(1))
    out = builtin.forward_backward(batch, name, loss_fn_config=config or None).result()
    total = 0.0
    for d, o in zip(batch, out.loss_fn_outputs):
        inputs = {k: torch.tensor(v.to_numpy(), dtype=torch.float32) for k, v in d.loss_fn_inputs.items() if k != "target_tokens"}
        expected = reference_loss(name, torch.tensor(o["logprobs"].to_numpy()), inputs, config)
        np.testing.assert_allclose(o["elementwise_loss"].to_numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
        total += float(expected.sum())
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-6)

    def the_reference(data: list[Any], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        parts = [reference_loss(name, lp, {k: torch.tensor(v.to_numpy(), dtype=torch.float32) for k, v in d.loss_fn_inputs.items()
                                           if k != "target_tokens"}, config).sum() for d, lp in zip(data, logprobs)]
        return torch.stack(parts).sum(), {}

    assert custom.forward_backward_custom(batch, the_reference).result().metrics["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-6)
    builtin.optim_step(LINEAR_ADAM).result()
    custom.optim_step(LINEAR_ADAM).result()
    moved = [a - b for a, b in zip(logprobs_of(builtin, sft_batch()), logprobs_of(custom, sft_batch()))]
    before = logprobs_of(service.create_lora_training_client(base_model=cluster.model, rank=4, seed=9).result(), sft_batch())
    assert max(float(np.abs(a - b).max()) for a, b in zip(logprobs_of(custom, sft_batch()), before)) > 1e-3  # the step moved the policy
    assert max(float(np.abs(m).max()) for m in moved) < 1e-4  # ... the same way for both: same gradient


def test_forward_backward_trains_only_where_the_loss_lives_and_still_answers_every_logprob(cluster: Any, connect: Any,
                                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A GRPO group: the engine trains the completions' non-zero advantages only, sharing the prompt, and the prompt's logprobs
    (and those of rows with nothing to train) come from one scoring call over the distinct prefixes; every logprob equals
    ``forward``'s."""
    seen: dict[str, list[Any]] = {"forward_backward": [], "logprobs": []}
    for method, name in (("forward_backward_many", "forward_backward"), ("logprobs_many", "logprobs")):
        real = getattr(cluster.base, method)
        monkeypatch.setattr(cluster.base, method, lambda calls, real=real, name=name: (seen[name].extend(r for _, r in calls), real(calls))[1])
    training = connect().create_lora_training_client(base_model=cluster.model, rank=4, seed=3).result()
    prompt = [7, 3, 9, 11, 40, 41]
    completions = [[50, 51, 52], [60, 61], [70, 71, 72, 73], [80, 81, 82]]
    for zero_rows in ([], [1, 3]):
        seen["forward_backward"].clear(), seen["logprobs"].clear()
        rng = np.random.default_rng(len(zero_rows))
        batch = []
        for k, completion in enumerate(completions):
            n = len(prompt) + len(completion) - 1
            advantage = 0.0 if k in zero_rows else float(rng.normal())
            adv = [0.0] * (len(prompt) - 1) + [advantage] * len(completion)
            batch.append(datum(prompt + completion, logprobs=list(rng.uniform(-3, -1, n + 1)), advantages=[0.0, *adv]))
        out = training.forward_backward(batch, "importance_sampling").result()
        (request,) = seen["forward_backward"]
        trained = [k for k in range(len(completions)) if k not in zero_rows]
        assert [d.tokens for d in request.data] == [prompt + completions[k] for k in trained]  # rows with nothing to train are left out
        for d, k in zip(request.data, trained):  # ... and the prompt is no position of the loss, so the group shares it
            assert d.loss_mask == [0.0] * len(prompt) + [1.0] * len(completions[k])
        (scoring,) = seen["logprobs"]
        if zero_rows:  # the rows without a gradient are scored whole; the prompt's prefix rides on them
            assert sorted(scoring[0]) == sorted(prompt + completions[k] for k in zero_rows)
        else:
            assert scoring[0] == [prompt]
        expected = [o["logprobs"].to_numpy() for o in training.forward(batch, "importance_sampling").result().loss_fn_outputs]
        for o, e in zip(out.loss_fn_outputs, expected):
            np.testing.assert_allclose(o["logprobs"].to_numpy(), e, rtol=1e-5, atol=1e-5)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_a_clients_concurrent_samples_share_one_pass(cluster: Any, connect: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight requests in flight at once (as a GRPO rollout sends its prompts) run as one batch on the shared worker."""
    sampler = connect().create_lora_training_client(base_model=cluster.model, rank=4).result().save_weights_and_get_sampling_client().result()
    worker = cluster.service.engine.worker
    assert worker.read_gather_s == 0.05  # serve tinker's default; a loaded test machine gets more room below
    monkeypatch.setattr(worker, "read_gather_s", 0.2)
    for _ in range(3):  # the first round may start before the last request arrives: then the rest make the next
        before = worker.rounds_run
        futures = [sampler.sample(types.ModelInput.from_ints([5, 6, 7 + k]), 2, types.SamplingParams(max_tokens=4)) for k in range(8)]
        assert all(len(f.result().sequences) == 2 for f in futures)
        sizes = sorted(len(r) for r in worker.rounds[len(worker.rounds) - (worker.rounds_run - before):])
        if sizes == [8]:
            break
    assert sizes == [8], f"eight concurrent samples ran in rounds of {sizes}"


def test_a_session_without_heartbeats_ends_and_frees_its_adapter_with_no_other_client_around(cluster: Any) -> None:
    service = cluster.service
    session_id = service.create_session("alice")
    run = service.create_run("alice", session_id, 0, cluster.model, 4, None, None)
    held = len(cluster.base.sessions)
    service.maintain()
    assert session_id in service.sessions and run.model_id in service.runs  # heartbeats are on time: nothing ends
    service.sessions[session_id].last_heartbeat -= service.limits.session_timeout_s + 1
    with pytest.raises(TinkerError) as refused:  # another tenant's heartbeat keeps nothing alive
        service.heartbeat("bob", session_id)
    assert refused.value.status == 404
    service.maintain()  # what the service's own thread runs every maintenance_s
    assert session_id not in service.sessions and run.model_id not in service.runs
    assert len(cluster.base.sessions) == held - 1


# ----- refusals and tenants -------------------------------------------------------------------------------------------
def test_what_the_server_lacks_is_a_clear_error(cluster: Any, connect: Any) -> None:
    service = connect()
    with pytest.raises(Exception, match="not offered by this server"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result()
    training = service.create_lora_training_client(base_model=cluster.model, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="stable_reinforce needs"):
        training.forward_backward(rl_batch("ppo", logprobs_of(training, sft_batch()), np.random.default_rng(0)), "stable_reinforce").result()
    shifted_wrong = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [9, 9, 9], "weights": [1.0] * 3})
    with pytest.raises(Exception, match="shifted by one"):
        training.forward_backward([shifted_wrong], "cross_entropy").result()
    with pytest.raises(Exception, match="ppo loss needs loss_fn_inputs logprobs, advantages"):
        training.forward_backward(sft_batch(), "ppo").result()
    # a refused request leaves the run usable
    assert training.forward_backward(sft_batch(), "cross_entropy").result().metrics["loss:sum"] > 0


def test_a_tenant_reaches_only_its_own_runs_samplers_and_checkpoints(cluster: Any, connect: Any) -> None:
    alice = connect("alice")
    training = alice.create_lora_training_client(base_model=cluster.model, rank=4).result()
    path = training.save_weights_for_sampler("mine").result().path
    state = training.save_state("mine").result().path

    def raw(who: str | None, method: str, route: str, **kwargs: Any) -> httpx.Response:
        headers = {"X-API-Key": cluster.keys[who]} if who else {}
        return httpx.request(method, cluster.url + route, headers=headers, timeout=30, **kwargs)

    assert raw(None, "GET", "/api/v1/training_runs").status_code == 401
    assert raw("carol", "GET", "/api/v1/training_runs").status_code == 401  # a read-only key trains nothing
    bad = dict(cluster.keys, mallory="tml-tgk_000000000000_" + "x" * 43)
    assert httpx.get(cluster.url + "/api/v1/training_runs", headers={"X-API-Key": bad["mallory"]}).status_code == 401
    assert raw("bob", "GET", f"/api/v1/training_runs/{training.model_id}").status_code == 404
    assert raw("bob", "GET", f"/api/v1/training_runs/{training.model_id}/checkpoints").status_code == 404
    assert training.model_id not in {r["training_run_id"] for r in raw("bob", "GET", "/api/v1/training_runs").json()["training_runs"]}
    assert training.model_id in {r["training_run_id"] for r in raw("alice", "GET", "/api/v1/training_runs").json()["training_runs"]}
    assert raw("bob", "DELETE", f"/api/v1/training_runs/{training.model_id}/checkpoints/weights/mine").status_code == 404
    bob = connect("bob")
    with pytest.raises(Exception, match="not found"):
        bob.create_sampling_client(model_path=path).sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(Exception, match="not found"):
        bob.create_training_client_from_state(state).result()
    # bob cannot drive alice's run, or read her futures
    session = raw("bob", "POST", "/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}).json()["session_id"]
    body = {"model_id": training.model_id, "adam_params": {"learning_rate": 1.0}}
    assert raw("bob", "POST", "/api/v1/optim_step", json=body).status_code == 404
    pending = raw("alice", "POST", "/api/v1/optim_step", json=body | {"adam_params": {"learning_rate": 0.0}}).json()["request_id"]
    assert raw("bob", "POST", "/api/v1/retrieve_future", json={"request_id": pending}).status_code == 404
    assert raw("alice", "POST", "/api/v1/retrieve_future", json={"request_id": pending}).status_code == 200
    assert raw("bob", "POST", "/api/v1/session_heartbeat", json={"session_id": session}).status_code == 200
    assert raw("alice", "POST", "/api/v1/session_heartbeat", json={"session_id": session}).status_code == 410


def test_samplers_past_the_bound_close_the_oldest(tiny: str, tmp_path: Any) -> None:
    """An RL loop makes a sampler every step: past the tenant's bound the oldest goes, and the loop goes on."""
    from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig
    from tinkergym.scheduler.auth import create_key
    from tinkergym.scheduler.db import make_engine, upgrade
    from tinkergym.tinker_api.server import create_server
    from testkit import serving

    engine = make_engine(f"sqlite:///{tmp_path / 'keys.db'}")
    upgrade(engine)
    key = "tml-" + create_key(engine, "alice", ["read", "write"])[1]
    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", max_sessions=8))
    app = create_server(base, tmp_path / "runs", engine, logging.getLogger("bound"), model_name="tiny-bound", tokenizer_id=tiny, max_samplers_per_tenant=2)
    prompt = types.ModelInput.from_ints([5, 6, 7])
    with serving(app) as url, tinker.ServiceClient(base_url=url, api_key=key) as service:
        training = service.create_lora_training_client(base_model="tiny-bound", rank=4).result()
        samplers = [training.save_weights_and_get_sampling_client().result() for _ in range(4)]
        assert len(app.state.tinker.samplers) == 2 and len(base.sessions) == 3  # the run's adapter and the two newest samplers
        assert samplers[-1].sample(prompt, 1, types.SamplingParams(max_tokens=2)).result().sequences
        with pytest.raises(Exception, match="not found"):
            samplers[0].sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    engine.dispose()


def test_one_tenants_huge_sample_call_is_sliced_so_anothers_small_one_waits_one_batch(tiny: str, tmp_path: Any, monkeypatch: Any) -> None:
    """Every Tinker sample call is one prompt: alice's of 40 samples on a server whose rounds hold 100 tokens and whose
    decode batches hold 8 sequences is worked in five batches, bob's 1-token sample runs after the first instead of
    after all five, and alice gets the samples she gets from the call in one go (the same seed)."""
    from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig
    from tinkergym.scheduler.auth import create_key
    from tinkergym.scheduler.db import make_engine, upgrade
    from tinkergym.tinker_api.server import create_server
    from testkit import serving, wait_until

    engine = make_engine(f"sqlite:///{tmp_path / 'keys.db'}")
    upgrade(engine)
    keys = {who: "tml-" + create_key(engine, who, ["read", "write"])[1] for who in ("alice", "bob")}
    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", max_sessions=8, max_sample_batch=8))
    app = create_server(base, tmp_path / "runs", engine, logging.getLogger("slices"), model_name="tiny-slices", tokenizer_id=tiny, pass_tokens=100)
    worker = app.state.tinker.engine.worker
    big = (types.ModelInput.from_ints([5, 6, 7]), 40, types.SamplingParams(max_tokens=10, temperature=1.0, seed=3))
    with serving(app) as url, tinker.ServiceClient(base_url=url, api_key=keys["alice"]) as alice, \
            tinker.ServiceClient(base_url=url, api_key=keys["bob"]) as bob:
        samplers = [c.create_lora_training_client(base_model="tiny-slices", rank=4).result().save_weights_and_get_sampling_client().result()
                    for c in (alice, bob)]
        before = worker.rounds_run
        with base._lock:  # alice's first slice waits on the base while bob's call arrives
            huge = samplers[0].sample(*big)
            wait_until("alice's first slice to start", lambda: len(worker._running) == 1, timeout=30, every=0.01)
            small = samplers[1].sample(types.ModelInput.from_ints([9, 10]), 1, types.SamplingParams(max_tokens=1))
            wait_until("bob's call to wait", lambda: sum(len(q.records) for q in worker._queues.values()) == 2, timeout=30, every=0.01)
        sliced = huge.result()
        assert len(small.result().sequences) == 1
        wait_until("the rounds to be logged", lambda: not worker._running, timeout=10, every=0.01)
        rounds = [[adapter for adapter, _ in r] for r in worker.rounds[before - worker.rounds_run:]]
        mine = [i for i, r in enumerate(rounds) if rounds[0][0] in r]
        theirs = next(i for i, r in enumerate(rounds) if any(a != rounds[0][0] for a in r))
        assert len(mine) == 5 and mine[0] < theirs < mine[-1], rounds
        monkeypatch.setattr(worker, "pass_tokens", 1 << 20)
        at_once = samplers[0].sample(*big).result()
    assert [s.tokens for s in sliced.sequences] == [s.tokens for s in at_once.sequences]
    assert len({tuple(s.tokens) for s in sliced.sequences}) > 1
    engine.dispose()


def test_hostile_inputs_are_refused_with_4xx_and_write_nothing_outside(cluster: Any, connect: Any, tmp_path: Any) -> None:
    """Names with '..', a NUL or a lone surrogate, huge counts, ids past the vocabulary, odd tinker:// paths: each a 4xx."""
    training = connect().create_lora_training_client(base_model=cluster.model, rank=4).result()
    headers = {"X-API-Key": cluster.keys["alice"], "Content-Type": "application/json"}

    def post(route: str, raw: str) -> httpx.Response:
        return httpx.post(cluster.url + route, content=raw.encode(), headers=headers, timeout=30)

    model = training.model_id
    for route in ("/api/v1/save_weights", "/api/v1/save_weights_external"):
        for name in ('"../evil"', '"a\\u0000b"', '"\\ud800"', '"a/b"', '"' + "x" * 300 + '"', '"x.tmp"'):
            answer = post(route, f'{{"model_id": "{model}", "path": {name}}}')
            assert 400 <= answer.status_code < 500, (route, name, answer.status_code, answer.text)
    for path in ("tinker://../weights/x", f"tinker://{model}/weights/../../x", f"tinker://{model}/other/x", "file:///etc/passwd", "tinker://\u0000"):
        answer = httpx.post(cluster.url + "/api/v1/weights_info", json={"tinker_path": path}, headers=headers, timeout=30)
        assert 400 <= answer.status_code < 500, (path, answer.status_code)
    assert not list(tmp_path.parent.rglob("evil"))
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    with pytest.raises(tinker.BadRequestError, match="num_samples must be"):
        sampler.sample(prompt, 10**6, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(tinker.BadRequestError, match="max_tokens must be"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=10**9)).result()
    with pytest.raises(tinker.BadRequestError, match="outside the model's vocabulary"):
        sampler.sample(types.ModelInput.from_ints([10**8]), 1, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(Exception, match="outside the model's vocabulary"):
        training.forward([datum([5, 6, 10**8], weights=[1.0, 1.0])], "cross_entropy").result()
    garbage = httpx.post(cluster.url + "/api/v1/forward_backward", content=b"\x00" * 64,
                         headers={"X-API-Key": cluster.keys["alice"], "Content-Type": "application/x-protobuf"}, timeout=30)
    assert garbage.status_code == 400
    assert post("/api/v1/retrieve_future", '{"request_id": "' + "r" * 10000 + '"}').status_code == 404


def test_numbers_that_are_not_finite_or_out_of_range_are_400_at_the_front_door(cluster: Any, connect: Any) -> None:
    """NaN, infinities and 1e999 anywhere in a JSON body are refused before a route reads them (the field named); a
    temperature or top_p out of its range is refused by the sample call; an oversized body is 413 before it is read."""
    training = connect().create_lora_training_client(base_model=cluster.model, rank=4).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    headers = {"X-API-Key": cluster.keys["alice"], "Content-Type": "application/json"}
    model = training.model_id
    for number in ("NaN", "Infinity", "-Infinity", "1e999"):
        body = f'{{"model_id": "{model}", "adam_params": {{"learning_rate": {number}}}}}'
        answer = httpx.post(cluster.url + "/api/v1/optim_step", content=body.encode(), headers=headers, timeout=30)
        assert answer.status_code == 400 and "learning_rate" in answer.text and "finite" in answer.text, (number, answer.text)
    prompt = types.ModelInput.from_ints([5, 6, 7])
    for params in ({"temperature": 1e30}, {"top_p": 0.0}, {"top_p": 2.0}):
        with pytest.raises(tinker.BadRequestError, match="temperature must be|top_p must be"):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, **params)).result()
    assert sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result().sequences  # the server goes on
    import http.client
    import urllib.parse

    where = urllib.parse.urlsplit(cluster.url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    try:  # a declared 1 GiB body: refused from its length, before a byte of it is read
        connection.putrequest("POST", "/api/v1/optim_step")
        for name, value in {**headers, "Content-Length": str(1 << 30)}.items():
            connection.putheader(name, value)
        connection.endheaders()
        assert connection.getresponse().status == 413
    finally:
        connection.close()
