"""tinkergym-math: math word problems for text agents, graded exactly.

Envs (made through the hub, e.g. ``gymnasium.make("tinker/Math-v0")`` after ``import tinkergym``):

- ``tinker/Math-v0`` (:class:`~tinkergym_math.env.MathEnv`): single-turn; reply with a ``\\boxed{}`` answer.
- ``tinker/MathTool-v0`` (:class:`~tinkergym_math.tool_env.MathToolEnv`): multi-turn, with a sandboxed
  ``python`` tool and an exact ``calculator`` tool before the final answer.

The shipped dataset (2,500 generated arithmetic and algebra word problems, 90/10 train/test) is
reproduced by ``python -m tinkergym_math.generate --out DIR --seed 0``. Importing this package loads
no data and imports nothing heavy.
"""

from tinkergym_math.agents import BaselineMathAgent, BaselineMathToolAgent
from tinkergym_math.env import MathEnv
from tinkergym_math.grading import answers_match, extract_answer, grade, parse_number
from tinkergym_math.tool_env import MathToolEnv

__all__ = [
    "BaselineMathAgent",
    "BaselineMathToolAgent",
    "MathEnv",
    "MathToolEnv",
    "answers_match",
    "extract_answer",
    "grade",
    "parse_number",
]
