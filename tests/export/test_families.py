"""Hugging Face BART-family import (`python -m export --from-hf DIR`): NLLB-200 / M2M100,
mBART-50 / mBART-cc25, BART, checked against transformers.

Every checkpoint is built here with random weights at odd sizes (tests/family_helpers.py),
its tokenizer trained here and written by the family's own transformers tokenizer class;
nothing is downloaded. transformers is a test-only dependency; without it this module is
skipped.

Checked per family: token ids of `AutoTokenizer.from_pretrained(DIR, src_lang=...)` on 200
strings for several source languages (language codes, special tokens and unknown pieces in
the text), and its decoding; the config mapping and the language conventions in the
manifest; teacher-forced logits (eager and ONNX, all at once and step by step through the
KV cache) within 1e-5 of the logits' scale; greedy and beam-4 tokens of `generate` on 50
inputs decoded in one batch whose rows go into different target languages, with target
prefixes, repetition_penalty and no_repeat_ngram_size mixed in; the same inputs joining a
running batch at different steps; mBART-cc25 into several languages (each request's own
decoder start token) in one batch, a running batch and the scheduler; the forced eos at
max_new_tokens from the generation defaults (mBART-50); the Translator's languages,
generation defaults and errors; cache snapshot naming; refusals naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import warnings

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only, never the hub
transformers = pytest.importorskip("transformers")

import family_helpers as fh  # noqa: E402
import hf_import_helpers as hh  # noqa: E402
from gpu_helpers import MIN_IDENTICAL, cuda_agreement, needs_cuda  # noqa: E402
from test_marian import tokenizer_strings  # noqa: E402

from export.cli import main as export_main  # noqa: E402
from export.importers import import_hf  # noqa: E402
from export.importers.hf_files import checkpoint_name  # noqa: E402
from export.sources import SourceError  # noqa: E402
from export.verify import relative_diff  # noqa: E402
from tfserve.artifacts.generation_defaults import GenerationDefaults  # noqa: E402
from tfserve.artifacts.manifest import Manifest  # noqa: E402
from tfserve.artifacts.model_config import ConfigError, ModelConfig  # noqa: E402
from tfserve.generation.batch import generate  # noqa: E402
from tfserve.model.eager import EagerBackend  # noqa: E402
from tfserve.text.languages import LanguageError  # noqa: E402
from tfserve.text.tokenizer import Tokenizer  # noqa: E402
from tfserve.text.translation_inputs import request_options, source_ids  # noqa: E402
from tfserve.translator import Translator  # noqa: E402

MAX_NEW_TOKENS = 20
COUNT = 50  # generate comparisons per family and mode
# (name, extra decoding settings) cycled over the inputs of the generate comparison
CONTROLS = (
    ("plain", {}),
    ("prefix", {"target_prefix": "the big"}),
    ("penalty", {"repetition_penalty": 1.3}),
    ("ngram", {"no_repeat_ngram_size": 2}),
    ("both", {"repetition_penalty": 0.8, "no_repeat_ngram_size": 3}),
)


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, transformers model, transformers tokenizer) per family."""
    built = {}
    for index, name in enumerate(fh.FAMILIES):
        directory = tmp_path_factory.mktemp("hf") / name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, tokenizer = fh.write_checkpoint(name, directory, seed=index)
        built[name] = (directory, model, tokenizer)
    return built


def source_batch(checkpoint, count: int, seed: int, name: str):
    """`count` sentences in the family's source language, AutoTokenizer's padded batch."""
    texts = fh.sentences(count, seed)
    tokenizer = hh.auto_tokenizer(checkpoint[0], fh.LANGUAGES[name][0])
    return texts, tokenizer(texts, return_tensors="pt", padding=True)


# -- tokenizers -----------------------------------------------------------------------------


def family_strings(name: str) -> list[str]:
    """200 strings: tokenizer_strings() with the family's codes, special tokens and
    neighbouring spaces in the text."""
    source, targets = fh.LANGUAGES[name]
    codes = [c for c in (source, *targets) if c]
    code_tokens = [f"__{c}__" for c in codes] if name == "m2m100" else codes
    specific = [f"{code_tokens[0]} the cat" if code_tokens else "the cat",
                f"a {code_tokens[-1]}b" if code_tokens else "a b", "</s>", "x </s> y",
                "<pad> the", "<s>dog", "<mask> cat", "the<mask>", " <unk> x", "__xx__ y",
                "xx_YY zz_Zzzz", "eng_Latnfra_Latn", "<s></s>"]
    return specific + tokenizer_strings()[: 200 - len(specific)]


@pytest.mark.parametrize("name", fh.FAMILIES)
def test_token_ids_match_auto_tokenizer(name, checkpoints):
    """Every source language of the test (and the checkpoint's default) places its token
    where transformers' tokenizer places it; the text's tokens are the tokenizer's."""
    directory = checkpoints[name][0]
    spec = import_hf(directory).tokenizer_spec
    assert spec.kind == ("spm-vocab" if name == "m2m100" else "hf-json")
    ours = Tokenizer(directory, spec)
    strings = family_strings(name)
    assert len(strings) == 200
    source, targets = fh.LANGUAGES[name]
    languages = [source, *[t for t in targets if t != source]][:3] if source else [""]
    for language in languages:
        theirs = hh.auto_tokenizer(directory, language)
        mismatches = [(s, ours.encode(s, language or None), theirs(s).input_ids)
                      for s in strings if ours.encode(s, language or None) != theirs(s).input_ids]
        assert not mismatches, (f"{name} {language}: {len(mismatches)} of 200 differ, e.g. "
                                f"{mismatches[:3]}")
    # the default source language is the checkpoint tokenizer's own
    assert ours.encode("the cat") == hh.auto_tokenizer(directory)("the cat").input_ids
    assert sum(ours.unk_id in ours.encode(s, source or None) for s in strings) >= 3 or \
        name == "bart"  # byte-level BPE has no unknown pieces
    ids, mask = ours.encode_batch(strings[:32])
    batch = hh.auto_tokenizer(directory)(strings[:32], return_tensors="np", padding=True)
    np.testing.assert_array_equal(ids, batch["input_ids"])
    np.testing.assert_array_equal(mask, batch["attention_mask"])


@pytest.mark.parametrize("name", fh.FAMILIES)
def test_decoding_matches_auto_tokenizer(name, checkpoints):
    """1,000 random id sequences over the tokenizer's vocabulary (language codes and special
    tokens included): the text of transformers' decode(skip_special_tokens=True)."""
    directory = checkpoints[name][0]
    ours = Tokenizer(directory, import_hf(directory).tokenizer_spec)
    theirs = hh.auto_tokenizer(directory)
    rng = np.random.default_rng(3)
    for _ in range(1000):
        sequence = rng.integers(0, len(theirs), size=int(rng.integers(0, 25))).tolist()
        assert ours.decode(sequence) == theirs.decode(sequence, skip_special_tokens=True), \
            sequence
    if ours.languages is not None:
        code = next(iter(ours.languages.codes.values()))
        assert ours.decode([code, 5, 6]) == ours.decode([5, 6])


