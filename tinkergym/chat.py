"""Chat rendering with the model's own chat template: messages -> token ids, and the bridge between turns.

:class:`ChatTemplateRenderer` wraps a Hugging Face tokenizer (imported lazily: ``transformers`` is needed only
when a renderer is built). The rollout loop uses two calls:

- :meth:`~ChatTemplateRenderer.prompt_tokens`: the first prompt, ending with the generation prompt.
- :meth:`~ChatTemplateRenderer.bridge_tokens`: the ids that follow the sampled ids of an assistant turn up to
  the next generation prompt: the rest of the template's turn closing (e.g. ``"\\n"`` after ``<|im_end|>``),
  the observation message and the generation prompt. They are the template's own rendering: the suffix of
  ``render(conversation + [observation], generation prompt)`` after ``render(conversation)``.

The sampled ids themselves are never re-tokenized, so a trajectory equals the template's rendering of its
conversation (when the sampled ids are the tokenizer's own segmentation of their text; otherwise it keeps the
sampled ids, and the decoded texts agree). Documented differences: a trajectory ends with its last sampled
id (what the template writes after the final end-of-turn token, e.g. a newline, is not part of the episode);
and when a turn stops at the token budget without a stop token, the bridge starts with the template's
end-of-turn token (mask 0), so the turn is closed exactly as the template would close it.

Templates that ignore ``tools`` (SmolLM2's, for one) get the tool schemas described in the system message.

Observations with images (:class:`~tinkergym.spaces.TextWithImages`) become messages with content lists
through :func:`observation_message`, their images kept beside the messages; :class:`ChatTemplateRenderer`
(a text tokenizer's template) renders such messages with each image part as :data:`IMAGE_PLACEHOLDER`.

:class:`ImageChatRenderer` renders them for a vision-language model with an image processor (Qwen2-VL's family and
models built like it): the template writes each image part as the model's image markers around one image token
(Qwen2-VL: ``<|vision_start|><|image_pad|><|vision_end|>``), and the renderer repeats that token as many times as the
image processor makes image features of the image (Qwen2-VL: ``grid_t * grid_h * grid_w / merge_size**2``), as the
model's processor does, then tokenizes. The tokens of a conversation with images are fixed by its text and its
images' sizes, and the invariants above hold: sampled ids are never re-tokenized, and the bridge is the template's
own rendering. Its methods take ``images``: the images of the messages in message order (as
:func:`observation_message` keeps them); each rendering uses as many as its messages hold image parts. The image
processor runs once per image: its count is kept under a digest of the image's pixels (the most recently used
:data:`IMAGE_CACHE_ENTRIES`), so a multi-turn episode, whose every turn renders all its images again, measures each once.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

Message = dict[str, Any]


class ChatRenderer(Protocol):
    """What the rollout loop needs from a tokenizer and its chat template."""

    stop_token_ids: list[int]

    def render(self, messages: list[Message], tools: list[dict] | None = None, add_generation_prompt: bool = False) -> list[int]: ...

    def prompt_tokens(self, messages: list[Message], tools: list[dict] | None) -> list[int]: ...

    def bridge_tokens(self, messages: list[Message], observation: Message, tools: list[dict] | None, stopped: bool) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...


def describe_tools(tools: list[dict]) -> str:
    """Tool schemas as system-prompt text, for chat templates that do not render ``tools`` themselves."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call these tools. Each is described by a JSON schema:\n<tools>\n" + lines + "\n</tools>\n"
        'To call one, write <tool_call>{"name": <tool name>, "arguments": <arguments object>}</tool_call>.'
    )


