"""The shared training server (tinkergym.serve.training.shared): adapters opened with the server's token, each
reached with its own token only, calls of several adapters run together and fairly, RemoteBackend unchanged."""

from __future__ import annotations

import json
import re
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("httpx")

import torch  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

import testkit  # noqa: E402  # registered by tests/conftest.py
from testkit import serving, wait_until  # noqa: E402
from tinkergym.backends.remote import RemoteBackend  # noqa: E402
from tinkergym.backends.torch.shared import LoraSessionConfig, SharedBase, SharedBaseConfig  # noqa: E402
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams  # noqa: E402
from tinkergym.serve.auth import token_digest  # noqa: E402
from tinkergym.serve.training.shared import create_shared_app  # noqa: E402

TOKEN = "s" * 40
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def shared_app(tiny: str, run_dir: Path, **options: Any) -> tuple[TestClient, SharedBase]:
    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", micro_batch_size=16, max_sessions=options.pop("max_adapters", 8),
                                       max_sample_batch=options.pop("max_sample_batch", 64)))
    app = create_shared_app(base, run_dir=run_dir, token_digest=token_digest(TOKEN), **options)
    return TestClient(app, raise_server_exceptions=False), base


def fb(tokens: list[int], loss: str = "cross_entropy") -> dict[str, Any]:
    return {"request": ForwardBackwardRequest([Datum(tokens, [0.0] + [1.0] * (len(tokens) - 1))], LossSpec(loss)).to_dict()}


class Caller:
    """One adapter's client over raw HTTP: a session and numbered calls."""

    def __init__(self, http: TestClient, token: str) -> None:
        self.http, self.headers = http, bearer(token)
        self.session = http.post("/v1/sessions", headers=self.headers).json()["session_id"]
        self.seq = 0

    def post(self, method: str, args: dict[str, Any], wait: float = 30.0) -> Any:
        self.seq += 1
        body = {"session_id": self.session, "seq": self.seq, "method": method, "args": args}
        return self.http.post(f"/v1/call?wait={wait}", headers=self.headers, json=body)


def test_adapters_are_managed_with_the_servers_token_and_reached_with_their_own(tiny, tmp_path) -> None:
    http, base = shared_app(tiny, tmp_path)
    a = http.post("/v1/adapters", headers=ADMIN, json={"lora_rank": 4, "seed": 1}).json()
    b = http.post("/v1/adapters", headers=ADMIN, json={"lora_rank": 8, "seed": 2}).json()
    assert a["info"]["lora_rank"] == 4 and "model_path" not in a["info"] and "tokenizer" not in a["info"]
    ta, tb = bearer(a["token"]), bearer(b["token"])
    paths = {re.sub(r"\{[^}]+\}", "x", p) for p in http.get("/openapi.json", headers=ta).json()["paths"]}
    assert {"/v1/adapters", "/v1/adapters/x", "/v1/call", "/v1/info", "/v1/sessions", "/v1/requests/x"} <= paths
    for path in paths - {"/health"}:  # no token, a wrong one: 401 everywhere but /health
        for method in ("GET", "POST", "DELETE"):
            for headers in ({}, bearer("w" * 40)):
                assert http.request(method, path, headers=headers, json={}).status_code in (401, 405), (method, path)
    assert http.post("/v1/adapters", headers=ta, json={}).status_code == 403  # an adapter cannot open or close adapters
    assert http.delete(f"/v1/adapters/{b['adapter_id']}", headers=ta).status_code == 403
    assert http.get("/v1/adapters", headers=ta).status_code == 403
    assert http.post("/v1/sessions", headers=ADMIN).status_code == 403  # the server's token trains no adapter
    # Each token reaches its own adapter's calls, sessions, states and exports only.
    caller_a = Caller(http, a["token"])
    saved = caller_a.post("export", {"name": "mine", "merged": False})
    assert saved.status_code == 200, saved.text
    request_id = saved.json()["request_id"]
    assert http.get(f"/v1/requests/{request_id}", headers=tb).status_code == 404
    assert http.get("/v1/files/exports/mine/adapter_config.json", headers=tb).status_code == 404
    assert http.get("/v1/files/exports/mine/adapter_config.json", headers=ta).status_code == 200
    foreign = http.post("/v1/call", headers=tb, json={"session_id": caller_a.session, "seq": 2, "method": "optim_step",
                                                       "args": {"params": OptimParams(learning_rate=1.0).to_dict()}})
    assert foreign.status_code == 404 and base.sessions[1].step == 0
    assert http.get("/v1/info", headers=tb).json()["lora_rank"] == 8
    listing = http.get("/v1/adapters", headers=ADMIN).json()
    assert {x["adapter_id"] for x in listing["adapters"]} == {a["adapter_id"], b["adapter_id"]}
    held = listing["memory"]["sessions_bytes"]
    assert listing["base"]["model"] == Path(tiny).name and "model_path" not in listing["base"] and listing["base"]["max_lora_rank"] == 64
    # Closing frees the adapter's memory and ends its token.
    assert http.delete(f"/v1/adapters/{a['adapter_id']}?purge=true", headers=ADMIN).json() == {"closed": True}
    assert http.get("/v1/info", headers=ta).status_code == 401
    after = http.get("/v1/adapters", headers=ADMIN).json()
    assert after["memory"]["sessions_bytes"] == held - base.session_bytes(4)
    # Measured as well as counted (what a seat's heartbeat carries): the process's memory now and at its peak, the base's
    # alone from the start, and the adapters open.
    measured = after["measured"]
    # the base's measure against the peak since (on a CPU the process's resident memory can shrink below it by now)
    assert measured["sessions"] == 1 and 0 < measured["base_bytes"] <= listing["measured"]["device_peak_bytes"]
    assert 0 < measured["host_bytes"] <= measured["host_peak_bytes"] and measured["device_bytes"] == measured["host_bytes"]
    assert not (tmp_path / "adapters" / a["adapter_id"]).exists()
    assert http.delete(f"/v1/adapters/{a['adapter_id']}", headers=ADMIN).status_code == 404


