"""The server side of the Tinker SDK's protobuf wire, on the SDK's own schema (``tinker.proto.tinker_public_pb2``) and types.

The SDK speaks protobuf (``Content-Type``/``Accept: application/x-protobuf``) on three paths; everything else is JSON:

* ``POST /api/v1/forward_backward`` (``tinker/resources/training.py``): the body is a ``public_pb.ForwardBackwardRequest``
  written by ``tinker.proto.request_conv.forward_backward_request_to_proto`` plus ``forward_only``, and zstd-compressed
  (one frame, ``Content-Encoding: zstd``) when the client config's ``proto_compress_fwdbwd`` is on. Decompression stops
  at ``max_bytes`` (a zstd bomb raises); concatenated frames are one stream; a truncated frame or trailing bytes raise.
  :func:`decode_forward_backward` inverts it into the SDK's ``ForwardBackwardRequest``:

  - ``model_id``, ``seq_id`` (proto3 ``int32`` without presence: the SDK writes ``None`` as 0, so 0 decodes as ``None``),
    ``loss_fn``;
  - ``loss_fn_config``: the SDK dual-writes every float into the legacy ``map<string, double> loss_fn_config`` and into
    ``loss_fn_config_v2`` (a ``LossConfigValue`` oneof ``number | text``; strings live only there). v2 wins when it has
    entries, as on the real server; an absent or empty config both decode as ``None`` (the wire cannot tell them apart);
  - per ``Datum``: ``model_input`` as ``Chunk`` oneofs (``encoded_text``: tokens as little-endian ``int32`` bytes;
    ``image``: raw bytes, format, optional ``expected_tokens``; ``dmel``: opaque TensorContainer bytes), ``loss_fn_inputs``
    as ``Tensor`` (dtype ``float32 | int64``, ``shape``, and a oneof of ``dense`` bytes or ``sparse_csr`` with values in
    the dtype and ``int64`` crow/col index bytes), and the provenance spans (``ProvenanceSpan`` oneof
    ``prompt_tokens | sampled_tokens``, each ``sequence_id``/``offset``/``length``). The SDK writes nothing for a span
    list that is ``None`` or empty, so a datum with no spans decodes both as ``None`` (``Datum`` wants the pair).
    A tensor written without a shape (``TensorData.shape is None``) has an empty ``shape`` and decodes with ``shape=None``.

* ``POST /api/v1/retrieve_future`` with ``Accept: application/x-protobuf``, for ``ForwardBackwardOutput`` and
  ``SampleResponse`` (``tinker/lib/api_future_impl.py``; the SDK refuses a JSON body for those two types). The SDK reads
  them with ``tinker.proto.response_conv``; :func:`encode_forward_backward_output` and :func:`encode_sample_response`
  write exactly what it decodes:

  - ``ForwardBackwardOutput.loss_fn_outputs`` is columnar: ``ArrayRecord`` chunks, each with ``num_datums`` and per field
    one ``BatchedTensor`` (the datums' flat bytes concatenated, ``int64`` byte ``offsets`` of length ``num_datums + 1``,
    dtype, and the ``trailing_shape`` shared by the chunk's datums; the reader rebuilds ``[size // prod(trailing), *trailing]``).
    Consecutive datums with the same per-field (dtype, trailing shape) share a chunk; a change starts a new one. Every
    datum must carry the same field names. A 0-d output travels as shape ``[1]``; sparse outputs are densified (pad 0).
  - ``SampleResponse``: per sequence ``stop_reason`` (enum ``stop | length``), ``int32`` tokens, optional ``float32`` logprobs
    and an optional ``TopkLogprobs`` (row-major ``N x K`` ``int32`` ids and ``float32`` logprobs, empty cells id 0 and
    logprob -99999.0); ``prompt_logprobs`` as ``float32`` with NaN where unscored (``None`` in the list view);
    ``topk_prompt_logprobs``, ``target_prompt_logprobs``, ``prompt_alt_tokens`` and ``prompt_cache_hit_tokens``.
    ``SampledSequence.sequence_id`` is *not* on this wire: the SDK stamps it from the ``sample_sequence_ids`` of the
    asample call's future (``UntypedAPIFuture``), so the server must return those there.

This module imports no torch (numpy only). Malformed requests raise ``ValueError`` saying what is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as public_pb
from tinker.types import (
    Datum,
    DmelChunk,
    EncodedTextChunk,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    ForwardBackwardRequest,
    ImageChunk,
    ModelInput,
    SampleResponse,
    TensorData,
)
from tinker.types.provenance_spans import PromptProvenanceSpan, SampledProvenanceSpan
from tinker.types.topk_logprobs import MASK_LOGPROB, TopkLogprobs

__all__ = ["DEFAULT_MAX_BYTES", "decode_forward_backward", "encode_forward_backward_output", "encode_sample_response"]

#: The largest forward_backward body accepted, after decompression: 256 MiB.
DEFAULT_MAX_BYTES = 256 * 1024 * 1024

_READ_CHUNK = 1 << 20
_MAX_ZSTD_RATIO = 32 * 1024  # output per input byte at worst: a 3-byte block header and 1 byte repeated to 128 KiB
_INT32 = np.iinfo(np.int32)

# The public wire's tensor dtypes, both ways. The SDK writes only float32 and int64 in requests.
_PROTO_TO_TENSOR_DTYPE: dict[public_pb.DType.ValueType, tuple[str, np.dtype]] = {
    public_pb.DTYPE_FLOAT32: ("float32", np.dtype("<f4")),
    public_pb.DTYPE_INT64: ("int64", np.dtype("<i8")),
}
_TENSOR_DTYPE_TO_PROTO: dict[str, tuple[public_pb.DType.ValueType, np.dtype]] = {
    name: (proto, np_dtype) for proto, (name, np_dtype) in _PROTO_TO_TENSOR_DTYPE.items()
}
_STOP_REASON_TO_PROTO = {"stop": public_pb.STOP_REASON_STOP, "length": public_pb.STOP_REASON_LENGTH}


# ---------------------------------------------------------------------------------------------------------------------
# forward_backward request: bytes -> SDK types


def decode_forward_backward(
    body: bytes, content_encoding: str | None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[ForwardBackwardRequest, bool]:
    """The SDK's ``forward_backward`` body (raw or ``Content-Encoding: zstd``) as its ``ForwardBackwardRequest`` and ``forward_only``.

    ``max_bytes`` bounds the body after decompression. Raises ``ValueError`` for an unknown encoding, a body over the
    bound, a corrupt zstd stream or protobuf message, and any field the SDK could not have written.
    """
    raw = _decompress(bytes(body), content_encoding, max_bytes)
    msg = public_pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except (DecodeError, RuntimeError) as exc:  # upb raises DecodeError; very deep nesting can surface as RuntimeError
        raise ValueError(f"forward_backward body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    if not msg.model_id:
        raise ValueError("forward_backward request has no model_id")
    if not msg.loss_fn:
        raise ValueError("forward_backward request has no loss_fn")
    data = [_datum_from_proto(i, d) for i, d in enumerate(msg.data)]
    fbi = ForwardBackwardInput(data=data, loss_fn=msg.loss_fn, loss_fn_config=_loss_fn_config_from_proto(msg))  # type: ignore[arg-type]
    request = ForwardBackwardRequest(forward_backward_input=fbi, model_id=msg.model_id, seq_id=msg.seq_id or None)
    return request, bool(msg.forward_only)


def _decompress(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """``body`` undone of its ``Content-Encoding`` (none, ``identity`` or ``zstd``), at most ``max_bytes`` long."""
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        if len(body) > max_bytes:
            raise ValueError(f"forward_backward body is {len(body)} bytes, over the limit of {max_bytes}")
        return body
    if encoding != "zstd":
        raise ValueError(f"unsupported Content-Encoding {content_encoding!r} for forward_backward (expected zstd or none)")
    try:
        declared = zstandard.frame_content_size(body)  # -1 when the frame does not say; a cheap early refusal when it does
    except zstandard.ZstdError as exc:
        raise ValueError(f"forward_backward body is not a zstd frame: {exc}") from exc
    if declared > max_bytes:
        raise ValueError(f"zstd body declares {declared} bytes decompressed, over the limit of {max_bytes}")
    # zstd's stream reader ends a truncated frame silently, so decode with decompressobjs (one a frame), whose ``eof``
    # says the frame was whole. One answers all the output of the input it is given at once, so the input goes in
    # slices small enough that even the densest frame (a 4-byte RLE block is 128 KiB) cannot overshoot the room left
    # by much. Concatenated frames are one stream (RFC 8878); the SDK sends a single frame.
    view = memoryview(body)
    parts: list[bytes] = []
    total = position = 0
    try:
        while position < len(body):
            decompressor = zstandard.ZstdDecompressor().decompressobj()
            while not decompressor.eof:
                if position >= len(body):
                    raise ValueError("zstd body ends inside a frame (truncated)")
                step = min(_READ_CHUNK, max(64, (max_bytes - total) // _MAX_ZSTD_RATIO))
                part = decompressor.decompress(view[position:position + step])
                position += step
                total += len(part)
                if total > max_bytes:
                    raise ValueError(f"zstd body decompresses to more than the limit of {max_bytes} bytes")
                parts.append(part)
            position = min(position, len(body)) - len(decompressor.unused_data)
    except zstandard.ZstdError as exc:
        raise ValueError(f"forward_backward body is not valid zstd: {exc}") from exc
    return b"".join(parts)


def _loss_fn_config_from_proto(msg: public_pb.ForwardBackwardRequest) -> dict[str, float | str] | None:
    """The loss config: ``loss_fn_config_v2`` when it has entries, else the legacy float map; ``None`` when both are empty."""
    if msg.loss_fn_config_v2:
        config: dict[str, float | str] = {}
        for key, value in msg.loss_fn_config_v2.items():
            arm = value.WhichOneof("value")
            if arm == "number":
                config[key] = float(value.number)
            elif arm == "text":
                config[key] = value.text
            else:
                raise ValueError(f"loss_fn_config_v2[{key!r}] has neither a number nor a text value")
        return config
    if msg.loss_fn_config:
        return {key: float(value) for key, value in msg.loss_fn_config.items()}
    return None


def _datum_from_proto(index: int, msg: public_pb.Datum) -> Datum:
    """One ``Datum`` of the request; errors name ``data[index]`` and the field."""
    where = f"data[{index}]"
    chunks = [_chunk_from_proto(f"{where}.model_input[{j}]", c) for j, c in enumerate(msg.model_input)]
    inputs = {name: _tensor_from_proto(f"{where}.loss_fn_inputs[{name!r}]", t) for name, t in msg.loss_fn_inputs.items()}
    model_input_spans = [_span_from_proto(f"{where}.model_input_spans[{j}]", s) for j, s in enumerate(msg.model_input_spans)]
    loss_fn_input_spans = [_span_from_proto(f"{where}.loss_fn_input_spans[{j}]", s) for j, s in enumerate(msg.loss_fn_input_spans)]
    has_spans = bool(model_input_spans or loss_fn_input_spans)
    try:
        return Datum(model_input=ModelInput(chunks=chunks), loss_fn_inputs=inputs,  # type: ignore[arg-type]
                     model_input_spans=model_input_spans if has_spans else None,
                     loss_fn_input_spans=loss_fn_input_spans if has_spans else None)
    except (ValueError, TypeError, AssertionError) as exc:
        raise ValueError(f"{where}: {exc}") from exc


def _chunk_from_proto(where: str, msg: public_pb.Chunk) -> EncodedTextChunk | ImageChunk | DmelChunk:
    """A ``Chunk`` oneof as the SDK's chunk type."""
    arm = msg.WhichOneof("chunk")
    try:
        if arm == "encoded_text":
            tokens = _frombuffer(where + ".tokens", msg.encoded_text.tokens, np.dtype("<i4"))
            return EncodedTextChunk(tokens=tokens.tolist())
        if arm == "image":
            image = msg.image
            expected = image.expected_tokens if image.HasField("expected_tokens") else None
            return ImageChunk(data=image.data, format=image.format, expected_tokens=expected)  # type: ignore[arg-type]
        if arm == "dmel":
            return DmelChunk(dmel=msg.dmel.dmel)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ValueError(f"{where}: invalid {arm} chunk: {exc}") from exc
    raise ValueError(f"{where}: chunk has no content (expected encoded_text, image or dmel)")