class ChatTemplateRenderer:
    """Renders conversations with a Hugging Face tokenizer's chat template.

    Args:
        tokenizer: a loaded tokenizer, or a local folder to load it from.
    """

    def __init__(self, tokenizer: Any) -> None:
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        if not getattr(tokenizer, "chat_template", None):
            from tinkergym.errors import ConfigError

            raise ConfigError("the tokenizer has no chat template; use an instruct/chat model or set tokenizer.chat_template.")
        self.tokenizer = tokenizer
        stops = {tokenizer.eos_token_id}
        for name in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
            token_id = tokenizer.convert_tokens_to_ids(name)
            if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
                stops.add(token_id)
        self.stop_token_ids = sorted(t for t in stops if t is not None)
        self._template_renders_tools: bool | None = None

    def render_text(self, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        """The template's text for ``messages`` (tools folded into the system message if the template ignores them)."""
        messages, tools = self._with_tools(text_only_messages(messages), tools)
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt)

    def render(self, messages: list[Message], tools: list[dict] | None = None, add_generation_prompt: bool = False) -> list[int]:
        """The template's token ids for ``messages``."""
        return self.tokenizer.encode(self.render_text(messages, tools, add_generation_prompt), add_special_tokens=False)

    def prompt_tokens(self, messages: list[Message], tools: list[dict] | None) -> list[int]:
        """The first prompt: the conversation so far plus the generation prompt."""
        return self.render(messages, tools, add_generation_prompt=True)

    def bridge_tokens(self, messages: list[Message], observation: Message, tools: list[dict] | None, stopped: bool) -> list[int]:
        """Ids between the sampled ids of the last assistant turn in ``messages`` and the next generation prompt's end."""
        closed = self.render(messages, tools)
        following = self.render([*messages, observation], tools, add_generation_prompt=True)
        return bridge_between(closed, following, self.stop_token_ids, stopped)

    def decode(self, tokens: list[int]) -> str:
        """Text of sampled ids, without a final stop token."""
        if tokens and tokens[-1] in self.stop_token_ids:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def _with_tools(self, messages: list[Message], tools: list[dict] | None) -> tuple[list[Message], list[dict] | None]:
        if not tools:
            return messages, None
        if self._template_renders_tools is None:
            probe = [{"role": "user", "content": "x"}]
            plain = self.tokenizer.apply_chat_template(probe, tokenize=False)
            self._template_renders_tools = plain != self.tokenizer.apply_chat_template(probe, tools=tools, tokenize=False)
        if self._template_renders_tools:
            return messages, tools
        text = describe_tools(tools)
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]], None
        return [{"role": "system", "content": text}, *messages], None


def bridge_between(closed: list[int], following: list[int], stop_token_ids: list[int], stopped: bool) -> list[int]:
    """The bridge of :meth:`ChatTemplateRenderer.bridge_tokens` from its two renderings: ``closed`` (the conversation)
    and ``following`` (the conversation, the next message and the generation prompt)."""
    common = 0
    for a, b in zip(closed, following):
        if a != b:
            break
        common += 1
    end = max((i for i, t in enumerate(closed) if t in stop_token_ids), default=len(closed) - 1)
    if common <= end:
        from tinkergym.errors import TinkergymError

        raise TinkergymError(
            "the chat template renders earlier turns differently once a new message follows (it is not prefix-stable); "
            "multi-turn rollouts need a template whose rendering of a conversation starts with its rendering of any prefix."
        )
    closing = closed[end + (1 if stopped else 0) : common]
    return closing + following[common:]


# ----- observations with images -------------------------------------------------------------------
#: What a text-only template shows in place of an image part.
IMAGE_PLACEHOLDER = "<image>"


def observation_message(observation: Any, role: str = "user") -> tuple[Message, list[Any]]:
    """The chat message of an env observation, and the images it shows (kept beside the messages).

    A ``str`` observation (a text env) is ``{"role": role, "content": text}`` with no images, exactly as
    before. A :class:`~tinkergym.spaces.TextWithImages` observation with images becomes an
    OpenAI/transformers-style content list, one ``{"type": "image"}`` part per image, in order, then the
    text: ``[{"type": "image"}, {"type": "text", "text": ...}]``. The parts hold no pixels: the images
    come back as the second value, and a conversation's images are the concatenation of its messages'
    images in message order (what a processor's ``images=`` takes beside the rendered template).
    """
    if not isinstance(observation, dict):
        return {"role": role, "content": observation if isinstance(observation, str) else str(observation)}, []
    text = str(observation.get("text", ""))
    images = list(observation.get("images", ()))
    if not images:
        return {"role": role, "content": text}, []
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in images]
    parts.append({"type": "text", "text": text})
    return {"role": role, "content": parts}, images