@pytest.mark.parametrize("name", fh.FAMILIES)
def test_ids_without_a_piece_decode_as_the_family_does(name, checkpoints):
    """An id the model can generate that the tokenizer's files give no piece (M2M100's
    made-up words past its languages, NLLB's ids past its tokenizer.json): M2M100Tokenizer
    writes its unk token's text where the id stands ("the<unk>cat"); the `tokenizers`
    library's decode (NLLB, mBART, BART) writes nothing. 300 random sequences with such ids
    mixed in, and one in the middle of a sentence."""
    directory = checkpoints[name][0]
    ours = Tokenizer(directory, import_hf(directory).tokenizer_spec)
    theirs = hh.auto_tokenizer(directory)
    size = len(theirs)
    assert ours.vocab_size == size
    rng = np.random.default_rng(11)
    for _ in range(300):
        sequence = rng.integers(0, size + 8, size=int(rng.integers(1, 25))).tolist()
        assert ours.decode(sequence) == theirs.decode(sequence, skip_special_tokens=True), \
            sequence
    words = theirs("the cat is good", add_special_tokens=False).input_ids
    sequence = [*words[:2], size, *words[2:], size + 1]
    text = ours.decode(sequence)
    assert text == theirs.decode(sequence, skip_special_tokens=True)
    assert (theirs.unk_token in text) == (name == "m2m100"), text


def test_source_truncation_keeps_the_language_frame(checkpoints):
    """truncate cuts the text and keeps the language token and eos where the family puts
    them, as transformers' tokenizer truncates (truncation=True, max_length)."""
    text = " ".join(fh.sentences(4, seed=8))
    for name in ("nllb", "cc25", "m2m100"):
        directory = checkpoints[name][0]
        ours = Tokenizer(directory, import_hf(directory).tokenizer_spec)
        source = fh.LANGUAGES[name][1][0]
        theirs = hh.auto_tokenizer(directory, source)
        expected = theirs(text, truncation=True, max_length=12).input_ids
        assert source_ids(ours, [text], source, 12, truncate=True) == [expected], name
        with pytest.raises(ValueError, match=r"texts\[0\] is \d+ tokens, over the limit of 12"):
            source_ids(ours, [text], source, 12)


# -- config, languages, weights -------------------------------------------------------------


def test_import_maps_each_family(imported, checkpoints):
    cfg = {name: model.config for name, model in imported.items()}
    for name in ("nllb", "m2m100"):
        assert (cfg[name].norm, cfg[name].positions, cfg[name].sinusoidal_layout) == (
            "pre", "sinusoidal", "fairseq")
        assert (cfg[name].position_offset, cfg[name].position_padding) == (2, True)
        assert not (cfg[name].embedding_norm or cfg[name].final_logits_bias)
        assert cfg[name].activation == "relu" and cfg[name].scale_embedding
    for name in ("mbart50", "cc25", "bart"):
        assert (cfg[name].positions, cfg[name].position_offset) == ("learned", 2)
        assert cfg[name].embedding_norm and cfg[name].final_logits_bias
        assert not cfg[name].position_padding and cfg[name].activation == "gelu"
    assert cfg["mbart50"].norm == cfg["cc25"].norm == "pre" and cfg["bart"].norm == "post"
    assert not cfg["bart"].scale_embedding and cfg["mbart50"].scale_embedding
    for name, c in cfg.items():
        assert (c.d_model, c.num_heads, c.ffn_dim, c.encoder_layers, c.decoder_layers) == (
            36, 3, 52, 2, 3), name
        assert (c.pad_token_id, c.eos_token_id, c.max_source_positions) == (1, 2, 160), name
        assert c.name == name and c.vocab_size == checkpoints[name][1].config.vocab_size
    # the decoder starts from eos, or (cc25) from its target language, fr_XX
    fr = checkpoints["cc25"][2].convert_tokens_to_ids("fr_XX")
    assert [cfg[n].decoder_start_token_id for n in fh.FAMILIES] == [2, 2, 2, fr, 2]
    assert cfg["cc25"].target_language == "fr_XX"
    assert cfg["nllb"].source_language == "eng_Latn" and cfg["m2m100"].source_language == "en"


def test_language_conventions_in_the_manifest(exported, checkpoints):
    expected = {"nllb": ("prefix", "forced", "eng_Latn", list(fh.NLLB_CODES)),
                "m2m100": ("prefix", "forced", "en", list(fh.M2M100_CODES)),
                "mbart50": ("prefix", "forced", "en_XX", None),
                "cc25": ("suffix", "start", "en_XX", None)}
    for name, (layout, mode, default, codes) in expected.items():
        manifest = Manifest.load(exported[name])
        languages = manifest.tokenizer.languages
        tokenizer = checkpoints[name][2]
        assert (languages["source_layout"], languages["target_mode"],
                languages["default_source"]) == (layout, mode, default), name
        if codes is not None:
            assert list(languages["codes"]) == codes
        for code, token_id in languages["codes"].items():
            token = f"__{code}__" if name == "m2m100" else code
            assert tokenizer.convert_tokens_to_ids(token) == token_id, (name, code)
        assert manifest.config.extra["language_codes"] == list(languages["codes"])
    assert len(Manifest.load(exported["mbart50"]).tokenizer.languages["codes"]) == 52
    assert len(Manifest.load(exported["cc25"]).tokenizer.languages["codes"]) == 25
    assert Manifest.load(exported["bart"]).tokenizer.languages is None


@pytest.mark.parametrize("changes, message", [
    (dict(position_padding=True, positions="rope"), "position_padding needs absolute"),
    (dict(position_padding=True, positions="learned", pad_token_id=1, position_offset=1),
     "position_padding needs position_offset > pad_token_id (1)"),
    (dict(position_offset=-1), "position_offset must be an integer >= 0"),
    (dict(position_offset=2, positions="relative"), "position_offset needs absolute"),
    (dict(embedding_norm="yes"), "embedding_norm must be true or false"),
    (dict(sinusoidal_layout="fairseq", d_model=2, num_heads=1),
     "sinusoidal_layout='fairseq' needs d_model >= 4"),
])
def test_invalid_family_options_are_refused_naming_the_field(changes, message):
    with pytest.raises(ConfigError) as info:
        ModelConfig(vocab_size=50, **changes)
    assert message in str(info.value)


