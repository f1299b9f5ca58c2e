"""Vision-language models in TorchBackend: images to the model's pixel inputs, rope positions, sampling rows with images.

A model folder is a vision-language model when its config has a ``vision_config`` and the folder an image processor
(:func:`~tinkergym.backends.models.is_vision_folder`); :class:`VisionInputs` then turns the protocol's images
(:class:`~tinkergym.protocol.types.ImageData`) into what its forward pass takes beside the token ids:
``pixel_values`` and ``image_grid_thw`` (Qwen2-VL's), and the 3D rope positions Qwen2-VL's language model reads
(``get_rope_index``: text tokens count on by one, an image's tokens by their place in the image's grid), computed
here and passed explicitly, so the model's own cached ``rope_deltas`` never decide a position.

Training passes and the sampler's prefill give the model the same inputs, so the sampler's logprobs are the training
pass's. Rows with images bypass the prefix cache and shared prompts, in sampling and in training: those key on token
ids, and every image shows as the same image token ids (and, in Qwen2-VL, shifts the positions of the text after it
by its grid's size), so a cached prompt of one image would serve another. A prompt with images is prefilled once
and its KV cache repeated for its samples; decoding is the text sampler's (:func:`~tinkergym.backends.torch.sampling.decode`).

A vision-language policy never writes image tokens: :func:`forbid_tokens` sets their logits to
:data:`FORBIDDEN_LOGIT` in every forward pass (sampling and training alike, so the two agree), because an image token
the policy wrote would have no image behind it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from tinkergym.backends.torch.cache_names import cache_of
from tinkergym.backends.torch.sampling import SeededRows, autograd_off, decode, preallocated, finished_sequences, stop_table, STOP_CHECK_INTERVAL
from tinkergym.backends.torch.scoring import host_to_device
from tinkergym.errors import ConfigError
from tinkergym.protocol.types import ImageData, SampledSequence, SamplingParams

#: The logit of a token the policy never writes: finite, so a masked-out position's logprob times 0 stays 0, and
#: far enough below any real logit that its probability is 0 in float32.
FORBIDDEN_LOGIT = -1.0e4

#: Special tokens of Qwen2-VL's vision markers, which a policy never writes.
VISION_TOKEN_NAMES = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def image_array(image: ImageData) -> np.ndarray:
    """The ``(H, W, 3)`` uint8 pixels of a protocol image."""
    return np.frombuffer(image.pixels(), dtype=np.uint8).reshape(image.height, image.width, 3)


def vision_token_ids(tokenizer: Any) -> list[int]:
    """The ids of ``tokenizer``'s vision markers (a vision-language policy never writes them)."""
    ids = [tokenizer.convert_tokens_to_ids(name) for name in VISION_TOKEN_NAMES]
    return [i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id]


def forbid_tokens(model: torch.nn.Module, token_ids: list[int]) -> None:
    """Set the logits of ``token_ids`` to :data:`FORBIDDEN_LOGIT` in every forward pass of ``model``'s output layer."""
    if not token_ids:
        return
    index = torch.tensor(sorted(set(token_ids)), dtype=torch.long)

    def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.index_fill(-1, index.to(output.device), FORBIDDEN_LOGIT)

    model.get_output_embeddings().register_forward_hook(hook)  # type: ignore[operator]  # an HF method via nn.Module.__getattr__


