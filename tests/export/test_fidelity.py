"""Token-for-token fidelity to transformers' `generate` where tfserve used to differ.

Random checkpoints built here with transformers (nothing downloaded), at tiny sizes, exported
with `python -m export --from-hf` and decoded over ONNX Runtime:

- the checkpoint's bans, nothing more: a T5 v1.1-style checkpoint (gated-gelu, untied
  lm_head) whose pad token is the model's top token in some steps is decoded without a pad
  ban (its generation config has no bad_words_ids), greedy and beam-4, as `generate` decodes
  it; an opus-mt-style Marian checkpoint keeps the pad ban its bad_words_ids ask for; a
  manifest written before model.json recorded the bans keeps pad banned;
- M2M100 with an odd d_model (fairseq's sinusoidal table, its last column zero-padded);
- beam search whose forced eos ends it before a step of its own (max_new_tokens 1, or only
  forced tokens before it) returns num_return_sequences hypotheses, with transformers'
  scores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only, never the hub
transformers = pytest.importorskip("transformers")

import family_helpers as fh  # noqa: E402
import hf_import_helpers as hh  # noqa: E402
import marian_helpers as mh  # noqa: E402
import t5_helpers as th  # noqa: E402

from export.cli import main as export_main  # noqa: E402
from tfserve.artifacts.generation_defaults import GenerationDefaults  # noqa: E402
from tfserve.artifacts.manifest import MANIFEST_FILE, Manifest  # noqa: E402
from tfserve.generation import DecodingOptions, Hypothesis  # noqa: E402
from tfserve.generation.batch import generate  # noqa: E402
from tfserve.runtime import Runtime  # noqa: E402

COUNT = 20  # inputs per comparison
MAX_NEW_TOKENS = 16
# the pad token's output row reads this much more of the dimension the last decoder FFN
# writes into (t5_helpers.randomize): pad is then the top token in some steps (measured: 7 of
# 20 greedy and 10 of 20 beam-4 outputs of `generate` hold it)
PAD_BOOST = 1.0
# the same for Marian, through its final logits bias (pad is the last id)
MARIAN_PAD_BOOST = 2.0
ODD_D_MODEL = 27  # M2M100: 3 heads of 9


def export(directory: Path, out: Path) -> Path:
    code = export_main(["--from-hf", str(directory), "--out", str(out), "--quiet",
                        "--parity-samples", "8"])
    assert code == 0, f"export of {directory} failed with exit code {code}"
    return out


def resave(model: Any, directory: Path) -> Any:
    """The edited model saved over its checkpoint, and read back as transformers reads it."""
    model.save_pretrained(directory)
    return type(model).from_pretrained(str(directory)).eval()


def cut_at_eos(sequences: torch.Tensor, eos: int, start: int = 1) -> list[list[int]]:
    """generate's rows from position `start` on, cut at the first eos. Pad is not removed:
    a model that does not ban it may produce it (rows that ended are cut before theirs)."""
    rows = []
    for row in sequences[:, start:].tolist():
        rows.append(row[: row.index(eos)] if eos in row else row)
    return rows


def tfserve_rows(runtime: Runtime, batch: Any, options: DecodingOptions) -> list[list[int]]:
    results = generate(runtime, batch["input_ids"].numpy(), batch["attention_mask"].numpy(),
                       options)
    return [hypotheses[0].token_ids for hypotheses in results]


def differing(ours: list[list[int]], theirs: list[list[int]]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]


# -- checkpoints ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def t5(tmp_path_factory) -> tuple[Path, Any, Any, Path]:
    """(checkpoint directory, transformers model, tokenizer, artifacts) of a T5 v1.1-style
    checkpoint whose pad token is sometimes the top token."""
    directory = tmp_path_factory.mktemp("hf") / "t5-v11"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = th.write_checkpoint(
            directory, th.train_t5_spm(), model_type="t5", untied=True, seed=0, eos_boost=1.0,
            d_model=24, num_heads=2, d_kv=12, d_ff=32, num_layers=1, num_decoder_layers=1,
            relative_attention_num_buckets=8, relative_attention_max_distance=16,
            feed_forward_proj="gated-gelu")
        with torch.no_grad():
            model.lm_head.weight[model.config.pad_token_id, 0] += PAD_BOOST
        model = resave(model, directory)
        tokenizer = hh.auto_tokenizer(directory)
    return directory, model, tokenizer, export(directory, tmp_path_factory.mktemp("out") / "t5")


@pytest.fixture(scope="module")
def t5_runtime(t5) -> Runtime:
    return Runtime(t5[3], intra_op_threads=1)


@pytest.fixture(scope="module")
def t5_batch(t5) -> Any:
    return t5[2](th.sentences(COUNT, seed=5), return_tensors="pt", padding=True)


@pytest.fixture(scope="module")
def m2m100(tmp_path_factory) -> tuple[Path, Any, Any, Path]:
    """(checkpoint directory, transformers model, tokenizer, artifacts) of an M2M100
    checkpoint with an odd d_model."""
    directory = tmp_path_factory.mktemp("hf") / "m2m100-odd"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tokenizer = fh.write_checkpoint(
            "m2m100", directory, seed=1, d_model=ODD_D_MODEL, encoder_attention_heads=3,
            decoder_attention_heads=3, encoder_ffn_dim=32, decoder_ffn_dim=32,
            encoder_layers=1, decoder_layers=2)
    out = export(directory, tmp_path_factory.mktemp("out") / "m2m100")
    return directory, model, tokenizer, out


# -- 1. what the checkpoint bans, nothing more ----------------------------------------------


def test_bad_words_ids_single_tokens_are_banned_multi_token_ones_recorded():
    """Single-token entries are banned (eos left out, as transformers leaves it out); longer
    entries are recorded and listed as not applied."""
    defaults = GenerationDefaults({"bad_words_ids": [[7], [3, 4], [2], [7], [5]]})
    assert defaults.banned_token_ids(eos_token_id=2) == [5, 7]
    assert defaults.unapplied(eos_token_id=2) == ["bad_words_ids"]
    assert GenerationDefaults({"bad_words_ids": [[9]]}).unapplied(eos_token_id=2) == []
    assert GenerationDefaults({}).banned_token_ids(eos_token_id=2) == []


@pytest.mark.parametrize("num_beams", [1, 4], ids=["greedy", "beam4"])
def test_t5_pad_is_not_banned_when_the_checkpoint_does_not_ban_it(t5, t5_runtime, t5_batch,
                                                                    num_beams):
    """transformers bans nothing on this checkpoint, and pad is the top token in some steps:
    tfserve's outputs hold the same pads."""
    _, model, _, artifacts = t5
    pad, eos = model.config.pad_token_id, model.config.eos_token_id
    assert json.loads((artifacts / MANIFEST_FILE).read_text())["banned_token_ids"] == []
    assert t5_runtime.banned_token_ids == ()
    with torch.no_grad():
        expected = cut_at_eos(model.generate(**t5_batch, do_sample=False, num_beams=num_beams,
                                             max_new_tokens=MAX_NEW_TOKENS), eos)
    assert sum(pad in row for row in expected) >= 3  # the case this test is about
    got = tfserve_rows(t5_runtime, t5_batch,
                       DecodingOptions(max_new_tokens=MAX_NEW_TOKENS, num_beams=num_beams))
    mismatches = differing(got, expected)
    assert not mismatches, (f"{len(mismatches)}/{COUNT} differ, first {mismatches[0]}: ours "
                            f"{got[mismatches[0]]} transformers {expected[mismatches[0]]}")