def test_opening_past_the_servers_bounds_is_refused_with_the_reason(tiny, tmp_path) -> None:
    http, _ = shared_app(tiny, tmp_path, max_adapters=1)
    too_big = http.post("/v1/adapters", headers=ADMIN, json={"lora_rank": 128})
    assert too_big.status_code == 400 and "max_lora_rank 64" in too_big.text
    assert http.post("/v1/adapters", headers=ADMIN, json={"lora_rank": 0}).status_code in (400, 422)
    assert http.post("/v1/adapters", headers=ADMIN, json={}).status_code == 201
    full = http.post("/v1/adapters", headers=ADMIN, json={})
    assert full.status_code == 400 and "most sessions" in full.text


def _submit(caller: Caller, method: str, args: dict[str, Any]) -> str:
    response = caller.post(method, args, wait=0)
    assert response.status_code in (200, 202), response.text
    return response.json()["request_id"]


@pytest.mark.parametrize("huge", [False, True])
def test_rounds_take_adapters_in_turn_so_none_waits_behind_anothers_queue(tiny, tmp_path, huge) -> None:
    http, base = shared_app(tiny, tmp_path, pass_tokens=40)
    tokens = [http.post("/v1/adapters", headers=ADMIN, json={"seed": s}).json()["token"] for s in (1, 2)]
    a, b = Caller(http, tokens[0]), Caller(http, tokens[1])
    worker = http.app.state.shared.worker
    row = list(range(5, 5 + (60 if huge else 6)))  # over the round's token budget, or well within it
    with base._lock:  # the first call waits on the base while the queues fill
        first = _submit(a, "forward_backward", fb(row))
        wait_until("the first round to start", lambda: len(worker._running) == 1, timeout=10, every=0.01)
        later = [_submit(a, "forward_backward", fb(row)) for _ in range(4)]
        mine = _submit(b, "forward_backward", fb([7, 8, 9, 10]))
    for request_id, headers in [(first, a.headers), *((r, a.headers) for r in later), (mine, b.headers)]:
        assert http.get(f"/v1/requests/{request_id}?wait=60", headers=headers).status_code == 200
    rounds = worker.rounds
    assert sum(len(r) for r in rounds) == 6
    assert [x[0] for x in rounds[0]] == [worker_id(http, 0)]
    b_id = worker_id(http, 1)
    assert any(adapter == b_id for adapter, _ in rounds[1]), f"b's call waited behind a's queue: {rounds}"
    if huge:  # a call over the budget runs in a round of its own
        assert all(len(r) == 1 for r in rounds)
    else:
        assert len(rounds[1]) == 2


