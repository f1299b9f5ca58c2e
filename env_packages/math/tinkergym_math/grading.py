r"""Answer extraction and exact answer comparison for math problems.

Extraction (:func:`extract_answer`): the content of the LAST ``\boxed{...}`` in the reply (braces
balanced, so ``\boxed{\frac{3}{4}}`` works); without one, the last line of the form ``Answer: ...``
(also ``Final answer: ...``, ``**Answer:** ...``).

Comparison (:func:`answers_match`): both sides are read as exact numbers with
:class:`fractions.Fraction` (never float equality) when they can be:

- integers, with thousands separators (``1,234``; LaTeX ``1{,}234``) and signs (``-5``, ``−5``);
- decimals and scientific notation (``0.75``, ``.5``, ``2.5e3``);
- fractions ``3/4``, ``\frac{3}{4}``, ``\dfrac{3}{4}``, ``\tfrac34``, ``-\frac{3}{4}``; mixed numbers
  ``1 3/4`` and ``1\frac{3}{4}``;
- surrounded by ``$...$``, ``\(...\)``, ``\text{...}``; with a leading ``x =``; with a currency sign
  (``$``, ``€``, ``£``), a trailing ``%``, degree sign or unit words (``12 cm``, ``5 km/h``) stripped.

So ``3/4``, ``0.75`` and ``\frac{3}{4}`` all match each other, while ``75%`` reads as 75 (the percent
sign is stripped): it matches an expected ``75``, not ``0.75``.
A decimal also matches a fraction whose decimal expansion does not terminate (``2/3``) when it has at
least 3 decimal places and lies within one unit of its last place (``0.667``, ``0.6666``). Answers
that are not numbers (``"blue"``) compare as text, ignoring case, spaces and a final period.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

#: Longest answer text that is read as a number (longer text is compared as text only).
MAX_NUMBER_TEXT = 120
#: Exponents beyond this are not expanded (``1e999999`` would build a huge integer).
MAX_EXPONENT = 400

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
# One line each: no two neighbouring parts can match the same characters, and the answer is the rest of the
# line (stripped afterwards), so a long line that is not an answer line fails in linear time, not quadratic.
_ANSWER_LINE = re.compile(
    r"^[ \t>#*_-]*+(?:the[ \t]++)?(?:final[ \t]++)?answer(?:[ \t]*+is)?[ \t*_]*+[:=](?P<answer>[^\n]*)",
    re.IGNORECASE | re.MULTILINE,
)
_ANSWER_PADDING = " \t\r*_"
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?"
_SIMPLE = re.compile(rf"^(?P<sign>[+-]?)\s*(?P<num>{_NUMBER})(?:\s*/\s*(?P<dsign>[+-]?)(?P<den>{_NUMBER}))?(?P<rest>.*)$")
_MIXED = re.compile(r"^(?P<sign>[+-]?)\s*(?P<whole>\d+)\s+(?P<num>\d+)\s*/\s*(?P<den>\d+)$")
_UNIT_TAIL = re.compile(r"^(?:[A-Za-z°²³/.^\s]|(?<=[A-Za-z^])\d)*$")
_FRAC = re.compile(r"\\[dt]?frac\s*")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "~", "\\displaystyle", "^\\circ", "^{\\circ}", "°", "\\%", "%")
_DASHES = {"\u2212": "-", "\u2013": "-", "\u2014": "-", "\ufe63": "-", "\uff0d": "-", "\uff0b": "+"}


@dataclass(frozen=True)
class Grade:
    """The grading of one reply.

    Attributes:
        correct: The extracted answer matches the expected one.
        extracted: The extracted answer text (``None``: nothing found).
        source: ``"boxed"``, ``"answer_line"`` or ``None``.
        well_formed: The answer came from a ``\\boxed{}`` and reads as a number (or, for a non-numeric
            expected answer, is non-empty): what the optional format reward pays for.
    """

    correct: bool
    extracted: str | None
    source: str | None
    well_formed: bool


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The content of the brace group opening at ``text[start]`` and the index after it."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        char = text[i]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


def _brace_pairs(text: str) -> dict[int, int]:
    """Index of each ``{`` that is closed -> index of its ``}`` (one pass)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for i, char in enumerate(text):
        if char == "{":
            stack.append(i)
        elif char == "}" and stack:
            pairs[stack.pop()] = i
    return pairs


def extract_boxed(text: str) -> str | None:
    r"""The content of the last well-formed ``\boxed{...}`` (or ``\fbox{...}``, or ``\boxed 5``) in ``text``."""
    pairs: dict[int, int] | None = None
    for match in reversed(list(_BOXED.finditer(text))):
        end = match.end()
        if end < len(text) and text[end] == "{":
            pairs = _brace_pairs(text) if pairs is None else pairs
            if end in pairs:
                return text[end + 1 : pairs[end]].strip()
            continue
        if end > match.start() + len("\\boxed") and end < len(text):  # "\boxed 42"
            token = re.match(r"[^\s$]+", text[end:])
            if token and "{" not in token.group(0):
                return token.group(0)
    return None