class VisionInputs:
    """What a vision-language model reads beside the token ids, made from the protocol's images.

    Args:
        image_processor: the model's image processor (``pixel_values``, ``image_grid_thw``, ``merge_size``).
        image_token_id: the id of the image token (one per image feature).
        rope_model: the module with ``get_rope_index`` (Qwen2-VL's inner model), or None for models without 3D positions.
    """

    #: Image sizes whose token counts are kept (the most recently used).
    COUNT_CACHE = 256

    def __init__(self, image_processor: Any, image_token_id: int, rope_model: Any | None) -> None:
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.rope_model = rope_model
        self.merge_length = int(getattr(image_processor, "merge_size", 1)) ** 2
        self._counts: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._counts_lock = threading.Lock()

    @classmethod
    def of(cls, model: torch.nn.Module, path: str, tokenizer: Any) -> VisionInputs:
        """The inputs of the vision-language model ``model`` loaded from ``path``."""
        from transformers import AutoImageProcessor

        config = model.config
        image_token_id = getattr(config, "image_token_id", None)
        if image_token_id is None:
            image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        rope_model = next((m for m in model.modules() if callable(getattr(m, "get_rope_index", None))), None)
        return cls(AutoImageProcessor.from_pretrained(path), int(image_token_id), rope_model)

    @classmethod
    def of_folder(cls, path: str, tokenizer: Any) -> VisionInputs:
        """The image processor and image token of the vision-language model folder ``path``, without its weights: enough to
        count an image's tokens (:meth:`token_count`), not to build a forward pass's inputs (no 3D positions)."""
        from transformers import AutoConfig, AutoImageProcessor

        image_token_id = getattr(AutoConfig.from_pretrained(path), "image_token_id", None)
        if image_token_id is None:
            image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        return cls(AutoImageProcessor.from_pretrained(path), int(image_token_id), None)

    def pixels(self, images: list[ImageData], device: torch.device) -> dict[str, torch.Tensor]:
        """``pixel_values`` and ``image_grid_thw`` of ``images`` on ``device`` (empty for no images)."""
        if not images:
            return {}
        from PIL import Image

        out = self.image_processor(images=[Image.fromarray(image_array(i)) for i in images], return_tensors="pt")
        return {"pixel_values": host_to_device(out["pixel_values"], device), "image_grid_thw": host_to_device(out["image_grid_thw"], device)}

    def check_rows(self, rows: list[list[int]], images: list[list[ImageData]], where: str,
                   advice: str = "render the conversation with the model's renderer (tinkergym.chat.ImageChatRenderer) and send its images",
                   ) -> None:
        """Each row holds as many image tokens as its images make features; a :class:`ConfigError` says which does not, and
        ``advice`` what to do."""
        for i, (tokens, row_images) in enumerate(zip(rows, images)):
            expected = sum(self.token_count(image) for image in row_images)
            found = sum(1 for t in tokens if t == self.image_token_id)
            if found != expected:
                raise ConfigError(
                    f"{where} {i}: its tokens hold {found} image tokens, but its {len(row_images)} images make {expected} image "
                    f"features; {advice}"
                )

    def token_count(self, image: ImageData) -> int:
        """How many image tokens ``image`` takes (its features after merging).

        The processor's grid follows from the image's size alone (it resizes to a multiple of its patch size within its pixel
        bounds), so the count is kept per size: a call's checks and a conversation's later turns do not run the processor again.
        """
        from PIL import Image

        key = (image.height, image.width)
        with self._counts_lock:
            if key in self._counts:
                self._counts.move_to_end(key)
                return self._counts[key]
        grid = self.image_processor(images=[Image.fromarray(image_array(image))], return_tensors="np")["image_grid_thw"]
        count = int(grid[0].prod()) // self.merge_length
        with self._counts_lock:
            self._counts[key] = count
            while len(self._counts) > self.COUNT_CACHE:
                self._counts.popitem(last=False)
        return count

    def model_inputs(self, tokens_BT: torch.Tensor, attention_BT: torch.Tensor | None, images: list[list[ImageData]]) -> dict[str, torch.Tensor]:
        """The forward pass's keyword arguments beside the ids for rows ``tokens_BT`` (right-padded) showing ``images``."""
        inputs = self.pixels([image for row in images for image in row], tokens_BT.device)
        if not inputs:
            return {}
        if self.rope_model is not None:
            mm_token_type_ids = (tokens_BT == self.image_token_id).int()
            positions, _ = self.rope_model.get_rope_index(
                tokens_BT, mm_token_type_ids, image_grid_thw=inputs["image_grid_thw"], attention_mask=attention_BT
            )
            inputs["position_ids"] = positions
        return inputs


@autograd_off
def sample_with_images(
    model: torch.nn.Module,
    prompt: list[int],
    images: list[ImageData],
    vision: VisionInputs,
    num_samples: int,
    params: SamplingParams,
    stop_ids: list[int],
    pad_id: int,
    generator: torch.Generator | SeededRows | None = None,
) -> list[SampledSequence]:
    """``num_samples`` completions of one prompt with images: the prompt is prefilled once (with its pixels and
    positions), its KV cache repeated for every sample, and the samples decoded together as the text sampler does."""
    device = next(model.parameters()).device
    tokens = host_to_device(torch.tensor([prompt], dtype=torch.long), device)
    inputs = vision.model_inputs(tokens, None, [images])
    out = model(input_ids=tokens, **inputs, use_cache=True, logits_to_keep=1)
    logits_BV, cache = out.logits[:, -1].repeat(num_samples, 1), cache_of(out)
    if num_samples > 1:
        cache.batch_repeat_interleave(num_samples)
    positions = inputs.get("position_ids")
    # Text after the last image counts on by one in every rope dimension: the first one's row continues the prompt.
    text_positions = positions[0] if positions is not None else torch.arange(len(prompt), device=device)[None]
    text_positions = text_positions.expand(num_samples, -1)
    cache = preallocated(cache, params.max_new_tokens)
    is_stop_V = stop_table(logits_BV.shape[-1], pad_id, stop_ids, device)
    tokens_BS, logprobs_BS, steps, _ = decode(model, logits_BV, cache, None, text_positions, params, is_stop_V, pad_id, generator, STOP_CHECK_INTERVAL)
    return finished_sequences(tokens_BS, logprobs_BS, steps, stop_ids)