def _slices_of(http: TestClient, adapter: str) -> int:
    return sum(x[0] == adapter for r in http.app.state.shared.worker.rounds for x in r)


@pytest.mark.parametrize("start", [0, 1], ids=["rotation 0", "rotation 1"])
@pytest.mark.parametrize("seed", [11, None])
@pytest.mark.parametrize("prompts, num_samples, slices", [(12, 4, 6), (1, 20, 3)], ids=["12 prompts", "one prompt"])
def test_a_sample_call_over_the_budget_runs_in_slices_that_other_adapters_calls_run_between(tiny, tmp_path, seed, prompts, num_samples,
                                                                                             slices, start) -> None:
    """One adapter's sample call of 12 prompts x 4 samples (624 tokens), or of one prompt x 20 samples (as every Tinker
    sample call is one prompt), on a server whose rounds hold 100 tokens: it is worked one batch of the base (8
    sequences) at a time, another adapter's small call runs in the second round instead of after the whole call, and
    the big call's samples are those it gets in one go on a server without the budget (the same adapter seed: the same
    draws, seeded or from the adapter's generator). A call in slices goes after fresh calls in a round, so the small
    call runs next whatever the rotation says."""
    big = SampleRequest([[5 + i, 6, 7 + i] for i in range(prompts)], SamplingParams(max_new_tokens=10, seed=seed), num_samples=num_samples)
    small = SampleRequest([[9, 10]], SamplingParams(max_new_tokens=2, seed=3))

    def serve(pass_tokens: int, folder: str) -> tuple[TestClient, SharedBase, Caller, Caller]:
        http, base = shared_app(tiny, tmp_path / folder, pass_tokens=pass_tokens, max_sample_batch=8)
        a, b = (Caller(http, http.post("/v1/adapters", headers=ADMIN, json={"seed": s}).json()["token"]) for s in (1, 2))
        return http, base, a, b

    http, base, a, b = serve(100, "sliced")
    worker = http.app.state.shared.worker
    worker._start = start  # whichever adapter the rotation puts first, the small call waits one slice (not two)
    with base._lock:  # the big call's first slice waits on the base while the small call arrives
        whole = _submit(a, "sample", {"request": big.to_dict()})
        wait_until("the first slice to start", lambda: len(worker._running) == 1, timeout=10, every=0.01)
        mine = _submit(b, "sample", {"request": small.to_dict()})
    sliced = http.get(f"/v1/requests/{whole}?wait=60", headers=a.headers).json()["result"]
    assert http.get(f"/v1/requests/{mine}?wait=60", headers=b.headers).status_code == 200
    a_id, b_id = worker_id(http, 0), worker_id(http, 1)
    wait_until("the last round to be logged", lambda: _slices_of(http, a_id) == slices, timeout=10, every=0.01)
    rounds = [[adapter for adapter, _ in r] for r in worker.rounds]
    assert rounds[0] == [a_id] and b_id in rounds[1], rounds  # the small call waited one slice, not the whole call
    assert any(a_id in r for r in rounds[2:]), rounds  # the last slices after the small call
    assert worker._slices == {}

    http, _, a, _ = serve(1 << 20, "whole")
    at_once = a.post("sample", {"request": big.to_dict()}).json()["result"]
    wait_until("the round to be logged", lambda: len(http.app.state.shared.worker.rounds) == 1, timeout=10, every=0.01)  # after its answer
    tokens = [[s["tokens"] for s in row] for row in sliced["sequences"]]
    assert tokens == [[s["tokens"] for s in row] for row in at_once["sequences"]]
    assert len(tokens) == prompts and all(len(row) == num_samples for row in tokens)
    assert len({tuple(t) for row in tokens for t in row}) > 1  # the draws differ between the slices' batches
    for mine_row, theirs_row in zip(sliced["sequences"], at_once["sequences"]):
        for x, y in zip(mine_row, theirs_row):
            assert x["logprobs"] == pytest.approx(y["logprobs"], abs=1e-5)


def _rows(count: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(5, 200) for _ in range(rng.randrange(6, 11))] for _ in range(count)]