def extract_answer(text: str) -> tuple[str | None, str | None]:
    r"""``(answer, source)``: the last ``\boxed{}`` content, else the last ``Answer: ...`` line."""
    if not isinstance(text, str):
        return None, None
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    lines = [m.group("answer").strip(_ANSWER_PADDING) for m in _ANSWER_LINE.finditer(text)]
    lines = [line for line in lines if line]
    if lines:
        return lines[-1], "answer_line"
    return None, None


def _replace_fracs(text: str) -> str:
    r"""``\frac{a}{b}`` / ``\frac34`` -> `` a/b `` (spaces keep ``1\frac{3}{4}`` a mixed number)."""
    out, pos = [], 0
    for _ in range(20):
        match = _FRAC.search(text, pos)
        if match is None:
            break
        args, i = [], match.end()
        for _ in range(2):
            group = _braced(text, i)
            if group is not None:
                args.append(group[0].strip())
                i = group[1]
            elif i < len(text) and not text[i].isspace():
                args.append(text[i])
                i += 1
            else:
                break
        if len(args) < 2:
            break
        out.append(text[pos : match.start()] + f" {args[0]}/{args[1]} ")
        pos = i
    out.append(text[pos:])
    return "".join(out)


def _clean(text: str) -> str:
    """LaTeX and decoration removed; what is left should be a number."""
    for old, new in _DASHES.items():
        text = text.replace(old, new)
    text = _TEXT_CMD.sub(r" \1 ", text)
    text = text.replace("{,}", ",").replace("\\$", "$").replace("\\(", "").replace("\\)", "")
    text = text.replace("\\[", "").replace("\\]", "")
    for token in _DROP:
        text = text.replace(token, " ")
    text = _replace_fracs(text).replace("$", " ")
    if "=" in text:
        text = text.rsplit("=", 1)[1]
    text = text.strip().rstrip(".").strip()
    for prefix in ("USD", "US", "€", "£", "¥", "Rs."):
        if text.upper().startswith(prefix.upper()):
            text = text[len(prefix) :].strip()
    if text.startswith("{") and text.endswith("}") and _braced(text, 0) == (text[1:-1], len(text)):
        text = text[1:-1].strip()
    return text


def _to_fraction(number: str) -> Fraction:
    number = number.replace(",", "")
    mantissa, _, exponent = number.lower().partition("e")
    if exponent and abs(int(exponent)) > MAX_EXPONENT:
        raise ValueError("exponent too large")
    return Fraction(number.rstrip(".") if not exponent else number)


def read_number(text: str) -> tuple[Fraction, int | None] | None:
    """``(value, decimal places)`` of an answer text (places ``None`` unless it was a plain decimal)."""
    if not isinstance(text, str) or len(text) > 4 * MAX_NUMBER_TEXT:
        return None
    cleaned = _clean(text)
    if not cleaned or len(cleaned) > MAX_NUMBER_TEXT:
        return None
    try:
        mixed = _MIXED.match(cleaned)
        if mixed:
            value = int(mixed["whole"]) + Fraction(int(mixed["num"]), int(mixed["den"]))
            return (-value if mixed["sign"] == "-" else value), None
        match = _SIMPLE.match(cleaned)
        if match is None or not _UNIT_TAIL.match(match["rest"]):
            return None
        value = _to_fraction(match["num"])
        places = None
        if match["den"] is not None:
            denominator = _to_fraction(match["den"])
            value = value / (-denominator if match["dsign"] == "-" else denominator)
        elif "." in match["num"] and "e" not in match["num"].lower():
            places = len(match["num"].split(".", 1)[1])
        return (-value if match["sign"] == "-" else value), places
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def parse_number(text: str) -> Fraction | None:
    r"""The exact value of an answer text (``"3/4"``, ``"\frac{3}{4}"``, ``"$1,234"``...), or ``None``."""
    read = read_number(text)
    return None if read is None else read[0]


def _terminates(denominator: int) -> bool:
    for p in (2, 5):
        while denominator % p == 0:
            denominator //= p
    return denominator == 1


def _normalize_text(text: str) -> str:
    text = _TEXT_CMD.sub(r"\1", text).replace("$", "")
    return " ".join(text.lower().split()).rstrip(".").strip()


def answers_match(predicted: str | None, expected: str) -> bool:
    """Whether ``predicted`` equals ``expected``: exactly as numbers, else as normalized text."""
    if not isinstance(predicted, str) or not isinstance(expected, str):
        return False
    want = read_number(expected)
    if want is None:
        return bool(_normalize_text(predicted)) and _normalize_text(predicted) == _normalize_text(expected)
    got = read_number(predicted)
    if got is None:
        return False
    (value, places), target = got, want[0]
    if value == target:
        return True
    if places is not None and places >= 3 and not _terminates(target.denominator):
        return abs(value - target) < Fraction(1, 10**places)
    return False


def grade(reply: str, expected: str) -> Grade:
    """Extract the answer from ``reply`` and compare it with ``expected``."""
    extracted, source = extract_answer(reply)
    correct = answers_match(extracted, expected)
    if source != "boxed" or extracted is None:
        well_formed = False
    elif read_number(expected) is not None:
        well_formed = read_number(extracted) is not None
    else:
        well_formed = bool(extracted.strip())
    return Grade(correct=correct, extracted=extracted, source=source, well_formed=well_formed)
