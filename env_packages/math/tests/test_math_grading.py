"""Tests of answer extraction and exact answer comparison."""

from __future__ import annotations

import random
import time
from fractions import Fraction

import pytest

from tinkergym_math.data import load_split
from tinkergym_math.grading import answers_match, extract_answer, extract_boxed, grade, parse_number


@pytest.mark.parametrize(
    "predicted, expected",
    [
        ("3/4", "0.75"),
        ("0.75", "3/4"),
        ("\\frac{3}{4}", "3/4"),
        ("\\dfrac{3}{4}", "0.75"),
        ("\\tfrac34", "3/4"),
        ("\\dfrac34", "0.75"),
        ("-\\frac{3}{4}", "-0.75"),
        ("\\frac{-3}{4}", "-3/4"),
        ("\\frac{3}{-4}", "-3/4"),
        ("6/8", "3/4"),
        ("1,234", "1234"),
        ("1{,}234", "1234"),
        ("1,234,567.5", "1234567.5"),
        ("-5", "-5"),
        ("−5", "-5"),
        ("$12.50", "12.5"),
        ("\\$12.50", "12.5"),
        ("12.50 dollars", "12.5"),
        ("25%", "25"),
        ("25\\%", "25"),
        ("90^\\circ", "90"),
        ("12 cm", "12"),
        ("5 km/h", "5"),
        ("\\text{12 apples}", "12"),
        ("12\\text{ hours}", "12"),
        ("x = 5", "5"),
        ("$x=-2$", "-2"),
        ("1 3/4", "7/4"),
        ("1\\frac{3}{4}", "1.75"),
        ("-1 1/2", "-1.5"),
        ("42.", "42"),
        ("42.0", "42"),
        (".5", "1/2"),
        ("2.5e3", "2500"),
        ("0.667", "2/3"),
        ("0.6666", "2/3"),
        ("0.333", "1/3"),
        ("{42}", "42"),
        ("Blue", "blue."),
    ],
)
def test_equivalent_answers(predicted, expected):
    assert answers_match(predicted, expected)


@pytest.mark.parametrize(
    "predicted, expected",
    [
        ("3/5", "3/4"),
        ("0.7", "3/4"),
        ("0.67", "2/3"),  # two decimal places are not enough for a non-terminating fraction
        ("0.6", "2/3"),
        ("0.751", "3/4"),  # a terminating answer must match exactly
        ("0.30000000000000004", "0.3"),
        ("5", "-5"),
        ("1,2", "12"),
        ("3 4", "34"),
        ("12 hours 20 minutes", "12"),
        ("1e999999", "1"),
        ("", "0"),
        ("forty-two", "42"),
        ("3/0", "0"),
        ("0.75", "75"),
        (None, "3"),
        ("red", "blue"),
    ],
)
def test_non_equivalent_answers(predicted, expected):
    assert not answers_match(predicted, expected)


def test_parse_number_is_exact():
    assert parse_number("0.1") == Fraction(1, 10)
    assert parse_number("\\frac{1}{3}") == Fraction(1, 3)
    assert parse_number("-1,000.25") == Fraction(-4001, 4)
    assert parse_number("nonsense") is None
    assert parse_number("9" * 1000) is None  # too long to read as a number


def test_extract_last_boxed_with_nested_braces():
    assert extract_answer("first \\boxed{1} then \\boxed{\\frac{3}{4}}.") == ("\\frac{3}{4}", "boxed")
    assert extract_answer("\\boxed{\\text{a {b} c}}") == ("\\text{a {b} c}", "boxed")
    assert extract_answer("\\boxed{2} and an unclosed \\boxed{3") == ("2", "boxed")
    assert extract_answer("$\\boxed 7$") == ("7", "boxed")
    assert extract_answer("\\fbox{9}") == ("9", "boxed")
    assert extract_boxed("no box here") is None