def test_manifest_without_the_field_keeps_pad_banned(t5, t5_batch, tmp_path):
    """An export made before model.json recorded the bans decodes as it did: pad banned,
    which is transformers' generate with bad_words_ids [[pad]]."""
    _, model, _, artifacts = t5
    old = shutil.copytree(artifacts, tmp_path / "old")
    data = json.loads((old / MANIFEST_FILE).read_text())
    del data["banned_token_ids"]
    (old / MANIFEST_FILE).write_text(json.dumps(data))
    assert Manifest.load(old).banned_token_ids is None
    runtime = Runtime(old, intra_op_threads=1)
    pad, eos = model.config.pad_token_id, model.config.eos_token_id
    assert runtime.banned_token_ids == (pad,)
    with torch.no_grad():
        expected = cut_at_eos(model.generate(**t5_batch, do_sample=False, num_beams=1,
                                             max_new_tokens=MAX_NEW_TOKENS,
                                             bad_words_ids=[[pad]]), eos)
    got = tfserve_rows(runtime, t5_batch, DecodingOptions(max_new_tokens=MAX_NEW_TOKENS))
    assert got == expected
    assert not any(pad in row for row in got)


def test_banned_token_ids_outside_the_vocabulary_are_refused(t5, tmp_path):
    bad = shutil.copytree(t5[3], tmp_path / "bad")
    data = json.loads((bad / MANIFEST_FILE).read_text())
    data["banned_token_ids"] = [data["model"]["vocab_size"]]
    (bad / MANIFEST_FILE).write_text(json.dumps(data))
    with pytest.raises(ValueError, match="banned_token_ids holds"):
        Manifest.load(bad)


