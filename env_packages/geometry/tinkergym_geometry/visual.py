"""A :class:`~tinkergym.TextEnv` whose observations carry images: :class:`VisualTextEnv`.

Subclasses write ``_reset``/``_step`` as for any text env and may return either a ``str`` or a
``{"text": ..., "images": (...)}`` observation; the public ``reset``/``step`` return every observation as a
fresh member of :class:`~tinkergym.spaces.TextWithImages` (invalid-action feedback included), so
Gymnasium's checks of shared and in-space data hold.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tinkergym import TextEnv
from tinkergym.spaces import TextWithImages, observation_text, text_with_images

VisualStepResult = tuple[dict[str, Any], float, bool, bool, dict[str, Any]]


class VisualTextEnv(TextEnv):
    """Base class of envs observed as text plus images (``observation_space`` is :class:`TextWithImages`).

    Class attributes, beside :class:`~tinkergym.TextEnv`'s: ``image_shape`` (``(height, width)`` of
    every image) and ``max_images`` (most images per observation). Render modes: ``"ansi"`` (the
    latest observation's text), ``"human"`` (prints it) and ``"rgb_array"`` (the episode's figure).
    """

    metadata: dict[str, Any] = {**TextEnv.metadata, "render_modes": ["ansi", "human", "rgb_array"]}
    image_shape: tuple[int, int] = (256, 256)
    max_images: int = 1

    def __init__(self, render_mode: str | None = None) -> None:
        super().__init__(render_mode=render_mode)
        self.observation_space = TextWithImages(self.max_observation_length, image_shape=self.image_shape, max_images=self.max_images)  # type: ignore[assignment]
        self.figure: np.ndarray | None = None

    @staticmethod
    def _as_observation(observation: Any) -> dict[str, Any]:
        if isinstance(observation, dict):
            return text_with_images(observation["text"], observation.get("images", ()))
        return text_with_images(observation)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:  # type: ignore[override]
        """Start an episode; the observation is ``{"text", "images"}`` (see :class:`~tinkergym.TextEnv`)."""
        observation, info = super().reset(seed=seed, options=options)
        return self._as_observation(observation), info

    def step(self, action: Any) -> VisualStepResult:  # type: ignore[override]
        """As :meth:`tinkergym.TextEnv.step`, with the observation as ``{"text", "images"}``."""
        observation, reward, terminated, truncated, info = super().step(action)
        return self._as_observation(observation), reward, terminated, truncated, info

    def render(self) -> Any:
        """``ansi``: the latest observation's text; ``human``: print it; ``rgb_array``: the episode's figure."""
        if self.render_mode == "rgb_array":
            if self.figure is None:
                return np.full((*self.image_shape, 3), 255, dtype=np.uint8)
            return self.figure.copy()
        text = observation_text(self._last_observation)
        if self.render_mode == "ansi":
            return text
        if self.render_mode == "human":
            print(text)
        return None
