"""Algebra word-problem templates: linear equations, systems of two equations, rates and work, ages,
ratios and averages. Same contract as :mod:`tinkergym_math.templates`: ``template(rng) -> (question,
answer)`` with the answer computed exactly.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

from tinkergym_math.templates import fmt, money, person


def _signed(value: int) -> str:
    """``+ 5`` or ``− 5`` for the middle of an equation."""
    return f"+ {value}" if value >= 0 else f"− {-value}"


def _coef(value: int, var: str = "x") -> str:
    """``3x``, ``x``, ``−x`` or ``−4x``."""
    if value == 1:
        return var
    if value == -1:
        return f"−{var}"
    return f"{value}{var}".replace("-", "−")


def _nonzero(rng: random.Random, low: int, high: int) -> int:
    value = 0
    while value == 0:
        value = rng.randint(low, high)
    return value


# ----- linear equations ---------------------------------------------------------------------------
def solve_linear(rng: random.Random) -> tuple[str, str]:
    """``ax + b = c`` and ``a(x − b) = c``, with integer or fractional solutions."""
    a, b = _nonzero(rng, -9, 12), rng.randint(-30, 30)
    x = Fraction(rng.randint(-15, 15)) if rng.random() < 0.7 else Fraction(rng.randint(-20, 20), abs(a) if abs(a) > 1 else 2)
    if rng.random() < 0.5:
        c = a * x + b
        if c.denominator != 1:
            x, c = Fraction(round(x)), a * Fraction(round(x)) + b
        equation = f"{_coef(a)} {_signed(b)} = {fmt(c)}".replace("-", "−")
    else:
        a = a if abs(a) > 1 else a * rng.randint(2, 6)
        c = a * (x - b)
        if c.denominator != 1:
            x, c = Fraction(round(x)), a * (Fraction(round(x)) - b)
        inner = f"x {_signed(-b)}" if b else "x"
        equation = f"{a}({inner}) = {fmt(c)}".replace("-", "−")
    question = rng.choice((f"Solve for x: {equation}.", f"Find x if {equation}.", f"What value of x satisfies {equation}?"))
    return question, fmt(x)


def both_sides(rng: random.Random) -> tuple[str, str]:
    """``ax + b = cx + d`` with x on both sides."""
    a, c = rng.randint(-8, 12), rng.randint(-8, 12)
    while a == c or a == 0:
        a, c = rng.randint(-8, 12), rng.randint(-8, 12)
    b, d = rng.randint(-25, 25), rng.randint(-25, 25)
    x = Fraction(d - b, a - c)
    right = f"{_coef(c)} {_signed(d)}" if c else str(d)
    equation = f"{_coef(a)} {_signed(b)} = {right}".replace("-", "−")
    return rng.choice((f"If {equation}, what is x?", f"Solve {equation} for x.")), fmt(x)


def think_of_number(rng: random.Random) -> tuple[str, str]:
    """'I think of a number' and a fee-plus-monthly-rate story."""
    if rng.random() < 0.5:
        n, a, b = rng.randint(-10, 40), rng.randint(2, 9), rng.randint(1, 30)
        op, result = rng.choice((("subtract", n * a - b), ("add", n * a + b)))
        question = rng.choice((
            f"I think of a number, multiply it by {a} and then {op} {b}. The result is {result}. What number did I think of?",
            f"When a number is multiplied by {a} and {b} is {'subtracted' if op == 'subtract' else 'added'}, the result is {result}. Find the number.",
        ))
        return question, fmt(Fraction(n))
    name, he, _ = person(rng)
    fee, monthly, months = rng.randint(2, 20) * 5, rng.randint(10, 60), rng.randint(2, 24)
    total = fee + monthly * months
    question = f"A gym charges a {money(fee)} sign-up fee plus {money(monthly)} per month. {name} has paid {money(total)} in total. For how many months has {he} been a member?"
    return question, fmt(Fraction(months))


# ----- systems of two equations -------------------------------------------------------------------
def linear_system(rng: random.Random) -> tuple[str, str]:
    """Two equations in x and y with an integer solution; asks for x, y or x + y."""
    x, y = rng.randint(-10, 12), rng.randint(-10, 12)
    while True:
        a, b, d, e = (_nonzero(rng, -6, 7) for _ in range(4))
        if a * e - b * d != 0:
            break
    first = f"{_coef(a)} {_signed(b)[0]} {_coef(abs(b), 'y')} = {a * x + b * y}".replace("-", "−")
    second = f"{_coef(d)} {_signed(e)[0]} {_coef(abs(e), 'y')} = {d * x + e * y}".replace("-", "−")
    target, value = rng.choice((("x", x), ("y", y), ("x + y", x + y)))
    question = rng.choice((
        f"Solve the system {first} and {second}. What is {target}?",
        f"Given that {first} and {second}, find {target}.",
    ))
    return question, fmt(Fraction(value))


def tickets(rng: random.Random) -> tuple[str, str]:
    """Adult and child tickets, or chickens and cows by heads and legs."""
    if rng.random() < 0.5:
        adult, child = rng.randint(8, 25), rng.randint(3, 7)
        n_adult, n_child = rng.randint(5, 120), rng.randint(5, 120)
        total = adult * n_adult + child * n_child
        question = (
            f"Adult tickets to a show cost {money(adult)} and child tickets cost {money(child)}. "
            f"{n_adult + n_child} tickets were sold for {money(total)} in all. How many adult tickets were sold?"
        )
        return question, fmt(Fraction(n_adult))
    chickens, cows = rng.randint(3, 60), rng.randint(3, 40)
    heads, legs = chickens + cows, 2 * chickens + 4 * cows
    animal = rng.choice(("cows", "chickens"))
    question = f"A farm has only chickens and cows. Together they have {heads} heads and {legs} legs. How many {animal} are on the farm?"
    return question, fmt(Fraction(cows if animal == "cows" else chickens))


def sum_difference(rng: random.Random) -> tuple[str, str]:
    """Two numbers from their sum and difference; nickels and dimes."""
    if rng.random() < 0.5:
        big, small = rng.randint(10, 99), rng.randint(1, 60)
        big, small = max(big, small + 1), min(big, small + 1)
        which, value = rng.choice((("larger", big), ("smaller", small)))
        question = f"The sum of two numbers is {big + small} and their difference is {big - small}. What is the {which} number?"
        return question, fmt(Fraction(value))
    name, he, _ = person(rng)
    nickels, dimes = rng.randint(1, 30), rng.randint(1, 30)
    value = Fraction(5 * nickels + 10 * dimes, 100)
    question = f"{name} has {nickels + dimes} coins, all nickels and dimes, worth {money(value)} in total. How many dimes does {he} have?"
    return question, fmt(Fraction(dimes))


# ----- rates and work -----------------------------------------------------------------------------
def speed(rng: random.Random) -> tuple[str, str]:
    """Distance at a constant speed; two travellers approaching each other."""
    if rng.random() < 0.5:
        rate, hours = rng.randint(20, 75), rng.randint(2, 6)
        later = rng.choice([h for h in range(2, 10) if h != hours])
        vehicle = rng.choice(("car", "train", "bus", "truck"))
        question = f"A {vehicle} travels {rate * hours} miles in {hours} hours. At the same speed, how many miles does it travel in {later} hours?"
        return question, fmt(Fraction(rate * later))
    v1, v2, distance = rng.randint(30, 80), rng.randint(30, 80), rng.randint(10, 60) * 10
    question = (
        f"Two trains start {distance} km apart and travel toward each other, one at {v1} km/h and the other at {v2} km/h. "
        "After how many hours do they meet?"
    )
    return question, fmt(Fraction(distance, v1 + v2), decimal=True)


def work_together(rng: random.Random) -> tuple[str, str]:
    """Two workers together; a filling pipe against a drain."""
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    if rng.random() < 0.6:
        name, _, _ = person(rng)
        friend, _, _ = person(rng, exclude=name)
        question = (
            f"{name} can paint a fence in {a} hours and {friend} can paint the same fence in {b} hours. "
            "Working together, how many hours will it take them? Give an exact answer."
        )
        return question, fmt(Fraction(a * b, a + b))
    while a == b:
        b = rng.randint(2, 12)
    fill, drain = min(a, b), max(a, b)
    question = f"A pipe fills a tank in {fill} hours and a drain empties the full tank in {drain} hours. If both are open, how many hours does it take to fill the empty tank?"
    return question, fmt(Fraction(fill * drain, drain - fill))


def unit_rate(rng: random.Random) -> tuple[str, str]:
    """Price per item scaled; typing speed."""
    if rng.random() < 0.5:
        count, each = rng.randint(2, 12), Fraction(rng.randint(1, 40), 4)
        wanted = rng.choice([w for w in range(2, 31) if w != count])
        item = rng.choice(("pencils", "erasers", "oranges", "batteries"))
        question = f"{count} {item} cost {money(count * each)}. At the same price each, how many dollars do {wanted} {item} cost?"
        return question, fmt(each * wanted, decimal=True)
    name, he, _ = person(rng)
    wpm, words = rng.randint(20, 90), rng.randint(100, 3000)
    question = f"{name} types {wpm} words per minute. How many minutes does {he} need to type {words:,} words? Give an exact answer."
    return question, fmt(Fraction(words, wpm))


# ----- ages ---------------------------------------------------------------------------------------
def ages(rng: random.Random) -> tuple[str, str]:
    """Classic age puzzles with a unique integer answer."""
    a_name, _, _ = person(rng)
    b_name, _, _ = person(rng, exclude=a_name)
    roll = rng.random()
    if roll < 0.34:
        b, k, n = rng.randint(2, 15), rng.randint(2, 5), rng.randint(1, 12)
        a = k * b
        question = f"{a_name} is {k} times as old as {b_name}. In {n} years the sum of their ages will be {a + b + 2 * n}. How old is {a_name} now?"
        return question, fmt(Fraction(a))
    if roll < 0.67:
        b, m = rng.randint(5, 30), rng.randint(1, 8)
        a = 2 * (b - m) + m  # m years ago a was twice b
        question = f"{a_name} is {a - b} years older than {b_name}. {m} years ago {a_name} was twice as old as {b_name}. How old is {b_name} now?"
        return question, fmt(Fraction(b))
    b, gap = rng.randint(3, 40), rng.randint(1, 20)
    question = f"The ages of {a_name} and {b_name} add up to {2 * b + gap}. {a_name} is {gap} years older than {b_name}. How old is {b_name}?"
    return question, fmt(Fraction(b))


# ----- ratios -------------------------------------------------------------------------------------
def ratios(rng: random.Random) -> tuple[str, str]:
    """Sharing in a ratio; a ratio with one part known; a map scale."""
    p, q = rng.randint(1, 9), rng.randint(1, 9)
    while math.gcd(p, q) != 1 or p == q:
        p, q = rng.randint(1, 9), rng.randint(1, 9)
    roll = rng.random()
    if roll < 0.4:
        a_name, _, _ = person(rng)
        b_name, _, _ = person(rng, exclude=a_name)
        total = (p + q) * rng.randint(2, 40)
        who, part = rng.choice(((a_name, p), (b_name, q)))
        question = f"{money(total)} is shared between {a_name} and {b_name} in the ratio {p}:{q}. How many dollars does {who} get?"
        return question, fmt(Fraction(total * part, p + q))
    if roll < 0.7:
        girls = q * rng.randint(2, 12)
        question = f"The ratio of boys to girls in a club is {p}:{q}. There are {girls} girls. How many boys are in the club?"
        return question, fmt(Fraction(girls * p, q))
    scale, cm = rng.choice((5, 10, 20, 25, 50)), Fraction(rng.randint(2, 30), 2)
    cm_text = fmt(cm, decimal=True)
    question = f"On a map, 1 cm stands for {scale} km. Two towns are {cm_text} cm apart on the map. How many km apart are they?"
    return question, fmt(cm * scale, decimal=True)


# ----- averages -----------------------------------------------------------------------------------
def averages(rng: random.Random) -> tuple[str, str]:
    """A mean of scores; the next score that lifts an average; a number removed from a set."""
    name, he, his = person(rng)
    roll = rng.random()
    if roll < 0.4:
        scores = [rng.randint(55, 100) for _ in range(rng.randint(3, 6))]
        listing = ", ".join(map(str, scores[:-1])) + f" and {scores[-1]}"
        question = f"{name}'s test scores are {listing}. What is the mean of {his} scores?"
        return question, fmt(Fraction(sum(scores), len(scores)), decimal=True)
    if roll < 0.7:
        n, avg, rise = rng.randint(2, 8), rng.randint(60, 85), rng.randint(1, 3)
        while (avg + rise) * (n + 1) - avg * n > 100:
            rise = 1
            avg -= 1
        needed = (avg + rise) * (n + 1) - avg * n
        question = f"After {n} tests {name}'s average score is {avg}. What score does {he} need on the next test to raise the average to {avg + rise}?"
        return question, fmt(Fraction(needed))
    n, avg = rng.randint(4, 9), rng.randint(10, 50)
    rest = avg + rng.randint(-6, 6)
    while avg * n - rest * (n - 1) < 1:
        rest -= 1
    removed = avg * n - rest * (n - 1)
    question = f"The average of {n} numbers is {avg}. When one of the numbers is removed, the average of the other {n - 1} is {rest}. What number was removed?"
    return question, fmt(Fraction(removed))