@pytest.fixture(scope="module")
def marian(tmp_path_factory) -> tuple[Any, Any, Path]:
    """(transformers model, tokenizer, artifacts) of an opus-mt-style checkpoint
    (bad_words_ids [[pad]]) whose pad token would be the top token in some steps."""
    source = mh.train_spm(mh.corpus(mh.SOURCE_WORDS, 400, seed=0), 120)
    target = mh.train_spm(mh.corpus(mh.TARGET_WORDS, 400, seed=1), 100)
    directory = tmp_path_factory.mktemp("hf") / "opus-mt-en-fr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Recommended: pip install sacremoses"
        model = mh.write_checkpoint(directory, source, target, mh.build_vocab(source, target),
                                    d_model=16, encoder_attention_heads=2,
                                    decoder_attention_heads=2, encoder_layers=1,
                                    decoder_layers=1, encoder_ffn_dim=24, decoder_ffn_dim=24)
        with torch.no_grad():
            model.final_logits_bias[0, model.config.pad_token_id] += MARIAN_PAD_BOOST
        model = resave(model, directory)
        tokenizer = transformers.MarianTokenizer.from_pretrained(str(directory))
    return model, tokenizer, export(directory, tmp_path_factory.mktemp("out") / "marian")


@pytest.mark.parametrize("num_beams", [1, 4], ids=["greedy", "beam4"])
def test_marian_keeps_the_pad_ban_of_its_bad_words_ids(marian, num_beams):
    model, tokenizer, artifacts = marian
    pad, eos = model.config.pad_token_id, model.config.eos_token_id
    assert model.generation_config.bad_words_ids == [[pad]]
    runtime = Runtime(artifacts, intra_op_threads=1)
    assert Manifest.load(artifacts).banned_token_ids == [pad]
    assert runtime.banned_token_ids == (pad,)
    batch = tokenizer(mh.corpus(mh.SOURCE_WORDS, COUNT, seed=7), return_tensors="pt",
                      padding=True)
    settings = dict(do_sample=False, num_beams=num_beams, max_new_tokens=MAX_NEW_TOKENS,
                    forced_eos_token_id=None)
    with torch.no_grad():
        expected = cut_at_eos(model.generate(**batch, **settings), eos)  # its own ban
        unbanned = cut_at_eos(model.generate(**batch, **settings, bad_words_ids=None), eos)
    assert any(pad in row for row in unbanned)  # the ban decides something here
    got = tfserve_rows(runtime, batch,
                       DecodingOptions(max_new_tokens=MAX_NEW_TOKENS, num_beams=num_beams))
    assert got == expected
    assert not any(pad in row for row in got)


# -- 2. M2M100 with an odd d_model ------------------------------------------------------------


def m2m100_batch(m2m100) -> tuple[Any, int]:
    """The source batch and the forced target language token (German)."""
    _, _, tokenizer, _ = m2m100
    batch = tokenizer(fh.sentences(COUNT, seed=3), return_tensors="pt", padding=True)
    return batch, tokenizer.convert_tokens_to_ids("__de__")


def test_odd_d_model_positions_equal_transformers():
    """fairseq's table with an odd dimension: transformers' own, last column zeros."""
    from transformers.models.m2m_100.modeling_m2m_100 import (
        M2M100SinusoidalPositionalEmbedding,
    )

    from tfserve.model.positions import fairseq_table

    for dim in (ODD_D_MODEL, 5, 1023):
        expected = M2M100SinusoidalPositionalEmbedding.get_embedding(300, dim, padding_idx=1)
        got = fairseq_table(300, dim, padding_row=1)
        assert got.shape == (300, dim)
        assert torch.equal(got, expected), dim
        assert not got[:, -1].any()