def test_fairseq_table_equals_transformers():
    from transformers.models.m2m_100.modeling_m2m_100 import (
        M2M100SinusoidalPositionalEmbedding as Table,
    )

    from tfserve.model.positions import sinusoidal_table

    for dim in (36, 1024):
        expected = Table.get_embedding(1200, dim, None)
        assert torch.equal(sinusoidal_table(1200, dim, "fairseq"), expected)


# -- logits ---------------------------------------------------------------------------------


def teacher_forced(checkpoint, name: str, count: int = 6, length: int = 24, seed: int = 2):
    """A padded source batch, right-padded random decoder inputs [B,T] starting with the
    start token, their mask, and transformers' logits."""
    _, model, tokenizer = checkpoint
    _, batch = source_batch(checkpoint, count, seed, name)
    return (batch, *hh.teacher_forced(model, batch, 4, len(tokenizer), length, seed))


@pytest.mark.parametrize("name", fh.FAMILIES)
def test_eager_logits_match_transformers(name, checkpoints, imported):
    batch, ids, mask, expected = teacher_forced(checkpoints[name], name)
    with torch.no_grad():
        got = imported[name](batch["input_ids"], batch["attention_mask"], ids, mask)
    hh.assert_logits_close(got.numpy(), expected.numpy(), mask.bool().numpy(),
                           f"{name} eager")


@pytest.mark.parametrize("name", fh.FAMILIES)
def test_onnx_logits_match_transformers(name, checkpoints, runtimes):
    """All decoder inputs in one step, then one token per step through the KV cache."""
    batch, ids, mask, expected = teacher_forced(checkpoints[name], name)
    hh.assert_onnx_logits_close(runtimes[name], checkpoints[name][1], batch, ids, mask,
                                expected, name)


def test_pad_tokens_inside_a_source_take_no_position(checkpoints, runtimes):
    """NLLB / M2M100 number positions over the non-pad tokens: a pad token typed in the
    text moves the positions of the tokens after it, in the graph as in transformers."""
    _, model, tokenizer = checkpoints["nllb"]
    batch = tokenizer(["the cat <pad> is <pad><pad> very good", "one <pad> two"],
                      return_tensors="pt", padding=True)
    assert int((batch["input_ids"] == 1).sum()) > int((batch["attention_mask"] == 0).sum())
    with torch.no_grad():
        expected = model.get_encoder()(**batch).last_hidden_state.numpy()
    hidden, _ = runtimes["nllb"].encode(batch["input_ids"].numpy(),
                                        batch["attention_mask"].numpy())
    keep = batch["attention_mask"].bool().numpy() & (batch["input_ids"] != 1).numpy()
    assert relative_diff(hidden[keep], expected[keep]) < hh.RELATIVE_TOLERANCE


# -- search ---------------------------------------------------------------------------------


