"""Tinker requests as engine calls: each function here checks a request and returns the operation its future runs.

The conversions:

- A Tinker ``Datum`` (``model_input`` of text chunks, ``loss_fn_inputs`` aligned with it: position ``i`` predicts
  ``target_tokens[i]``) is our :class:`~tinkergym.protocol.types.Datum` of ``model_input + [target_tokens[-1]]``,
  which needs ``target_tokens`` to be ``model_input`` shifted by one (as every Tinker client builds them);
  other targets are refused with that reason, but at an image's positions (the SDK's cookbook writes 0 there).
- Image chunks (a vision-language model only; a text model refuses them): each decoded PNG or JPEG (at most
  :data:`~tinkergym.protocol.types.MAX_IMAGES` per input, :data:`~tinkergym.protocol.types.MAX_IMAGE_PIXELS` pixels
  each; bytes that do not decode are a 400) becomes the model's image token repeated as many times as the image
  processor makes features (as :class:`~tinkergym.chat.ImageChatRenderer` renders it), and its pixels travel with the
  row (:class:`~tinkergym.protocol.types.ImageData`); an ``expected_tokens`` other than that count is a 400. No loss
  is taken at a position whose target is an image token (its weight and advantage count as 0, its logprob reads 0).
- ``forward_backward`` is one of our requests with the same loss (the Backend protocol has every Tinker loss but
  ``stable_reinforce``, with ``aggregation="sum"``: each token weighs its loss-mask entry): ``cross_entropy``'s
  weights are the loss mask; the RL losses' advantages and sampler logprobs are the datum's, masked to the positions
  where the loss's term can be non-zero (see :func:`_policy_inputs`), so the engine shares a group's prompt and
  computes no logits for it; ``ppo``/``cispo``/``gspo``'s thresholds are ``1 - clip_low`` and ``1 + clip_high``.
  It runs in the same pass as other tenants' rows and answers the logprobs of the masked positions
  (``return_logprobs``); the others (a prompt, an observation) come from one ``logprobs`` call over the distinct
  prefixes that hold them, so every position's logprob is answered as the SDK's contract says. The elementwise
  loss is the engine's (:func:`~tinkergym.backends.torch.losses.policy_loss`) at those logprobs.
- ``forward`` scores the rows (``logprobs``) and computes the same loss without a gradient.
- ``optim_step``: AdamW with the request's ``AdamParams`` (``grad_clip_norm`` 0: no clipping).
- ``sample``: our sampler; ``prompt_logprobs`` (``compute_logprobs``) scores the prompt in a ``logprobs`` call.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import numpy as np

from tinkergym.protocol.types import (
    MAX_IMAGES,
    Datum,
    ForwardBackwardRequest,
    ImageData,
    LossSpec,
    OptimParams,
    SampleRequest,
    SamplingParams,
    read_image_file,
)
from tinkergym.tinker_api import losses as tinker_losses
from tinkergym.tinker_api.records import Run, Sampler
from tinkergym.tinker_api.service import TinkerError, TinkerService, as_array, loss_settings

#: Per-datum ``loss_fn_outputs`` are records of arrays.
OUTPUT_TYPE = "ArrayRecord"


#: The SDK's image formats, as PIL names them.
IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG"}


def image_inputs(service: TinkerService, model: str | None) -> Any | None:
    """The served model's image inputs (:class:`~tinkergym.backends.torch.vision.VisionInputs`), or None when it reads none."""
    vision = getattr(service.engine, "vision", None)
    return None if vision is None or model is None else vision(model)


def decode_image(chunk: Any, where: str) -> ImageData:
    """The pixels of an ``ImageChunk``: PNG or JPEG bytes of at most :data:`MAX_IMAGE_PIXELS` pixels, else a 400."""
    fmt = str(getattr(chunk, "format", ""))
    if fmt not in IMAGE_FORMATS:
        raise TinkerError(400, f"{where}: image format {fmt[:20]!r} is not supported; send png or jpeg")
    try:
        return ImageData.from_array(read_image_file(bytes(chunk.data), (IMAGE_FORMATS[fmt],)))
    except ValueError as exc:
        raise TinkerError(400, f"{where}: {exc}") from None


