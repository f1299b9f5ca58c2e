"""The Tinker SDK's protobuf wire, both ways through the SDK's own converters: requests the SDK writes decode into the
SDK's types field by field, and responses we write decode in the SDK into what we encoded. No server, no torch."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("tinker")
zstd = pytest.importorskip("zstandard")

from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as public_pb  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response  # noqa: E402
from tinker.types.topk_logprobs import TopkLogprobs  # noqa: E402

from tinkergym.tinker_api.wire import decode_forward_backward, encode_forward_backward_output, encode_sample_response  # noqa: E402

MiB = 1024 * 1024


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def sdk_body(request: types.ForwardBackwardRequest, forward_only: bool = False, compress: bool = False) -> bytes:
    """The body ``AsyncTrainingResource.forward_backward`` posts for ``request``."""
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    body = msg.SerializeToString()
    return zstd.ZstdCompressor().compress(body) if compress else body


def sdk_proto(request: types.ForwardBackwardRequest) -> public_pb.ForwardBackwardRequest:
    return forward_backward_request_to_proto(request)


def sparse(dense: np.ndarray, dtype: str) -> types.TensorData:
    """A 2-D array as a CSR ``TensorData`` (zeros left out), built without torch."""
    rows, cols = np.nonzero(dense)
    crow = np.zeros(dense.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=dense.shape[0]), out=crow[1:])
    return types.TensorData(data=dense[rows, cols], dtype=dtype, shape=list(dense.shape),  # type: ignore[arg-type]
                            sparse_crow_indices=crow.tolist(), sparse_col_indices=cols.tolist())


def text_datum(tokens: list[int], *, chunk_at: int | None = None, spans: bool = False, extra: dict | None = None) -> types.Datum:
    """A cross-entropy style datum over ``tokens`` (optionally split in two text chunks), with optional provenance."""
    chunks = [tokens] if chunk_at is None else [tokens[:chunk_at], tokens[chunk_at:]]
    model_input = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=c) for c in chunks])
    n = len(tokens)
    inputs: dict = {
        "target_tokens": np.arange(100, 100 + n, dtype=np.int64),
        "weights": np.linspace(0.0, 1.0, n, dtype=np.float32),
        **(extra or {}),
    }
    datum = types.Datum(model_input=model_input, loss_fn_inputs=inputs)
    if spans:
        half = n // 2
        datum = datum.with_provenance(
            model_input=[types.PromptProvenanceSpan(sequence_id="p-1", offset=0, length=half),
                         types.SampledProvenanceSpan(sequence_id="s-1", offset=3, length=n - half)],
            loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="s-1", offset=0, length=n)],
        )
    return datum


def rich_request(seq_id: int | None = 7, loss_fn_config: dict | None = None) -> types.ForwardBackwardRequest:
    """Several datums of different lengths: text chunks, an image and a dmel chunk, dense and sparse inputs, spans."""
    weights_2d = np.zeros((4, 6), dtype=np.float32)
    weights_2d[0, 1], weights_2d[2, 5], weights_2d[3, 0] = 0.5, 1.0, -2.0
    targets_2d = np.zeros((3, 5), dtype=np.int64)
    targets_2d[1, 2], targets_2d[2, 4] = 42, 7
    image = types.ModelInput(chunks=[
        types.EncodedTextChunk(tokens=[1, 2, 3]),
        types.ImageChunk(data=b"\x89PNG\r\n\x1a\nnot-really", format="png", expected_tokens=4),
        types.ImageChunk(data=b"\xff\xd8jpeg", format="jpeg"),
        types.DmelChunk(dmel=b"\x00\x01opaque-container"),
        types.EncodedTextChunk(tokens=[2**31 - 1, 0]),
    ])
    data = [
        text_datum([5, 6, 7, 8, 9], chunk_at=2, spans=True),
        text_datum(list(range(1000, 1017)), extra={"advantages": [0.25] * 17, "logprobs": np.full(17, -1.5, dtype=np.float32)}),
        text_datum([11], spans=True),
        types.Datum(model_input=types.ModelInput.from_ints([3, 1, 4, 1]),
                    loss_fn_inputs={"weights": sparse(weights_2d, "float32"), "target_tokens": sparse(targets_2d, "int64")}),
        types.Datum(model_input=image, loss_fn_inputs={"target_tokens": types.TensorData(data=[1, 2, 3], dtype="int64")}),
    ]
    fbi = types.ForwardBackwardInput(data=data, loss_fn="ppo", loss_fn_config=loss_fn_config)
    return types.ForwardBackwardRequest(forward_backward_input=fbi, model_id="run-abc", seq_id=seq_id)


def assert_tensor_equal(got: types.TensorData, want: types.TensorData, where: str) -> None:
    assert got.dtype == want.dtype, where
    assert got.shape == want.shape, where
    assert got.sparse_crow_indices == want.sparse_crow_indices, where
    assert got.sparse_col_indices == want.sparse_col_indices, where
    assert got.data == want.data, where  # flattened values (the CSR values when sparse)
    if want.sparse_crow_indices is None:
        g, w = got.to_numpy(), want.to_numpy()
        assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w), where


def assert_request_equal(got: types.ForwardBackwardRequest, want: types.ForwardBackwardRequest) -> None:
    assert got.model_id == want.model_id
    assert got.seq_id == want.seq_id
    g, w = got.forward_backward_input, want.forward_backward_input
    assert g.loss_fn == w.loss_fn
    assert g.loss_fn_config == w.loss_fn_config
    assert len(g.data) == len(w.data)
    for i, (gd, wd) in enumerate(zip(g.data, w.data)):
        assert gd.model_input == wd.model_input, i
        assert [type(c) for c in gd.model_input.chunks] == [type(c) for c in wd.model_input.chunks], i
        for gc, wc in zip(gd.model_input.chunks, wd.model_input.chunks):
            if isinstance(wc, types.EncodedTextChunk):
                assert list(gc.tokens) == list(wc.tokens), i
        assert sorted(gd.loss_fn_inputs) == sorted(wd.loss_fn_inputs), i
        for name in wd.loss_fn_inputs:
            assert_tensor_equal(gd.loss_fn_inputs[name], wd.loss_fn_inputs[name], f"data[{i}][{name}]")
        assert gd.model_input_spans == wd.model_input_spans, i
        assert gd.loss_fn_input_spans == wd.loss_fn_input_spans, i
        if wd.model_input_spans is not None:
            assert [type(s) for s in gd.model_input_spans] == [type(s) for s in wd.model_input_spans], i  # type: ignore[union-attr]
            got_kinds = [type(s) for s in gd.loss_fn_input_spans]  # type: ignore[union-attr]
            assert got_kinds == [type(s) for s in wd.loss_fn_input_spans], i  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------------------------------
# forward_backward requests


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "zstd"])
@pytest.mark.parametrize("forward_only", [False, True], ids=["backward", "forward-only"])
def test_request_round_trips_through_the_sdk_writer(compress: bool, forward_only: bool) -> None:
    want = rich_request(loss_fn_config={"clip_low_threshold": 0.75, "clip_high_threshold": 1.25, "mode": "token"})
    got, got_forward_only = decode_forward_backward(sdk_body(want, forward_only, compress), "zstd" if compress else None)
    assert got_forward_only is forward_only
    assert_request_equal(got, want)
    assert isinstance(got.forward_backward_input.loss_fn_config["mode"], str)  # type: ignore[index]
    spans = got.forward_backward_input.data[0].model_input_spans
    assert isinstance(spans[0], types.PromptProvenanceSpan) and isinstance(spans[1], types.SampledProvenanceSpan)  # type: ignore[index]
    assert got.forward_backward_input.data[1].model_input_spans is None
    assert got.forward_backward_input.data[0].model_input.to_ints() == [5, 6, 7, 8, 9]
    assert got.forward_backward_input.data[4].model_input.chunks[1].expected_tokens == 4  # type: ignore[union-attr]
    assert got.forward_backward_input.data[4].model_input.chunks[2].expected_tokens is None  # type: ignore[union-attr]


def test_decoded_arrays_are_writable_and_native() -> None:
    got, _ = decode_forward_backward(sdk_body(rich_request()), None)
    arr = got.forward_backward_input.data[1].loss_fn_inputs["weights"].to_numpy()
    assert arr.flags.writeable and arr.dtype == np.float32 and arr.shape == (17,)


@pytest.mark.parametrize("encoding", ["zstd", "ZSTD", " zstd "])
def test_content_encoding_is_case_and_space_insensitive(encoding: str) -> None:
    want = rich_request()
    got, _ = decode_forward_backward(sdk_body(want, compress=True), encoding)
    assert_request_equal(got, want)


def test_identity_encoding_and_empty_header_mean_raw() -> None:
    want = rich_request()
    for encoding in (None, "", "identity"):
        assert_request_equal(decode_forward_backward(sdk_body(want), encoding)[0], want)


def test_seq_id_none_and_no_loss_config_round_trip() -> None:
    want = rich_request(seq_id=None, loss_fn_config=None)
    got, _ = decode_forward_backward(sdk_body(want), None)
    assert got.seq_id is None and got.forward_backward_input.loss_fn_config is None
    assert_request_equal(got, want)


def test_a_streamed_zstd_frame_without_content_size_decodes() -> None:
    want = rich_request()
    raw = sdk_proto(want).SerializeToString()
    cobj = zstd.ZstdCompressor(write_content_size=False).compressobj()
    body = cobj.compress(raw[:10]) + cobj.compress(raw[10:]) + cobj.flush()
    assert zstd.frame_content_size(body) == -1
    assert_request_equal(decode_forward_backward(body, "zstd")[0], want)


def test_legacy_float_only_loss_config_is_read_when_v2_is_absent() -> None:
    msg = sdk_proto(rich_request(loss_fn_config={"beta": 0.5}))
    msg.ClearField("loss_fn_config_v2")
    msg.loss_fn_config["beta"] = 0.125  # an older SDK writes only this map
    got, _ = decode_forward_backward(msg.SerializeToString(), None)
    assert got.forward_backward_input.loss_fn_config == {"beta": 0.125}


def test_v2_loss_config_wins_over_the_legacy_map() -> None:
    msg = sdk_proto(rich_request(loss_fn_config={"beta": 0.5}))
    msg.loss_fn_config["beta"] = 9.0
    got, _ = decode_forward_backward(msg.SerializeToString(), None)
    assert got.forward_backward_input.loss_fn_config == {"beta": 0.5}


def test_one_sided_spans_decode_as_a_pair() -> None:
    """The SDK writes nothing for an empty span list, so [] beside a non-empty list comes back as []."""
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [3, 4]},
                        model_input_spans=[], loss_fn_input_spans=[types.SampledProvenanceSpan(sequence_id="s", length=2)])
    want = types.ForwardBackwardRequest(types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"), model_id="m", seq_id=1)
    got, _ = decode_forward_backward(sdk_body(want), None)
    assert_request_equal(got, want)


# ---------------------------------------------------------------------------------------------------------------------
# malformed requests


def streamed_zeros(total: int, chunk: int = 4 * MiB) -> bytes:
    """``total`` zero bytes as one zstd frame that does not declare its size (as a hostile client would send it)."""
    cobj = zstd.ZstdCompressor(level=1, write_content_size=False).compressobj()
    zeros = bytes(chunk)
    parts = [cobj.compress(zeros) for _ in range(total // chunk)]
    return b"".join(parts) + cobj.flush()


def test_a_zstd_bomb_raises_instead_of_filling_memory() -> None:
    bomb = streamed_zeros(1024 * MiB)  # 1 GiB of zeros, a few tens of KiB compressed
    assert len(bomb) < 1 * MiB
    with pytest.raises(ValueError, match="more than the limit"):
        decode_forward_backward(bomb, "zstd", max_bytes=4 * MiB)


def test_a_zstd_frame_declaring_too_much_is_refused_before_decompressing() -> None:
    body = zstd.ZstdCompressor().compress(bytes(8 * MiB))
    assert zstd.frame_content_size(body) == 8 * MiB
    with pytest.raises(ValueError, match="declares"):
        decode_forward_backward(body, "zstd", max_bytes=MiB)


def test_the_limit_applies_to_raw_bodies_too() -> None:
    body = sdk_body(rich_request())
    with pytest.raises(ValueError, match="over the limit"):
        decode_forward_backward(body, None, max_bytes=len(body) - 1)
    decode_forward_backward(body, None, max_bytes=len(body))
    decode_forward_backward(zstd.ZstdCompressor().compress(body), "zstd", max_bytes=len(body))


@pytest.mark.parametrize("body", [b"garbage bytes \xff\xfe not a protobuf", b"\x0a\xff\xff\xff\xff\x0f", b"\xff" * 64],
                         ids=["text", "overlong-length", "ff"])
def test_garbage_raises_value_error(body: bytes) -> None:
    with pytest.raises(ValueError):
        decode_forward_backward(body, None)


@pytest.mark.parametrize("body", [b"garbage", b"\x28\xb5\x2f\xfd" + b"\x00" * 3], ids=["not-zstd", "truncated-frame"])
def test_corrupt_zstd_raises_value_error(body: bytes) -> None:
    with pytest.raises(ValueError, match="zstd"):
        decode_forward_backward(body, "zstd")


def test_a_truncated_zstd_body_raises_value_error() -> None:
    body = sdk_body(rich_request(), compress=True)
    with pytest.raises(ValueError):
        decode_forward_backward(body[: len(body) // 2], "zstd")


def test_concatenated_zstd_frames_are_one_stream_and_trailing_bytes_are_refused() -> None:
    want = rich_request()
    raw = sdk_proto(want).SerializeToString()
    cut = len(raw) // 3
    body = zstd.ZstdCompressor().compress(raw[:cut]) + zstd.ZstdCompressor(write_content_size=False).compress(raw[cut:])
    assert_request_equal(decode_forward_backward(body, "zstd")[0], want)
    with pytest.raises(ValueError, match="zstd"):
        decode_forward_backward(body + b"trailing", "zstd")


def test_an_unknown_content_encoding_raises_value_error() -> None:
    with pytest.raises(ValueError, match="Content-Encoding"):
        decode_forward_backward(sdk_body(rich_request()), "gzip")


def mutated(mutate) -> bytes:  # noqa: ANN001
    msg = sdk_proto(rich_request())
    mutate(msg)
    return msg.SerializeToString()


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda m: m.ClearField("model_id"), "no model_id"),
    (lambda m: m.ClearField("loss_fn"), "no loss_fn"),
    (lambda m: setattr(m.data[0].model_input[0].encoded_text, "tokens", b"\x01\x02\x03"), r"data\[0\]\.model_input\[0\].*whole number"),
    (lambda m: m.data[0].model_input.add(), r"data\[0\]\.model_input\[2\]: chunk has no content"),
    (lambda m: setattr(m.data[4].model_input[1].image, "format", "gif"), r"data\[4\]\.model_input\[1\]: invalid image chunk"),
    (lambda m: setattr(m.data[1].loss_fn_inputs["weights"], "dense", b"\x00" * 6), "whole number"),
    (lambda m: m.data[1].loss_fn_inputs["weights"].shape.append(2), "do not fill shape"),
    (lambda m: setattr(m.data[1].loss_fn_inputs["weights"], "dtype", public_pb.DTYPE_BFLOAT16), "unsupported tensor dtype DTYPE_BFLOAT16"),
    (lambda m: setattr(m.data[1].loss_fn_inputs["weights"], "dtype", 99), "unsupported tensor dtype 99"),
    (lambda m: m.data[1].loss_fn_inputs["weights"].ClearField("dense"), "neither dense nor sparse_csr"),
    (lambda m: setattr(m.data[3].loss_fn_inputs["weights"].sparse_csr, "col_indices", np.array([1, 6, 0], "<i8").tobytes()),
     "out of range"),
    (lambda m: setattr(m.data[3].loss_fn_inputs["weights"].sparse_csr, "crow_indices", np.array([0, 1, 1], "<i8").tobytes()), "rows \\+ 1"),
    (lambda m: setattr(m.data[3].loss_fn_inputs["weights"].sparse_csr, "crow_indices", np.array([0, 2, 1, 2, 3], "<i8").tobytes()),
     "never decrease"),
    (lambda m: m.data[3].loss_fn_inputs["weights"].shape.append(1), "2-D shape"),
    (lambda m: m.data[0].model_input_spans.add(), r"data\[0\]\.model_input_spans\[2\]: provenance span has neither"),
    (lambda m: setattr(m.data[0].loss_fn_input_spans[0].sampled_tokens, "sequence_id", ""), "sequence_id must be non-empty"),
    (lambda m: m.loss_fn_config_v2["x"].SetInParent(), "neither a number nor a text"),
], ids=["model-id", "loss-fn", "token-bytes", "empty-chunk", "image-format", "dense-bytes", "dense-shape", "bf16", "dtype-99",
        "no-encoding", "csr-col", "csr-crow-len", "csr-crow-order", "csr-3d", "empty-span", "span-id", "config-value"])
def test_malformed_fields_raise_value_error_naming_the_field(mutate, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        decode_forward_backward(mutated(mutate), None)


# ---------------------------------------------------------------------------------------------------------------------
# ForwardBackwardOutput


def fb_output(outputs: list[dict[str, types.TensorData]], metrics: dict[str, float] | None = None,
              kind: str = "ArrayRecord") -> types.ForwardBackwardOutput:
    return types.ForwardBackwardOutput(loss_fn_output_type=kind, loss_fn_outputs=outputs, metrics=metrics or {})


def assert_outputs_equal(got: types.ForwardBackwardOutput, want: types.ForwardBackwardOutput) -> None:
    assert got.loss_fn_output_type == want.loss_fn_output_type
    assert got.metrics == want.metrics
    assert len(got.loss_fn_outputs) == len(want.loss_fn_outputs)
    for i, (g, w) in enumerate(zip(got.loss_fn_outputs, want.loss_fn_outputs)):
        assert sorted(g) == sorted(w), i
        for name in w:
            assert_tensor_equal(g[name], w[name], f"loss_fn_outputs[{i}][{name}]")


def test_forward_backward_output_round_trips_through_the_sdk_reader() -> None:
    rng = np.random.default_rng(0)
    outputs = [
        {"logprobs": types.TensorData.from_numpy(rng.normal(size=n).astype(np.float32)),
         "elementwise_loss": types.TensorData.from_numpy(rng.normal(size=n).astype(np.float32)),
         "target_tokens": types.TensorData.from_numpy(np.arange(n, dtype=np.int64) + 2**40)}
        for n in (5, 17, 1, 0, 9)
    ]
    want = fb_output(outputs, {"loss:sum": 1.2345678901234567, "clip_frac:mean": 0.0, "tokens": 32.0})
    got = deserialize_forward_backward_output(encode_forward_backward_output(want))
    assert_outputs_equal(got, want)
    assert got.metrics["loss:sum"] == 1.2345678901234567  # doubles on the wire


def test_one_record_per_run_of_matching_trailing_shapes() -> None:
    """Ragged trailing shapes (e.g. a per-datum top-k width) travel as several internally rectangular chunks."""
    shapes = [(3, 2), (4, 2), (2, 5), (1, 5), (6, 2)]
    outputs = [{"topk": types.TensorData.from_numpy(np.arange(math.prod(s), dtype=np.float32).reshape(s)),
                "logprobs": types.TensorData.from_numpy(np.full(s[0], -0.5, dtype=np.float32))} for s in shapes]
    want = fb_output(outputs)
    body = encode_forward_backward_output(want)
    msg = public_pb.ForwardBackwardOutput()
    msg.ParseFromString(body)
    assert [r.num_datums for r in msg.loss_fn_outputs] == [2, 2, 1]
    assert [list(r.fields["topk"].trailing_shape) for r in msg.loss_fn_outputs] == [[2], [5], [2]]
    assert_outputs_equal(deserialize_forward_backward_output(body), want)


def test_empty_outputs_and_outputs_without_fields() -> None:
    empty = fb_output([], {"loss:sum": 0.5}, kind="TorchLossReturn")
    assert_outputs_equal(deserialize_forward_backward_output(encode_forward_backward_output(empty)), empty)
    bare = fb_output([{}, {}, {}])  # e.g. the server dropped every field: num_datums still says three
    assert_outputs_equal(deserialize_forward_backward_output(encode_forward_backward_output(bare)), bare)


def test_scalar_and_sparse_outputs_are_carried_as_the_reader_can_read_them() -> None:
    dense = np.array([[0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [3.0, 0.0, 4.0]], dtype=np.float32)
    want_sparse = sparse(dense, "float32")
    outputs = [{"loss": types.TensorData.from_numpy(np.array(1.5, dtype=np.float32)), "grid": want_sparse}]
    got = deserialize_forward_backward_output(encode_forward_backward_output(fb_output(outputs)))
    assert got.loss_fn_outputs[0]["loss"].shape == [1] and got.loss_fn_outputs[0]["loss"].data == [1.5]
    assert got.loss_fn_outputs[0]["grid"].sparse_crow_indices is None
    np.testing.assert_array_equal(got.loss_fn_outputs[0]["grid"].to_numpy(), dense)


def test_datums_with_different_fields_are_refused() -> None:
    outputs = [{"logprobs": types.TensorData(data=[0.1], dtype="float32")}, {"loss": types.TensorData(data=[0.1], dtype="float32")}]
    with pytest.raises(ValueError, match="same fields"):
        encode_forward_backward_output(fb_output(outputs))


def test_a_zero_size_trailing_dimension_is_refused() -> None:
    outputs = [{"topk": types.TensorData.from_numpy(np.zeros((3, 0), dtype=np.float32))}]
    with pytest.raises(ValueError, match="zero-size trailing"):
        encode_forward_backward_output(fb_output(outputs))


# ---------------------------------------------------------------------------------------------------------------------
# SampleResponse


def topk(rows: int, k: int, seed: int) -> TopkLogprobs:
    rng = np.random.default_rng(seed)
    return TopkLogprobs(token_ids=rng.integers(0, 50_000, size=(rows, k), dtype=np.int32),
                        logprobs=-rng.random((rows, k), dtype=np.float32))


def test_sample_response_round_trips_through_the_sdk_reader() -> None:
    prompt_lp = np.array([np.nan, -1.25, -0.5, -3.0], dtype=np.float32)
    topk_prompt = topk(4, 3, 1)
    topk_prompt.token_ids[0], topk_prompt.logprobs[0] = 0, -99999.0  # the unscored first position
    want = types.SampleResponse(
        sequences=[
            types.SampledSequence(stop_reason="stop", sequence_id="seq-a", tokens_np=np.array([10, 11, 12], dtype=np.int32),
                                  logprobs_np=np.array([-0.1, -0.2, -0.3], dtype=np.float32), topk_logprobs_np=topk(3, 2, 2)),
            types.SampledSequence(stop_reason="length", sequence_id="seq-b", tokens_np=np.array([2**31 - 1, 0, 7, 8], dtype=np.int32)),
        ],
        prompt_logprobs_np=prompt_lp,
        topk_prompt_logprobs_np=topk_prompt,
        target_prompt_logprobs=types.TensorData.from_numpy(np.array([[0.0, -1.0], [-2.0, 0.0]], dtype=np.float32)),
        prompt_alt_tokens=types.PromptAltTokens(tokens=types.TensorData.from_numpy(np.array([[5, 6], [7, 8], [9, 1]], dtype=np.int64)),
                                                logprobs=types.TensorData.from_numpy(np.full((3, 2), -0.7, dtype=np.float32))),
        prompt_cache_hit_tokens=3,
    )
    got = deserialize_sample_response(encode_sample_response(want))
    assert len(got.sequences) == 2
    for g, w in zip(got.sequences, want.sequences):
        assert g.stop_reason == w.stop_reason
        assert g.sequence_id is None  # not on this wire: the SDK stamps the ids from the asample future
        assert g.tokens == w.tokens and g.tokens_np.dtype == np.int32  # type: ignore[union-attr]
    np.testing.assert_array_equal(got.sequences[0].logprobs_np, want.sequences[0].logprobs_np)  # type: ignore[arg-type]
    assert got.sequences[1].logprobs is None and got.sequences[1].topk_logprobs is None
    got_topk, want_topk = got.sequences[0].topk_logprobs_np, want.sequences[0].topk_logprobs_np
    assert got_topk is not None and want_topk is not None
    np.testing.assert_array_equal(got_topk.token_ids, want_topk.token_ids)
    np.testing.assert_array_equal(got_topk.logprobs, want_topk.logprobs)
    assert got.sequences[0].topk_logprobs == want.sequences[0].topk_logprobs
    assert got.prompt_logprobs == [None, -1.25, -0.5, -3.0]
    np.testing.assert_array_equal(got.prompt_logprobs_np, prompt_lp)  # NaN == NaN here
    assert got.topk_prompt_logprobs == want.topk_prompt_logprobs and got.topk_prompt_logprobs[0] is None  # type: ignore[index]
    assert_tensor_equal(got.target_prompt_logprobs, want.target_prompt_logprobs, "target_prompt_logprobs")  # type: ignore[arg-type]
    assert_tensor_equal(got.prompt_alt_tokens.tokens, want.prompt_alt_tokens.tokens, "alt.tokens")  # type: ignore[union-attr]
    assert_tensor_equal(got.prompt_alt_tokens.logprobs, want.prompt_alt_tokens.logprobs, "alt.logprobs")  # type: ignore[union-attr]
    assert got.prompt_cache_hit_tokens == 3


def test_sample_response_built_from_lists() -> None:
    """The list construction path (the SDK's private ``_..._list`` fields): None prompt logprobs and ragged top-k rows."""
    seq = types.SampledSequence(stop_reason="stop", sequence_id="s", _tokens_list=[1, 2, 3], _logprobs_list=[-0.5, -0.25, -1.0],
                                _topk_logprobs_list=[[(1, -0.5), (4, -1.5)], None, [(3, -1.0)]])
    want = types.SampleResponse(sequences=[seq], _prompt_logprobs_list=[None, -2.0, -0.125],
                                _topk_prompt_logprobs_list=[None, [(7, -2.0), (8, -3.0)], [(9, -0.125)]])
    got = deserialize_sample_response(encode_sample_response(want))
    assert got.sequences[0].tokens == [1, 2, 3] and got.sequences[0].logprobs == [-0.5, -0.25, -1.0]
    assert got.sequences[0].topk_logprobs == [[(1, -0.5), (4, -1.5)], None, [(3, -1.0)]]
    assert got.prompt_logprobs == [None, -2.0, -0.125]
    assert got.topk_prompt_logprobs == [None, [(7, -2.0), (8, -3.0)], [(9, -0.125)]]


def test_sample_response_without_optional_parts() -> None:
    want = types.SampleResponse(sequences=[types.SampledSequence(stop_reason="length", sequence_id="x", tokens_np=np.zeros(0, np.int32))])
    got = deserialize_sample_response(encode_sample_response(want))
    assert got.sequences[0].tokens == [] and got.sequences[0].stop_reason == "length"
    assert got.prompt_logprobs is None and got.topk_prompt_logprobs is None
    assert got.target_prompt_logprobs is None and got.prompt_alt_tokens is None and got.prompt_cache_hit_tokens == 0


def test_sample_response_refuses_what_the_wire_cannot_say() -> None:
    bad_stop = types.SampledSequence(stop_reason="eos", sequence_id="x", tokens_np=np.array([1], np.int32))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stop_reason"):
        encode_sample_response(types.SampleResponse(sequences=[bad_stop]))
    mismatched = types.SampledSequence(stop_reason="stop", sequence_id="x", tokens_np=np.array([1, 2], np.int32),
                                       logprobs_np=np.array([-1.0], np.float32))
    with pytest.raises(ValueError, match="1 logprobs for 2 tokens"):
        encode_sample_response(types.SampleResponse(sequences=[mismatched]))
    too_big = types.SampledSequence(stop_reason="stop", sequence_id="x", _tokens_list=[2**31])
    with pytest.raises(ValueError, match="outside int32"):
        encode_sample_response(types.SampleResponse(sequences=[too_big]))


def test_the_wire_needs_no_torch() -> None:
    """Decoding and encoding work in a process where ``import torch`` fails (the SDK's torch import is optional)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent('''
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        import numpy as np
        from tinker import types
        from tinker.proto.request_conv import forward_backward_request_to_proto
        from tinker.proto.response_conv import deserialize_forward_backward_output
        from tinkergym.tinker_api.wire import decode_forward_backward, encode_forward_backward_output

        datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [3, 4]})
        request = types.ForwardBackwardRequest(types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"), model_id="m", seq_id=1)
        got, _ = decode_forward_backward(forward_backward_request_to_proto(request).SerializeToString(), None)
        assert got.forward_backward_input.data[0].loss_fn_inputs["target_tokens"].to_numpy().tolist() == [3, 4]
        out = types.ForwardBackwardOutput("ArrayRecord", [{"logprobs": types.TensorData(data=[-0.5, -1.0], dtype="float32")}])
        assert deserialize_forward_backward_output(encode_forward_backward_output(out)).loss_fn_outputs[0]["logprobs"].data == [-0.5, -1.0]
        print("ok")
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