@pytest.mark.parametrize("num_beams", [1, 4], ids=["greedy", "beam4"])
def test_m2m100_with_an_odd_d_model_decodes_as_transformers(m2m100, num_beams):
    _, model, _, artifacts = m2m100
    assert model.config.d_model % 2 == 1
    runtime = Runtime(artifacts, intra_op_threads=1)
    assert (runtime.config.d_model, runtime.config.head_dim) == (ODD_D_MODEL, 9)
    batch, language = m2m100_batch(m2m100)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, num_beams=num_beams,
                             max_new_tokens=MAX_NEW_TOKENS, forced_bos_token_id=language)
    expected = cut_at_eos(out, model.config.eos_token_id)
    got = tfserve_rows(runtime, batch, DecodingOptions(
        max_new_tokens=MAX_NEW_TOKENS, num_beams=num_beams, prefix_token_ids=(language,),
        prefix_counts_as_new=True))
    mismatches = differing(got, expected)
    assert not mismatches, (f"{len(mismatches)}/{COUNT} differ, first {mismatches[0]}: ours "
                            f"{got[mismatches[0]]} transformers {expected[mismatches[0]]}")
    assert len({tuple(row) for row in got}) >= 5  # outputs depend on the source


# -- 3. beam search ended by the forced eos ---------------------------------------------------


def assert_same_hypotheses(results: list[list[Hypothesis]], out: Any, per_source: int,
                           eos: int, start: int) -> None:
    """tfserve's hypotheses against generate's sequences and sequences_scores, in order."""
    expected = cut_at_eos(out.sequences, eos, start)
    scores = out.sequences_scores.tolist()
    assert [len(hypotheses) for hypotheses in results] == [per_source] * len(results)
    got = [h for hypotheses in results for h in hypotheses]
    assert [h.token_ids for h in got] == expected
    np.testing.assert_allclose([h.score for h in got], scores, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("num_return_sequences", [4, 2])
def test_forced_eos_at_the_first_step_returns_every_sequence(t5, t5_runtime, t5_batch,
                                                             num_return_sequences):
    """max_new_tokens 1 with the forced eos: generate returns num_return_sequences empty
    outputs, the first at 0 and the others at transformers' -1e9 (beams 1..3 never left
    their initial score)."""
    _, model, _, _ = t5
    eos = model.config.eos_token_id
    with torch.no_grad():
        out = model.generate(**t5_batch, do_sample=False, num_beams=4, max_new_tokens=1,
                             num_return_sequences=num_return_sequences,
                             forced_eos_token_id=eos, length_penalty=0.6,
                             return_dict_in_generate=True, output_scores=True)
    results = generate(t5_runtime, t5_batch["input_ids"].numpy(),
                       t5_batch["attention_mask"].numpy(),
                       DecodingOptions(max_new_tokens=1, num_beams=4, forced_eos=True,
                                       num_return_sequences=num_return_sequences,
                                       length_penalty=0.6))
    assert_same_hypotheses(results, out, num_return_sequences, eos, 1)


@pytest.mark.parametrize("prefix", ["language", "target_prefix"])
def test_forced_eos_after_forced_tokens_returns_every_sequence(m2m100, prefix):
    """The forced language token (max_new_tokens 2) or a target prefix (max_new_tokens 1)
    and then the forced eos: no step of the search's own, num_return_sequences outputs."""
    _, model, tokenizer, artifacts = m2m100
    runtime = Runtime(artifacts, intra_op_threads=1)
    batch, language = m2m100_batch(m2m100)
    eos, start = model.config.eos_token_id, model.config.decoder_start_token_id
    settings = dict(do_sample=False, num_beams=4, num_return_sequences=3,
                    forced_eos_token_id=eos, length_penalty=1.0,
                    return_dict_in_generate=True, output_scores=True)
    if prefix == "language":
        settings.update(forced_bos_token_id=language, max_new_tokens=2)
        options = DecodingOptions(max_new_tokens=2, prefix_token_ids=(language,),
                                  prefix_counts_as_new=True)
    else:
        words = tokenizer("the big", add_special_tokens=False).input_ids
        settings.update(max_new_tokens=1, decoder_input_ids=torch.tensor(
            [[start, language, *words]] * COUNT))
        options = DecodingOptions(max_new_tokens=1, prefix_token_ids=(language, *words))
    with torch.no_grad():
        out = model.generate(**batch, **settings)
    results = generate(runtime, batch["input_ids"].numpy(), batch["attention_mask"].numpy(),
                       dataclasses.replace(options, num_beams=4, num_return_sequences=3,
                                           forced_eos=True))
    assert_same_hypotheses(results, out, 3, eos, 1)