def model_input(service: TinkerService, model: str | None, value: Any, where: str) -> tuple[list[int], list[ImageData]]:
    """The token ids of a ``ModelInput`` and the images its image chunks show (see the module docstring)."""
    tokens: list[int] = []
    images: list[ImageData] = []
    image_tokens = 0
    vision = image_inputs(service, model)
    for j, chunk in enumerate(value.chunks):
        kind = getattr(chunk, "type", None)
        if kind == "encoded_text":
            tokens.extend(int(t) for t in chunk.tokens)
            continue
        if kind != "image":
            raise TinkerError(400, f"{where}: {kind or type(chunk).__name__} chunks are not supported: this server takes text and image chunks")
        if vision is None:
            raise TinkerError(400, f"{where}: image chunks are not supported: this server trains text models (its model reads no images)")
        if len(images) == MAX_IMAGES:
            raise TinkerError(400, f"{where}: more than {MAX_IMAGES} images in one input; send at most {MAX_IMAGES}")
        image = decode_image(chunk, f"{where}.chunks[{j}]")
        count = vision.token_count(image)
        expected = getattr(chunk, "expected_tokens", None)
        if expected is not None and int(expected) != count:
            raise TinkerError(400, f"{where}.chunks[{j}]: expected_tokens is {int(expected)}, but this {image.width} x {image.height} image "
                                   f"takes {count} tokens of this model; set expected_tokens to {count} (or leave it unset)")
        tokens.extend([vision.image_token_id] * count)
        images.append(image)
        image_tokens += count
    if vision is not None and tokens.count(vision.image_token_id) != image_tokens:
        raise TinkerError(400, f"{where}: a text chunk holds the image token id {vision.image_token_id}; send each image as an image chunk")
    return tokens, images


def image_positions(service: TinkerService, model: str | None, tokens: list[int]) -> np.ndarray:
    """Which of ``tokens`` are image tokens (all False for a text model)."""
    vision = image_inputs(service, model)
    if vision is None:
        return np.zeros(len(tokens), dtype=bool)
    return np.asarray(tokens, dtype=np.int64) == vision.image_token_id


class PreparedRows:
    """A request's data as our rows, with each datum's Tinker inputs as numpy arrays."""

    def __init__(self, service: TinkerService, data: list[Any], loss_name: str, model: str | None = None) -> None:
        if not data:
            raise TinkerError(400, "the request has no data")
        if len(data) > service.limits.max_datums:
            raise TinkerError(400, f"{len(data)} datums is over this server's limit of {service.limits.max_datums} per request")
        self.rows: list[Datum] = []
        self.inputs: list[dict[str, np.ndarray]] = []
        #: Per datum, the positions whose target is an image token (no loss is taken there).
        self.image_targets: list[np.ndarray] = []
        for i, datum in enumerate(data):
            where = f"data[{i}]"
            tokens, images = model_input(service, model, datum.model_input, where)
            if not tokens:
                raise TinkerError(400, f"{where}: model_input has no tokens")
            arrays = {str(k): as_array(v) for k, v in datum.loss_fn_inputs.items()}
            if "target_tokens" not in arrays:
                raise TinkerError(400, f"{where}: loss_fn_inputs needs target_tokens")
            try:
                tinker_losses.check_inputs(loss_name, arrays, len(tokens), where)
            except tinker_losses.LossInputError as exc:
                raise TinkerError(400, str(exc)) from exc
            targets = [int(t) for t in arrays["target_tokens"]]
            on_image = np.append(image_positions(service, model, tokens)[1:], False)  # position i's target is token i + 1
            shifted = [t if image else target for t, target, image in zip(tokens[1:], targets, on_image)]
            if shifted != tokens[1:]:
                raise TinkerError(400, f"{where}: target_tokens must be model_input shifted by one (position i predicts token i + 1 of the "
                                       "sequence, as the SDK's docs build them); other targets are not supported")
            if image_positions(service, model, targets[-1:]).any():
                raise TinkerError(400, f"{where}: the last target is the image token; an image is sent as an image chunk of model_input")
            for name in ("weights", "advantages"):  # no loss where the target is an image token
                if name in arrays and on_image.any():
                    arrays[name] = np.where(on_image, 0, arrays[name])
            self.rows.append(Datum(tokens=tokens + [targets[-1]], loss_mask=[0.0] + [1.0] * len(tokens), images=images))
            self.inputs.append(arrays)
            self.image_targets.append(on_image)
        service.check_tokens([d.tokens for d in self.rows], "data", model)


