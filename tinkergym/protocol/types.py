"""Plain-data requests and responses of the Backend protocol.

Everything here is token id lists, floats, strings and small dicts: no tensors and no live objects, so a
request serializes to JSON (``to_dict`` / ``from_dict``) and the same protocol runs in-process or over HTTP.

Per-token arrays in a :class:`Datum` are aligned with ``tokens``: entry ``t`` describes the prediction of
``tokens[t]`` from ``tokens[:t]``, so entry 0 never counts (its mask is 0).

Images (for vision-language models) travel as :class:`ImageData`: height, width and the RGB uint8 pixels in base64,
at most :data:`MAX_IMAGES` per prompt or datum and :data:`MAX_IMAGE_PIXELS` pixels each. A request without images
has no ``images`` key at all, so text-only requests are what they were before images existed.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, TypeVar

T = TypeVar("T")

#: Where the old policy of an importance ratio comes from (``LossSpec.old_logprobs``): the sampler's logprobs,
#: or the trainer's own.
OLD_LOGPROBS = ("sampler", "trainer")


_ATOMS = frozenset({int, float, str, bool, type(None)})

#: Most images one prompt (of a :class:`SampleRequest`) or one :class:`Datum` may carry.
MAX_IMAGES = 16
#: Most pixels (height times width) of one image.
MAX_IMAGE_PIXELS = 1024 * 1024


def _fields_of(value: Any) -> list[Any]:
    """The dataclass fields of ``value`` that go on the wire: those named in ``_OMIT_WHEN_EMPTY`` only when non-empty."""
    omit = getattr(value, "_OMIT_WHEN_EMPTY", ())
    return [f for f in fields(value) if not (f.name in omit and not getattr(value, f.name))]


def _plain(value: Any) -> Any:
    """``value`` with dataclasses as dicts and every list and dict copied; a list of numbers is copied in one go."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is list or kind is tuple:
        if all(type(v) in _ATOMS for v in value):
            return kind(value)
        return kind(_plain(v) for v in value)
    if kind is dict:
        return {k: _plain(v) for k, v in value.items()}
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in _fields_of(value)}
    return value


class PlainData:
    """``to_dict`` / ``from_dict`` for the dataclasses below (nested lists of dataclasses included)."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable copy (lists are copied, as :func:`dataclasses.asdict` does, without its per-item deepcopy)."""
        return {f.name: _plain(getattr(self, f.name)) for f in _fields_of(self)}

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        """Rebuild from :meth:`to_dict` output (unknown keys are an error, so typos do not pass silently)."""
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"{cls.__name__} has no fields {sorted(unknown)}; known: {sorted(names)}")
        return cls(**{k: _NESTED.get((cls.__name__, k), lambda v: v)(v) for k, v in data.items()})