def assignments(name: str, count: int, targets: tuple[str, ...] | None = None
                ) -> list[tuple[str, str, dict]]:
    """Per input: (target language, control name, settings), cycling through both (the
    family's test targets unless given)."""
    targets = targets or fh.LANGUAGES[name][1]
    out = []
    for index in range(count):
        control, settings = CONTROLS[(index // len(targets)) % len(CONTROLS)]
        out.append((targets[index % len(targets)], control, settings))
    return out


def hf_rows(tokenizer, sequences: torch.Tensor, pad: int, eos: int) -> list[list[int]]:
    """generate's output rows without the start token, cut at eos, pads left out (none of
    these checkpoints makes pad its top token, which test_fidelity.py checks for T5)."""
    rows = []
    for row in sequences[:, 1:].tolist():
        row = row[: row.index(eos)] if eos in row else row
        rows.append([t for t in row if t != pad] if pad in row else row)
    return rows


def hf_generate(checkpoint, name: str, batch, rows: list[int], target: str, settings: dict,
                num_beams: int, max_new_tokens: int = MAX_NEW_TOKENS,
                forced_eos: bool = False) -> list[list[int]]:
    """transformers' generate on rows of the batch, into `target` with `settings`: the
    target language forced first (forced_bos_token_id), or, for mBART-cc25, the token
    decoding starts from (decoder_start_token_id).

    Nothing is banned (these checkpoints have no bad_words_ids, and tfserve bans what the
    checkpoint bans); eos is forced at max_length only with forced_eos (forced_eos_token_id
    eos, else None); length_penalty 1.0, no early stopping."""
    _, model, tokenizer = checkpoint
    config = model.config
    forced = None
    start = config.decoder_start_token_id
    if name in ("nllb", "m2m100", "mbart50"):
        forced = tokenizer.convert_tokens_to_ids(f"__{target}__" if name == "m2m100" else target)
    elif name == "bart":
        forced = 0
    elif name == "cc25" and target:
        start = tokenizer.convert_tokens_to_ids(target)
    kwargs = dict(do_sample=False, num_beams=num_beams, max_new_tokens=max_new_tokens,
                  forced_eos_token_id=config.eos_token_id if forced_eos else None,
                  length_penalty=1.0, early_stopping=False, min_length=0,
                  repetition_penalty=settings.get("repetition_penalty", 1.0),
                  no_repeat_ngram_size=settings.get("no_repeat_ngram_size", 0),
                  forced_bos_token_id=forced, decoder_start_token_id=start)
    inputs = {key: value[rows] for key, value in batch.items()}
    if "target_prefix" in settings:
        prefix = tokenizer(settings["target_prefix"], add_special_tokens=False).input_ids
        decoder_input = [start] + ([forced] if forced is not None else [])
        inputs["decoder_input_ids"] = torch.tensor([decoder_input + prefix] * len(rows))
        kwargs["forced_bos_token_id"] = None
    with torch.no_grad():
        out = model.generate(**inputs, **kwargs)
    return hf_rows(tokenizer, out, config.pad_token_id, config.eos_token_id)


def expected_outputs(checkpoint, name: str, batch, plan: list[tuple[str, str, dict]]
                     ) -> dict[str, list[list[int]]]:
    """transformers' greedy and beam-4 output per input of `plan`, each (target, control)
    group in one generate call."""
    expected: dict[str, list[list[int]]] = {}
    for mode, beams in (("greedy", 1), ("beam4", 4)):
        rows: list[list[int]] = [[] for _ in plan]
        groups: dict[tuple[str, str], list[int]] = {}
        for index, (target, control, _) in enumerate(plan):
            groups.setdefault((target, control), []).append(index)
        for (target, control), members in groups.items():
            settings = dict(CONTROLS)[control]
            for index, row in zip(members, hf_generate(checkpoint, name, batch, members,
                                                       target, settings, beams)):
                rows[index] = row
        expected[mode] = rows
    return expected


@pytest.fixture(scope="module")
def searches(checkpoints):
    """name -> (50 sources as a padded batch, per input (target, control, settings), and
    transformers' greedy and beam-4 outputs per input)."""
    out = {}
    for name in fh.FAMILIES:
        _, batch = source_batch(checkpoints[name], COUNT, seed=5, name=name)
        plan = assignments(name, COUNT)
        out[name] = (batch, plan, expected_outputs(checkpoints[name], name, batch, plan))
    return out


def options_for(runtime_or_backend, tokenizer: Tokenizer, name: str, target: str,
                settings: dict, num_beams: int):
    """The request's DecodingOptions through tfserve.text.translation_inputs (as the server
    builds them): the target language, the prefix text, the controls."""
    defaults = GenerationDefaults({"forced_bos_token_id": 0} if name == "bart" else {})
    given = {"max_new_tokens": MAX_NEW_TOKENS, "num_beams": num_beams,
             **{k: v for k, v in settings.items() if k != "target_prefix"}}
    return request_options(tokenizer, defaults, given, runtime_or_backend.decoder_start_token_id,
                           runtime_or_backend.max_target_positions - 1, target or None,
                           settings.get("target_prefix"), runtime_or_backend.vocab_size)


@pytest.mark.parametrize("mode", ["greedy", "beam4"])
@pytest.mark.parametrize("name", fh.FAMILIES)
def test_search_matches_generate(name, mode, searches, runtimes, exported):
    """One batch of 50 inputs over ONNX Runtime, each row with its own target language and
    controls, equals transformers' generate of each group alone."""
    runtime = runtimes[name]
    batch, plan, expected = searches[name]
    per_source = [options_for(runtime, runtime.tokenizer, name, target, settings,
                              4 if mode == "beam4" else 1) for target, _, settings in plan]
    results = generate(runtime, batch["input_ids"].numpy(), batch["attention_mask"].numpy(),
                       per_source)
    ours = [r[0].token_ids for r in results]
    mismatches = [i for i, (a, b) in enumerate(zip(ours, expected[mode], strict=True)) if a != b]
    assert not mismatches, (f"{len(mismatches)}/{COUNT} differ, first {mismatches[0]} "
                            f"{plan[mismatches[0]][:2]}: ours {ours[mismatches[0]]} "
                            f"transformers {expected[mode][mismatches[0]]}")
    # meaningful: outputs depend on the input, some end with eos, some reach the limit,
    # the targets' forced tokens lead and the prefixes follow them
    assert len({tuple(t) for t in ours}) >= 15
    finished = sum(r[0].finished for r in results)
    assert 3 <= finished <= COUNT - 3, finished
    for (target, control, settings), tokens in zip(plan, ours):
        options = options_for(runtime, runtime.tokenizer, name, target, settings, 1)
        lead = options.prefix_token_ids
        assert tuple(tokens[: len(lead)]) == lead
        if control == "prefix":
            assert runtime.tokenizer.decode(tokens).startswith("the big")


def test_beam_differs_from_greedy(searches):
    for name in fh.FAMILIES:
        greedy, beam = searches[name][2]["greedy"], searches[name][2]["beam4"]
        assert sum(a != b for a, b in zip(greedy, beam, strict=True)) >= 5, name


@pytest.mark.parametrize("name", ["nllb", "mbart50"])
def test_eager_search_matches_generate(name, searches, imported, runtimes):
    """The same beam-4 batch on the eager PyTorch model."""
    backend = EagerBackend(imported[name])
    batch, plan, expected = searches[name]
    per_source = [options_for(backend, runtimes[name].tokenizer, name, target, settings, 4)
                  for target, _, settings in plan]
    results = generate(backend, batch["input_ids"].numpy(), batch["attention_mask"].numpy(),
                       per_source)
    assert [r[0].token_ids for r in results] == expected["beam4"]


def continuous_batch(runtime, name: str, batch, plan) -> tuple[dict[int, str],
                                                                 dict[int, list[int]]]:
    """`hh.continuous_batch` with each input's own target language and controls."""
    assert len(plan) == COUNT
    return hh.continuous_batch(runtime, batch, lambda row, beams: options_for(
        runtime, runtime.tokenizer, name, plan[row][0], plan[row][2], beams))


@pytest.mark.parametrize("name", ["nllb", "m2m100", "cc25"])
def test_continuous_batch_with_mixed_targets(name, searches, runtimes):
    """Inputs joining a running batch at different steps (`continuous_batch`): every input
    gets generate's answer for it alone."""
    batch, plan, expected = searches[name]
    modes, results = continuous_batch(runtimes[name], name, batch, plan)
    hh.assert_each_gets_its_own_answer(modes, results, expected)


# -- mBART-cc25: a request's target language is the token its decoding starts from ---------

CC25_TARGETS = ("de_DE", "ro_RO", "fr_XX")  # fr_XX: the checkpoint's own start token


@pytest.fixture(scope="module")
def cc25_searches(checkpoints):
    """(50 sources, per input (target among CC25_TARGETS, control, settings), transformers'
    greedy and beam-4 output per input with decoder_start_token_id = its target language,
    and every source's greedy output into de_DE and into ro_RO)."""
    checkpoint = checkpoints["cc25"]
    _, batch = source_batch(checkpoint, COUNT, seed=5, name="cc25")
    plan = assignments("cc25", COUNT, CC25_TARGETS)
    into = {target: hf_generate(checkpoint, "cc25", batch, list(range(COUNT)), target, {}, 1)
            for target in CC25_TARGETS[:2]}
    return batch, plan, expected_outputs(checkpoint, "cc25", batch, plan), into


@pytest.mark.parametrize("mode", ["greedy", "beam4"])
def test_cc25_decodes_into_each_requests_language(mode, cc25_searches, runtimes):
    """mBART-cc25 into de_DE, ro_RO and fr_XX (the model's own) in one batch, with target
    prefixes and controls mixed in: the requests' options (translation_inputs, as every
    front end builds them) start from their language's token, and every output equals
    generate(decoder_start_token_id=<language>) and tfserve's output for the input alone."""
    runtime = runtimes["cc25"]
    batch, plan, expected, into = cc25_searches
    beams = 4 if mode == "beam4" else 1
    per_source = [options_for(runtime, runtime.tokenizer, "cc25", target, settings, beams)
                  for target, _, settings in plan]
    codes = runtime.tokenizer.languages.codes
    assert [o.decoder_start_token_id for o in per_source] == [
        None if target == "fr_XX" else codes[target] for target, _, _ in plan]
    assert codes["fr_XX"] == runtime.decoder_start_token_id
    ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy()
    ours = [r[0].token_ids for r in generate(runtime, ids, mask, per_source)]
    mismatches = [i for i, (a, b) in enumerate(zip(ours, expected[mode], strict=True)) if a != b]
    assert not mismatches, (f"{len(mismatches)}/{COUNT} differ, first {mismatches[0]} "
                            f"{plan[mismatches[0]][:2]}: ours {ours[mismatches[0]]} "
                            f"transformers {expected[mode][mismatches[0]]}")
    sources = hh.unpadded(batch)
    for row, options in enumerate(per_source):
        alone = generate(runtime, np.array([sources[row]]), np.ones((1, len(sources[row])),
                                                                    np.int64), options)
        assert alone[0][0].token_ids == ours[row], row
    # meaningful: the start token decides the language, so outputs differ by target
    differ = sum(a != b for a, b in zip(into["de_DE"], into["ro_RO"], strict=True))
    assert differ >= 10, differ
    assert len({tuple(t) for t in ours}) >= 15


def test_cc25_languages_join_a_running_batch(cc25_searches, runtimes):
    """The cc25 requests joining a running batch at different steps (`continuous_batch`):
    each row's first input is its own language's token, and every input gets generate's
    answer for it."""
    batch, plan, expected, _ = cc25_searches
    modes, results = continuous_batch(runtimes["cc25"], "cc25", batch, plan)
    hh.assert_each_gets_its_own_answer(modes, results, expected)


def test_cc25_languages_through_the_scheduler(cc25_searches, runtimes):
    """The server's scheduler: requests into different languages, arriving while others
    decode, each get generate's answer (the scheduler's searches start from each request's
    token); a start token outside the vocabulary is refused at submit, naming the field."""
    from test_scheduler import drive

    from tfserve.scheduler import Scheduler, SchedulerConfig

    runtime = runtimes["cc25"]
    batch, plan, expected, _ = cc25_searches
    sources = hh.unpadded(batch)
    scheduler = Scheduler(runtime, SchedulerConfig(max_batch_size=16, max_wait_ms=0.0,
                                                   wave_wait_steps=0))
    with pytest.raises(ValueError, match="decoder_start_token_id must be in"):
        scheduler.submit_translate([sources[0]], dataclasses.replace(
            options_for(runtime, runtime.tokenizer, "cc25", "de_DE", {}, 1),
            decoder_start_token_id=runtime.vocab_size))
    rows = list(range(12))
    jobs = []
    for row in rows:
        mode = "beam4" if row % 3 == 2 else "greedy"
        options = options_for(runtime, runtime.tokenizer, "cc25", plan[row][0], plan[row][2],
                              4 if mode == "beam4" else 1)
        jobs.append((row, mode, scheduler.submit_translate([sources[row]], options)))
        scheduler.run_once()  # the next request arrives while these decode
    drive(scheduler, [job for _, _, job in jobs])
    for row, mode, job in jobs:
        assert job.result(0)[0][0].token_ids == expected[mode][row], (row, plan[row][:2])


# -- forced eos at the length limit (the checkpoints' forced_eos_token_id) -----------------

EOS_LIMIT = 8  # max_new_tokens of the forced-eos comparison: many outputs reach it


@pytest.mark.parametrize("mode", ["greedy", "beam4"])
def test_forced_eos_default_matches_generate(mode, checkpoints, runtimes):
    """mBART-50 checkpoints set forced_eos_token_id = eos: taken from the generation
    defaults by translation_inputs (as every front end builds a request's options), 50
    inputs into three languages (the forced language token counted as a new token) at
    max_new_tokens 8 equal generate(forced_bos_token_id=<language>, forced_eos_token_id=eos);
    a request that sets forced_eos false gets the cut outputs."""
    name, beams = "mbart50", 4 if mode == "beam4" else 1
    runtime, checkpoint = runtimes[name], checkpoints[name]
    _, batch = source_batch(checkpoint, COUNT, seed=5, name=name)
    targets = fh.LANGUAGES[name][1]
    plan = [targets[i % len(targets)] for i in range(COUNT)]
    defaults = GenerationDefaults({"forced_eos_token_id": runtime.eos_token_id})

    def options(target: str, **given):
        return request_options(runtime.tokenizer, defaults,
                               {"max_new_tokens": EOS_LIMIT, "num_beams": beams, **given},
                               runtime.decoder_start_token_id,
                               runtime.max_target_positions - 1, target, None,
                               runtime.vocab_size)

    ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy()
    per_source = [options(target) for target in plan]
    assert all(o.forced_eos for o in per_source)
    results = generate(runtime, ids, mask, per_source)
    cut = generate(runtime, ids, mask, [options(target, forced_eos=False) for target in plan])
    ours = [r[0].token_ids for r in results]
    expected: list[list[int]] = [[] for _ in plan]
    for target in targets:
        rows = [i for i, t in enumerate(plan) if t == target]
        for row, tokens in zip(rows, hf_generate(checkpoint, name, batch, rows, target, {},
                                                 beams, max_new_tokens=EOS_LIMIT,
                                                 forced_eos=True)):
            expected[row] = tokens
    mismatches = [i for i, (a, b) in enumerate(zip(ours, expected, strict=True)) if a != b]
    assert not mismatches, (f"{len(mismatches)}/{COUNT} differ, first {mismatches[0]} "
                            f"({plan[mismatches[0]]}): ours {ours[mismatches[0]]} "
                            f"transformers {expected[mismatches[0]]}")
    assert all(r[0].finished for r in results)
    # meaningful: many reach the limit (the language token and 6 more, then the forced
    # eos), where the outputs without it are cut one token later
    assert max(len(t) for t in ours) == EOS_LIMIT - 1
    ended = sum(len(t) == EOS_LIMIT - 1 for t in ours)
    changed = sum(a != b[0].token_ids for a, b in zip(ours, cut, strict=True))
    assert ended >= 10 and changed >= 10, (ended, changed)


# -- the Translator: languages, prefixes, generation defaults ------------------------------


def hf_texts(checkpoint, name: str, texts: list[str], target: str, **kwargs) -> list[str]:
    """transformers' translations of texts into `target` (its tokenizer decodes them), with
    the checkpoint's own forced_eos_token_id (mBART's config sets eos; the Translator takes
    it from the generation defaults)."""
    directory, model, _ = checkpoint
    tokenizer = hh.auto_tokenizer(directory, fh.LANGUAGES[name][0])
    forced = tokenizer.convert_tokens_to_ids(f"__{target}__" if name == "m2m100" else target) \
        if name in ("nllb", "m2m100", "mbart50") else None
    with torch.no_grad():
        out = model.generate(**tokenizer(texts, return_tensors="pt", padding=True),
                             forced_bos_token_id=forced, **kwargs)
    return tokenizer.batch_decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("name", ["nllb", "m2m100", "mbart50"])
def test_translator_translates_into_each_rows_language(name, checkpoints, exported):
    """Texts into different target languages in one call (one batch) get transformers'
    translation of each; the language token is not part of the text."""
    translator = Translator(exported[name], intra_op_threads=1)
    source, targets = fh.LANGUAGES[name]
    texts = fh.sentences(6, seed=21)
    wanted = [targets[i % len(targets)] for i in range(len(texts))]
    got = translator.translate(texts, source_language=source, target_language=wanted,
                               num_beams=4, max_new_tokens=MAX_NEW_TOKENS)
    for target in targets:
        rows = [i for i, t in enumerate(wanted) if t == target]
        expected = hf_texts(checkpoints[name], name, [texts[i] for i in rows], target,
                            num_beams=4, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        assert [got[i] for i in rows] == expected, (name, target)
    assert translator.languages == list(Manifest.load(exported[name]).tokenizer.languages[
        "codes"])


def test_target_prefix_starts_the_translation(exported, checkpoints):
    translator = Translator(exported["nllb"], intra_op_threads=1)
    texts = fh.sentences(4, seed=22)
    hyps = translator.translate_hypotheses(texts, target_language="fra_Latn",
                                           target_prefix="the big", max_new_tokens=8)
    prefix = translator.tokenizer.encode_text("the big")
    fra = translator.tokenizer.languages.codes["fra_Latn"]
    for hyp in (h[0] for h in hyps):
        assert hyp.text.startswith("the big")
        assert hyp.token_ids[: 1 + len(prefix)] == [fra, *prefix]
        # the prefix is decoder input: max_new_tokens counts the tokens after it
        assert len(hyp.token_ids) <= 1 + len(prefix) + 8


@pytest.mark.parametrize("name, call, message", [
    ("nllb", dict(), "target_language is required by this multilingual model; valid codes "
                     "include eng_Latn, fra_Latn"),
    ("nllb", dict(target_language="xx_Yyyy"), "target_language 'xx_Yyyy' is not a language "
                                               "of this model; valid codes include"),
    ("nllb", dict(target_language="fra_Latn", source_language="fr"),
     "source_language 'fr' is not a language of this model; valid codes include fra_Latn"),
    ("m2m100", dict(target_language="__de__"), "target_language '__de__' is not a language"),
    ("nllb", dict(target_language=["fra_Latn"]), "target_language holds 1 items for 2 texts"),
    ("nllb", dict(target_language="fra_Latn", target_prefix="a </s> b"),
     "target_prefix must not contain the end-of-sequence token ('</s>')"),
    ("nllb", dict(target_language="fra_Latn", target_prefix="the " * 200),
     "target_prefix is"),
    ("cc25", dict(target_language="xx_XX"), "target_language 'xx_XX' is not a language of "
                                             "this model; valid codes include"),
    ("bart", dict(target_language="fr"), "target_language 'fr' is not accepted: this model "
                                         "has no language codes"),
    ("bart", dict(source_language="en"), "source_language 'en' is not accepted"),
    ("nllb", dict(target_language="fra_Latn", prefix_token_ids=(5,)),
     "prefix_token_ids is set from target_language and target_prefix"),
])
def test_bad_languages_are_refused_naming_the_field(name, call, message, exported):
    translator = Translator(exported[name], intra_op_threads=1)
    with pytest.raises(ValueError) as info:
        translator.translate(["the cat", "a dog"], max_new_tokens=4, **call)
    assert message in str(info.value)
    if message.startswith(("target_language '", "source_language '",
                           "target_language is required")):
        assert isinstance(info.value, LanguageError)


def test_start_token_models_take_each_texts_target(exported, checkpoints):
    """mBART-cc25: decoding starts from the target language's token; no target is the
    model's own (fr_XX); texts into different languages in one call each get
    transformers' translation with that decoder_start_token_id."""
    translator = Translator(exported["cc25"], intra_op_threads=1)
    texts = fh.sentences(6, seed=23)
    assert translator.translate(texts, max_new_tokens=6) == translator.translate(
        texts, target_language="fr_XX", max_new_tokens=6) == hf_texts(
        checkpoints["cc25"], "cc25", texts, "fr_XX", max_new_tokens=6, num_beams=1,
        do_sample=False)
    wanted = [CC25_TARGETS[i % 2] for i in range(len(texts))]
    got = translator.translate(texts, target_language=wanted, num_beams=4, max_new_tokens=12)
    tokenizer = checkpoints["cc25"][2]
    for target in CC25_TARGETS[:2]:
        rows = [i for i, t in enumerate(wanted) if t == target]
        expected = hf_texts(checkpoints["cc25"], "cc25", [texts[i] for i in rows], target,
                            max_new_tokens=12, num_beams=4, do_sample=False,
                            decoder_start_token_id=tokenizer.convert_tokens_to_ids(target))
        assert [got[i] for i in rows] == expected, target


BART_GENERATION = {"num_beams": 4, "max_length": 14, "min_length": 5, "length_penalty": 2.0,
                   "no_repeat_ngram_size": 3, "early_stopping": True, "forced_bos_token_id": 0,
                   "forced_eos_token_id": 2, "decoder_start_token_id": 2, "bos_token_id": 0,
                   "eos_token_id": 2, "pad_token_id": 1}


@pytest.fixture(scope="module")
def bart_with_defaults(checkpoints, tmp_path_factory):
    """The BART checkpoint with bart-large-cnn's kind of generation_config.json, exported."""
    directory = tmp_path_factory.mktemp("hf") / "bart-cnn"
    shutil.copytree(checkpoints["bart"][0], directory)
    (directory / "generation_config.json").write_text(json.dumps(BART_GENERATION),
                                                      encoding="utf-8")
    out = tmp_path_factory.mktemp("artifacts") / "bart-cnn"
    assert export_main(["--from-hf", str(directory), "--out", str(out), "--quiet"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.BartForConditionalGeneration.from_pretrained(
            str(directory), attn_implementation="eager").eval()
    return directory, out, model


def test_generation_defaults_fill_unset_options(bart_with_defaults):
    """model.json records generation_config.json; a call that sets nothing decodes as
    transformers' generate with the checkpoint's own settings (its forced eos at max_length
    included), a call that sets num_beams overrides that one, a sampling call gets no beam
    settings but the forced eos."""
    directory, out, model = bart_with_defaults
    manifest = Manifest.load(out)
    assert {k: manifest.generation[k] for k in BART_GENERATION if k in manifest.generation} == {
        k: v for k, v in BART_GENERATION.items()
        if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    assert manifest.generation_defaults.unapplied(pad_token_id=1, eos_token_id=2) == []
    translator = Translator(out, intra_op_threads=1)
    tokenizer = hh.auto_tokenizer(directory)
    texts = fh.sentences(12, seed=24)
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        beams = model.generate(**batch)
        greedy = model.generate(**batch, num_beams=1)
        uncut = model.generate(**batch, num_beams=1, forced_eos_token_id=None)
    expected = tokenizer.batch_decode(beams, skip_special_tokens=True)
    assert translator.translate(texts) == expected
    assert translator.translate(texts, num_beams=1) == tokenizer.batch_decode(
        greedy, skip_special_tokens=True)
    assert expected != tokenizer.batch_decode(greedy, skip_special_tokens=True)
    # the forced eos mattered: without it some greedy outputs are one token longer
    assert translator.translate(texts, num_beams=1, forced_eos=False) == \
        tokenizer.batch_decode(uncut, skip_special_tokens=True) != tokenizer.batch_decode(
            greedy, skip_special_tokens=True)
    hyps = translator.translate_hypotheses(texts, do_sample=True, seed=3)
    assert all(len(h) == 1 and 5 <= len(h[0].token_ids) <= 12 for h in hyps)


def test_generation_defaults_merge_rules():
    defaults = GenerationDefaults({"num_beams": 5, "max_length": 200, "min_length": 3,
                                   "early_stopping": "never", "length_penalty": 1.5})
    assert defaults.merge({}, 0, 1023) == {"num_beams": 5, "length_penalty": 1.5,
                                           "early_stopping": "never", "max_new_tokens": 199,
                                           "min_new_tokens": 2}
    # a target prefix of 3 input tokens: transformers counts them in max_length
    assert defaults.merge({}, 3, 1020)["max_new_tokens"] == 196
    assert defaults.merge({"max_new_tokens": 1}, 0, 1023)["min_new_tokens"] == 1
    assert defaults.merge({"do_sample": True}, 0, 1023) == {
        "do_sample": True, "max_new_tokens": 199, "min_new_tokens": 2}
    assert defaults.merge({}, 0, 50)["max_new_tokens"] == 50  # within the model's limit
    assert defaults.unapplied() == []
    # forced_eos_token_id: applied where it is the model's eos (an id, or a list of it), to
    # sampling too; a request's own forced_eos wins
    for forced in (2, [2]):
        eos = GenerationDefaults({"forced_eos_token_id": forced, "num_beams": 4})
        assert eos.merge({}, eos_token_id=2) == {"num_beams": 4, "forced_eos": True}
        assert eos.merge({"do_sample": True}, eos_token_id=2) == {"do_sample": True,
                                                                    "forced_eos": True}
        assert eos.merge({"forced_eos": False}, eos_token_id=2)["forced_eos"] is False
        assert eos.unapplied(eos_token_id=2) == []
    other = GenerationDefaults({"forced_eos_token_id": [2, 5]})
    assert "forced_eos" not in other.merge({}, eos_token_id=2)
    assert other.unapplied(eos_token_id=2) == ["forced_eos_token_id"]
    with pytest.raises(ValueError, match='generation.early_stopping must be true, false or '
                                         '"never", got \'always\''):
        GenerationDefaults({"early_stopping": "always"})
    with pytest.raises(ValueError, match="generation.num_beams must be int, got '4'"):
        GenerationDefaults({"num_beams": "4"})
    with pytest.raises(ValueError, match="generation.temperature is not a setting"):
        GenerationDefaults({"temperature": 0.5})


def test_older_manifests_keep_their_recorded_generation(exported, tmp_path):
    """An export made before model.json had "generation" (Marian and T5 imports kept the
    settings in model.extra.hf_generation) gets them as its defaults."""
    directory = tmp_path / "old"
    shutil.copytree(exported["bart"], directory)
    path = directory / "model.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data.pop("generation")
    data["model"]["extra"]["hf_generation"] = {"num_beams": 4, "bad_words_ids": [[1]],
                                               "max_length": 512}
    path.write_text(json.dumps(data), encoding="utf-8")
    assert Manifest.load(directory).generation == {"num_beams": 4, "bad_words_ids": [[1]],
                                                   "max_length": 512}


# -- checkpoint directories and refusals -----------------------------------------------------


def test_cache_snapshot_is_named_after_its_repository(checkpoints, tmp_path):
    """A huggingface_hub cache snapshot (files linked to blobs) is read like a directory and
    named ORG/NAME, not by its commit hash."""
    source = checkpoints["nllb"][0]
    blobs = tmp_path / "hub" / "models--facebook--nllb-tiny" / "blobs"
    snapshot = blobs.parent / "snapshots" / "5f6d2a0c1b"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, file in enumerate(sorted(source.iterdir())):
        blob = blobs / f"blob{index}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    assert checkpoint_name(snapshot) == "facebook/nllb-tiny"
    assert checkpoint_name(source) == "nllb"
    out = tmp_path / "out"
    assert export_main(["--from-hf", str(snapshot), "--out", str(out), "--quiet"]) == 0
    manifest = Manifest.load(out)
    assert manifest.config.name == "facebook/nllb-tiny"
    assert manifest.config.source_language == "eng_Latn"
    assert (out / "tokenizer.json").is_file() and not (out / "tokenizer.json").is_symlink()


@pytest.mark.parametrize("name, file, changes, message", [
    ("bart", "config.json", dict(normalize_before=True),
     "normalize_before=true (pre-norm layers) is not how transformers runs model_type 'bart'"),
    ("mbart50", "config.json", dict(normalize_before=False), "normalize_before=false"),
    ("nllb", "config.json", dict(decoder_ffn_dim=60),
     "encoder_ffn_dim (52) != decoder_ffn_dim (60)"),
    ("nllb", "config.json", dict(activation_function="tanh"),
     "activation_function 'tanh' is not supported"),
    ("nllb", "config.json", dict(pad_token_id=0),
     "pad_token_id is 0 but tokenizer.json maps the pad token to 1"),
    ("m2m100", "config.json", dict(eos_token_id=3),
     "eos_token_id is 3 but vocab.json maps the eos token to 2"),
    ("m2m100", "tokenizer_config.json", dict(language_codes="m2m200"),
     "language_codes 'm2m200' is not one of m2m100, wmt21"),
    ("mbart50", "config.json", dict(encoder_layers=3), "missing tensor(s) encoder.layers.2"),
    ("nllb", "config.json", dict(vocab_size=100), "more than the model's vocab_size 100"),
    ("nllb", "config.json", dict(max_position_embeddings=0),
     "max_source_positions must be a positive integer"),
    ("bart", "config.json", dict(decoder_layers=0),
     "decoder_layers must be a positive integer, got 0"),
])
def test_unsupported_checkpoints_are_refused_naming_the_field(name, file, changes, message,
                                                            checkpoints, tmp_path):
    directory = hh.copy_checkpoint(checkpoints, tmp_path, name)
    hh.edit_json(directory / file, **changes)
    with pytest.raises(SourceError) as info:
        import_hf(directory)
    assert message in str(info.value)


@pytest.mark.parametrize("name", ["nllb", "mbart50", "cc25", "bart"])
def test_tokenizer_json_is_built_from_the_slow_files(name, checkpoints, exported, tmp_path):
    """A checkpoint with only its SentencePiece model (NLLB, mBART) or BPE vocab.json +
    merges.txt (BART): export builds tokenizer.json as AutoTokenizer builds it; the ids equal
    AutoTokenizer's on the directory as it is, and the model translates as the export of the
    checkpoint with its tokenizer.json."""
    directory = hh.copy_checkpoint(checkpoints, tmp_path, name)
    (directory / "tokenizer.json").unlink()
    out = tmp_path / "out"
    assert export_main(["--from-hf", str(directory), "--out", str(out), "--quiet"]) == 0
    manifest = Manifest.load(out)
    assert manifest.tokenizer.kind == "hf-json" and (out / "tokenizer.json").is_file()
    assert manifest.provenance["tokenizer"].startswith(
        f"built by transformers {transformers.__version__}")
    assert not (directory / "tokenizer.json").exists()  # the checkpoint is left as it was
    ours = Tokenizer(out, manifest.tokenizer)
    strings = family_strings(name)
    source, targets = fh.LANGUAGES[name]
    for language in [source, *targets][:2] if source else [""]:
        theirs = hh.auto_tokenizer(directory, language)
        assert [ours.encode(s, language or None) for s in strings] == [
            theirs(s).input_ids for s in strings], (name, language)
    shipped = Manifest.load(exported[name])
    assert manifest.tokenizer.languages == shipped.tokenizer.languages
    texts = fh.sentences(8, seed=11)
    languages = dict(source_language=source or None, target_language=targets[0] or None,
                     max_new_tokens=12)
    assert Translator(out, intra_op_threads=1).translate(texts, **languages) == Translator(
        exported[name], intra_op_threads=1).translate(texts, **languages)


def test_the_older_sentencepiece_file_name_is_read(checkpoints, tmp_path):
    """mBART-cc25's checkpoints name their SentencePiece model sentence.bpe.model, which
    transformers' tokenizers do not read: export shows it to them under the name they read
    (before, AutoTokenizer built a tokenizer of the special tokens alone)."""
    directory = hh.copy_checkpoint(checkpoints, tmp_path, "mbart50")
    (directory / "tokenizer.json").unlink()
    (directory / "sentencepiece.bpe.model").rename(directory / "sentence.bpe.model")
    # beside it, a dangling link under the name transformers reads and a link loop
    (directory / "sentencepiece.bpe.model").symlink_to(tmp_path / "gone.model")
    (directory / "loop").symlink_to(directory / "loop")
    out = tmp_path / "out"
    assert export_main(["--from-hf", str(directory), "--out", str(out), "--quiet"]) == 0
    manifest = Manifest.load(out)
    assert "from sentence.bpe.model" in manifest.provenance["tokenizer"]
    ours = Tokenizer(out, manifest.tokenizer)
    reference = hh.copy_checkpoint(checkpoints, tmp_path / "reference", "mbart50")
    (reference / "tokenizer.json").unlink()  # AutoTokenizer on the file under its own name
    theirs = hh.auto_tokenizer(reference, "en_XX")
    strings = family_strings("mbart50")
    assert [ours.encode(s, "en_XX") for s in strings] == [theirs(s).input_ids
                                                           for s in strings]


def test_a_tokenizer_built_without_its_vocabulary_is_refused(checkpoints, tmp_path):
    """Slow files transformers does not read for the family (a vocab.json beside an NLLB
    config): the tokenizer it builds holds the special tokens alone, and is refused against
    the model's vocab_size instead of exporting a model whose every word is <unk>."""
    directory = hh.copy_checkpoint(checkpoints, tmp_path, "nllb")
    (directory / "tokenizer.json").unlink()
    (directory / "sentencepiece.bpe.model").unlink()
    (directory / "vocab.json").write_text(json.dumps({"<s>": 0}), encoding="utf-8")
    with pytest.raises(SourceError) as info:
        import_hf(directory)
    assert "it did not read the vocabulary" in str(info.value)
    assert "against the model's vocab_size 228" in str(info.value)


def test_a_checkpoint_without_tokenizer_files_is_refused(checkpoints, tmp_path, capsys,
                                                         monkeypatch):
    directory = hh.copy_checkpoint(checkpoints, tmp_path, "nllb")
    (directory / "tokenizer.json").unlink()
    # without transformers, the message says what builds tokenizer.json
    monkeypatch.setitem(sys.modules, "transformers", None)
    code = export_main(["--from-hf", str(directory), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "has no tokenizer.json: building it from sentencepiece.bpe.model needs " \
           "transformers" in err
    monkeypatch.undo()
    (directory / "sentencepiece.bpe.model").unlink()
    code = export_main(["--from-hf", str(directory), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "NLLB tokenizer not found" in err and "expected tokenizer.json, or " \
           "sentencepiece.bpe.model" in err


def test_stray_tensors_are_refused(checkpoints, tmp_path):
    directory = hh.copy_checkpoint(checkpoints, tmp_path, "bart")
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    state = load_file(str(path))
    state["model.encoder.layer_norm.weight"] = torch.ones(36)  # a pre-norm model's
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(SourceError, match="no place in tfserve's model: "
                                          "encoder.layer_norm.weight"):
        import_hf(directory)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", fh.FAMILIES)
def test_cuda_matches_cpu(name, exported):
    """Each family's export on CUDA (IO binding) decodes as on CPU: mixed target languages,
    greedy and beam 4, 50 sentences."""
    source, targets = fh.LANGUAGES[name]
    texts = fh.sentences(COUNT, seed=5)
    identical = cuda_agreement(exported[name], texts, source_language=source or None,
                               target_language=[targets[i % len(targets)] or None
                                                for i in range(COUNT)],
                               max_new_tokens=MAX_NEW_TOKENS)
    assert min(identical.values()) >= MIN_IDENTICAL * COUNT, identical


def test_step_profile_names_the_output_projection(exported, capsys):
    from tfserve.bench.step_profile import main as step_profile

    assert step_profile([str(exported["nllb"]), "--batch", "2", "--threads", "1",
                         "--steps", "2", "--top", "40"]) == 0
    out = capsys.readouterr().out
    assert "vocabulary 228, 3 decoder layers, batch 2" in out and "/lm_head/MatMul" in out


@pytest.mark.parametrize("name", ["nllb", "cc25"])
@pytest.mark.parametrize("variant", [["--quantize", "int8"], ["--dtype", "fp16"]])
def test_reduced_precision_exports_pass_their_parity_checks(name, variant, checkpoints,
                                                             tmp_path):
    out = tmp_path / "out"
    assert export_main(["--from-hf", str(checkpoints[name][0]), "--out", str(out), "--quiet",
                        *variant]) == 0
    manifest = Manifest.load(out)
    assert manifest.parity["passed"]
    assert (manifest.quantization, manifest.dtype) == (
        ("int8", "fp32") if variant[0] == "--quantize" else (None, "fp16"))
