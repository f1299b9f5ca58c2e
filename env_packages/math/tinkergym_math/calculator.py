"""A safe calculator: arithmetic expressions evaluated from their syntax tree, never with ``eval``.

:func:`evaluate` parses the expression with :mod:`ast` and walks the tree, allowing only numbers,
``+ - * / // % **`` (``^`` also means power), parentheses, the constants ``pi`` and ``e`` and a few
functions (``sqrt``, ``abs``, ``round``, ``floor``, ``ceil``, ``min``, ``max``, ``log``, ``log10``,
``log2``, ``exp``, ``sin``, ``cos``, ``tan``, ``factorial``, ``gcd``, ``lcm``, ``comb``, ``perm``).
Arithmetic is exact with :class:`fractions.Fraction` (``1/3 + 1/6`` is ``1/2``) until a function
such as ``sqrt(2)`` needs a float. Sizes are bounded: long expressions, huge powers and factorials
are refused with a message instead of hanging. ``×``, ``÷``, ``·`` and the unicode minus are accepted.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction
from typing import Any, Callable, Union

Number = Union[Fraction, float]

#: Longest expression accepted, in characters.
MAX_EXPRESSION_LENGTH = 500
#: Largest result accepted, in bits of numerator or denominator.
MAX_BITS = 20_000

_REPLACEMENTS = {"×": "*", "·": "*", "÷": "/", "−": "-", "–": "-", "^": "**", "√": "sqrt"}
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}


class CalculatorError(ValueError):
    """An expression the calculator refuses, with the reason."""


def _integer(value: Number, what: str) -> int:
    if isinstance(value, Fraction) and value.denominator == 1:
        return value.numerator
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise CalculatorError(f"{what} needs a whole number, got {format_number(value)}")


def _checked(value: Number) -> Number:
    if isinstance(value, Fraction) and max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise CalculatorError("the result is too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    return value


def _sqrt(x: Number) -> Number:
    if x < 0:
        raise CalculatorError("sqrt of a negative number")
    if isinstance(x, Fraction):
        num, den = math.isqrt(x.numerator), math.isqrt(x.denominator)
        if num * num == x.numerator and den * den == x.denominator:
            return Fraction(num, den)
    return math.sqrt(x)


def _factorial(x: Number) -> Number:
    n = _integer(x, "factorial")
    if not 0 <= n <= 1000:
        raise CalculatorError("factorial needs a whole number from 0 to 1000")
    return Fraction(math.factorial(n))


def _log(x: Number, base: Number | None = None) -> float:
    if x <= 0 or (base is not None and (base <= 0 or base == 1)):
        raise CalculatorError("log needs a positive number (and a positive base other than 1)")
    return math.log(x) if base is None else math.log(x, base)


def _round(x: Number, digits: Number | None = None) -> Number:
    if digits is None:
        return Fraction(round(x))
    places = _integer(digits, "round")
    if not -50 <= places <= 50:
        raise CalculatorError("round takes between -50 and 50 digits")
    return round(Fraction(x), places) if isinstance(x, Fraction) else round(x, places)


def _combinatoric(fn: Callable[[int, int], int]) -> Callable[[Number, Number], Number]:
    def apply(n: Number, k: Number) -> Number:
        """``fn(n, k)`` on whole numbers up to 10,000."""
        a, b = _integer(n, fn.__name__), _integer(k, fn.__name__)
        if not (0 <= b <= a <= 10_000):
            raise CalculatorError(f"{fn.__name__} needs 0 <= k <= n <= 10000")
        return Fraction(fn(a, b))

    return apply


def _float_fn(fn: Callable[[float], float]) -> Callable[[Number], float]:
    def apply(x: Number) -> float:
        """``fn(x)`` on a float, with domain errors as :class:`CalculatorError`."""
        try:
            return fn(float(x))
        except (ValueError, OverflowError) as exc:
            raise CalculatorError(f"{fn.__name__}: {exc}") from exc

    return apply


_FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": _sqrt,
    "abs": abs,
    "round": _round,
    "floor": lambda x: Fraction(math.floor(x)),
    "ceil": lambda x: Fraction(math.ceil(x)),
    "min": min,
    "max": max,
    "log": _log,
    "ln": _log,
    "log10": lambda x: _log(x, 10),
    "log2": lambda x: _log(x, 2),
    "exp": _float_fn(math.exp),
    "sin": _float_fn(math.sin),
    "cos": _float_fn(math.cos),
    "tan": _float_fn(math.tan),
    "factorial": _factorial,
    "gcd": lambda a, b: Fraction(math.gcd(_integer(a, "gcd"), _integer(b, "gcd"))),
    "lcm": lambda a, b: Fraction(math.lcm(_integer(a, "lcm"), _integer(b, "lcm"))),
    "comb": _combinatoric(math.comb),
    "perm": _combinatoric(math.perm),
}


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(exponent, Fraction) and exponent.denominator == 1 and isinstance(base, Fraction):
        n = exponent.numerator
        size = max(base.numerator.bit_length(), base.denominator.bit_length(), 1)
        if abs(n) * size > MAX_BITS and abs(base) != 1:
            raise CalculatorError("the power is too large")
        if base == 0 and n < 0:
            raise CalculatorError("division by zero")
        return base**n
    if base < 0:
        raise CalculatorError("a negative number to a fractional power is not a real number")
    try:
        return float(base) ** float(exponent)
    except OverflowError as exc:
        raise CalculatorError("the power is too large") from exc


def _eval(node: ast.AST, source: str) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body, source)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        if isinstance(node.value, int):
            return Fraction(node.value)
        literal = ast.get_source_segment(source, node) or repr(node.value)
        try:
            return Fraction(literal.replace("_", ""))
        except ValueError:
            return Fraction(repr(node.value))
    if isinstance(node, ast.Name):
        if node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        raise CalculatorError(f"unknown name {node.id!r}: the calculator has no variables (use the python tool for algebra)")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand, source)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, source), _eval(node.right, source)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        if type(node.op) in _BINARY:
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise CalculatorError("division by zero")
            return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS and not node.keywords:
        args = [_eval(arg, source) for arg in node.args]
        try:
            return _checked(_FUNCTIONS[node.func.id](*args))
        except TypeError as exc:
            raise CalculatorError(f"{node.func.id}() got the wrong number of arguments") from exc
    if isinstance(node, ast.Tuple):
        raise CalculatorError("commas are not allowed (write 1234, not 1,234; one expression at a time)")
    raise CalculatorError(f"unsupported syntax {type(node).__name__}; use numbers, + - * / // % ** ( ) and {', '.join(sorted(_FUNCTIONS))}")


def evaluate(expression: str) -> Number:
    """The value of ``expression``: a :class:`~fractions.Fraction` when exact, else a float.

    Raises:
        CalculatorError: the expression is empty, too long, malformed, uses something not allowed, or
            its result is too large or undefined (division by zero, sqrt of a negative number).
    """
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("the expression is empty")
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise CalculatorError(f"the expression is {len(expression):,} characters long; the limit is {MAX_EXPRESSION_LENGTH}")
    text = expression.strip().rstrip("=").strip()
    for old, new in _REPLACEMENTS.items():
        text = text.replace(old, new)
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"cannot parse {expression.strip()[:80]!r} as an arithmetic expression") from exc
    try:
        return _eval(tree, text)
    except RecursionError as exc:
        raise CalculatorError("the expression is nested too deeply") from exc
    except (OverflowError, ZeroDivisionError, ValueError) as exc:
        if isinstance(exc, CalculatorError):
            raise
        raise CalculatorError(str(exc) or type(exc).__name__) from exc


def format_number(value: Number) -> str:
    """``42``, ``1.75``, ``2/3 (about 0.6666666667)`` or a float to 12 significant digits."""
    if isinstance(value, float):
        return f"{value:.12g}"
    if value.denominator == 1:
        return str(value.numerator)
    places, denominator = 0, value.denominator
    while denominator % 10 == 0 or denominator % 2 == 0 or denominator % 5 == 0:
        denominator //= 2 if denominator % 2 == 0 else 5
    if denominator == 1:
        while (value * 10**places).denominator != 1:
            places += 1
        if places <= 30:
            scaled = abs(value.numerator * 10**places // value.denominator)
            whole, frac = divmod(scaled, 10**places)
            return f"{'-' if value < 0 else ''}{whole}.{frac:0{places}d}"
    try:
        return f"{value.numerator}/{value.denominator} (about {float(value):.10g})"
    except OverflowError:
        return f"{value.numerator}/{value.denominator}"


def calculate(expression: str) -> str:
    """Evaluate and format; an invalid expression gives ``"Error: ..."`` text instead of raising."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as exc:
        return f"Error: {exc}."