@dataclass
class ImageData(PlainData):
    """One RGB image: ``height`` x ``width`` pixels, ``data`` their uint8 values row by row (R, G, B each) in base64.

    Checked when made (also by :meth:`from_dict`): positive sizes, at most :data:`MAX_IMAGE_PIXELS` pixels, and
    ``data`` exactly as long as the base64 of ``height * width * 3`` bytes; anything else is a ``ValueError``.
    """

    height: int
    width: int
    data: str

    def __post_init__(self) -> None:
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (self.height, self.width)):
            raise ValueError(f"an image needs a positive whole height and width, not {self.height!r} x {self.width!r}")
        if self.height * self.width > MAX_IMAGE_PIXELS:
            raise ValueError(
                f"an image of {self.height} x {self.width} pixels is larger than the {MAX_IMAGE_PIXELS} pixels allowed; resize it first"
            )
        expected = 4 * ((self.height * self.width * 3 + 2) // 3)
        if not isinstance(self.data, str) or len(self.data) != expected:
            raise ValueError(
                f"an image of {self.height} x {self.width} pixels holds {expected} base64 characters (its RGB bytes), "
                f"not {len(self.data) if isinstance(self.data, str) else type(self.data).__name__}"
            )

    @classmethod
    def from_array(cls, array: Any) -> ImageData:
        """The image of an ``(H, W, 3)`` uint8 array (a NumPy array, or anything with ``shape``, ``dtype`` and ``tobytes``)."""
        shape = tuple(getattr(array, "shape", ()))
        if len(shape) != 3 or shape[2] != 3 or str(getattr(array, "dtype", "")) != "uint8":
            raise ValueError(f"an image must be an (H, W, 3) uint8 array, not shape {shape} of {getattr(array, 'dtype', type(array).__name__)}")
        return cls(height=int(shape[0]), width=int(shape[1]), data=base64.b64encode(array.tobytes()).decode("ascii"))

    def pixels(self) -> bytes:
        """The RGB bytes, ``height * width * 3`` of them (row by row)."""
        try:
            raw = base64.b64decode(self.data, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"an image's data is not base64: {exc}") from exc
        if len(raw) != self.height * self.width * 3:
            raise ValueError(f"an image of {self.height} x {self.width} pixels needs {self.height * self.width * 3} bytes, not {len(raw)}")
        return raw


def read_image_file(data: bytes, formats: tuple[str, ...] = ("PNG", "JPEG")) -> Any:
    """The ``(H, W, 3)`` uint8 pixels of an image file's bytes in one of Pillow's ``formats``, read bounded: the size from
    the header first (at most :data:`MAX_IMAGE_PIXELS` pixels: nothing larger is decoded), then the pixels. A
    ``ValueError`` says what is wrong and what to send (servers answer it as a 400)."""
    import io

    import numpy as np
    from PIL import Image

    names = " or ".join(formats)
    try:
        with Image.open(io.BytesIO(data), formats=list(formats)) as image:
            width, height = image.size  # read from the header: nothing is decoded yet
            if width * height > MAX_IMAGE_PIXELS:
                raise OverflowError(f"a {width} x {height} image is over the {MAX_IMAGE_PIXELS:,} pixels allowed; resize it first")
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except OverflowError as exc:
        raise ValueError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - bytes that do not decode are the sender's error
        raise ValueError(f"the image's bytes are not a readable {names} ({type(exc).__name__}: {str(exc)[:200]}); send the bytes of a "
                         f"{names} file") from None


def _check_images(images: list[ImageData], where: str) -> None:
    if len(images) > MAX_IMAGES:
        raise ValueError(f"{where} carries {len(images)} images; at most {MAX_IMAGES} are allowed")
    for image in images:
        if not isinstance(image, ImageData):
            raise ValueError(f"{where}: an image must be an ImageData (height, width, data), not {type(image).__name__}")


@dataclass
class SamplingParams(PlainData):
    """How to sample: ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 switch those filters off."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    #: The hottest temperature sampled at: past it every distribution is uniform to float precision.
    MAX_TEMPERATURE = 100.0

    def check(self) -> None:
        """Refuse settings out of their ranges with a ValueError whose message starts with the field's name."""
        if not 0 <= self.temperature <= self.MAX_TEMPERATURE:  # NaN fails the comparison too
            raise ValueError(f"temperature must be in [0, {self.MAX_TEMPERATURE:g}] (0: greedy), not {str(self.temperature)[:24]}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: no nucleus filter), not {str(self.top_p)[:24]}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no top-k filter), not {str(self.top_k)[:24]}")


@dataclass
class SampledSequence(PlainData):
    """One completion: the ids exactly as sampled, their logprobs under the sampling policy, why it stopped."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token, kept as the last id) or "length"


@dataclass
class SampleRequest(PlainData):
    """``num_samples`` completions for each token prompt.

    ``images``: empty (text only), or one list per prompt of the images its image tokens show, in order.
    """

    _OMIT_WHEN_EMPTY = ("images",)

    prompts: list[list[int]]
    params: SamplingParams = field(default_factory=SamplingParams)
    num_samples: int = 1
    images: list[list[ImageData]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.images:
            if not isinstance(self.images, list) or len(self.images) != len(self.prompts):
                raise ValueError(f"images must hold one list per prompt ({len(self.prompts)}), not {len(self.images)}")
            for i, row in enumerate(self.images):
                _check_images(row, f"prompt {i}")


@dataclass
class SampleResponse(PlainData):
    """``sequences[i]`` holds the completions of ``prompts[i]``."""

    sequences: list[list[SampledSequence]]


@dataclass
class Datum(PlainData):
    """One training sequence with per-token loss mask, advantages and (for RL) the sampler's logprobs.

    ``images``: the images its image tokens show, in order (empty for text).
    """

    _OMIT_WHEN_EMPTY = ("images",)

    tokens: list[int]
    loss_mask: list[float]
    advantages: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    #: The old policy's logprobs as the trainer computes them (optional; see ``LossSpec.old_logprobs``).
    old_logprobs: list[float] = field(default_factory=list)
    images: list[ImageData] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.images:
            _check_images(self.images, "a datum")


@dataclass
class LossSpec(PlainData):
    """A named loss and its settings, computed by the backend.

    Names: ``"cross_entropy"`` (SFT: mean negative log-likelihood of masked tokens), ``"ppo"`` (clipped
    importance ratio against ``sampling_logprobs``), ``"importance_sampling"`` (unclipped ratio) and
    ``"reinforce"`` (plain policy gradient, logprob times advantage); and three more of the Tinker API's:
    ``"cispo"`` (the clipped ratio, without its gradient, times logprob and advantage), ``"dro"`` (logprob times
    advantage less ``beta / 2`` times the squared log ratio) and ``"gspo"`` (``ppo`` with every token's ratio the
    sequence's: the geometric mean of its masked tokens' ratios, with the token's own gradient).
    ``aggregation`` ``"token"`` averages over all masked tokens of the batch; ``"sequence"`` averages each
    sequence first; ``"sum"`` sums, each token weighed by its ``loss_mask`` entry (any weight: the Tinker API's
    summed losses). ``kl_coef`` > 0 adds the k3 KL estimate to the reference policy (with LoRA: the base model
    with the adapter disabled).

    ``temperature`` is the temperature the data was sampled at: policy and reference logprobs are those of
    ``softmax(logits / temperature)``, the distribution the sampler drew from, so an unchanged policy has an
    importance ratio of exactly 1. ``top_k``/``top_p`` truncation cannot be scored that way and is refused
    (sample training data with ``top_k=0``, ``top_p=1``; truncation is fine in evaluation).

    ``old_logprobs`` is the old policy of the importance ratio: ``"sampler"`` (the datum's
    ``sampling_logprobs``) or ``"trainer"`` (the datum's ``old_logprobs`` when given, else the policy's own
    logprobs in this pass before its optimizer step, so the ratio starts at 1 even when the sampler's numerics
    differ). ``tis_cap`` > 0 (with ``"trainer"``) multiplies each token's loss by the truncated importance
    weight ``min(exp(trainer_old - sampler), tis_cap)`` that corrects for that difference.
    """

    name: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    aggregation: str = "token"
    loss_scale: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    old_logprobs: str = "sampler"
    tis_cap: float = 0.0
    beta: float = 0.05


@dataclass
class ForwardBackwardRequest(PlainData):
    """A batch and its loss; gradients accumulate until :meth:`Backend.optim_step`.

    ``num_tokens`` / ``num_sequences``: the loss normalizers of the whole optimizer batch (the summed loss
    mask and the number of sequences with a non-empty mask, as TRL's ``num_items_in_batch``) when it is sent
    in several requests, or when sequences without a gradient were left out of it; ``None`` uses this
    request's own. Several requests with the batch's totals before one ``optim_step`` give the gradient of one
    request with everything.

    ``return_logprobs``: answer each datum's per-token logprobs of this pass (as :meth:`Backend.logprobs` gives them,
    at the loss temperature; entry 0 and unmasked entries are 0.0) in the result.
    """

    data: list[Datum]
    loss: LossSpec = field(default_factory=LossSpec)
    num_tokens: float | None = None
    num_sequences: int | None = None
    return_logprobs: bool = False


@dataclass
class ForwardBackwardResult(PlainData):
    """Aggregated numbers of the pass (loss, KL, clip fraction, tokens); with ``return_logprobs``, each datum's logprobs."""

    metrics: dict[str, float]
    logprobs: list[list[float]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """As the other types; ``logprobs`` only when the request asked for them (the wire of a pass that did not is unchanged)."""
        data = super().to_dict()
        if data["logprobs"] is None:
            del data["logprobs"]
        return data


@dataclass
class OptimParams(PlainData):
    """AdamW settings of one optimizer step; ``max_grad_norm`` 0 switches clipping off."""

    learning_rate: float = 1e-5
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0


def _image(value: Any) -> Any:
    return ImageData.from_dict(value) if isinstance(value, dict) else value


_NESTED: dict[tuple[str, str], Any] = {
    ("SampleRequest", "images"): lambda v: [[_image(i) for i in row] if isinstance(row, list) else row for row in v] if isinstance(v, list) else v,
    ("Datum", "images"): lambda v: [_image(i) for i in v] if isinstance(v, list) else v,
    ("SampleRequest", "params"): lambda v: SamplingParams.from_dict(v) if isinstance(v, dict) else v,
    ("SampleResponse", "sequences"): lambda v: [[SampledSequence.from_dict(s) if isinstance(s, dict) else s for s in row] for row in v],
    ("ForwardBackwardRequest", "data"): lambda v: [Datum.from_dict(d) if isinstance(d, dict) else d for d in v],
    ("ForwardBackwardRequest", "loss"): lambda v: LossSpec.from_dict(v) if isinstance(v, dict) else v,
}


@dataclass
class LoraSessionConfig(PlainData):
    """A session's adapter on a shared base: its rank and alpha, and the seed of its initialization and sampling
    (:class:`tinkergym.backends.torch.lora_session.LoraSession`; a league's players: ``tinkergym.trainers.players``)."""

    lora_rank: int = 8
    lora_alpha: float = 16.0
    seed: int = 0
