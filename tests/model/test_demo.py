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
    SENTENCE_ENDS,
    SENTENCE_FORMS,
    SOURCE_FORMS,
    english,
    french,
    held_out_numbers,
    no_and,
    no_commas,
    no_hyphens,
    sentence_pair,
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

# one sentence of a pasted paragraph each (the server splits a text into sentences), and the
# exact French: sentence-cased, a space before '!' and '?'
SENTENCE_EXAMPLES = [
    ("Seven.", "Sept."),  # the README's examples
    ("Three hundred and forty-two!", "Trois cent quarante-deux !"),
    ("Seven?", "Sept ?"),
    ("Twenty one", "Vingt et un"),
    ("Eighty.", "Quatre-vingts."),
    ("Zero!", "Zéro !"),
    ("One thousand, two hundred and thirty-four?", "Mille deux cent trente-quatre ?"),
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


def test_sentence_pairs() -> None:
    assert [sentence_pair("seven", "sept", end) for end in SENTENCE_ENDS] == [
        ("Seven", "Sept"), ("Seven.", "Sept."), ("Seven!", "Sept !"), ("Seven?", "Sept ?")]
    assert {form: pair(english(80), french(80)) for form, pair in SENTENCE_FORMS.items()} == {
        "sentence": ("Eighty", "Quatre-vingts"),
        "sentence.": ("Eighty.", "Quatre-vingts."),
        "sentence!": ("Eighty!", "Quatre-vingts !"),
        "sentence?": ("Eighty?", "Quatre-vingts ?"),
    }
    # training writes about half its pairs as sentences, with each end, and the rest as before
    pairs = training_pairs(seed=0, sentence_rate=0.5)
    drawn = [next(pairs) for _ in range(2000)]
    sentences = [(en, fr) for en, fr in drawn if en[0].isupper()]
    assert abs(len(sentences) / len(drawn) - 0.5) < 0.05
    assert {en[-1] for en, _ in sentences if not en[-1].isalpha()} == {".", "!", "?"}
    assert all(fr[0].isupper() and fr.endswith((" !", " ?", ".")) == (en[-1] in ".!?")
               for en, fr in sentences)
    assert all(en == en.lower() and fr == fr.lower() for en, fr in drawn if not en[0].isupper())


def test_vocabulary_covers_every_form(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 111
    unk = tokenizer.unk_id
    for n in held_out_numbers()[:300]:
        for write in SOURCE_FORMS.values():
            assert unk not in tokenizer.encode(write(english(n))), write(english(n))
        for pair in SENTENCE_FORMS.values():
            for text in pair(english(n), french(n)):
                assert unk not in tokenizer.encode(text), text


def test_capitals_are_a_mark_before_the_lower_case_pieces(tokenizer: Tokenizer) -> None:
    """'Seven.' is the case mark, seven's own pieces and '.'; the decoder side turns the mark
    back into a capital, and a mark with nothing after it yet (mid-stream) into nothing."""
    mark = [4, 88]  # "▁", "⇧"
    assert tokenizer.encode("Seven.") == mark + tokenizer.encode_text("seven") + [94, 1]
    assert [tokenizer.id_to_token(i) for i in (88, 94, 95, 98)] == ["\u21e7", ".", "!", "?"]
    target = tokenizer.encode_target("Trois cent quarante-deux !")
    assert target[:2] == mark
    assert target[2:-3] == tokenizer.encode_target("trois cent quarante-deux")[:-1]
    assert tokenizer.decode(target) == "Trois cent quarante-deux !"
    assert [tokenizer.decode(target[:k]) for k in (1, 2, 3)] == ["", "", "Trois"]


# -- the trained checkpoint --------------------------------------------------------------------


@trained
def test_demo_translates_what_people_type(translator: Translator) -> None:
    sources = [en for en, _ in EXAMPLES]
    assert translator.translate(sources) == [fr for _, fr in EXAMPLES]


@trained
def test_demo_translates_sentences(translator: Translator) -> None:
    sources = [en for en, _ in SENTENCE_EXAMPLES] + ["three hundred and forty-two"]
    expected = [fr for _, fr in SENTENCE_EXAMPLES] + ["trois cent quarante-deux"]
    assert translator.translate(sources) == expected


def test_examples_are_num2words_french() -> None:
    """The expected French above is num2words' own (the demo's training targets)."""
    numbers = [7, 342, 21, 21, 71, 81, 91, 80, 342, 1234, 1234, 1001, 200_000, 99_999, 512_380]
    assert [french(n) for n in numbers] == [fr for _, fr in EXAMPLES]


@trained
def test_evaluate_scores_each_form(capsys: pytest.CaptureFixture[str]) -> None:
    from tfserve.demo.evaluate import main

    assert main(["--limit", "40"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for form in [*SOURCE_FORMS, *SENTENCE_FORMS]:
        assert any(line.startswith(f"eager: {form}: greedy exact match 100.00% on 40 ")
                   for line in lines), lines
