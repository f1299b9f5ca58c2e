"""The core side of vision-language envs: the TextWithImages space, chat image parts, the checker on image observations."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from tinkergym import TextEnv
from tinkergym.chat import ChatTemplateRenderer, count_image_parts, observation_message, text_only_messages, to_pil_images
from tinkergym.errors import CheckFailed
from tinkergym.spaces import BoundedSequence, TextWithImages, image_box, observation_text, text_with_images
from tinkergym.testing import check_text_env


class ShadeEnv(TextEnv):
    """A tiny image env: a grey image whose shade is drawn on reset; say "dark" or "light"."""

    metadata = {**TextEnv.metadata, "render_modes": ["ansi"]}
    max_invalid_actions = 1

    def __init__(self, render_mode: str | None = None) -> None:
        super().__init__(render_mode=render_mode)
        self.observation_space = TextWithImages(256, image_shape=(8, 6), max_images=2)  # type: ignore[assignment]
        self.shade = 0
        self.image = np.zeros((8, 6, 3), np.uint8)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        text, info = super().reset(seed=seed, options=options)
        return text_with_images(text, (self.image,)), info

    def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.shade = int(self.np_random.integers(256))
        self.image = np.full((8, 6, 3), self.shade, np.uint8)
        return "Is the image dark or light?", {}

    def step(self, action: Any) -> Any:
        text, reward, terminated, truncated, info = super().step(action)
        return text_with_images(text), reward, terminated, truncated, info

    def _step(self, action: str) -> Any:
        right = ("dark" if self.shade < 128 else "light") in action
        return "Right." if right else "Wrong.", float(right), True, False, {}

    def render(self) -> Any:
        return observation_text(self._last_observation)


def test_space_contains_only_bounded_rgb_images_and_printable_text() -> None:
    space = TextWithImages(10, image_shape=(8, 6), max_images=2, seed=0)
    image = np.zeros((8, 6, 3), np.uint8)
    assert space.contains({"text": "hi there", "images": ()})
    assert space.contains({"text": "two", "images": (image, image)})
    assert not space.contains({"text": "three", "images": (image, image, image)})  # too many
    assert not space.contains({"text": "x", "images": (np.zeros((6, 8, 3), np.uint8),)})  # wrong shape
    assert not space.contains({"text": "x", "images": (image.astype(np.float32),)})  # wrong dtype
    assert not space.contains({"text": "x", "images": [image]})  # a tuple, not a list
    assert not space.contains({"text": "x" * 11, "images": ()})
    assert not space.contains({"text": "\x00", "images": ()})
    assert not space.contains("just text")
    for _ in range(20):
        assert space.contains(space.sample())
    assert space == TextWithImages(10, image_shape=(8, 6), max_images=2)
    assert space != TextWithImages(10, image_shape=(8, 6), max_images=3)
    assert "max_images=2" in repr(space)
    assert BoundedSequence(image_box(2, 2), 3).sample(mask=(2, None)).__len__() == 2
    with pytest.raises(ValueError):
        BoundedSequence(image_box(2, 2), -1)


def test_text_with_images_copies_and_observation_text_reads_both_kinds() -> None:
    image = np.ones((2, 2, 3), np.uint8)
    observation = text_with_images("hello", [image])
    assert observation["images"][0] is not image and np.array_equal(observation["images"][0], image)
    assert observation_text(observation) == "hello" and observation_text("plain") == "plain"


def test_gymnasium_check_env_and_our_checker_accept_an_image_env() -> None:
    check_env(ShadeEnv(), skip_render_check=True)
    check_text_env(ShadeEnv(), fuzz_count=20)


def test_checker_catches_an_image_env_whose_pixels_are_not_deterministic() -> None:
    class Noisy(ShadeEnv):
        metadata = {**ShadeEnv.metadata, "tinkergym": {"checker_skip": ("peer",)}}
        draws = 0

        def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
            text, info = super()._reset(options)
            Noisy.draws += 1
            self.image = np.full((8, 6, 3), Noisy.draws % 256, np.uint8)
            return text, info

    with pytest.raises(CheckFailed, match="differ"):
        check_text_env(Noisy(), fuzz_count=0)


def test_observation_message_keeps_images_beside_the_content_parts() -> None:
    a, b = np.zeros((2, 2, 3), np.uint8), np.ones((2, 2, 3), np.uint8)
    assert observation_message("plain text") == ({"role": "user", "content": "plain text"}, [])
    assert observation_message({"text": "no images", "images": ()}) == ({"role": "user", "content": "no images"}, [])
    message, images = observation_message({"text": "Which?", "images": (a, b)}, role="tool")
    assert message == {"role": "tool", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which?"}]}
    assert images[0] is a and images[1] is b
    messages = [{"role": "system", "content": "s"}, message, {"role": "assistant", "content": "x"}]
    assert count_image_parts(messages) == 2
    flat = text_only_messages(messages)
    assert flat[1] == {"role": "tool", "content": "<image>\n<image>\nWhich?"} and flat[0] is messages[0]
    pil = to_pil_images(images)
    assert pil[1].size == (2, 2) and pil[1].mode == "RGB" and pil[1].getpixel((0, 0)) == (1, 1, 1)


def test_text_template_renders_image_parts_as_placeholders() -> None:
    class StringTemplateTokenizer:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
        eos_token_id = 0
        unk_token_id = 1

        def convert_tokens_to_ids(self, name: str) -> int:
            return 1

        def apply_chat_template(self, messages: list[dict], tools: Any = None, tokenize: bool = False, add_generation_prompt: bool = False) -> str:
            assert all(isinstance(m["content"], str) for m in messages)
            return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    renderer = ChatTemplateRenderer(StringTemplateTokenizer())
    message, _ = observation_message({"text": "Find x.", "images": (np.zeros((2, 2, 3), np.uint8),)})
    assert renderer.render_text([message], None, add_generation_prompt=False) == "user:<image>\nFind x."


def test_import_tinkergym_imports_neither_pillow_nor_torch() -> None:
    code = "import sys, tinkergym, tinkergym.chat, tinkergym.spaces, tinkergym.testing; print(sorted(m for m in ('PIL', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