def test_training_and_scoring_calls_over_the_budget_run_in_micro_batch_slices_with_the_whole_calls_result(tiny, tmp_path) -> None:
    """A forward_backward call of 40 rows (about 320 tokens, three micro-batches of 16 rows) and a logprobs call of as
    many, on a server whose rounds hold 100 tokens: each is worked a micro-batch at a time, another adapter's call runs
    between the slices, and each call answers what it answers in one go: the same loss metrics and logprobs, and the
    same weights after the optimizer step."""
    rows = _rows(40, seed=4)
    request = ForwardBackwardRequest([Datum(r, [0.0] + [1.0] * (len(r) - 1)) for r in rows], LossSpec("cross_entropy"), return_logprobs=True)
    scoring = {"sequences": _rows(40, seed=5), "temperature": 1.0}
    runs = {}
    for pass_tokens in (100, 1 << 20):
        http, base = shared_app(tiny, tmp_path / str(pass_tokens), pass_tokens=pass_tokens)
        a, b = (Caller(http, http.post("/v1/adapters", headers=ADMIN, json={"seed": s}).json()["token"]) for s in (1, 2))
        a_id, b_id = worker_id(http, 0), worker_id(http, 1)
        worker = http.app.state.shared.worker
        results = []
        for method, args in (("forward_backward", {"request": request.to_dict()}), ("logprobs", scoring)):
            before = worker.rounds_run
            with base._lock:
                whole = _submit(a, method, args)
                wait_until("the first slice to start", lambda w=worker: len(w._running) == 1, timeout=10, every=0.01)
                mine = _submit(b, "logprobs", {"sequences": [[9, 10, 11]], "temperature": 1.0})
            results.append(http.get(f"/v1/requests/{whole}?wait=60", headers=a.headers).json()["result"])
            assert http.get(f"/v1/requests/{mine}?wait=60", headers=b.headers).status_code == 200
            wait_until("the rounds to be logged", lambda w=worker: not w._running, timeout=10, every=0.01)
            rounds = [[adapter for adapter, _ in r] for r in worker.rounds[before - worker.rounds_run:]]
            slices = [i for i, r in enumerate(rounds) if a_id in r]
            if pass_tokens == 100:  # three slices; the other adapter's call ran after the first, before the last
                assert len(slices) == 3 and slices[0] < next(i for i, r in enumerate(rounds) if b_id in r) < slices[-1], rounds
            else:
                assert len(slices) == 1, rounds
        assert worker._slices == {}
        assert a.post("optim_step", {"params": OptimParams(learning_rate=0.05).to_dict()}).status_code == 200
        results.append(a.post("logprobs", {"sequences": rows[:4], "temperature": 1.0}).json()["result"])
        runs[pass_tokens] = results
    (fit, scored, after), (fit_whole, scored_whole, after_whole) = ([r["logprobs"] if "metrics" not in r else r for r in runs[t]] for t in (100, 1 << 20))
    assert len(scored) == len(scored_whole) == 40 and len(after) == 4
    assert fit["metrics"] == pytest.approx(fit_whole["metrics"], rel=1e-5, abs=1e-6)
    assert fit["metrics"]["tokens"] == sum(len(r) - 1 for r in rows)
    for mine, theirs in [*zip(fit["logprobs"], fit_whole["logprobs"]), *zip(scored, scored_whole), *zip(after, after_whole)]:
        assert mine == pytest.approx(theirs, abs=1e-5)
    assert after[0][1:] != pytest.approx(fit["logprobs"][0][1:], abs=1e-4)  # the step moved the weights