def _policy_inputs(rows: PreparedRows, i: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Datum ``i``'s per-position ``(mask, weights)`` for the engine (aligned with ``target_tokens``).

    ``mask``: the positions where the loss's term can be non-zero, the only ones the engine scores and trains:
    ``cross_entropy``'s non-zero weights, ``gspo``'s ratio mask, ``dro``'s every position (its penalty needs no
    advantage), the other losses' non-zero advantages (a term is ``-f(ratio) * A``). ``weights``: the engine's loss mask
    there (aggregation ``sum``: each token weighs its entry): the weights, or 1.
    """
    inputs = rows.inputs[i]
    if name == "cross_entropy":
        weights = inputs["weights"].astype(np.float64)
        return weights != 0, weights
    advantages = inputs["advantages"]
    if name == "gspo":
        mask = inputs["sequence_ratio_mask"] != 0 if "sequence_ratio_mask" in inputs else advantages != 0
        if np.any(~mask & (advantages != 0)):
            raise TinkerError(400, f"data[{i}]: gspo with advantages outside sequence_ratio_mask is not supported here: "
                                   "give those tokens a zero advantage or put them in the mask")
    elif name == "dro":
        mask = np.ones(len(advantages), dtype=bool)
    else:
        mask = advantages != 0
    mask = mask & ~rows.image_targets[i]
    return mask, mask.astype(np.float64)


def our_request(rows: PreparedRows, name: str, settings: dict[str, float]) -> tuple[ForwardBackwardRequest, list[int], list[np.ndarray]]:
    """The Backend protocol's request of a Tinker ``forward_backward`` (see the module docstring), the datums it holds (those
    with a position to train) and every datum's mask (see :func:`_policy_inputs`)."""
    data, kept, masks = [], [], []
    for i, datum in enumerate(rows.rows):
        mask, weights = _policy_inputs(rows, i, name)
        masks.append(mask)
        if not mask.any():
            continue
        kept.append(i)
        if name == "cross_entropy":
            data.append(Datum(tokens=datum.tokens, loss_mask=[0.0, *weights.tolist()], images=datum.images))
            continue
        inputs = rows.inputs[i]
        data.append(Datum(tokens=datum.tokens, loss_mask=[0.0, *weights.tolist()], advantages=[0.0, *inputs["advantages"].astype(float).tolist()],
                          sampling_logprobs=[0.0, *inputs["logprobs"].astype(float).tolist()], images=datum.images))
    low, high = settings.get("clip_low_threshold", 0.8), settings.get("clip_high_threshold", 1.2)
    spec = LossSpec(name=name, aggregation="sum", clip_low=1.0 - low, clip_high=high - 1.0, beta=settings.get("beta", 0.05))
    return ForwardBackwardRequest(data=data, loss=spec, return_logprobs=True), kept, masks


def elementwise_loss(rows: PreparedRows, i: int, name: str, settings: dict[str, float], logprobs: np.ndarray) -> np.ndarray:
    """Datum ``i``'s per-token loss at ``logprobs`` (of its ``target_tokens``), by the engine's own definitions
    (:func:`~tinkergym.backends.torch.losses.policy_loss`), over every position as Tinker defines them."""
    import torch

    from tinkergym.backends.torch.losses import policy_loss

    inputs = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in rows.inputs[i].items() if k != "target_tokens"}
    lp = torch.as_tensor(logprobs, dtype=torch.float64)
    if name == "cross_entropy":
        return (-lp * inputs["weights"]).numpy()
    low, high = settings.get("clip_low_threshold", 0.8), settings.get("clip_high_threshold", 1.2)
    mask = torch.as_tensor(_policy_inputs(rows, i, name)[0], dtype=torch.float64) if name == "gspo" else None
    with torch.no_grad():
        loss, _, _ = policy_loss(name, lp, inputs["advantages"], inputs["logprobs"], 1.0 - low, high - 1.0, mask=mask, beta=settings.get("beta", 0.05))
    return loss.numpy()


