"""A safe calculator: arithmetic expressions evaluated from their syntax tree, never with ``eval``.

:func:`evaluate` parses the expression with :mod:`ast` and walks the tree, allowing only numbers,
``+ - * / // % **`` (``^`` also means power), parentheses, the constants ``pi`` and ``e`` and a few
functions (``sqrt``, ``abs``, ``round``, ``floor``, ``ceil``, ``min``, ``max``, ``log``, ``log10``,
``log2``, ``exp``, ``sin``, ``cos``, ``tan``, ``factorial``, ``gcd``, ``lcm``, ``comb``, ``perm``).
Arithmetic is exact with :class:`fractions.Fraction` (``1/3 + 1/6`` is ``1/2``) until a function
such as ``sqrt(2)`` needs a float. Sizes are bounded before any work that grows with them: long
expressions, number literals with huge exponents (``1e999999999``), huge powers and factorials are
refused with a message instead of hanging, and whole numbers too long to print exactly are shown in
scientific notation. ``×``, ``÷``, ``·`` and the unicode minus are accepted.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import sys
from fractions import Fraction
from typing import Any
from collections.abc import Callable

Number = Fraction | float

#: Longest expression accepted, in characters.
MAX_EXPRESSION_LENGTH = 500
#: Largest result accepted, in bits of numerator or denominator.
MAX_BITS = 20_000
#: Most digits an exact result is printed with (numerator and denominator together); a longer one
#: is printed to 10 significant digits, ``about 1.234567891e+5000``. This also keeps ``str(int)``
#: under Python's 4,300-digit limit, and its cost (which grows with the square of the length) small.
MAX_EXACT_DIGITS = 1_000
#: Most decimal places printed for an exact terminating decimal (``1/8`` is ``0.125``).
MAX_DECIMAL_PLACES = 30

_LOG2_10 = math.log2(10)
_DECIMAL_LITERAL = re.compile(r"(?P<whole>[0-9]*)(?:\.(?P<fraction>[0-9]*))?(?:[eE](?P<exponent>[+-]?[0-9]+))?")

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


def _decimal_literal(literal: str) -> Fraction:
    """The exact value of a decimal literal such as ``1.5e-3``, refused before any work when it is too large.

    ``Fraction("1e999999999")`` would build a billion-digit integer (hours of work), and Python's own
    ``float`` turns it into ``inf``, so the exponent is read and bounded first.
    """
    text = literal.replace("_", "")
    match = _DECIMAL_LITERAL.fullmatch(text)
    if match is None or not (match["whole"] or match["fraction"]):
        raise CalculatorError(f"cannot read the number {_shown_literal(literal)}")
    digits = (match["whole"] + (match["fraction"] or "")).lstrip("0")
    if not digits:
        return Fraction(0)
    scale = int(match["exponent"] or 0) - len(match["fraction"] or "")  # value = int(digits) * 10**scale
    if (len(digits) + abs(scale)) * _LOG2_10 > MAX_BITS:
        size = "large" if scale > 0 else "small"
        raise CalculatorError(f"the number {_shown_literal(literal)} is too {size} (exponents go up to about ±{int(MAX_BITS / _LOG2_10):,})")
    mantissa = int(digits)
    return Fraction(mantissa * 10**scale) if scale >= 0 else Fraction(mantissa, 10**-scale)


def _shown_literal(literal: str) -> str:
    return literal if len(literal) <= 30 else literal[:27] + "..."


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(exponent, Fraction) and exponent.denominator == 1 and isinstance(base, Fraction):
        n = exponent.numerator
        if base == 0:
            if n < 0:
                raise CalculatorError("division by zero")
            return Fraction(0 if n else 1)
        if abs(base) == 1:  # (-1)**n and 1**n stay small whatever n is
            return Fraction(-1 if base < 0 and n % 2 else 1)
        size = max(base.numerator.bit_length(), base.denominator.bit_length())
        if abs(n) * size > MAX_BITS:
            raise CalculatorError("the power is too large")
        return base**n
    try:
        if base < 0 and not float(exponent).is_integer():
            raise CalculatorError("a negative number to a fractional power is not a real number")
        return float(base) ** float(exponent)
    except OverflowError as exc:
        raise CalculatorError("the power is too large") from exc


def _eval(node: ast.AST, source: str) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body, source)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        if isinstance(node.value, int):
            return _checked(Fraction(node.value))
        return _decimal_literal(ast.get_source_segment(source, node) or repr(node.value))
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
    """``42``, ``1.75``, ``2/3 (about 0.6666666667)`` or a float to 12 significant digits.

    An exact result longer than :data:`MAX_EXACT_DIGITS` digits is shown as ``about 1.234567891e+5000 (...)``.
    """
    if isinstance(value, float):
        return f"{value:.12g}"
    if value.denominator == 1:
        text = _exact_digits(value.numerator)
        if text is not None:
            return text
        return f"about {_approximate(value)} (a whole number with {_digit_count(value.numerator):,} digits, too long to show exactly)"
    places = _decimal_places(value.denominator)
    if places is not None:
        whole, fraction = divmod(abs(value.numerator) * 10**places // value.denominator, 10**places)
        text = _exact_digits(whole, MAX_EXACT_DIGITS - places)
        if text is not None:
            return f"{'-' if value < 0 else ''}{text}.{fraction:0{places}d}"
    denominator = _exact_digits(value.denominator)
    numerator = _exact_digits(value.numerator, MAX_EXACT_DIGITS - len(denominator)) if denominator is not None else None
    if numerator is None or denominator is None:
        return f"about {_approximate(value)} (a fraction too long to show exactly)"
    return f"{numerator}/{denominator} (about {_approximate(value)})"


def _exact_digits(n: int, limit: int = MAX_EXACT_DIGITS) -> str | None:
    """``str(n)``, or ``None`` when it would have more than ``limit`` digits (checked before printing)."""
    if n.bit_length() > limit * _LOG2_10 and _digit_count(n) > limit:
        return None
    try:
        return str(n)
    except ValueError:  # sys.set_int_max_str_digits set below MAX_EXACT_DIGITS
        return None


def _digit_count(n: int) -> int:
    """How many decimal digits ``abs(n)`` has, without printing it."""
    n = abs(n)
    if n == 0:
        return 1
    count = int(math.log10(n)) + 1
    if n < 10 ** (count - 1):
        return count - 1
    return count + 1 if n >= 10**count else count


def _decimal_places(denominator: int) -> int | None:
    """The places of the exact decimal of ``k/denominator`` (in lowest terms), or ``None`` past :data:`MAX_DECIMAL_PLACES`."""
    twos = (denominator & -denominator).bit_length() - 1
    rest, fives = denominator >> twos, 0
    while rest % 5 == 0 and fives <= MAX_DECIMAL_PLACES:
        rest //= 5
        fives += 1
    places = max(twos, fives)
    return places if rest == 1 and places <= MAX_DECIMAL_PLACES else None


def _approximate(value: Fraction) -> str:
    """``value`` to 10 significant digits; in scientific notation when it lies outside the float range."""
    if value == 0:
        return "0"
    try:
        approx = float(value)
    except OverflowError:
        approx = math.inf
    if math.isfinite(approx) and abs(approx) >= sys.float_info.min:
        return f"{approx:.10g}"
    log = math.log10(abs(value.numerator)) - math.log10(value.denominator)  # math.log10 takes ints of any size
    exponent = math.floor(log)
    mantissa = f"{10 ** (log - exponent):.10g}"
    if mantissa.startswith("10"):  # rounded up to the next power of ten
        mantissa, exponent = "1", exponent + 1
    return f"{'-' if value < 0 else ''}{mantissa}e{exponent:+d}"


def calculate(expression: str) -> str:
    """Evaluate and format; an invalid expression gives ``"Error: ..."`` text instead of raising."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as exc:
        return f"Error: {exc}."
    except (ArithmeticError, ValueError, TypeError, RecursionError, MemoryError) as exc:  # a bound missed: still an answer
        return f"Error: cannot evaluate this expression ({type(exc).__name__})."
