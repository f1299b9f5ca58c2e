"""Word-problem templates for the shipped dataset: arithmetic stories and elementary algebra.

Each template is a function ``template(rng) -> (question, answer)`` that draws its numbers from a
``random.Random`` and computes the answer exactly with :class:`fractions.Fraction`. Answers are
integers (``"42"``, ``"-5"``), fractions in lowest terms (``"3/4"``) or terminating decimals
(``"12.5"``, for money and percentages). This module holds the arithmetic, percentage and fraction
templates; :mod:`tinkergym_math.templates_algebra` holds the algebra ones, and
:data:`tinkergym_math.generate.TOPICS` maps each topic name to its templates.
"""

from __future__ import annotations

import random
from fractions import Fraction
from collections.abc import Callable

Template = Callable[[random.Random], tuple[str, str]]

NAMES = (
    ("Ava", "she"), ("Liam", "he"), ("Maya", "she"), ("Noah", "he"), ("Zoe", "she"), ("Omar", "he"),
    ("Priya", "she"), ("Diego", "he"), ("Hana", "she"), ("Kofi", "he"), ("Elena", "she"), ("Tomas", "he"),
    ("Aisha", "she"), ("Ben", "he"), ("Chloe", "she"), ("Ravi", "he"), ("Sofia", "she"), ("Yuki", "he"),
)
ITEMS = ("notebook", "pen", "apple", "sandwich", "ticket", "candle", "mug", "poster", "plant", "book")
COLLECTIBLES = ("stickers", "marbles", "stamps", "shells", "cards", "coins")