def _scored(service: TinkerService, run: Run, rows: PreparedRows, known: dict[int, tuple[np.ndarray, list[float]]]) -> list[np.ndarray]:
    """Every datum's logprobs of its ``target_tokens``: the engine's where ``known`` has them (``i: (mask, logprobs)``, valid at the
    mask's positions), the rest from one ``logprobs`` call over the shortest prefixes that hold them, each scored once
    (a group's copies of a prompt share one); a datum with images is scored whole with its images, on its own (its prefix
    of tokens is not its images'). Positions whose target is an image token read 0."""
    out = [np.zeros(len(d.tokens) - 1) for d in rows.rows]
    needs: list[tuple[int, np.ndarray, int]] = []  # (datum, positions still needed, tokens to score)
    for i in range(len(rows.rows)):
        mask = np.zeros(len(out[i]), dtype=bool)
        if i in known:
            mask, engine = known[i]
            out[i][mask] = np.asarray(engine[1:], dtype=np.float64)[mask]
        missing = np.flatnonzero(~mask)
        if len(missing):
            needs.append((i, missing, len(rows.rows[i].tokens) if rows.rows[i].images else int(missing[-1]) + 2))
    # In lexicographic order every prefix comes just before the sequences that extend it: each prefix needed rides on the
    # sequence chosen for the next one when it begins that one, else is scored itself (sorting keeps this n log n).
    prefixes = [tuple(rows.rows[i].tokens[:length]) for i, _, length in needs]
    text = [j for j, (i, _, _) in enumerate(needs) if not rows.rows[i].images]
    order = sorted(text, key=lambda j: prefixes[j])
    sequences: list[list[int]] = []
    chosen: dict[int, int] = {}
    for at in reversed(range(len(order))):
        j = order[at]
        after = order[at + 1] if at + 1 < len(order) else None
        if after is not None and prefixes[after][: len(prefixes[j])] == prefixes[j]:
            chosen[j] = chosen[after]
        else:
            sequences.append(list(prefixes[j]))
            chosen[j] = len(sequences) - 1
    images: list[list[ImageData]] = [[] for _ in sequences]
    for j, (i, _, _) in enumerate(needs):
        if rows.rows[i].images:
            sequences.append(list(prefixes[j]))
            images.append(rows.rows[i].images)
            chosen[j] = len(sequences) - 1
    where = [(i, missing, chosen[j]) for j, (i, missing, _) in enumerate(needs)]
    if sequences:
        args: dict[str, Any] = {"sequences": sequences, "temperature": 1.0}
        if any(images):
            args["images"] = images
        scored = service.call(run.handle, "logprobs", args)["logprobs"]
        for i, missing, k in where:
            out[i][missing] = np.asarray(scored[k][1:], dtype=np.float64)[missing]
    for lp, on_image in zip(out, rows.image_targets):
        lp[on_image] = 0.0
    return out


def _output(rows: PreparedRows, name: str, settings: dict[str, float], logprobs: list[np.ndarray], loss: float | None) -> Any:
    """The ``ForwardBackwardOutput``: each datum's logprobs and elementwise loss, and ``loss:sum`` (``loss``, else the elementwise sum)."""
    from tinker import types

    elementwise = [elementwise_loss(rows, i, name, settings, lp) for i, lp in enumerate(logprobs)]
    outputs = [{"logprobs": types.TensorData.from_numpy(lp.astype(np.float32)),
                "elementwise_loss": types.TensorData.from_numpy(el.astype(np.float32))} for lp, el in zip(logprobs, elementwise)]
    total = float(sum(el.sum() for el in elementwise)) if loss is None else loss
    return types.ForwardBackwardOutput(loss_fn_output_type=OUTPUT_TYPE, loss_fn_outputs=outputs, metrics={"loss:sum": total})