@pytest.mark.parametrize(
    "reply, answer",
    [
        ("Work...\nAnswer: 42", "42"),
        ("Answer: 1\nAnswer: 2\nThat is all.", "2"),
        ("**Answer:** 3/4", "3/4"),
        ("**Answer**: 5", "5"),
        ("Final answer: $\\frac{1}{2}$", "$\\frac{1}{2}$"),
        ("The final answer is: 12", "12"),
    ],
)
def test_extract_answer_line(reply, answer):
    assert extract_answer(reply) == (answer, "answer_line")


def test_boxed_wins_over_answer_line():
    assert extract_answer("\\boxed{5}\nAnswer: 6") == ("5", "boxed")


def test_no_answer():
    for reply in ["", "I think it is 42", "\\boxed{", "answers are hard", 42, None]:
        assert extract_answer(reply) == (None, None)


def test_grade_flags():
    good = grade("so \\boxed{3/4}", "0.75")
    assert good.correct and good.well_formed and good.source == "boxed"
    wrong_but_boxed = grade("\\boxed{7}", "8")
    assert not wrong_but_boxed.correct and wrong_but_boxed.well_formed
    not_a_number = grade("\\boxed{seven}", "7")
    assert not not_a_number.correct and not not_a_number.well_formed
    line = grade("Answer: 8", "8")
    assert line.correct and not line.well_formed and line.source == "answer_line"
    nothing = grade("no idea", "8")
    assert nothing.extracted is None and not nothing.correct and not nothing.well_formed


def test_every_shipped_answer_matches_its_other_forms():
    for split in ("train", "test"):
        for problem in load_split(split):
            value = parse_number(problem.answer)
            assert value is not None, problem
            assert answers_match(problem.answer, problem.answer)
            assert answers_match(f"\\frac{{{value.numerator}}}{{{value.denominator}}}", problem.answer)
            assert not answers_match(str(value + 1), problem.answer)


def test_fuzz_never_raises():
    rng = random.Random(0)
    pieces = ["\\boxed{", "}", "{", "\\frac", "Answer:", "\n", "3", "/", "-", ",", ".", "e", "$", "%", "\\text{", "x=", " ", "\ud800", "🙂"]
    for _ in range(3000):
        reply = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 25)))
        expected = "".join(rng.choice(pieces[6:12]) for _ in range(rng.randint(1, 5)))
        result = grade(reply, expected)
        assert isinstance(result.correct, bool)
    for hostile in ["\\boxed{" * 20_000, "{" * 50_000, "\\frac" * 10_000, "Answer:" * 10_000, "9" * 100_000]:
        grade(hostile, "3/4")


@pytest.mark.parametrize("answer", ["inf", "-inf", "nan", "NaN", "Infinity", "1e999", "-1e999", "1e-999", "\\infty", "∞"])
def test_non_finite_answers_are_wrong_and_never_raise(answer):
    for reply in (answer, f"\\boxed{{{answer}}}", f"Answer: {answer}"):
        assert not grade(reply, "5").correct
        assert not answers_match(answer, "5")


_LONG = 16_000


@pytest.mark.parametrize(
    "reply",
    [
        " " * _LONG,
        "\n" * _LONG,
        " \t\r\n\x0b\x0c" * (_LONG // 6),
        "answer" + " " * _LONG,
        "The final answer is" + " " * _LONG,
        "answer" + "\n" * _LONG,
        "Answer: a" + " " * _LONG + "b",
        "Answer: 1" + " " * _LONG + "1",
        "1" * 20_000,
        "\\boxed{" + "1" * 20_000 + "}",
        "Answer: " + "1" * 20_000,
        "\\boxed a{" * (_LONG // 9),
        "-" * _LONG + "answer",
    ],
    ids=lambda reply: f"{reply[:12]!r}x{len(reply)}",
)
def test_long_replies_grade_in_linear_time(reply):
    started = time.perf_counter()
    grade(reply, "5")
    grade(reply, "blue")
    assert time.perf_counter() - started < 0.2
