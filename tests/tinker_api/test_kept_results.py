"""A journaled Tinker service (the front door's ``front_door.sqlite``) keeps the results of runs' requests across a restart:
``retrieve_future`` answers each after it as the official SDK received it before (a forward_backward's protobuf byte for
byte), and nothing is logged as not kept; a sampler's request is not kept (410); a result too large to keep answers 410
saying it took effect, logged once; past the bytes kept in all, the oldest results are dropped the same way."""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("torch")
tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")

from tinker import types  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output  # noqa: E402

from testkit import wait_until  # noqa: E402  # registered by tests/conftest.py
from tinkergym.tinker_api import journal as journal_module  # noqa: E402
from tinkergym.tinker_api.app import create_tinker_app  # noqa: E402
from tinkergym.tinker_api.engines import EngineError, LocalEngine  # noqa: E402
from tinkergym.tinker_api.journal import FILE, Journal, decode_result, encode_result  # noqa: E402
from tinkergym.tinker_api.service import TinkerService  # noqa: E402
from tinkergym.tinker_api.wire import encode_forward_backward_output  # noqa: E402

MODEL = "tiny-kept"
KEY = "tml-kept-alice"
LOGGER = "tinker-kept-results-test"
ROWS = [list(range(5, 21)), [7, 3, 9, 11, 40, 41, 42, 43, 44]]


class JournaledLocalEngine(LocalEngine):
    """The in-process engine with what a journal asks of an engine (its handles described, and restored): the restart here is a
    new service on the same journal file in the same process, so a restored handle is the live one it names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.live: dict[str, Any] = {}
        self.journal: Any = None

    def open_run(self, run_id: str, *args: Any, **kwargs: Any) -> Any:
        self.live[run_id] = super().open_run(run_id, *args, **kwargs)
        return self.live[run_id]

    def open_sampler(self, sampler_id: str, *args: Any, **kwargs: Any) -> Any:
        self.live[sampler_id] = super().open_sampler(sampler_id, *args, **kwargs)
        return self.live[sampler_id]

    def describe(self, handle: Any) -> dict[str, Any]:
        return {"adapter_id": handle.adapter_id}

    def restore(self, owner: str, data: dict[str, Any], calls: list[tuple[str, Any]]) -> Any:
        return self.live[data["adapter_id"]]


@pytest.fixture(scope="module")
def engine(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> JournaledLocalEngine:
    from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig
    from tinkergym.serve.training.shared import SharedWorker

    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", micro_batch_size=16, max_sessions=16))
    worker = SharedWorker(base, logging.getLogger(LOGGER), keep_states=0, pass_tokens=65536, gather_s=0.002, max_waiting=64, read_gather_s=0.05)
    return JournaledLocalEngine(base, worker, tmp_path_factory.mktemp("kept"), MODEL, tiny, 16)


class FrontDoor:
    """A journaled service on ``folder``'s journal, served; :meth:`restart` stops it and starts another on the same file."""

    def __init__(self, engine: JournaledLocalEngine, folder: Path) -> None:
        self.engine, self.folder = engine, folder
        self.port = 0
        self.start()

    def start(self) -> None:
        """A service on the journal, served on the port of the one before (the SDK's clients keep their URL)."""
        import socket
        import threading

        import uvicorn

        self.journal = Journal(self.folder / FILE)
        logger = logging.getLogger(LOGGER)
        self.service = TinkerService(self.engine, logger, journal=self.journal)
        app = create_tinker_app(self.service, lambda key: "alice" if key == KEY[len("tml-"):] else None, logger)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        wait_until("the server to start", lambda: self._server.started, timeout=30, every=0.01)

    def stop(self) -> None:
        """As a killed server: its connections close at once (the SDK's kept-alive ones too, which then reach the next
        server), never a graceful wait for open long-polls, so no request meets the old service after its journal closed."""
        self._server.should_exit = self._server.force_exit = True
        self._thread.join(30)
        assert not self._thread.is_alive(), "the server did not stop"
        self.journal.close()

    def restart(self) -> None:
        self.stop()
        self.start()

    def sent(self, call: Callable[[], Any], kept: bool = True) -> tuple[Any, str]:
        """``call()`` (one SDK call, waited for) and the id of the one request it made; one ``kept`` once its result is written
        (the journal writes it as the request is done, the client may read it a moment before)."""
        before = set(self.service.futures)
        result = call()
        (request_id,) = set(self.service.futures) - before
        if kept:
            wait_until("the request's result to be written", lambda: self.journal.request(request_id)[1] is not None, timeout=10, every=0.01)
        return result, request_id

    def retrieve(self, request_id: str) -> httpx.Response:
        """``retrieve_future`` as the SDK asks for it (protobuf accepted: a forward_backward's and a sample's come so)."""
        return httpx.post(f"{self.url}/api/v1/retrieve_future", json={"request_id": request_id}, timeout=60,
                          headers={"X-API-Key": KEY, "Accept": "application/x-protobuf"})


