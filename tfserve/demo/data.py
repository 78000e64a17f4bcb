"""English -> French number phrases generated with num2words (0..999,999).

The held-out evaluation set is a fixed sample of 1,000 numbers that training never sees.
Sources get light variety (commas and "and" dropped, hyphens typed as spaces, each at
random), since people type numbers all these ways; targets are always num2words' French.
`SOURCE_FORMS` names the forms the evaluation scores separately.

A pasted paragraph reaches the model one sentence at a time, so training also writes some
pairs as sentences: sentence-cased, with or without a closing '.', '!' or '?' ("Three
hundred and forty-two!" -> "Trois cent quarante-deux !": French puts a space before '!',
'?', ';' and ':'; a plain space, not the narrow no-break one). `SENTENCE_FORMS` names those
the evaluation scores.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

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


# how often training drops the commas, drops the "and"s, and types the hyphens as spaces
COMMA_DROP_RATE = 0.3
AND_DROP_RATE = 0.2
HYPHEN_SPACE_RATE = 0.4


def no_commas(text: str) -> str:
    return text.replace(",", "")


def no_and(text: str) -> str:
    return text.replace(" and ", " ")


def no_hyphens(text: str) -> str:
    """'twenty-one' -> 'twenty one', as most people type it."""
    return text.replace("-", " ")


def bare(text: str) -> str:
    """No hyphens, commas or 'and': 'three hundred forty two thousand one'."""
    return no_and(no_commas(no_hyphens(text)))


# the English forms the evaluation scores one by one: num2words' own, and the ways people
# write it; every one must translate like the canonical form
SOURCE_FORMS: dict[str, Callable[[str], str]] = {
    "canonical": lambda text: text,
    "no-hyphens": no_hyphens,
    "no-commas": no_commas,
    "no-and": no_and,
    "bare": bare,
}


def vary_source(text: str, rng: random.Random, hyphen_rate: float = HYPHEN_SPACE_RATE) -> str:
    """Drop the commas, the 'and's, the hyphens, each sometimes: 'two hundred thirty four'.

    The hyphen draw comes last and only when hyphen_rate > 0: hyphen_rate=0 takes two draws
    per source, the stream the vocabulary's corpus is drawn from (see tokenizer_corpus).
    """
    if rng.random() < COMMA_DROP_RATE:
        text = no_commas(text)
    if rng.random() < AND_DROP_RATE:
        text = no_and(text)
    if hyphen_rate > 0 and rng.random() < hyphen_rate:
        text = no_hyphens(text)
    return text


# how often training writes a pair as a sentence (sentence_pair), and the marks that close one
SENTENCE_RATE = 0.5
SENTENCE_ENDS = ("", ".", "!", "?")
# French writes a space before these: "Sept ?"
SPACED_MARKS = "!?;:"


def sentence_case(text: str) -> str:
    """'three hundred' -> 'Three hundred' (the first letter only: 'Quatre-vingts')."""
    return text[:1].upper() + text[1:]


def sentence_pair(english_text: str, french_text: str, end: str) -> tuple[str, str]:
    """The pair as a sentence closed by `end` (one of SENTENCE_ENDS):
    ('seven', 'sept', '?') -> ('Seven?', 'Sept ?')."""
    french_end = f" {end}" if end and end in SPACED_MARKS else end
    return sentence_case(english_text) + end, sentence_case(french_text) + french_end


# the sentence forms the evaluation scores, each on num2words' English
SENTENCE_FORMS: dict[str, Callable[[str, str], tuple[str, str]]] = {
    "sentence": lambda en, fr: sentence_pair(en, fr, ""),
    "sentence.": lambda en, fr: sentence_pair(en, fr, "."),
    "sentence!": lambda en, fr: sentence_pair(en, fr, "!"),
    "sentence?": lambda en, fr: sentence_pair(en, fr, "?"),
}
FORMS = [*SOURCE_FORMS, *SENTENCE_FORMS]


def form_pair(number: int, form: str) -> tuple[str, str]:
    """(english, french) of `number` in `form`, a SOURCE_FORMS or SENTENCE_FORMS key."""
    if form in SENTENCE_FORMS:
        return SENTENCE_FORMS[form](english(number), french(number))
    return SOURCE_FORMS[form](english(number)), french(number)


def sample_number(rng: random.Random) -> int:
    """Half uniform (like the held-out set), half uniform over digit counts (small numbers)."""
    if rng.random() < 0.5:
        return rng.randint(0, MAX_NUMBER)
    digits = rng.randint(1, 6)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def training_pairs(
    seed: int, hyphen_rate: float = HYPHEN_SPACE_RATE, sentence_rate: float = 0.0
) -> Iterator[tuple[str, str]]:
    """An endless stream of (english, french) pairs, held-out numbers excluded; a fraction
    sentence_rate of them written as sentences (sentence_pair, each end alike).

    The sentence draws come after vary_source's and only when sentence_rate > 0, so the
    default stream is the one the tests and tokenizer_corpus have always drawn.
    """
    rng = random.Random(seed)
    excluded = set(held_out_numbers())
    while True:
        n = sample_number(rng)
        if n in excluded:
            continue
        pair = vary_source(english(n), rng, hyphen_rate), french(n)
        if sentence_rate > 0 and rng.random() < sentence_rate:
            pair = sentence_pair(*pair, rng.choice(SENTENCE_ENDS))
        yield pair


def tokenizer_corpus(count: int, seed: int) -> list[str]:
    """Lines of both languages for training the shared SentencePiece model.

    Hyphens stay as num2words writes them here: this is the corpus the bundled 111-piece
    vocabulary was trained on (with an earlier SentencePiece: 0.2.2 trains 132 pieces from
    it, so train.py keeps the bundled vocabulary instead). The spaced forms need no new
    pieces: 'twenty one' is made of words the corpus has on their own.
    """
    lines: list[str] = []
    for n in range(0, 101):
        lines += [english(n), french(n)]
    pairs = training_pairs(seed, hyphen_rate=0.0)
    for _ in range(count):
        en, fr = next(pairs)
        lines += [en, fr]
    return lines
