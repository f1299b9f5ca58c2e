"""tinkergym-geometry: questions about drawn images, observed as text plus images.

Envs (made through the hub, e.g. ``gymnasium.make("tinker/Geometry-v0")`` after ``import tinkergym``):

- ``tinker/Geometry-v0`` (:class:`~tinkergym_geometry.env.GeometryEnv`): single-turn; a procedurally drawn
  figure (triangle, right triangle, triangle with height, circle, parallel lines) and a question about an
  angle, a length or an area, graded exactly (or to the stated rounding).
- ``tinker/GeometryTool-v0`` (:class:`~tinkergym_geometry.tool_env.GeometryToolEnv`): the same, multi-turn,
  with the ``calculator`` and sandboxed ``python`` tools of ``tinker/MathTool-v0``.
- ``tinker/ColourSquare-v0`` (:class:`~tinkergym_geometry.env.ColourSquareEnv`): which of two colours fills
  the square; the trivial visual task of learning tests.

Observations are :class:`tinkergym.spaces.TextWithImages` members ``{"text": str, "images": (uint8 HxWx3, ...)}``;
the figure in words is ``info["figure_description"]``. Data-free: every figure comes from the reset seed.
"""

from tinkergym_geometry.agents import BaselineColourAgent, BaselineGeometryAgent, BaselineGeometryToolAgent
from tinkergym_geometry.env import ColourSquareEnv, GeometryEnv
from tinkergym_geometry.figures import KINDS, Problem, generate, solve
from tinkergym_geometry.tool_env import GeometryToolEnv
from tinkergym_geometry.visual import VisualTextEnv

__all__ = [
    "KINDS",
    "BaselineColourAgent",
    "BaselineGeometryAgent",
    "BaselineGeometryToolAgent",
    "ColourSquareEnv",
    "GeometryEnv",
    "GeometryToolEnv",
    "Problem",
    "VisualTextEnv",
    "generate",
    "solve",
]