def count_image_parts(messages: list[Message]) -> int:
    """How many ``{"type": "image"}`` parts ``messages`` hold (the number of images kept beside them)."""
    return sum(1 for m in messages if isinstance(m.get("content"), list) for part in m["content"] if isinstance(part, dict) and part.get("type") == "image")


def text_only_messages(messages: list[Message], placeholder: str = IMAGE_PLACEHOLDER) -> list[Message]:
    """``messages`` with every content list flattened to a string (image parts become ``placeholder``).

    For chat templates that only render string contents (text models): the text keeps its place and
    each image is marked where it was.
    """
    flat = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            pieces = [placeholder if isinstance(p, dict) and p.get("type") == "image" else str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content]
            message = {**message, "content": "\n".join(pieces)}
        flat.append(message)
    return flat


def to_pil_images(images: list[Any]) -> list[Any]:
    """The images as ``PIL.Image.Image`` objects in RGB mode (Pillow is imported here, lazily)."""
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from tinkergym.errors import ConfigError

        raise ConfigError("images need Pillow; install it with: pip install Pillow") from exc
    import numpy as np

    return [image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image, dtype=np.uint8)) for image in images]


# ----- vision-language models ---------------------------------------------------------------------
#: Qwen2-VL's image token: the one the template writes per image, and the processor repeats.
QWEN2_VL_IMAGE_TOKEN = "<|image_pad|>"
#: How many images' token counts an :class:`ImageChatRenderer` keeps (the most recently used): a few bytes each.
IMAGE_CACHE_ENTRIES = 512


def image_digest(image: Any) -> tuple:
    """A key of ``image``'s pixels (a ``PIL.Image.Image`` or an array-like of uint8): equal pixels, equal keys."""
    import numpy as np

    if hasattr(image, "tobytes") and hasattr(image, "mode") and hasattr(image, "size"):  # a PIL image
        kind, shape, data = image.mode, tuple(image.size), image.tobytes()
    else:
        array = np.ascontiguousarray(np.asarray(image, dtype=np.uint8))
        kind, shape, data = "uint8", array.shape, array.data
    return kind, shape, hashlib.blake2b(data, digest_size=32).digest()


