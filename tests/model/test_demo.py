"""The bundled demo: its data forms, its vocabulary, and what the trained checkpoint says.

The translations are greedy and the checkpoint is fixed, so each expected French is exact.
They run on the eager checkpoint (tfserve.demo.evaluate.eager_translator), which needs torch.
"""

from __future__ import annotations

import json
import random
import re

import pytest
from exported import demo_trained

from tfserve.demo import CHECKPOINT_DIR
from tfserve.demo.data import (
    HYPHEN_SPACE_RATE,
    SOURCE_FORMS,
    english,
    french,
    held_out_numbers,
    no_and,
    no_commas,
    no_hyphens,
    tokenizer_corpus,
    training_pairs,
    vary_source,
)
from tfserve.text.tokenizer import Tokenizer, TokenizerSpec
from tfserve.translator import Translator

trained = pytest.mark.skipif(not demo_trained(), reason="demo checkpoint not trained yet")

# English as people type it (hyphens, commas and "and" or not) and the exact French
EXAMPLES = [
    ("seven", "sept"),  # the README's examples
    ("three hundred and forty-two", "trois cent quarante-deux"),
    ("twenty one", "vingt et un"),
    ("twenty-one", "vingt et un"),
    ("seventy one", "soixante et onze"),
    ("eighty one", "quatre-vingt-un"),
    ("ninety one", "quatre-vingt-onze"),
    ("eighty", "quatre-vingts"),
    ("three hundred forty two", "trois cent quarante-deux"),
    ("one thousand two hundred thirty four", "mille deux cent trente-quatre"),
    ("one thousand, two hundred and thirty-four", "mille deux cent trente-quatre"),
    ("one thousand and one", "mille un"),
    ("two hundred thousand", "deux cent mille"),
    ("ninety nine thousand nine hundred ninety nine",
     "quatre-vingt-dix-neuf mille neuf cent quatre-vingt-dix-neuf"),
    ("five hundred twelve thousand three hundred eighty",
     "cinq cent douze mille trois cent quatre-vingts"),
]


# "twenty one": tens and units written apart, where num2words writes "twenty-one"
SPACED_TENS = re.compile(r"\b(twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety) "
                         r"(one|two|three|four|five|six|seven|eight|nine)\b")


@pytest.fixture(scope="module")
def translator() -> Translator:
    from tfserve.demo.evaluate import eager_translator

    return eager_translator()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    spec = TokenizerSpec.from_dict(json.loads((CHECKPOINT_DIR / "tokenizer.json").read_text()))
    return Tokenizer(CHECKPOINT_DIR, spec)


# -- data --------------------------------------------------------------------------------------


def test_source_forms() -> None:
    text = english(21_342)
    assert text == "twenty-one thousand, three hundred and forty-two"
    assert {form: write(text) for form, write in SOURCE_FORMS.items()} == {
        "canonical": "twenty-one thousand, three hundred and forty-two",
        "no-hyphens": "twenty one thousand, three hundred and forty two",
        "no-commas": "twenty-one thousand three hundred and forty-two",
        "no-and": "twenty-one thousand, three hundred forty-two",
        "bare": "twenty one thousand three hundred forty two",
    }


def test_vary_source_types_hyphens_as_spaces_sometimes() -> None:
    rng = random.Random(0)
    text = english(21_342)
    varied = [vary_source(text, rng) for _ in range(2000)]
    spaced = sum("-" not in v for v in varied) / len(varied)
    assert abs(spaced - HYPHEN_SPACE_RATE) < 0.05
    # every combination of the three changes turns up, and nothing else
    combinations = {text}
    for change in (no_commas, no_and, no_hyphens):
        combinations |= {change(t) for t in combinations}
    assert len(combinations) == 8
    assert set(varied) == combinations
    pairs = training_pairs(seed=0)
    assert any(SPACED_TENS.search(next(pairs)[0]) for _ in range(300))


def test_hyphen_rate_zero_draws_as_before() -> None:
    """Without hyphen variation a source takes two draws (commas, 'and') and keeps its
    hyphens: the stream the tokenizer corpus, and so the 111-piece vocabulary, comes from."""
    rng, reference = random.Random(5), random.Random(5)
    for n in range(0, 999_999, 997):
        text = english(n)
        varied = vary_source(text, rng, hyphen_rate=0.0)
        reference.random(), reference.random()
        assert varied.count("-") == text.count("-")
        assert rng.getstate() == reference.getstate()
    english_lines = tokenizer_corpus(300, seed=0)[202::2]
    assert not any(SPACED_TENS.search(line) for line in english_lines)


def test_vocabulary_covers_every_form(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 111
    unk = tokenizer.unk_id
    for n in held_out_numbers()[:300]:
        for write in SOURCE_FORMS.values():
            assert unk not in tokenizer.encode(write(english(n))), write(english(n))


# -- the trained checkpoint --------------------------------------------------------------------


@trained
def test_demo_translates_what_people_type(translator: Translator) -> None:
    sources = [en for en, _ in EXAMPLES]
    assert translator.translate(sources) == [fr for _, fr in EXAMPLES]


def test_examples_are_num2words_french() -> None:
    """The expected French above is num2words' own (the demo's training targets)."""
    numbers = [7, 342, 21, 21, 71, 81, 91, 80, 342, 1234, 1234, 1001, 200_000, 99_999, 512_380]
    assert [french(n) for n in numbers] == [fr for _, fr in EXAMPLES]


@trained
def test_evaluate_scores_each_form(capsys: pytest.CaptureFixture[str]) -> None:
    from tfserve.demo.evaluate import main

    assert main(["--limit", "40"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for form in SOURCE_FORMS:
        assert any(line.startswith(f"eager: {form}: greedy exact match 100.00% on 40 ")
                   for line in lines), lines