def fmt(value: Fraction, decimal: bool = False) -> str:
    """An exact answer as text: an integer, a decimal (when ``decimal`` and it terminates) or ``p/q``."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    if decimal and _terminates(value.denominator):
        return _decimal_text(value)
    return f"{value.numerator}/{value.denominator}"


def _terminates(denominator: int) -> bool:
    for p in (2, 5):
        while denominator % p == 0:
            denominator //= p
    return denominator == 1


def _decimal_text(value: Fraction) -> str:
    sign = "-" if value < 0 else ""
    value = abs(value)
    places = 0
    while (value * 10**places).denominator != 1:
        places += 1
    scaled = int(value * 10**places)
    whole, frac = divmod(scaled, 10**places)
    return f"{sign}{whole}.{frac:0{places}d}"


def money(value: Fraction | int) -> str:
    """A dollar amount for question text: ``$12`` or ``$12.50``."""
    value = Fraction(value)
    if value.denominator == 1:
        return f"${value.numerator:,}"
    return f"${float(value):,.2f}"


def person(rng: random.Random, exclude: str = "") -> tuple[str, str, str]:
    """A name with its subject and possessive pronouns."""
    name, pronoun = rng.choice([n for n in NAMES if n[0] != exclude])
    return name, pronoun, "her" if pronoun == "she" else "his"


# ----- multi-step arithmetic stories --------------------------------------------------------------
def shopping(rng: random.Random) -> tuple[str, str]:
    """Buy two kinds of items, pay with a bill, get change."""
    name, he, _ = person(rng)
    item1, item2 = rng.sample(ITEMS, 2)
    n1, n2 = rng.randint(2, 9), rng.randint(2, 9)
    p1, p2 = Fraction(rng.randint(2, 30), rng.choice((1, 2))), Fraction(rng.randint(1, 20))
    total = n1 * p1 + n2 * p2
    bill = next(b for b in (20, 50, 100, 200, 500) if b > total)
    question = rng.choice((
        f"{name} buys {n1} {item1}s at {money(p1)} each and {n2} {item2}s at {money(p2)} each. {he.capitalize()} pays with a {money(bill)} bill. How "
        f"much change, in dollars, does {he} get?",
        f"At a shop, {item1}s cost {money(p1)} each and {item2}s cost {money(p2)} each. {name} takes {n1} {item1}s and {n2} {item2}s and hands over "
        f"{money(bill)}. How many dollars of change should {name} receive?",
    ))
    return question, fmt(bill - total, decimal=True)


def collecting(rng: random.Random) -> tuple[str, str]:
    """Start with some, gain a fixed amount per day, give some away."""
    name, he, his = person(rng)
    friend, _, _ = person(rng, exclude=name)
    thing = rng.choice(COLLECTIBLES)
    start, per_day, days = rng.randint(5, 60), rng.randint(2, 12), rng.randint(2, 9)
    given = rng.randint(1, start + per_day * days - 1)
    question = rng.choice((
        f"{name} has {start} {thing}. Every day for {days} days {he} gets {per_day} more. Then {he} gives {given} to {friend}. How many {thing} does "
        f"{name} have now?",
        f"{name} starts the week with {start} {thing} in {his} collection and adds {per_day} {thing} a day for {days} days. After giving {friend} "
        f"{given} {thing}, how many are left in the collection?",
    ))
    return question, fmt(Fraction(start + per_day * days - given))


def bakery(rng: random.Random) -> tuple[str, str]:
    """Trays of muffins, some sold in two batches, how many left."""
    trays, per_tray = rng.randint(3, 12), rng.choice((6, 8, 12, 24))
    made = trays * per_tray
    morning = rng.randint(1, made // 2)
    afternoon = rng.randint(1, made - morning)
    question = rng.choice((
        f"A bakery bakes {trays} trays of muffins with {per_tray} muffins on each tray. It sells {morning} muffins in the morning and {afternoon} in "
        "the afternoon. How many muffins are left?",
        f"There are {per_tray} muffins on each of {trays} trays. If {morning} muffins are sold before noon and another {afternoon} after noon, how "
        "many muffins remain unsold?",
    ))
    return question, fmt(Fraction(made - morning - afternoon))


def buses(rng: random.Random) -> tuple[str, str]:
    """Classes of students on buses: a ceiling division."""
    classes, size, seats = rng.randint(3, 12), rng.randint(18, 32), rng.choice((40, 45, 48, 50, 52, 60))
    students = classes * size
    needed = -(-students // seats)
    question = rng.choice((
        f"A school has {classes} classes with {size} students each. Every bus holds {seats} students. How many buses are needed to take all the "
        "students on a trip?",
        f"For a field trip, {classes} classes of {size} pupils must ride buses that seat {seats} each. What is the smallest number of buses that can "
        "carry everyone?",
    ))
    return question, fmt(Fraction(needed))


def savings(rng: random.Random) -> tuple[str, str]:
    """Weekly savings minus a purchase."""
    name, he, _ = person(rng)
    weekly, weeks = rng.randint(5, 40), rng.randint(3, 20)
    saved = weekly * weeks
    spent = rng.randint(1, saved)
    item = rng.choice(("bike", "game", "jacket", "guitar", "camera"))
    question = rng.choice((
        f"{name} saves {money(weekly)} every week. After {weeks} weeks {he} spends {money(spent)} on a {item}. How many dollars does {he} have left?",
        f"Putting away {money(weekly)} a week for {weeks} weeks, {name} then buys a {item} for {money(spent)}. How much money remains, in dollars?",
    ))
    return question, fmt(Fraction(saved - spent))


# ----- order of operations ------------------------------------------------------------------------
_EXPRESSIONS: tuple[tuple[str, Callable[..., Fraction]], ...] = (
    ("{a} + {b} × {c}", lambda a, b, c, d: Fraction(a + b * c)),
    ("({a} + {b}) × {c} − {d}", lambda a, b, c, d: Fraction((a + b) * c - d)),
    ("{a} × {b} − {c} × {d}", lambda a, b, c, d: Fraction(a * b - c * d)),
    ("{a} − ({b} − {c}) × {d}", lambda a, b, c, d: Fraction(a - (b - c) * d)),
    ("({a} − {b}) × ({c} + {d})", lambda a, b, c, d: Fraction((a - b) * (c + d))),
    ("{a} × ({b} + {c}) ÷ {d}", lambda a, b, c, d: Fraction(a * (b + c), d)),
    ("{a} ÷ {d} + {b} × {c}", lambda a, b, c, d: Fraction(a, d) + b * c),
)


def expression(rng: random.Random) -> tuple[str, str]:
    """Evaluate an arithmetic expression with the usual order of operations."""
    pattern, value = rng.choice(_EXPRESSIONS)
    a, b, c, d = (rng.randint(1, 20) for _ in range(4))
    if "÷" in pattern:
        d = rng.randint(2, 9)
        a = d * rng.randint(1, 12) if "÷ {d} +" in pattern else a
    text = pattern.format(a=a, b=b, c=c, d=d)
    if rng.random() < 0.4:
        text = text.replace("×", "*").replace("÷", "/").replace("−", "-")
    question = rng.choice((f"Evaluate {text}.", f"What is the value of {text}?", f"Compute {text}.", f"Calculate: {text}"))
    return question, fmt(value(a, b, c, d))


# ----- percentages --------------------------------------------------------------------------------
def discount(rng: random.Random) -> tuple[str, str]:
    """A sale price after a percent discount."""
    item = rng.choice(("jacket", "lamp", "bicycle", "backpack", "kettle", "chair"))
    price, rate = rng.randint(2, 40) * 5, rng.choice((10, 15, 20, 25, 30, 35, 40, 50, 60, 75))
    question = rng.choice((
        f"A {item} costs {money(price)}. It is on sale for {rate}% off. What is the sale price in dollars?",
        f"The {item} normally sells for {money(price)}, but the store takes {rate}% off. How many dollars does it cost now?",
    ))
    return question, fmt(Fraction(price) * (100 - rate) / 100, decimal=True)


def percent_of(rng: random.Random) -> tuple[str, str]:
    """A percent of a number, or what percent one number is of another."""
    if rng.random() < 0.5:
        rate, base = rng.choice((5, 12, 15, 20, 25, 35, 40, 60, 75, 120, 150)), rng.randint(2, 60) * 4
        question = rng.choice((f"What is {rate}% of {base}?", f"Find {rate} percent of {base}."))
        return question, fmt(Fraction(rate * base, 100), decimal=True)
    name, he, _ = person(rng)
    total = rng.choice((20, 25, 40, 50, 80))
    right = rng.randint(1, total)
    question = rng.choice((
        f"{name} answered {right} of {total} questions correctly. What percentage of the questions did {he} get right?",
        f"On a {total}-question quiz, {name} got {right} right. What percent is that?",
    ))
    return question, fmt(Fraction(100 * right, total), decimal=True)


def percent_change(rng: random.Random) -> tuple[str, str]:
    """A percent increase, or an increase followed by a decrease."""
    if rng.random() < 0.5:
        start, rate = rng.randint(2, 50) * 100, rng.choice((4, 5, 8, 10, 12, 15, 20, 25, 30, 50))
        end = start * (100 + rate) // 100
        question = rng.choice((
            f"A town's population grew from {start:,} to {end:,}. By what percent did it increase?",
            f"Membership of a club went up from {start:,} to {end:,}. What was the percent increase?",
        ))
        return question, fmt(Fraction(rate))
    price, up, down = rng.randint(2, 40) * 10, rng.choice((10, 20, 25, 50)), rng.choice((10, 20, 25, 40))
    final = Fraction(price) * (100 + up) / 100 * (100 - down) / 100
    question = (
        f"A price of {money(price)} is raised by {up}% and the new price is then lowered by {down}%. "
        "What is the final price in dollars?"
    )
    return question, fmt(final, decimal=True)


# ----- fractions ----------------------------------------------------------------------------------
def _proper(rng: random.Random, low: int = 2, high: int = 12) -> Fraction:
    denominator = rng.randint(low, high)
    return Fraction(rng.randint(1, denominator - 1), denominator)


def _frac_text(value: Fraction) -> str:
    return f"{value.numerator}/{value.denominator}"


def pizza(rng: random.Random) -> tuple[str, str]:
    """Two fractions of a whole added (or one subtracted from another)."""
    name, _, _ = person(rng)
    friend, _, _ = person(rng, exclude=name)
    a, b = _proper(rng), _proper(rng)
    while a + b >= 1 or a == b:
        a, b = _proper(rng), _proper(rng)
    if rng.random() < 0.5:
        question = (f"{name} ate {_frac_text(a)} of a pizza and {friend} ate {_frac_text(b)} of the same pizza. "
                    "What fraction of the pizza did they eat together?")
        return question, fmt(a + b)
    big, small = max(a, b), min(a, b)
    question = f"A tank is {_frac_text(big)} full of water. Then {_frac_text(small)} of the tank's capacity is drained. What fraction of the tank is full now?"
    return question, fmt(big - small)


def fraction_of(rng: random.Random) -> tuple[str, str]:
    """A fraction of a quantity, or a fraction scaled up in a recipe."""
    a = _proper(rng)
    if rng.random() < 0.5:
        n = rng.randint(2, 60)
        question = rng.choice((f"What is {_frac_text(a)} of {n}?", f"Compute {_frac_text(a)} of {n}."))
        return question, fmt(a * n)
    batches = rng.randint(2, 9)
    ingredient = rng.choice(("sugar", "flour", "milk", "oil"))
    question = f"A recipe needs {_frac_text(a)} cup of {ingredient} per batch. How many cups of {ingredient} are needed for {batches} batches?"
    return question, fmt(a * batches)


def fraction_ops(rng: random.Random) -> tuple[str, str]:
    """Multiply or divide two fractions; or a part of a class as a fraction."""
    roll = rng.random()
    a, b = _proper(rng), _proper(rng)
    if roll < 0.35:
        return f"Compute {_frac_text(a)} × {_frac_text(b)} and simplify.", fmt(a * b)
    if roll < 0.7:
        return f"What is {_frac_text(a)} divided by {_frac_text(b)}? Give the answer as a fraction.", fmt(a / b)
    size = rng.randint(12, 40)
    part = rng.randint(1, size - 1)
    plural, singular = rng.choice((("walk", "walks"), ("cycle", "cycles"), ("take the bus", "takes the bus")))
    question = f"In a class of {size} students, {part} {plural} to school. What fraction of the class {singular} to school? Give the fraction in lowest terms."
    return question, fmt(Fraction(part, size))
