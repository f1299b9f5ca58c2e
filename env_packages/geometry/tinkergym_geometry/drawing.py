"""Pillow rendering of a figure's primitives: the same primitives give the same pixels.

Primitives (tuples, pixel coordinates, y down): ``("polygon", points)``, ``("polyline", points)``,
``("line", a, b)``, ``("dashed", a, b)``, ``("circle", centre, radius)``, ``("dot", centre)`` and
``("text", centre, text)``. Text uses Pillow's bundled default font, so no system font is needed.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

BACKGROUND = (255, 255, 255)
INK = (20, 20, 20)
LABEL = (30, 60, 170)


@lru_cache(maxsize=4)
def _font(size: int) -> Any:
    return ImageFont.load_default(size=size)


def _dashed(draw: ImageDraw.ImageDraw, a: tuple[float, float], b: tuple[float, float], dash: float = 6.0) -> None:
    length = math.hypot(b[0] - a[0], b[1] - a[1])
    steps = max(1, int(length // dash))
    for i in range(0, steps, 2):
        s, e = i / steps, min(1.0, (i + 1) / steps)
        draw.line([(a[0] + (b[0] - a[0]) * s, a[1] + (b[1] - a[1]) * s), (a[0] + (b[0] - a[0]) * e, a[1] + (b[1] - a[1]) * e)], fill=INK, width=1)


def draw_figure(shapes: tuple[tuple[Any, ...], ...], size: tuple[int, int], font_size: int = 15) -> np.ndarray:
    """An RGB ``uint8`` array of shape ``(height, width, 3)`` with the primitives drawn on white."""
    height, width = size
    image = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for shape in shapes:
        kind = shape[0]
        if kind == "polygon":
            draw.polygon([tuple(p) for p in shape[1]], outline=INK, width=2)
        elif kind == "polyline":
            draw.line([tuple(p) for p in shape[1]], fill=INK, width=1)
        elif kind == "line":
            draw.line([tuple(shape[1]), tuple(shape[2])], fill=INK, width=2)
        elif kind == "dashed":
            _dashed(draw, shape[1], shape[2])
        elif kind == "circle":
            (x, y), r = shape[1], shape[2]
            draw.ellipse([x - r, y - r, x + r, y + r], outline=INK, width=2)
        elif kind == "dot":
            x, y = shape[1]
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=INK)
        elif kind == "text":
            draw.text(tuple(shape[1]), shape[2], fill=LABEL, font=_font(font_size), anchor="mm")
        else:
            raise ValueError(f"unknown primitive {kind!r}")
    return np.asarray(image, dtype=np.uint8).copy()


def draw_square(size: tuple[int, int], box: tuple[int, int, int, int], colour: tuple[int, int, int]) -> np.ndarray:
    """A white image with one filled square ``box = (left, top, right, bottom)`` outlined in ink."""
    height, width = size
    image = Image.new("RGB", (width, height), BACKGROUND)
    ImageDraw.Draw(image).rectangle(box, fill=colour, outline=INK, width=1)
    return np.asarray(image, dtype=np.uint8).copy()