def forward_backward(service: TinkerService, run: Run, request: Any, forward_only: bool) -> Callable[[], Any]:
    """The operation of a ``forward_backward`` (or, ``forward_only``, a ``forward``) request."""
    spec = request.forward_backward_input
    name = str(spec.loss_fn)
    settings = loss_settings(name, spec.loss_fn_config)
    rows = PreparedRows(service, list(spec.data), name, run.base_model)
    ours, kept, masks = our_request(rows, name, settings)  # its refusals come with the request, not its result

    def run_it() -> Any:
        if forward_only:
            return _output(rows, name, settings, _scored(service, run, rows, {}), None)
        loss, known = 0.0, {}
        if ours.data:  # datums with nothing to train add no gradient: they are only scored
            result = service.call(run.handle, "forward_backward", {"request": ours})
            loss = float(result["metrics"]["loss"])
            known = {i: (masks[i], lp) for i, lp in zip(kept, result["logprobs"])}
        return _output(rows, name, settings, _scored(service, run, rows, known), loss)

    return run_it


def optim_step(service: TinkerService, run: Run, request: Any) -> Callable[[], Any]:
    params = request.optim_params
    if getattr(params, "type", "adamw") not in ("adamw", None) and not hasattr(params, "beta2"):
        raise TinkerError(400, f"optimizer {getattr(params, 'type', '?')!r} is not offered: this server steps AdamW (AdamParams)")
    ours = OptimParams(learning_rate=params.learning_rate, beta1=params.beta1, beta2=params.beta2, eps=params.eps,
                       weight_decay=params.weight_decay, max_grad_norm=params.grad_clip_norm)

    def run_it() -> Any:
        from tinker import types

        result = service.call(run.handle, "optim_step", {"params": ours})
        return types.OptimStepResponse(metrics={f"{k}:mean" if ":" not in k else k: float(v) for k, v in result.get("metrics", {}).items()})

    return run_it


def save_state(service: TinkerService, run: Run, name: str | None, kind: str, user_metadata: Any) -> Callable[[], Any]:
    """``save_weights`` (``kind`` training: the whole state), ``save_weights_for_sampler`` (sampler: the adapter) or
    ``save_weights_external`` (external: the adapter as a peft folder to download) under ``name``."""
    name = name or f"{kind}-{secrets.token_hex(4)}"
    service.new_checkpoint(run, kind, name)  # a bad name or a full run is refused when the request comes

    def run_it() -> str:
        return service.save(run, kind, name, user_metadata).tinker_path(run.model_id)

    return run_it


def load_state(service: TinkerService, run: Run, path: str, optimizer: bool) -> Callable[[], Any]:
    """Load a training checkpoint into ``run``: the weights, and with ``optimizer`` the Adam moments and step too."""
    source_run, checkpoint = service.checkpoint(run.tenant, path)
    if checkpoint.kind != "training":
        raise TinkerError(400, f"{path[:200]!r} is a {checkpoint.kind} checkpoint (weights only, for sampling or download); load a training "
                               "checkpoint (tinker://<run>/weights/<name>, from save_state)")
    if source_run.rank != run.rank:
        raise TinkerError(400, f"{path[:200]!r} holds a rank-{source_run.rank} adapter; this training run has rank {run.rank}")

    def run_it() -> Any:
        service.engine.load(run.handle, checkpoint.saved, optimizer)
        return path

    return run_it


def stop_string_end(tokenizer: Any, tokens: list[int], stops: list[str]) -> int | None:
    """The number of leading ``tokens`` whose text first holds one of ``stops`` (the tokens through the one that completes
    it), or None. Sampling stops there: the tokens after it were drawn past the stop and are dropped, which leaves the
    kept tokens distributed as a sampler that stopped at the string would have drawn them."""
    text = tokenizer.decode(tokens)
    found = [text.find(s) + len(s) for s in stops if s in text]
    if not found:
        return None
    end = min(found)
    low, high = 1, len(tokens)
    while low < high:  # the shortest prefix whose text reaches past the stop string
        mid = (low + high) // 2
        if len(tokenizer.decode(tokens[:mid])) >= end:
            high = mid
        else:
            low = mid + 1
    return low


