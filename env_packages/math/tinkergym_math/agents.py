r"""Baseline agents for the math envs: formatting and plumbing baselines, not solvers.

They read only the observation text (and ``info``), like a model would. :class:`BaselineMathAgent`
finds an arithmetic expression written in the problem (``Evaluate 12 + 3 × (4 − 1).``), evaluates
it with the safe calculator and answers ``\boxed{result}``; without one it answers ``\boxed{0}``. It
solves the order-of-operations problems and little else: a floor to beat, and a check that episodes,
rewards and the answer format flow end to end. :class:`BaselineMathToolAgent` does the same through
the ``calculator`` tool of ``tinker/MathTool-v0``: one tool call, then the tool's result as the answer.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tinkergym_math.calculator import CalculatorError, evaluate, format_number

_EXPRESSION = re.compile(r"[\d(][\d\s+\-−*/×÷().^]*[\d)]")
_OPERATOR = re.compile(r"\d\s*\)?\s*[+\-−*/×÷^]\s*\(?\s*\d")
_TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


def find_expression(text: str) -> str | None:
    """The longest arithmetic expression in ``text`` that the calculator can evaluate, if any."""
    candidates = sorted({m.group(0).strip() for m in _EXPRESSION.finditer(text or "")}, key=lambda c: (-len(c), c))
    for candidate in candidates:
        if not _OPERATOR.search(candidate):
            continue
        try:
            evaluate(candidate)
        except CalculatorError:
            continue
        return candidate
    return None


#: The calculator's operator signs that Python writes otherwise.
_PYTHON_SIGNS = str.maketrans({"×": "*", "÷": "/", "−": "-"})


def python_expression(expression: str) -> str:
    """An expression of :func:`find_expression` written in Python (``×`` ``÷`` ``−`` ``^`` as ``*`` ``/`` ``-`` ``**``)."""
    return expression.translate(_PYTHON_SIGNS).replace("^", "**")


def answer_text(value: str) -> str:
    """A result of the calculator as a bare answer (``"2/3 (about 0.667)"`` -> ``"2/3"``)."""
    return value.split(" (", 1)[0].strip()


class BaselineMathAgent:
    r"""``tinker/Math-v0`` baseline: evaluates an arithmetic expression found in the problem, else guesses 0.

    Args:
        seed: Unused (the agent is deterministic); accepted for the agent protocol.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed

    def __call__(self, observation: str, info: dict[str, Any]) -> str:
        expression = find_expression(observation)
        if expression is None:
            return "I could not find a calculation to do.\n\\boxed{0}"
        value = answer_text(format_number(evaluate(expression)))
        return f"{expression} = {value}\n\\boxed{{{value}}}"


class BaselineMathToolAgent:
    r"""``tinker/MathTool-v0`` baseline: calls the calculator on an expression from the problem, then answers with its result.

    First message: one ``<tool_call>`` to ``calculator`` with the expression found in the problem (``0``
    if none); where the env offers no calculator (``info["tools"]`` names python alone), a ``python`` call that
    prints the expression written in Python. Second message: ``\boxed{result}`` (``\boxed{0}`` if the tool
    reported an error).

    Args:
        seed: Unused (the agent is deterministic); accepted for the agent protocol.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self.called = False

    def __call__(self, observation: str, info: dict[str, Any]) -> str:
        if not self.called:
            self.called = True
            expression = find_expression(observation) or "0"
            offered = {tool.get("function", {}).get("name") for tool in info.get("tools") or [] if isinstance(tool, dict)}
            if offered and "calculator" not in offered and "python" in offered:
                call = {"name": "python", "arguments": {"code": f"print({python_expression(expression)})"}}
            else:
                call = {"name": "calculator", "arguments": {"expression": expression}}
            return f"Let me compute this.\n<tool_call>{json.dumps(call, ensure_ascii=False)}</tool_call>"
        responses = _TOOL_RESPONSE.findall(observation)
        result = answer_text(responses[0]) if responses else "0"
        if result.endswith(".0") and result[:-2].lstrip("-").isdigit():  # python prints a whole quotient as 10.0
            result = result[:-2]
        if not result or result.startswith("Error"):
            result = "0"
        return f"The calculator gives {result}.\n\\boxed{{{result}}}"