@pytest.fixture
def door(engine: JournaledLocalEngine, tmp_path: Path) -> Iterator[FrontDoor]:
    made = FrontDoor(engine, tmp_path / "door")
    yield made
    made.stop()


def _datums() -> list[Any]:
    return [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]), loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)})
            for r in ROWS]


def _same_output(parsed: Any, received: Any) -> None:
    """Two ForwardBackwardOutputs equal as the SDK reads them (TensorData has no ``==``)."""
    assert (parsed.loss_fn_output_type, parsed.metrics) == (received.loss_fn_output_type, received.metrics)
    assert [sorted(o) for o in parsed.loss_fn_outputs] == [sorted(o) for o in received.loss_fn_outputs]
    for mine, theirs in zip(parsed.loss_fn_outputs, received.loss_fn_outputs):
        for name in mine:
            assert (mine[name].dtype, list(mine[name].shape)) == (theirs[name].dtype, list(theirs[name].shape))
            np.testing.assert_array_equal(mine[name].to_numpy(), theirs[name].to_numpy())


def _not_kept(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "tinker_result_not_kept" in r.getMessage()]


@pytest.mark.filterwarnings("ignore:.*load_state.*:FutureWarning")  # the SDK deprecates it, the server still answers it
def test_every_result_of_a_run_is_answered_after_a_restart_as_the_sdk_received_it(door: FrontDoor, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    kept: dict[str, str] = {}  # what -> request id
    with tinker.ServiceClient(base_url=door.url, api_key=KEY) as client:
        training, kept["create_model"] = door.sent(lambda: client.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result())
        trained, kept["forward_backward"] = door.sent(lambda: training.forward_backward(_datums(), "cross_entropy").result())
        _, kept["optim_step"] = door.sent(lambda: training.optim_step(types.AdamParams(learning_rate=1e-2)).result())
        scored, kept["forward"] = door.sent(lambda: training.forward(_datums(), "cross_entropy").result())
        state, kept["save_state"] = door.sent(lambda: training.save_state("one").result())
        _, kept["save_weights_for_sampler"] = door.sent(lambda: training.save_weights_for_sampler("one").result())
        _, kept["load_state"] = door.sent(lambda: training.load_state(state.path).result())
        sampler, kept["sampler_snapshot"] = door.sent(lambda: training.save_weights_and_get_sampling_client().result())
        _, sampled = door.sent(lambda: sampler.sample(types.ModelInput.from_ints(ROWS[0][:4]), 1, types.SamplingParams(max_tokens=3)).result(),
                              kept=False)
        before = {what: door.retrieve(request_id) for what, request_id in kept.items()}
        door.restart()
        after = {what: door.retrieve(request_id) for what, request_id in kept.items()}
        for what in kept:
            assert after[what].status_code == 200 == before[what].status_code, (what, after[what].text)
            assert after[what].headers["content-type"] == before[what].headers["content-type"], what
            assert after[what].content == before[what].content, what  # byte for byte: the protobuf of forward and forward_backward too
        for what, received in (("forward_backward", trained), ("forward", scored)):
            assert after[what].headers["content-type"] == "application/x-protobuf"
            _same_output(deserialize_forward_backward_output(after[what].content), received)
        assert after["save_state"].json()["path"] == state.path
        # a sampler's request changed no run and is not kept: it answers 410, to be sent again
        gone = door.retrieve(sampled)
        assert gone.status_code == 410 and "sampler's" in gone.json()["detail"], gone.text
    assert _not_kept(caplog) == []


def test_a_result_too_large_to_keep_answers_410_saying_it_took_effect_and_is_logged_once(door: FrontDoor, caplog: pytest.LogCaptureFixture,
                                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    monkeypatch.setattr(journal_module, "MAX_RESULT_BYTES", 256)
    with tinker.ServiceClient(base_url=door.url, api_key=KEY) as client:
        training = client.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
        _, request_id = door.sent(lambda: training.forward_backward(_datums(), "cross_entropy").result())
        _, small = door.sent(lambda: training.optim_step(types.AdamParams(learning_rate=1e-2)).result())
        assert door.retrieve(request_id).status_code == 200  # answered from memory while the service lives
        door.restart()
        refused = door.retrieve(request_id)
        assert refused.status_code == 410, refused.text
        detail = refused.json()["detail"]
        assert "larger than the 256 bytes" in detail and "sending it again would apply it twice" in detail, detail
        assert door.retrieve(small).status_code == 200  # a result within the bound is kept
    logged = _not_kept(caplog)
    assert len(logged) == 1 and request_id in logged[0], logged


def test_the_oldest_results_are_dropped_past_the_bytes_kept_in_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_module, "KEEP_RESULT_BYTES", 4096)
    journal = Journal(tmp_path / FILE)
    try:
        for n in range(12):
            journal.put_request(f"req-{n}", "alice")
            journal.put_result(f"req-{n}", encode_result({"path": "x" * 1000, "n": n}))
        kinds = ["kept" if "not_kept" not in journal.request(f"req-{n}")[1] else "dropped" for n in range(12)]
        assert kinds == ["dropped"] * 9 + ["kept"] * 3, kinds
        assert decode_result(journal.request("req-11")[1])["n"] == 11
        with pytest.raises(EngineError) as dropped:
            decode_result(journal.request("req-0")[1])
        assert dropped.value.status == 410 and "dropped for newer ones" in dropped.value.message
    finally:
        journal.close()
    reopened = Journal(tmp_path / FILE)  # the bytes kept are counted again on opening
    try:
        assert 3000 < reopened._result_bytes <= 4096  # the notes of results dropped count for nothing
    finally:
        reopened.close()


def test_each_kind_of_result_encodes_to_json_and_back() -> None:
    import json

    output = types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics={"loss:sum": 2.5}, loss_fn_outputs=[
        {"logprobs": types.TensorData.from_numpy(np.array([-0.5, -1.25, -3.0], np.float32)),
         "elementwise_loss": types.TensorData.from_numpy(np.array([0.5, 1.25, 3.0], np.float32))},
        {"logprobs": types.TensorData.from_numpy(np.array([-2.0], np.float32)),
         "elementwise_loss": types.TensorData.from_numpy(np.array([2.0], np.float32))}])
    kept = json.loads(json.dumps(encode_result(output)))
    assert base64.b64decode(kept["proto"]) == encode_forward_backward_output(output)
    back = decode_result(kept)
    assert encode_forward_backward_output(back) == encode_forward_backward_output(output)
    _same_output(back, output)
    step = types.OptimStepResponse(metrics={"grad_norm:mean": 0.25})
    assert decode_result(json.loads(json.dumps(encode_result(step)))) == step
    plain = {"path": "tinker://run/weights/one", "type": "save_weights"}
    assert decode_result(json.loads(json.dumps(encode_result(plain)))) == plain
    with pytest.raises(TypeError, match="cannot be kept"):
        encode_result(object())


def test_a_result_too_large_is_recorded_as_done_and_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_module, "MAX_RESULT_BYTES", 100)
    journal = Journal(tmp_path / FILE)
    try:
        journal.put_request("req-big", "alice")
        with pytest.raises(journal_module.ResultNotKept, match="req-big was done"):
            journal.put_result("req-big", encode_result({"path": "x" * 200}))
        tenant, result = journal.request("req-big")
        assert tenant == "alice" and "larger than the 100 bytes" in result["not_kept"]
    finally:
        journal.close()