def _span_from_proto(where: str, msg: public_pb.ProvenanceSpan) -> PromptProvenanceSpan | SampledProvenanceSpan:
    """A ``ProvenanceSpan`` oneof as the SDK's span type."""
    arm = msg.WhichOneof("span")
    if arm is None:
        raise ValueError(f"{where}: provenance span has neither prompt_tokens nor sampled_tokens")
    cls = PromptProvenanceSpan if arm == "prompt_tokens" else SampledProvenanceSpan
    inner = getattr(msg, arm)
    try:
        return cls(sequence_id=inner.sequence_id, offset=inner.offset, length=inner.length)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def _frombuffer(where: str, buf: bytes, dtype: np.dtype) -> np.ndarray:
    """``buf`` as a writable 1-D array of ``dtype``, refusing a length that is not a whole number of items."""
    if len(buf) % dtype.itemsize:
        raise ValueError(f"{where}: {len(buf)} bytes is not a whole number of {dtype.itemsize}-byte {dtype.name} items")
    return np.frombuffer(buf, dtype=dtype).astype(dtype.newbyteorder("="), copy=True)


def _tensor_from_proto(where: str, msg: public_pb.Tensor) -> TensorData:
    """A request ``Tensor`` as ``TensorData``, keeping a sparse CSR tensor sparse. Inverse of ``request_conv._tensor_data_to_proto``."""
    dtypes = _PROTO_TO_TENSOR_DTYPE.get(msg.dtype)
    if dtypes is None:
        name = public_pb.DType.Name(msg.dtype) if msg.dtype in public_pb.DType.values() else str(msg.dtype)
        raise ValueError(f"{where}: unsupported tensor dtype {name} (the SDK writes float32 or int64)")
    dtype, np_dtype = dtypes
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise ValueError(f"{where}: negative dimension in shape {shape}")
    arm = msg.WhichOneof("encoding")
    if arm == "dense":
        values = _frombuffer(where + ".dense", msg.dense, np_dtype)
        if shape and values.size != math.prod(shape):
            raise ValueError(f"{where}: {values.size} values do not fill shape {shape}")
        return TensorData(data=values, dtype=dtype, shape=shape or None)  # type: ignore[arg-type]
    if arm == "sparse_csr":
        csr = msg.sparse_csr
        values = _frombuffer(where + ".sparse_csr.values", csr.values, np_dtype)
        crow = _frombuffer(where + ".sparse_csr.crow_indices", csr.crow_indices, np.dtype("<i8"))
        col = _frombuffer(where + ".sparse_csr.col_indices", csr.col_indices, np.dtype("<i8"))
        _check_csr(where, shape, values, crow, col)
        return TensorData(data=values, dtype=dtype, shape=shape,  # type: ignore[arg-type]
                          sparse_crow_indices=crow.tolist(), sparse_col_indices=col.tolist())
    raise ValueError(f"{where}: tensor has neither dense nor sparse_csr data")