class ImageChatRenderer(ChatTemplateRenderer):
    """Renders conversations with images with the tokenizer's chat template and the model's image processor.

    Args:
        tokenizer: the model's tokenizer (its chat template renders content lists with image parts).
        image_processor: the model's image processor (``image_grid_thw`` and ``merge_size``, as Qwen2-VL's).
        image_token: the token the template writes once per image and the model reads once per image feature.
        cache_entries: how many images' token counts to keep (the most recently used; 0 keeps none).
    """

    #: The rollout loop hands this renderer the conversation's images.
    renders_images = True

    def __init__(self, tokenizer: Any, image_processor: Any, image_token: str = QWEN2_VL_IMAGE_TOKEN,
                 cache_entries: int = IMAGE_CACHE_ENTRIES) -> None:
        super().__init__(tokenizer)
        from tinkergym.errors import ConfigError

        token_id = tokenizer.convert_tokens_to_ids(image_token)
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
            raise ConfigError(f"the tokenizer has no image token {image_token!r}; pass the model's own (image_token=...)")
        self.image_processor = image_processor
        self.image_token = image_token
        self.image_token_id = token_id
        self.merge_length = int(getattr(image_processor, "merge_size", 1)) ** 2
        self.cache_entries = cache_entries
        self._counts: OrderedDict[tuple, int] = OrderedDict()  # image_digest -> image tokens, least recently used first
        self._counts_lock = threading.Lock()  # rollouts may render from several threads

    @classmethod
    def from_folder(cls, path: str) -> ImageChatRenderer:
        """The renderer of the model folder ``path``: its tokenizer and its image processor."""
        from transformers import AutoImageProcessor, AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path))

    def image_token_counts(self, images: list[Any]) -> list[int]:
        """How many image tokens each image takes (what the image processor makes of it; each image measured once)."""
        if not images:
            return []
        keys = [image_digest(image) for image in images]
        with self._counts_lock:
            known = {key: self._counts[key] for key in keys if key in self._counts}
            for key in known:
                self._counts.move_to_end(key)
        new = {key: image for key, image in zip(keys, images) if key not in known}  # one of each repeated image
        if new:
            grid = self.image_processor(images=to_pil_images(list(new.values())), return_tensors="np")["image_grid_thw"]
            measured = {key: int(row.prod()) // self.merge_length for key, row in zip(new, grid)}
            known.update(measured)
            with self._counts_lock:
                self._counts.update(measured)
                while len(self._counts) > self.cache_entries:
                    self._counts.popitem(last=False)
        return [known[key] for key in keys]

    def render_text(self, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        """The template's text for ``messages``, one image token per image part (content lists are kept)."""
        messages, tools = self._with_tools(messages, tools)
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt)

    def render(self, messages: list[Message], tools: list[dict] | None = None, add_generation_prompt: bool = False, images: Sequence[Any] = ()) -> list[int]:
        """The token ids of ``messages``, each image token repeated as many times as its image has features."""
        from tinkergym.errors import ConfigError, TinkergymError

        wanted = count_image_parts(messages)
        if len(images) < wanted:
            raise ConfigError(f"the messages hold {wanted} image parts but {len(images)} images were given; pass each image part's image")
        text = self.render_text(messages, tools, add_generation_prompt)
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != wanted:
            raise TinkergymError(
                f"the chat template wrote {len(pieces) - 1} image tokens {self.image_token!r} for {wanted} image parts; "
                "it must write one per image part (use the model's own template)"
            )
        counts = self.image_token_counts(list(images)[:wanted])
        expanded = pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(counts, pieces[1:]))
        return self.tokenizer.encode(expanded, add_special_tokens=False)

    def prompt_tokens(self, messages: list[Message], tools: list[dict] | None, images: Sequence[Any] = ()) -> list[int]:
        """The first prompt: the conversation so far plus the generation prompt."""
        return self.render(messages, tools, add_generation_prompt=True, images=images)

    def bridge_tokens(self, messages: list[Message], observation: Message, tools: list[dict] | None, stopped: bool,
                      images: Sequence[Any] = ()) -> list[int]:
        """Ids between the last sampled ids and the next generation prompt's end (``images``: those of ``messages``, then the observation's)."""
        closed = self.render(messages, tools, images=images)
        following = self.render([*messages, observation], tools, add_generation_prompt=True, images=images)
        return bridge_between(closed, following, self.stop_token_ids, stopped)


def renderer_for(tokenizer: Any) -> ChatTemplateRenderer:
    """The renderer of a model: an :class:`ImageChatRenderer` for a vision-language model's folder (a config with a
    ``vision_config`` and an image processor beside it) or the tokenizer folder a training server sends of one (no
    model config; an image processor's ``preprocessor_config.json``), else a :class:`ChatTemplateRenderer` of
    ``tokenizer`` (a loaded tokenizer, or a folder to load it from)."""
    if isinstance(tokenizer, str) and _renders_images(tokenizer):
        return ImageChatRenderer.from_folder(tokenizer)
    return ChatTemplateRenderer(tokenizer)


def _renders_images(folder: str) -> bool:
    """Whether ``folder`` holds a vision-language model's tokenizer and image processor (see :func:`renderer_for`)."""
    import os

    def read(name: str) -> Any:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                return json.load(handle)
        except (OSError, ValueError):
            return None

    processor = read("preprocessor_config.json")
    if not isinstance(processor, dict):
        return False
    if os.path.isfile(os.path.join(folder, "config.json")):
        config = read("config.json")
        return isinstance(config, dict) and "vision_config" in config
    return "image_processor_type" in processor  # a tokenizer folder: the processor says it reads images