def test_an_adapters_waiting_reads_share_one_pass_and_draw_what_each_would_alone(tiny, tmp_path) -> None:
    from tinkergym.backends.torch.sampling import RowGenerators

    http, base = shared_app(tiny, tmp_path)
    caller = Caller(http, http.post("/v1/adapters", headers=ADMIN, json={"seed": 5}).json()["token"])
    worker = http.app.state.shared.worker
    seeded = [SampleRequest([[5, 6, 7], [9, 10]], SamplingParams(max_new_tokens=6, seed=s), num_samples=2) for s in (1, 2, 3)]
    unseeded = SampleRequest([[5, 6, 7]], SamplingParams(max_new_tokens=6), num_samples=2)
    with base._lock:  # the first call waits on the base while the reads queue up behind it
        first = _submit(caller, "forward_backward", fb([5, 6, 7, 8]))
        wait_until("the first round to start", lambda: len(worker._running) == 1, timeout=10, every=0.01)
        reads = [_submit(caller, "sample", {"request": r.to_dict()}) for r in [*seeded, unseeded, unseeded]]
        scoring = _submit(caller, "logprobs", {"sequences": [[5, 6, 7]], "temperature": 1.0})
    results = [http.get(f"/v1/requests/{r}?wait=60", headers=caller.headers).json()["result"] for r in [first, *reads, scoring]]
    adapter = worker_id(http, 0)
    assert worker.rounds[-3:] == [[(adapter, "forward_backward")], [(adapter, "sample")] * 5, [(adapter, "logprobs")]]
    for request, joint in zip(seeded, results[1:4]):  # a seeded read draws what it draws alone (its logprobs within float32
        alone = caller.post("sample", {"request": request.to_dict()}).json()["result"]  # rounding: the pass's shape differs)
        def drawn(result: dict) -> dict:
            return {**result, "sequences": [[{k: v for k, v in s.items() if k != "logprobs"} for s in row] for row in result["sequences"]]}

        assert drawn(alone) == drawn(joint)
        for mine, theirs in zip(sum(alone["sequences"], []), sum(joint["sequences"], [])):
            assert mine["logprobs"] == pytest.approx(theirs["logprobs"], abs=1e-5)
    twins = [[s["tokens"] for s in r["sequences"][0]] for r in results[4:6]]
    assert twins[0] != twins[1]  # unseeded reads share the adapter's generator, one after the other, never the same numbers

    # A generator shared by segments is left after the latest of their last steps (the numbers it gave are never drawn again).
    generator = torch.Generator().manual_seed(0)
    rows = RowGenerators([(range(0, 2), generator), (range(2, 3), torch.Generator().manual_seed(1)), (range(3, 4), generator)])
    start = rows.get_state()
    rows.history.clear()
    for _ in range(3):
        rows.get_state()
        rows.rand(4, torch.device("cpu"))
    after = [rows.history[2][0], generator.get_state()]
    rows.settle(start, [2, 0, 1])
    assert torch.equal(generator.get_state(), after[0]) and not torch.equal(after[0], after[1])


def test_an_adapters_waiting_calls_and_disk_are_bounded(tiny, tmp_path) -> None:
    http, base = shared_app(tiny, tmp_path, max_waiting_calls=2, max_adapter_disk_mb=0.01)
    token = http.post("/v1/adapters", headers=ADMIN, json={}).json()["token"]
    caller = Caller(http, token)
    worker = http.app.state.shared.worker
    with base._lock:  # the first call runs (and waits on the base); two may wait behind it, the next is refused
        running = _submit(caller, "forward_backward", fb([5, 6, 7]))
        wait_until("the first call to run", lambda: len(worker._running) == 1, timeout=10, every=0.01)
        waiting = [_submit(caller, "forward_backward", fb([5, 6, 7])) for _ in range(2)]
        refused = caller.post("forward_backward", fb([5, 6, 7]), wait=0)
    assert refused.status_code == 429 and "--max-waiting-calls 2" in refused.text
    for request_id in [running, *waiting]:
        assert http.get(f"/v1/requests/{request_id}?wait=60", headers=caller.headers).status_code == 200
    assert caller.post("export", {"name": "one", "merged": False}).status_code == 200  # the folder was empty
    second = caller.post("export", {"name": "two", "merged": False})
    assert second.status_code == 400 and "--max-adapter-disk-mb" in second.text
    assert not (tmp_path / "adapters" / list(http.app.state.shared.adapters)[0] / "exports" / "two").exists()


def worker_id(http: TestClient, index: int) -> str:
    return list(http.app.state.shared.adapters)[index]


@pytest.fixture
def live_shared(tiny, tmp_path):
    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", micro_batch_size=16))
    app = create_shared_app(base, run_dir=tmp_path, token_digest=token_digest(TOKEN), gather_ms=100)
    with serving(app) as url:
        yield url, app