def sample(service: TinkerService, sampler: Sampler, request: Any) -> tuple[Callable[[], Any], list[str]]:
    """The operation of an ``asample`` request, and the ``sequence_id`` of each sample it will answer."""
    prompt, images = model_input(service, sampler.base_model, request.prompt, "prompt")
    if not prompt:
        raise TinkerError(400, "prompt: give at least one token")
    params = request.sampling_params
    if not 1 <= request.num_samples <= service.limits.max_num_samples:
        raise TinkerError(400, f"num_samples must be 1 to {service.limits.max_num_samples}")
    max_tokens = service.limits.max_new_tokens if params.max_tokens is None else int(params.max_tokens)
    if not 0 <= max_tokens <= service.limits.max_new_tokens:
        raise TinkerError(400, f"max_tokens must be 0 to {service.limits.max_new_tokens}")
    stop = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    stop_ids = [int(s) for s in stop if not isinstance(s, str)]
    stop_strings = [s for s in stop if isinstance(s, str) and s]
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if getattr(request, name, 0):
            raise TinkerError(400, f"{name} is not supported by this server")
    if getattr(request, "target_prompt_logprobs", None) is not None or getattr(request, "record_stability_info", None):
        raise TinkerError(400, "target_prompt_logprobs and record_stability_info are not supported by this server")
    service.check_tokens([prompt], "prompt", sampler.base_model)
    try:
        sampling = SamplingParams(max_new_tokens=max_tokens, temperature=float(params.temperature), top_p=float(params.top_p),
                                  top_k=max(0, int(params.top_k)), stop_token_ids=stop_ids, seed=params.seed)
        sampling.check()
    except ValueError as exc:  # a temperature or top_p out of its range (NaN and infinities never reach here: 400 at the door)
        raise TinkerError(400, f"sampling_params: {exc}") from None
    ours = SampleRequest(prompts=[prompt], images=[images] if images else [], num_samples=int(request.num_samples), params=sampling)
    ids = [f"seq-{secrets.token_hex(8)}" for _ in range(ours.num_samples)]
    want_prompt = bool(request.prompt_logprobs)
    last_n = getattr(request, "prompt_logprobs_last_n", None)

    def run_it() -> Any:
        from tinker import types

        sequences: list[Any] = []
        if max_tokens > 0:
            result = service.call(sampler.handle, "sample", {"request": ours})
            for sequence_id, seq in zip(ids, result["sequences"][0]):
                tokens, logprobs, reason = seq["tokens"], seq["logprobs"], seq["finish_reason"]
                cut = stop_string_end(service.engine.tokenizer(sampler.base_model), tokens, stop_strings) if stop_strings else None
                if cut is not None:
                    tokens, logprobs, reason = tokens[:cut], logprobs[:cut], "stop"
                sequences.append(types.SampledSequence(stop_reason="stop" if reason == "stop" else "length", sequence_id=sequence_id,
                                                       tokens_np=np.asarray(tokens, dtype=np.int32), logprobs_np=np.asarray(logprobs, dtype=np.float32)))
        else:
            sequences = [types.SampledSequence(stop_reason="length", sequence_id=s, tokens_np=np.zeros(0, np.int32),
                                               logprobs_np=np.zeros(0, np.float32)) for s in ids]
        prompt_logprobs = None
        if want_prompt:
            args: dict[str, Any] = {"sequences": [prompt], "temperature": 1.0}
            if images:
                args["images"] = [images]
            scored = service.call(sampler.handle, "logprobs", args)["logprobs"][0]
            values = np.asarray(scored, dtype=np.float32)
            values[0] = np.nan
            values[1:][image_positions(service, sampler.base_model, prompt)[1:]] = np.nan  # an image token is no prediction
            if last_n is not None:
                values[: max(1, len(prompt) - int(last_n))] = np.nan
            prompt_logprobs = values
        return types.SampleResponse(sequences=sequences, prompt_logprobs_np=prompt_logprobs)

    return run_it, ids