def _check_csr(where: str, shape: Sequence[int], values: np.ndarray, crow: np.ndarray, col: np.ndarray) -> None:
    """Refuse a CSR triple that does not describe a 2-D tensor of ``shape``."""
    if len(shape) != 2:
        raise ValueError(f"{where}: a sparse CSR tensor needs a 2-D shape, got {list(shape)}")
    rows, cols = shape
    if crow.size != rows + 1:
        raise ValueError(f"{where}: crow_indices has {crow.size} entries, expected rows + 1 = {rows + 1}")
    if crow[0] != 0 or np.any(np.diff(crow) < 0):
        raise ValueError(f"{where}: crow_indices must start at 0 and never decrease")
    if not (crow[-1] == col.size == values.size):
        raise ValueError(f"{where}: crow_indices ends at {int(crow[-1])} but there are {col.size} col_indices and {values.size} values")
    if col.size and (col.min() < 0 or col.max() >= cols):
        raise ValueError(f"{where}: col_indices out of range [0, {cols})")


# ---------------------------------------------------------------------------------------------------------------------
# responses: SDK types -> bytes


def encode_forward_backward_output(output: ForwardBackwardOutput) -> bytes:
    """``output`` as the ``ForwardBackwardOutput`` protobuf that ``response_conv.deserialize_forward_backward_output`` reads.

    Raises ``ValueError`` when the datums' outputs cannot be carried: different field names across datums, a dtype other
    than float32/int64, or a zero-size trailing dimension (the reader could not recover the leading one).
    """
    msg = public_pb.ForwardBackwardOutput(loss_fn_output_type=output.loss_fn_output_type)
    for key, value in output.metrics.items():
        msg.metrics[key] = float(value)
    outputs = list(output.loss_fn_outputs)
    if not outputs:
        return msg.SerializeToString()
    names = sorted(outputs[0])
    arrays: list[dict[str, tuple[public_pb.DType.ValueType, np.ndarray]]] = []
    for i, datum in enumerate(outputs):
        if sorted(datum) != names:
            raise ValueError(f"loss_fn_outputs[{i}] has fields {sorted(datum)}, but loss_fn_outputs[0] has {names}: "
                             "every datum must carry the same fields")
        arrays.append({name: _output_array(f"loss_fn_outputs[{i}][{name!r}]", datum[name]) for name in names})

    def signature(row: dict[str, tuple[public_pb.DType.ValueType, np.ndarray]]) -> tuple[tuple[int, tuple[int, ...]], ...]:
        return tuple((proto_dtype, arr.shape[1:]) for proto_dtype, arr in (row[name] for name in names))

    start = 0
    while start < len(arrays):  # one ArrayRecord per run of datums sharing every field's dtype and trailing shape
        end = start + 1
        while end < len(arrays) and signature(arrays[end]) == signature(arrays[start]):
            end += 1
        record = msg.loss_fn_outputs.add(type_tag=output.loss_fn_output_type, num_datums=end - start)
        for name in names:
            proto_dtype, first = arrays[start][name]
            chunk = [arrays[k][name][1] for k in range(start, end)]
            offsets = np.zeros(len(chunk) + 1, dtype="<i8")
            np.cumsum([a.nbytes for a in chunk], out=offsets[1:])
            bt = record.fields[name]
            bt.dtype = proto_dtype
            bt.data = b"".join(a.tobytes() for a in chunk)
            bt.offsets = offsets.tobytes()
            bt.trailing_shape.extend(first.shape[1:])
        start = end
    return msg.SerializeToString()


