"""English -> French number phrases generated with num2words (0..999,999).

The held-out evaluation set is a fixed sample of 1,000 numbers that training never sees.
Sources get light variety (commas and "and" dropped at random), since people type numbers
both ways; targets are always num2words' French.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from num2words import num2words

MAX_NUMBER = 999_999
HELD_OUT_SEED = 20261121
HELD_OUT_SIZE = 1000


def english(number: int) -> str:
    return num2words(number, lang="en")


def french(number: int) -> str:
    return num2words(number, lang="fr")


def held_out_numbers(size: int = HELD_OUT_SIZE) -> list[int]:
    """The fixed evaluation numbers, uniform over 0..999,999."""
    rng = random.Random(HELD_OUT_SEED)
    numbers: list[int] = []
    seen: set[int] = set()
    while len(numbers) < size:
        n = rng.randint(0, MAX_NUMBER)
        if n not in seen:
            seen.add(n)
            numbers.append(n)
    return numbers


def vary_source(text: str, rng: random.Random) -> str:
    """Drop the comma and/or the 'and' sometimes: 'one thousand two hundred thirty-four'."""
    if rng.random() < 0.3:
        text = text.replace(",", "")
    if rng.random() < 0.2:
        text = text.replace(" and ", " ")
    return text


def sample_number(rng: random.Random) -> int:
    """Half uniform (like the held-out set), half uniform over digit counts (small numbers)."""
    if rng.random() < 0.5:
        return rng.randint(0, MAX_NUMBER)
    digits = rng.randint(1, 6)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def training_pairs(seed: int) -> Iterator[tuple[str, str]]:
    """An endless stream of (english, french) pairs, held-out numbers excluded."""
    rng = random.Random(seed)
    excluded = set(held_out_numbers())
    while True:
        n = sample_number(rng)
        if n in excluded:
            continue
        yield vary_source(english(n), rng), french(n)


def tokenizer_corpus(count: int, seed: int) -> list[str]:
    """Lines of both languages for training the shared SentencePiece model."""
    lines: list[str] = []
    for n in range(0, 101):
        lines += [english(n), french(n)]
    pairs = training_pairs(seed)
    for _ in range(count):
        en, fr = next(pairs)
        lines += [en, fr]
    return lines