def test_remote_backends_train_adapters_together_as_each_would_alone(tiny, live_shared) -> None:
    import httpx

    url, app = live_shared
    tokens = [httpx.post(f"{url}/v1/adapters", headers=ADMIN, json={"lora_rank": r, "lora_alpha": 2.0 * r, "seed": r}).json()["token"] for r in (4, 8)]
    alone = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", micro_batch_size=16))
    references = [alone.open_session(LoraSessionConfig(lora_rank=r, lora_alpha=2.0 * r, seed=r)) for r in (4, 8)]
    sample = SampleRequest([[5, 6, 7], [9, 10]], SamplingParams(max_new_tokens=6, seed=3), num_samples=2)
    results: dict[int, list[Any]] = {}
    barrier = threading.Barrier(2)

    def train(k: int) -> None:
        remote = RemoteBackend(url, tokens[k])
        out = []
        for _ in range(3):
            barrier.wait(30)  # both adapters' calls arrive together, so rounds can share them
            response = remote.sample(sample)
            data = [Datum([5, 6, 7, *s.tokens], [0.0, 0.0, 0.0] + [1.0] * len(s.tokens), [0.5 - 0.25 * i] * (3 + len(s.tokens)),
                          [0.0, 0.0, 0.0, *s.logprobs]) for i, s in enumerate(response.sequences[0])]
            out.append((response, remote.forward_backward(ForwardBackwardRequest(data, LossSpec("ppo"))).metrics,
                        remote.optim_step(OptimParams(learning_rate=5e-2))))
        results[k] = out

    threads = [threading.Thread(target=train, args=(k,)) for k in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert set(results) == {0, 1}
    for k, reference in enumerate(references):  # the same calls on a session alone
        for response, metrics, optim in results[k]:
            solo = reference.sample(sample)
            assert [[s.tokens for s in row] for row in solo.sequences] == [[s.tokens for s in row] for row in response.sequences]
            for row, solo_row in zip(response.sequences, solo.sequences):
                for seq, solo_seq in zip(row, solo_row):
                    assert seq.logprobs == pytest.approx(solo_seq.logprobs, abs=1e-5)
            data = [Datum([5, 6, 7, *s.tokens], [0.0, 0.0, 0.0] + [1.0] * len(s.tokens), [0.5 - 0.25 * i] * (3 + len(s.tokens)),
                          [0.0, 0.0, 0.0, *s.logprobs]) for i, s in enumerate(response.sequences[0])]
            assert reference.forward_backward(ForwardBackwardRequest(data, LossSpec("ppo"))).metrics["loss"] == pytest.approx(metrics["loss"], abs=1e-5)
            assert reference.optim_step(OptimParams(learning_rate=5e-2))["grad_norm"] == pytest.approx(optim["grad_norm"], rel=1e-4)
    shared_rounds = [r for r in app.state.shared.worker.rounds if len({a for a, _ in r}) == 2]
    assert shared_rounds, "no round ran both adapters' calls"
    served = [s for s in app.state.shared.base.sessions.values()]
    for mine, reference in zip(served, references):
        for name, param in reference.params.items():
            # Adam divides each gradient by its own scale: float-order differences of near-zero gradients grow to ~1e-5.
            torch.testing.assert_close(mine.params[name], param, rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_serve_shared_trains_two_runs_of_tinkergym_train_through_their_adapters(tiny, tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys

    import httpx

    from testkit import exited_output, wait_until_answers  # noqa: E402

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    port, metrics_port = ports
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TINKERGYM_CACHE": str(tmp_path / "cache")}
    server = subprocess.Popen([sys.executable, "-m", "tinkergym", "serve", "shared", "--model", tiny, "--dtype", "float32", "--port", str(port),
                               "--token-file", str(token_file), "--run-dir", str(tmp_path / "server"), "--gather-ms", "50",
                               "--metrics-port", str(metrics_port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_until_answers(f"{url}/health", timeout=120, process=server, output=exited_output(server))
        runs = []
        for k in range(2):
            opened = httpx.post(f"{url}/v1/adapters", headers=ADMIN, json={"lora_rank": 4 * (k + 1), "seed": k}).json()
            adapter_token = tmp_path / f"adapter{k}"
            adapter_token.write_text(opened["token"] + "\n")
            adapter_token.chmod(0o600)
            out = tmp_path / f"run{k}"
            runs.append((out, subprocess.Popen(
                # enough steps that the two runs overlap whatever the jitter of their processes' start (their calls then share rounds)
                [sys.executable, "-m", "tinkergym", "train", "--env", "tinker/Bandit-v0", "--steps", "8", "--batch-size", "2", "--group-size", "4",
                 "--max-new-tokens", "6", "--lr", "1e-3", "--quiet", "--out", str(out), "--backend-url", url, "--backend-token-file", str(adapter_token)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)))
        for out, process in runs:
            output, _ = process.communicate(timeout=300)
            assert process.returncode == 0, output[-3000:]
            assert (out / "final" / "adapter_config.json").is_file()
            assert json.loads((out / "config.json").read_text())["lora_rank"] in (4, 8)
        listing = httpx.get(f"{url}/v1/adapters", headers=ADMIN).json()
        assert len(listing["adapters"]) == 2 and all(a["step"] >= 1 for a in listing["adapters"])  # a step with no advantage applies nothing
        # Each adapter's own token counts (what a worker reports for its seat's job): both runs sampled and trained.
        assert all(a["tokens_trained"] > 0 and a["tokens_sampled"] > 0 for a in listing["adapters"]), listing["adapters"]
        rounds = [json.loads(line) for line in (tmp_path / "server" / "server.log").read_text().splitlines() if '"event": "call"' in line]
        assert any(r.get("round", 1) == 2 for r in rounds), "no round ran both runs' calls"
        testkit.check_training_metrics(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text, "shared", adapters=2)
    finally:
        server.terminate()
        server.wait(30)


def test_a_caller_chosen_token_and_a_lease_bind_an_adapter_to_a_job(tiny, tmp_path) -> None:
    import hashlib
    import time

    http, _ = shared_app(tiny, tmp_path)
    lease_token = "L" * 43
    digest = hashlib.sha256(lease_token.encode()).hexdigest()
    opened = http.post("/v1/adapters", headers=ADMIN, json={"adapter_id": "job-7.e2", "token_sha256": digest})
    assert opened.status_code == 201 and opened.json()["token"] is None and opened.json()["adapter_id"] == "job-7.e2"
    assert (tmp_path / "adapters" / "job-7.e2").is_dir()
    assert http.post("/v1/adapters", headers=ADMIN, json={"adapter_id": "job-7.e2"}).status_code == 409
    assert http.post("/v1/adapters", headers=ADMIN, json={"token_sha256": digest}).status_code == 409
    for bad in ("../x", ".hidden", "a/b", "x" * 65, "a\x00b", "\ud800x"):
        body = json.dumps({"adapter_id": bad})  # escaped JSON: a lone surrogate travels as \\ud800
        assert http.post("/v1/adapters", headers={**ADMIN, "Content-Type": "application/json"}, content=body).status_code == 400, bad
    other = http.post("/v1/adapters", headers=ADMIN, json={}).json()
    mine = bearer(lease_token)
    assert http.get("/v1/info", headers=mine).status_code == 200
    assert http.put("/v1/adapters/job-7.e2/lease", headers=ADMIN, json={"seconds": 0.3, "epoch": 2}).status_code == 200
    assert http.get("/v1/info", headers=mine).status_code == 200
    time.sleep(0.4)
    ended = http.get("/v1/info", headers=mine)
    assert ended.status_code == 401 and ended.json()["error"]["type"] == "lease_ended"
    assert http.get("/v1/info", headers=bearer(other["token"])).status_code == 200  # another adapter's lease is its own
    assert http.put("/v1/adapters/job-7.e2/lease", headers=ADMIN, json={"seconds": 30, "epoch": 1}).status_code == 409
    assert http.put("/v1/adapters/job-7.e2/lease", headers=ADMIN, json={"seconds": 30, "epoch": 3}).status_code == 200
    assert http.get("/v1/info", headers=mine).status_code == 200
    assert http.put("/v1/adapters/nope/lease", headers=ADMIN, json={"seconds": 30, "epoch": 3}).status_code == 404
    assert http.put("/v1/adapters/job-7.e2/lease", headers=mine, json={"seconds": 30, "epoch": 9}).status_code == 403


def test_a_saved_adapter_is_sampled_by_name_from_the_same_base(tiny, tmp_path) -> None:
    http, base = shared_app(tiny, tmp_path)
    a = http.post("/v1/adapters", headers=ADMIN, json={"lora_rank": 4, "lora_alpha": 8, "seed": 1}).json()
    caller = Caller(http, a["token"])
    data = ForwardBackwardRequest([Datum([5, 6, 7, 8, 9], [0.0, 0.0, 1.0, 1.0, 1.0])], LossSpec("cross_entropy")).to_dict()
    assert caller.post("forward_backward", {"request": data}).status_code == 200
    assert caller.post("optim_step", {"params": OptimParams(learning_rate=5e-2).to_dict()}).status_code == 200
    assert caller.post("export", {"name": "v1", "merged": False}).status_code == 200
    expected = caller.post("logprobs", {"sequences": [[5, 6, 7, 8, 9]]}).json()["result"]["logprobs"]
    held = base.memory()["base_bytes"]
    opened = http.post("/v1/adapters", headers=ADMIN, json={"source": {"adapter_id": a["adapter_id"], "export": "v1"}})
    assert opened.status_code == 201 and opened.json()["info"]["lora_rank"] == 4 and opened.json()["info"]["lora_alpha"] == 8
    served = Caller(http, opened.json()["token"]).post("logprobs", {"sequences": [[5, 6, 7, 8, 9]]}).json()["result"]["logprobs"]
    assert served[0] == pytest.approx(expected[0], abs=1e-6) and base.memory()["base_bytes"] == held
    for source, words in (({"adapter_id": a["adapter_id"], "export": "nope"}, "no export named"), ({"adapter_id": "x", "export": "v1"}, "no open adapter"),
                          ({"adapter_id": a["adapter_id"], "export": "../v1"}, "not allowed")):
        refused = http.post("/v1/adapters", headers=ADMIN, json={"source": source})
        assert refused.status_code == 400 and words in refused.text, refused.text
    assert len(base.sessions) == 2  # a refused source opened nothing


def test_token_ids_past_the_vocabulary_are_refused_before_any_shared_pass(tiny, tmp_path) -> None:
    http, base = shared_app(tiny, tmp_path)
    caller = Caller(http, http.post("/v1/adapters", headers=ADMIN, json={}).json()["token"])
    vocab = base.model.get_input_embeddings().num_embeddings
    refused = caller.post("forward_backward", fb([5, vocab + 3, 6]))
    assert refused.status_code == 400 and "outside the vocabulary" in refused.text
    assert http.app.state.shared.worker.rounds == []  # refused at the door: no round ran, nobody's pass was redone
    assert http.get("/openapi.json", headers=ADMIN).status_code == 200


def test_a_training_call_whose_slice_fails_fails_whole_and_leaves_no_gradient_of_its_earlier_slices(tiny, tmp_path, monkeypatch) -> None:
    """The second of a forward_backward call's three slices fails (as a pass that runs out of memory would): the call
    fails, its third slice never runs, and the adapter's gradients are as before the call, not the first slice's."""
    http, base = shared_app(tiny, tmp_path, pass_tokens=100)
    a = Caller(http, http.post("/v1/adapters", headers=ADMIN, json={"seed": 1}).json()["token"])
    worker = http.app.state.shared.worker
    session = worker.adapters[worker_id(http, 0)][0]
    real, passes = base.forward_backward_many, []

    def second_fails(calls, carries=None):
        passes.append(len(calls))
        if len(passes) == 2:
            raise RuntimeError("out of memory in the second slice")
        return real(calls, carries)

    monkeypatch.setattr(base, "forward_backward_many", second_fails)
    rows = _rows(40, seed=4)
    request = ForwardBackwardRequest([Datum(r, [0.0] + [1.0] * (len(r) - 1)) for r in rows], LossSpec("cross_entropy"))
    response = a.post("forward_backward", {"request": request.to_dict()})
    assert response.status_code == 500 and "RuntimeError" in response.json()["error"]["message"], response.text
    assert passes == [1, 1] and worker._slices == {}
    assert all(p.grad is None or not p.grad.any() for p in session.params.values())
    monkeypatch.setattr(base, "forward_backward_many", real)
    assert a.post("forward_backward", {"request": request.to_dict()}).status_code == 200  # the adapter goes on
    assert any(p.grad is not None and p.grad.any() for p in session.params.values())