def _output_array(where: str, td: TensorData) -> tuple[public_pb.DType.ValueType, np.ndarray]:
    """A per-datum output as (proto dtype, little-endian array of at least one dimension), densified if sparse."""
    proto_dtype, np_dtype = _proto_dtype(where, td)
    arr = _dense_array(where, td, np_dtype)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if any(s == 0 for s in arr.shape[1:]):
        raise ValueError(f"{where}: shape {list(arr.shape)} has a zero-size trailing dimension, which the wire cannot carry")
    return proto_dtype, np.ascontiguousarray(arr)


def _proto_dtype(where: str, td: TensorData) -> tuple[public_pb.DType.ValueType, np.dtype]:
    dtypes = _TENSOR_DTYPE_TO_PROTO.get(td.dtype)
    if dtypes is None:
        raise ValueError(f"{where}: unsupported TensorData dtype {td.dtype!r} (float32 or int64)")
    return dtypes


def _sparse_parts(where: str, td: TensorData, np_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sparse ``TensorData``'s (values, crow, col), checked."""
    if td.sparse_col_indices is None or td.shape is None:
        raise ValueError(f"{where}: a sparse CSR TensorData needs sparse_col_indices and shape")
    values = np.asarray(td.data, dtype=np_dtype)
    crow = np.asarray(td.sparse_crow_indices, dtype="<i8")
    col = np.asarray(td.sparse_col_indices, dtype="<i8")
    _check_csr(where, td.shape, values, crow, col)
    return values, crow, col


def _dense_array(where: str, td: TensorData, np_dtype: np.dtype) -> np.ndarray:
    """``td`` as a dense array of ``np_dtype`` (a sparse CSR tensor densified with 0), without torch."""
    if td.sparse_crow_indices is None:
        return np.asarray(td.to_numpy(), dtype=np_dtype)
    values, crow, col = _sparse_parts(where, td, np_dtype)
    dense = np.zeros(td.shape, dtype=np_dtype)  # type: ignore[arg-type]
    dense[np.repeat(np.arange(len(crow) - 1), np.diff(crow)), col] = values
    return dense


def _tensor_to_proto(where: str, td: TensorData, msg: public_pb.Tensor) -> None:
    """Write ``td`` into ``msg`` (dense or sparse CSR) as ``response_conv._tensor_data_from_proto`` reads it: the shape always written."""
    proto_dtype, np_dtype = _proto_dtype(where, td)
    msg.dtype = proto_dtype
    if td.sparse_crow_indices is not None:
        values, crow, col = _sparse_parts(where, td, np_dtype)
        msg.shape.extend(td.shape or [])
        msg.sparse_csr.values = values.tobytes()
        msg.sparse_csr.crow_indices = crow.tobytes()
        msg.sparse_csr.col_indices = col.tobytes()
        return
    arr = np.ascontiguousarray(td.to_numpy(), dtype=np_dtype)
    msg.shape.extend(td.shape if td.shape is not None else arr.shape)
    msg.dense = arr.tobytes()


def encode_sample_response(response: SampleResponse) -> bytes:
    """``response`` as the ``SampleResponse`` protobuf that ``response_conv.deserialize_sample_response`` reads.

    The sequences' ``sequence_id`` is not on this wire (see the module docstring). An empty ``logprobs`` or
    ``prompt_logprobs`` reads back as ``None``, and a top-k with no rows or k = 0 as ``None``: the reader's choice.
    """
    msg = public_pb.SampleResponse(prompt_cache_hit_tokens=int(response.prompt_cache_hit_tokens))
    for i, seq in enumerate(response.sequences):
        where = f"sequences[{i}]"
        stop = _STOP_REASON_TO_PROTO.get(seq.stop_reason)
        if stop is None:
            raise ValueError(f"{where}: unknown stop_reason {seq.stop_reason!r} (stop or length)")
        tokens = _int32_tokens(where + ".tokens", seq.tokens_np if seq.tokens_np is not None else seq.tokens)
        out = msg.sequences.add(stop_reason=stop, tokens=tokens.tobytes())
        logprobs = seq.logprobs_np if seq.logprobs_np is not None else seq.logprobs
        if logprobs is not None:
            lp = np.asarray(logprobs, dtype="<f4").reshape(-1)
            if lp.size != tokens.size:
                raise ValueError(f"{where}: {lp.size} logprobs for {tokens.size} tokens")
            out.logprobs = lp.tobytes()
        topk = seq.topk_logprobs_np if seq.topk_logprobs_np is not None else seq.topk_logprobs
        if topk is not None:
            _topk_to_proto(where + ".topk_logprobs", topk, out.topk_sampled_logprobs)
    prompt = response.prompt_logprobs_np if response.prompt_logprobs_np is not None else response.prompt_logprobs
    if prompt is not None:
        values = prompt if isinstance(prompt, np.ndarray) else [math.nan if v is None else v for v in prompt]
        msg.prompt_logprobs = np.asarray(values, dtype="<f4").reshape(-1).tobytes()
    topk_prompt = response.topk_prompt_logprobs_np if response.topk_prompt_logprobs_np is not None else response.topk_prompt_logprobs
    if topk_prompt is not None:
        _topk_to_proto("topk_prompt_logprobs", topk_prompt, msg.topk_prompt_logprobs)
    if response.target_prompt_logprobs is not None:
        _tensor_to_proto("target_prompt_logprobs", response.target_prompt_logprobs, msg.target_prompt_logprobs)
    if response.prompt_alt_tokens is not None:
        _tensor_to_proto("prompt_alt_tokens.tokens", response.prompt_alt_tokens.tokens, msg.prompt_alt_tokens.tokens)
        _tensor_to_proto("prompt_alt_tokens.logprobs", response.prompt_alt_tokens.logprobs, msg.prompt_alt_tokens.logprobs)
    return msg.SerializeToString()


def _int32_tokens(where: str, tokens: Any) -> np.ndarray:
    """Token ids as a flat little-endian int32 array, refusing ids outside int32."""
    arr = np.asarray(tokens if len(tokens) else [], dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < _INT32.min or arr.max() > _INT32.max):
        raise ValueError(f"{where}: token ids outside int32")
    return arr.astype("<i4")


def _topk_to_proto(where: str, topk: TopkLogprobs | Sequence[Sequence[tuple[int, float]] | None], msg: public_pb.TopkLogprobs) -> None:
    """Top-k logprobs (the SDK's matrices or its list view, ``None`` rows allowed) as a row-major ``TopkLogprobs``."""
    if isinstance(topk, TopkLogprobs):
        ids = np.asarray(topk.token_ids, dtype=np.int64)
        lps = np.asarray(topk.logprobs, dtype="<f4")
        if ids.ndim != 2 or ids.shape != lps.shape:
            raise ValueError(f"{where}: token_ids {list(ids.shape)} and logprobs {list(lps.shape)} must be matching 2-D matrices")
    else:
        rows = list(topk)
        k = max((len(row) for row in rows if row is not None), default=0)
        ids = np.zeros((len(rows), k), dtype=np.int64)
        lps = np.full((len(rows), k), MASK_LOGPROB, dtype="<f4")
        for i, row in enumerate(rows):
            for j, (token, logprob) in enumerate(row or ()):
                ids[i, j], lps[i, j] = token, logprob
    if ids.size and (ids.min() < _INT32.min or ids.max() > _INT32.max):
        raise ValueError(f"{where}: token ids outside int32")
    msg.SetInParent()
    msg.length, msg.k = ids.shape
    msg.token_ids = ids.astype("<i4").tobytes()
    msg.logprobs = lps.tobytes()
