"""Hugging Face MarianMT import (`python -m export --from-hf DIR`), checked against transformers.

Every checkpoint is built here with random weights (tests/marian_helpers.py): nothing is
downloaded. transformers is a test-only dependency; without it this module is skipped.

- the tokenizer (vocab mode: source.spm -> vocab.json ids + </s>) gives MarianTokenizer's ids;
- decoding any id sequence of vocab.json gives MarianTokenizer.decode's text;
- logits of the imported eager model and of the exported ONNX graphs match MarianMTModel's;
- a model whose logits reach |20| passes the export's parity check (the tolerance scales
  with the logits) and an export whose graph is corrupted is refused;
- greedy and beam-4 search (tfserve.generation over ONNX Runtime and over the eager model)
  give MarianMTModel.generate's tokens;
- unsupported checkpoints and missing files are refused with the file or field named
  (exit code 2 through the CLI).

Known differences from transformers are tests too:
- test_language_code_prefix: a leading ">>fr<<" is one vocab token, as in MarianTokenizer;
- test_special_token_strings_in_text: "</s>" etc. inside the text are special ids there only;
- test_target_side_and_decoding_match_marian_tokenizer: decoded text is stripped in both;
- test_beam_scores_match_generate_defaults: pad is banned after log_softmax in both;
- test_generate_defaults_of_opus_mt: transformers forces eos at max_length, tfserve does not.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only, never the hub
transformers = pytest.importorskip("transformers")

import hf_import_helpers as hh  # noqa: E402
import marian_helpers as mh  # noqa: E402

from export.cli import main as export_main  # noqa: E402
from export.importers import import_hf, supported_model_types  # noqa: E402
from export.importers.marian import marian_key_map  # noqa: E402
from export.sources import SourceError  # noqa: E402
from tfserve.generation import DecodingOptions  # noqa: E402
from tfserve.generation.batch import generate  # noqa: E402
from tfserve.model.eager import EagerBackend  # noqa: E402
from tfserve.runtime import Runtime  # noqa: E402
from tfserve.text.tokenizer import Tokenizer  # noqa: E402

TOLERANCE = 1e-4
MAX_NEW_TOKENS = 20
LANGUAGE_CODES = (">>fr<<", ">>de<<")
EXPORTED = ("a", "b")  # the checkpoints exported (tests/export/conftest.py)

# name -> (weights layout, MarianConfig overrides); "a" is the opus-mt shape in miniature
CHECKPOINTS = {
    "a": ("safetensors", dict()),
    "b": ("bin", dict(d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
                      encoder_layers=1, decoder_layers=3, encoder_ffn_dim=48,
                      decoder_ffn_dim=48, activation_function="gelu", scale_embedding=False,
                      tie_word_embeddings=False)),
    "c": ("sharded", dict(d_model=16, encoder_attention_heads=2, decoder_attention_heads=2,
                          encoder_layers=2, decoder_layers=2, encoder_ffn_dim=24,
                          decoder_ffn_dim=24, activation_function="relu",
                          max_position_embeddings=40)),
}


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spm_models() -> tuple[bytes, bytes]:
    """Two different SentencePiece models: source (English-ish) and target (French-ish)."""
    return (mh.train_spm(mh.corpus(mh.SOURCE_WORDS, 400, seed=0), 120),
            mh.train_spm(mh.corpus(mh.TARGET_WORDS, 400, seed=1), 100))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, spm_models):
    """name -> (directory, MarianMTModel) for every entry of CHECKPOINTS."""
    source, target = spm_models
    built = {}
    for index, (name, (weights, overrides)) in enumerate(CHECKPOINTS.items()):
        codes = LANGUAGE_CODES if name == "b" else ()
        vocab = mh.build_vocab(source, target, language_codes=codes)
        directory = tmp_path_factory.mktemp("hf") / f"opus-mt-en-fr-{name}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Recommended: pip install sacremoses"
            model = mh.write_checkpoint(directory, source, target, vocab, weights=weights,
                                        seed=index, **overrides)
        built[name] = (directory, model)
    return built


@pytest.fixture(scope="module")
def sources(checkpoints, hf_tokenizers):
    """50 source texts for checkpoint a, encoded by MarianTokenizer (a padded batch)."""
    texts = mh.corpus(mh.SOURCE_WORDS, 50, seed=5)
    batch = hf_tokenizers["a"](texts, return_tensors="pt", padding=True)
    return texts, batch


# -- tokenizer ------------------------------------------------------------------------------


def tokenizer_strings() -> list[str]:
    """200 strings: sentences, unicode, unknown characters, whitespace, the empty string."""
    special = [
        "", " ", "   ", "\n", "\t", "a\tb\nc", "  the  cat  ", "The Cat.", "THE CAT!",
        "café naïve résumé", "straße über", "e\u0301te\u0301", "ﬁ ﬂ ligatures",
        "Ｆｕｌｌ ｗｉｄｔｈ",
        "①②③ x² ½", "non\u00a0breaking", "zero\u200bwidth", "日本語のテキスト", "中文 测试",
        "Привет мир", "Ελληνικά", "עברית", "مرحبا بالعالم", "हिन्दी", "emoji 😀👍🏽",
        "☃ snowman ☃", "♞♟", "\x00nul\x01", "control\x1bchar", "<>&", "a<b>c", "[x]{y}",
        "$%^*~`|\\", "___", "▁ the spm underline ▁▁", "1234567890", "3.14159 -42 +7",
        "🇫🇷 flag", "'quoted' \"text\"", "tab\tseparated\tvalues", "trailing space ",
        " leading space", "a" * 200, "the " * 60, "Ünïcödé Çàpïtâls", "ǅ ǈ ǋ titlecase",
        "\ufeffbom", "ℌ𝔢𝔩𝔩𝔬 𝕨𝕠𝕣𝕝𝕕", "\u2028line\u2029separators", "the cat\r\nwindows",
    ]
    rng = np.random.default_rng(3)
    alphabet = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJ 0123456789.,!?'-éèüößçñåœ日本ЖЩ😀☃")
    mixed = ["".join(rng.choice(alphabet, size=int(rng.integers(1, 40))))
             for _ in range(40)]
    sentences = mh.corpus(mh.SOURCE_WORDS, 80, seed=11) + mh.corpus(mh.TARGET_WORDS, 30, seed=12)
    strings = special + mixed + sentences
    assert len(strings) >= 200
    return strings[:200]


def test_marian_tokenizer_loads_the_test_checkpoint(checkpoints, hf_tokenizers):
    directory, model = checkpoints["a"]
    tokenizer = hf_tokenizers["a"]
    vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
    assert tokenizer.vocab_size == len(vocab) == model.config.vocab_size
    assert (tokenizer.eos_token_id, tokenizer.unk_token_id, tokenizer.pad_token_id) == (
        0, 1, len(vocab) - 1)
    assert 100 <= len(vocab) <= 300


@pytest.mark.parametrize("name", ["a", "b"])
def test_token_ids_match_marian_tokenizer(name, checkpoints, hf_tokenizers):
    directory = checkpoints[name][0]
    ours = Tokenizer(directory, import_hf(directory).tokenizer_spec)
    theirs = hf_tokenizers[name]
    strings = tokenizer_strings()
    mismatches = [(s, ours.encode(s), theirs(s).input_ids) for s in strings
                  if ours.encode(s) != theirs(s).input_ids]
    assert not mismatches, f"{len(mismatches)} of {len(strings)} differ, e.g. {mismatches[:3]}"
    # the cases are meaningful: unknown pieces occur, the empty string is just </s>
    unk = ours.unk_id
    assert sum(unk in ours.encode(s) for s in strings) >= 10
    assert ours.encode("") == [ours.eos_id] == theirs("").input_ids
    # a padded batch is MarianTokenizer's padded batch
    batch = theirs(strings[:32], return_tensors="np", padding=True)
    ids, mask = ours.encode_batch(strings[:32])
    np.testing.assert_array_equal(ids, batch["input_ids"])
    np.testing.assert_array_equal(mask, batch["attention_mask"])


def test_target_side_and_decoding_match_marian_tokenizer(checkpoints, hf_tokenizers):
    directory = checkpoints["a"][0]
    ours = Tokenizer(directory, import_hf(directory).tokenizer_spec)
    theirs = hf_tokenizers["a"]
    texts = mh.corpus(mh.TARGET_WORDS, 50, seed=21) + ["", "où déjà être garçon", "cœur ☃"]
    for text in texts:
        ids = ours.encode_target(text)
        assert ids == theirs(text_target=text).input_ids, text
        # both strip the decoded text (a dropped <unk> can leave a space at an end)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    ids = ours.encode_target("cœur ☃")
    assert (ours.decode(ids), theirs.decode(ids, skip_special_tokens=True)) == ("cœur", "cœur")


@pytest.mark.parametrize("name", ["a", "b"])
def test_decoding_random_ids_matches_marian_tokenizer(name, checkpoints, hf_tokenizers):
    """1,000 random id sequences over the whole vocab.json: source-only pieces (unknown to
    target.spm), the specials and, in b, the language codes; identical text."""
    directory = checkpoints[name][0]
    ours = Tokenizer(directory, import_hf(directory).tokenizer_spec)
    theirs = hf_tokenizers[name]
    vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
    ids = sorted(vocab.values())
    target_pieces = set(mh.spm_pieces((directory / "target.spm").read_bytes()))
    assert {p for p in vocab if p not in target_pieces and p.startswith("\u2581")}, \
        "the vocabulary holds word pieces that target.spm does not know"
    rng = np.random.default_rng(len(name))
    for _ in range(1000):
        sequence = rng.choice(ids, size=int(rng.integers(0, 25))).tolist()
        assert ours.decode(sequence) == theirs.decode(sequence, skip_special_tokens=True), \
            [ours.id_to_token(i) for i in sequence]


def test_language_code_prefix(checkpoints, hf_tokenizers):
    directory = checkpoints["b"][0]  # its vocab.json holds >>fr<< and >>de<<
    ours = Tokenizer(directory, import_hf(directory).tokenizer_spec)
    theirs = hf_tokenizers["b"]
    texts = [">>fr<< the cat is good", ">>de<<the house", ">>xx<< unknown code", ">>fr<<"]
    assert [ours.encode(t) for t in texts] == [theirs(t).input_ids for t in texts]


def test_special_token_strings_in_text(checkpoints, hf_tokenizers):
    """Documents a difference: MarianTokenizer turns "</s>", "<unk>", "<pad>" inside the text
    into those special ids (PreTrainedTokenizer.tokenize splits the text on its special
    tokens first, transformers/tokenization_python.py); tfserve treats them as plain text,
    so user text cannot inject an eos or a pad. Every other string gives identical ids."""
    directory = checkpoints["a"][0]
    ours = Tokenizer(directory, import_hf(directory).tokenizer_spec)
    theirs = hf_tokenizers["a"]
    for text, token in (("the cat </s> dog", ours.eos_id), ("a <unk> b", ours.unk_id),
                        ("<pad>", ours.pad_id)):
        hf_ids, our_ids = theirs(text).input_ids, ours.encode(text)
        assert token in hf_ids[:-1]
        assert our_ids != hf_ids
        if token != ours.unk_id:  # ("<" is not in this vocabulary, so tfserve has unks there)
            assert token not in our_ids[:-1]


# -- config and weights ---------------------------------------------------------------------


def test_import_maps_the_config(checkpoints):
    directory, model = checkpoints["a"]
    source = import_hf(directory)
    cfg = source.model.config
    hf = model.config
    assert source.kind == "hf-marian"
    assert (cfg.positions, cfg.sinusoidal_layout, cfg.norm, cfg.activation) == (
        "sinusoidal", "half", "post", "silu")
    assert (cfg.d_model, cfg.num_heads, cfg.encoder_layers, cfg.decoder_layers, cfg.ffn_dim) == (
        24, 3, 2, 1, 40)
    assert cfg.vocab_size == hf.vocab_size
    assert cfg.max_source_positions == cfg.max_target_positions == 64
    assert cfg.scale_embedding and cfg.tie_word_embeddings and cfg.final_logits_bias
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.unk_token_id, cfg.decoder_start_token_id) == (
        hf.pad_token_id, 0, 1, hf.pad_token_id)
    assert cfg.layer_norm_eps == 1e-5
    assert cfg.name == "opus-mt-en-fr-a"
    assert (cfg.source_language, cfg.target_language) == ("en", "fr")
    assert cfg.extra["hf_generation"]["bad_words_ids"] == [[hf.pad_token_id]]
    spec = source.tokenizer_spec
    assert (spec.source, spec.target, spec.vocab) == ("source.spm", "target.spm", "vocab.json")
    assert [p.name for p in source.weight_files] == ["config.json", "model.safetensors"]
    b = import_hf(checkpoints["b"][0])
    assert b.model.config.activation == "gelu" and not b.model.config.tie_word_embeddings
    assert b.model.config.extra["language_codes"] == sorted(LANGUAGE_CODES)
    assert [p.name for p in b.weight_files] == ["config.json", "pytorch_model.bin"]
    c = import_hf(checkpoints["c"][0])  # save_pretrained(max_shard_size=...): an index + shards
    assert (checkpoints["c"][0] / "model.safetensors.index.json").is_file()
    assert len(c.weight_files) > 2
    assert c.model.config.activation == "relu" and c.model.config.max_source_positions == 40


def test_languages_from_the_directory_name(checkpoints, tmp_path):
    """Without source_lang/target_lang in tokenizer_config.json, opus-mt's naming is used."""
    directory = tmp_path / "opus-mt-tc-big-en-de"
    shutil.copytree(checkpoints["a"][0], directory)
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    del config["source_lang"], config["target_lang"]
    path.write_text(json.dumps(config), encoding="utf-8")
    cfg = import_hf(directory).model.config
    assert (cfg.name, cfg.source_language, cfg.target_language) == (
        "opus-mt-tc-big-en-de", "en", "de")
    (directory / "tokenizer_config.json").unlink()  # optional: defaults as MarianTokenizer's
    assert import_hf(directory).model.config.unk_token_id == 1


def test_key_map_is_explicit_and_complete():
    key_map = marian_key_map(encoder_layers=2, decoder_layers=1)
    assert key_map["shared.weight"] == "shared.weight"
    assert key_map["encoder.layers.1.self_attn.out_proj.weight"] == \
        "encoder_layers.1.self_attn.out_proj.weight"
    assert key_map["encoder.layers.0.self_attn_layer_norm.bias"] == \
        "encoder_layers.0.self_attn_res.norm.bias"
    assert key_map["decoder.layers.0.encoder_attn.k_proj.bias"] == \
        "decoder_layers.0.cross_attn.k_proj.bias"
    assert key_map["decoder.layers.0.encoder_attn_layer_norm.weight"] == \
        "decoder_layers.0.cross_attn_res.norm.weight"
    assert key_map["decoder.layers.0.final_layer_norm.weight"] == \
        "decoder_layers.0.ffn_res.norm.weight"
    assert key_map["decoder.layers.0.fc2.bias"] == "decoder_layers.0.ffn.fc2.bias"
    # 16 tensors per encoder layer, 26 per decoder layer, shared table, logits bias
    assert len(key_map) == 2 * 16 + 26 + 2
    assert len(set(key_map.values())) == len(key_map)


def teacher_forced_inputs(batch, vocab_size: int, start: int, seed: int = 0):
    """Right-padded random decoder inputs [B,T] starting with the start token, and their mask."""
    gen = torch.Generator().manual_seed(seed)
    rows = batch["input_ids"].shape[0]
    ids = torch.randint(1, vocab_size - 1, (rows, 11), generator=gen)
    ids[:, 0] = start
    mask = torch.ones_like(ids)
    for row in range(rows):
        length = 2 + row % 10
        mask[row, length:] = 0
        ids[row, length:] = start  # the pad token
    return ids, mask


@torch.no_grad()
def reference_logits(model, batch, decoder_ids, decoder_mask) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask).logits


def source_batch(hf_tokenizer, count: int = 12, seed: int = 8):
    texts = mh.corpus(mh.SOURCE_WORDS, count, seed=seed) + ["", "☃ unknown ☃"]
    return hf_tokenizer(texts, return_tensors="pt", padding=True)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_eager_logits_match_transformers(name, checkpoints, hf_tokenizers):
    directory, model = checkpoints[name]
    imported = import_hf(directory).model
    batch = source_batch(hf_tokenizers[name])
    decoder_ids, decoder_mask = teacher_forced_inputs(batch, model.config.vocab_size,
                                                      model.config.decoder_start_token_id)
    expected = reference_logits(model, batch, decoder_ids, decoder_mask)
    with torch.no_grad():
        got = imported(batch["input_ids"], batch["attention_mask"], decoder_ids, decoder_mask)
    keep = decoder_mask.bool()
    diff = float((got[keep] - expected[keep]).abs().max())
    print(f"checkpoint {name}: eager max |logits diff| vs MarianMTModel {diff:.2e}")
    assert diff < TOLERANCE
    assert float(expected[keep].std()) > 0.5  # the comparison is not between near-constants


@pytest.mark.parametrize("name", ["a", "b"])
def test_onnx_logits_match_transformers(name, checkpoints, hf_tokenizers, exported):
    _, model = checkpoints[name]
    runtime = Runtime(exported[name], intra_op_threads=1)
    manifest = json.loads((exported[name] / "model.json").read_text(encoding="utf-8"))
    assert manifest["provenance"]["source_format"] == "hf-marian"
    assert manifest["parity"]["passed"]
    for file in ("source.spm", "target.spm", "vocab.json"):
        assert (exported[name] / file).is_file()
    batch = source_batch(hf_tokenizers[name])
    decoder_ids, decoder_mask = teacher_forced_inputs(batch, model.config.vocab_size,
                                                      model.config.decoder_start_token_id)
    expected = reference_logits(model, batch, decoder_ids, decoder_mask).numpy()
    ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy()
    _, cross = runtime.encode(ids, mask)
    rows, length = decoder_ids.shape
    positions = np.broadcast_to(np.arange(length), (rows, length))
    got, _ = runtime.step(decoder_ids.numpy(), positions, decoder_mask.numpy(), mask,
                          runtime.empty_past(rows), cross)[:2]
    keep = decoder_mask.numpy().astype(bool)
    diff = float(np.abs(got[keep] - expected[keep]).max())
    print(f"checkpoint {name}: ONNX Runtime max |logits diff| vs MarianMTModel {diff:.2e}")
    assert diff < TOLERANCE


# -- search ---------------------------------------------------------------------------------


def hf_generate(model, batch, **settings) -> tuple[list[list[int]], np.ndarray | None]:
    """MarianMTModel.generate's tokens per row (start token, eos and padding removed).

    The checkpoint's generation config is used as opus-mt ships it, bad_words_ids [[pad]]
    included (tfserve.generation never produces the pad token either), except
    forced_eos_token_id, which makes eos the last token at max_length and which tfserve's
    search does not do (test_generate_defaults_of_opus_mt shows what it changes).
    """
    settings = {"forced_eos_token_id": None, **settings}
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                             return_dict_in_generate=True, output_scores=True, **settings)
    eos = model.config.eos_token_id
    rows = []
    for row in out.sequences[:, 1:].tolist():
        rows.append(row[: row.index(eos)] if eos in row else row)
    scores = out.sequences_scores.numpy() if out.get("sequences_scores") is not None else None
    return rows, scores


@pytest.fixture(scope="module")
def search_backends(checkpoints, exported) -> dict[str, object]:
    """Checkpoint a behind both of tfserve's backends."""
    return {"onnxruntime": Runtime(exported["a"], intra_op_threads=1),
            "eager": EagerBackend(import_hf(checkpoints["a"][0]).model)}


@pytest.fixture(scope="module")
def hf_outputs(checkpoints, sources):
    model = checkpoints["a"][1]
    _, batch = sources
    assert model.generation_config.bad_words_ids == [[model.config.pad_token_id]]
    return {"greedy": hf_generate(model, batch, num_beams=1),
            "beam4": hf_generate(model, batch, num_beams=4)}


def tfserve_search(backend, batch, mode: str):
    options = DecodingOptions(max_new_tokens=MAX_NEW_TOKENS,
                              num_beams=4 if mode == "beam4" else 1)
    return generate(backend, batch["input_ids"].numpy(), batch["attention_mask"].numpy(),
                    options)


@pytest.mark.parametrize("backend_name", ["onnxruntime", "eager"])
@pytest.mark.parametrize("mode", ["greedy", "beam4"])
def test_search_matches_generate(mode, backend_name, search_backends, sources, hf_outputs):
    _, batch = sources
    results = tfserve_search(search_backends[backend_name], batch, mode)
    ours = [r[0].token_ids for r in results]
    expected, scores = hf_outputs[mode]
    mismatches = [i for i, (a, b) in enumerate(zip(ours, expected, strict=True)) if a != b]
    assert not mismatches, (f"{len(mismatches)}/50 differ, first {mismatches[0]}: "
                            f"ours {ours[mismatches[0]]} transformers {expected[mismatches[0]]}")
    # meaningful: outputs depend on the input, some end early with eos, some reach the limit
    assert len({tuple(t) for t in ours}) >= 10
    finished = sum(r[0].finished for r in results)
    assert 5 <= finished <= 45


def test_beam_scores_match_generate_defaults(search_backends, sources, hf_outputs):
    _, batch = sources
    results = tfserve_search(search_backends["eager"], batch, "beam4")
    _, scores = hf_outputs["beam4"]
    np.testing.assert_allclose([r[0].score for r in results], scores, atol=1e-4, rtol=0)


def test_beam_differs_from_greedy(hf_outputs):
    """The beam-4 comparison checks more than greedy again."""
    greedy, beam = hf_outputs["greedy"][0], hf_outputs["beam4"][0]
    assert sum(a != b for a, b in zip(greedy, beam, strict=True)) >= 10


def test_generate_defaults_of_opus_mt(checkpoints, sources, search_backends):
    """transformers' generate() with all of the checkpoint's generation defaults (as opus-mt
    ships them: bad_words_ids [[pad]] and forced_eos_token_id = eos) equals tfserve's greedy
    search with max_new_tokens - 1: at max_length transformers replaces the last token by a
    forced eos (ForcedEOSTokenLogitsProcessor), which tfserve does only when asked
    (DecodingOptions.forced_eos, filled from the checkpoint's defaults by
    tfserve.artifacts.generation_defaults; tests/export/test_decoding_controls.py checks it at the
    limit).
    """
    _, model = checkpoints["a"]
    _, batch = sources
    with torch.no_grad():
        sequences = model.generate(**batch, do_sample=False, num_beams=1,
                                   max_new_tokens=MAX_NEW_TOKENS)  # checkpoint defaults
    eos = model.config.eos_token_id
    rows = sequences[:, 1:].tolist()
    assert all(eos in row for row in rows)  # every output ends with eos, forced or not
    expected = [row[: row.index(eos)] for row in rows]
    results = generate(search_backends["eager"], batch["input_ids"].numpy(),
                       batch["attention_mask"].numpy(),
                       DecodingOptions(max_new_tokens=MAX_NEW_TOKENS - 1))
    assert [r[0].token_ids for r in results] == expected
    assert sum(len(t) == MAX_NEW_TOKENS - 1 for t in expected) >= 5  # forced eos happened


# -- parity check on large logits -----------------------------------------------------------


@pytest.fixture(scope="module")
def large_logits(tmp_path_factory, spm_models):
    """A checkpoint with transformers' own initialization at std 0.5 and d_model 128: logits
    reach |20|, where fp32 rounding alone differs by more than 1e-4 between backends."""
    source, target = spm_models
    vocab = mh.build_vocab(source, target)
    directory = tmp_path_factory.mktemp("hf") / "opus-mt-en-fr-large-logits"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = mh.write_checkpoint(directory, source, target, vocab, init_std=0.5,
                                    d_model=128, encoder_attention_heads=4,
                                    decoder_attention_heads=4, encoder_ffn_dim=256,
                                    decoder_ffn_dim=256)
        tokenizer = transformers.MarianTokenizer.from_pretrained(str(directory))
    return directory, model, tokenizer


def test_large_logits_pass_the_parity_check(large_logits, tmp_path):
    directory, model, tokenizer = large_logits
    out = tmp_path / "out"
    assert export_main(["--from-hf", str(directory), "--out", str(out), "--quiet"]) == 0
    parity = json.loads((out / "model.json").read_text(encoding="utf-8"))["parity"]
    abs_diff, rel_diff = parity["max_abs_diff"]["max_logits"], parity["max_rel_diff"]["max_logits"]
    print(f"large logits: max |logit| {parity['max_abs_logits']:.1f}, max |diff| {abs_diff:.3g}, "
          f"relative {rel_diff:.3g}, {parity['tolerance_ratio']:.3g} of the tolerance")
    assert parity["max_abs_logits"] >= 20
    assert parity["passed"] and not parity["failures"]
    assert parity["tolerance"]["atol"] == parity["tolerance"]["rtol"] == 1e-4
    assert parity["tolerance_ratio"] <= 1.0
    # the fields the server reports stay where it reads them
    assert parity["precision"] == "fp32" and parity["device"] == "cpu"
    assert parity["greedy_random_sources"]["agreement"] == 1.0
    assert parity["greedy"]["agreement"] == 1.0
    # and the export is exact where it counts: greedy tokens of transformers
    batch = tokenizer(mh.corpus(mh.SOURCE_WORDS, 20, seed=5), return_tensors="pt",
                      padding=True)
    expected, _ = hf_generate(model, batch, num_beams=1)
    results = tfserve_search(Runtime(out, intra_op_threads=1), batch, "greedy")
    assert [r[0].token_ids for r in results] == expected


def corrupt_output_projection(path: Path, vocab_size: int, factor: float) -> None:
    """Scale one token's column of the graph's output projection [D,V] by `factor`."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path))
    for tensor in graph.graph.initializer:
        weights = numpy_helper.to_array(tensor)
        if weights.ndim == 2 and weights.shape[1] == vocab_size:
            weights = weights.copy()
            weights[:, 5] *= factor
            tensor.CopyFrom(numpy_helper.from_array(weights, tensor.name))
            onnx.save(graph, str(path))
            return
    raise AssertionError(f"no [D,{vocab_size}] output projection among {path}'s initializers")


def test_corrupted_graph_fails_the_parity_check(large_logits, tmp_path, monkeypatch, capsys):
    """One token's output weights 1% off in decoder.onnx: its logits move by about 1% of
    their size, far outside the tolerance, so the export is refused; --force publishes it
    with the failure recorded."""
    import export.graphs as graphs

    directory, model, _ = large_logits
    store = graphs.store_weights_externally

    def corrupt_then_store(staging: Path, files: list[str]) -> None:
        corrupt_output_projection(staging / "decoder.onnx", model.config.vocab_size, 1.01)
        store(staging, files)

    monkeypatch.setattr(graphs, "store_weights_externally", corrupt_then_store)
    out = tmp_path / "out"
    assert export_main(["--from-hf", str(directory), "--out", str(out), "--quiet"]) == 1
    assert not out.exists()
    err = capsys.readouterr().err
    assert "parity check failed, nothing written: logits differ by up to" in err, err
    assert export_main(["--from-hf", str(directory), "--out", str(out), "--quiet",
                        "--force"]) == 0
    parity = json.loads((out / "model.json").read_text(encoding="utf-8"))["parity"]
    print(f"corrupted: max |diff| {parity['max_abs_diff']['max_logits']:.3g}, relative "
          f"{parity['max_rel_diff']['max_logits']:.3g}, {parity['tolerance_ratio']:.3g} of the "
          "tolerance")
    assert not parity["passed"] and parity["tolerance_ratio"] > 1.0
    assert parity["failures"][0].startswith("logits differ by up to")


# -- refusals -------------------------------------------------------------------------------


def run_cli(directory: Path, tmp_path: Path, capsys) -> tuple[int, str]:
    code = export_main(["--from-hf", str(directory), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    return code, err


def test_cli_refuses_a_non_marian_checkpoint(checkpoints, tmp_path, capsys):
    directory = hh.copy_checkpoint(checkpoints, tmp_path, "a")
    hh.edit_json(directory / "config.json", model_type="bert", architectures=["BertModel"])
    code, err = run_cli(directory, tmp_path, capsys)
    assert code == 2
    assert err.count("\n") == 1
    assert "unsupported model_type 'bert'" in err and "config.json" in err
    assert "supported model types: " in err and "marian (MarianMTModel)" in err
    assert supported_model_types() == ["bart", "m2m_100", "marian", "mbart", "mt5", "t5"]


@pytest.mark.parametrize("missing", ["directory", "config.json", "model.safetensors",
                                     "source.spm", "target.spm", "vocab.json"])
def test_cli_names_the_missing_file(missing, checkpoints, tmp_path, capsys):
    directory = hh.copy_checkpoint(checkpoints, tmp_path, "a")
    if missing == "directory":
        shutil.rmtree(directory)
    else:
        (directory / missing).unlink()
    code, err = run_cli(directory, tmp_path, capsys)
    assert code == 2
    assert err.startswith("python -m export: error:") and err.count("\n") == 1
    named = str(directory) if missing in ("directory", "model.safetensors") else \
        str(directory / missing)
    assert named in err
    if missing == "model.safetensors":
        assert "no weights found" in err and "pytorch_model.bin" in err


@pytest.mark.parametrize("changes, message", [
    (dict(normalize_before=True), "normalize_before"),
    (dict(add_final_layer_norm=True), "add_final_layer_norm"),
    (dict(layernorm_embedding=True), "layernorm_embedding"),
    (dict(normalize_embedding=True), "normalize_embedding"),
    (dict(static_position_embeddings=False), "static_position_embeddings"),
    (dict(decoder_attention_heads=4), "encoder_attention_heads (3) != decoder_attention_heads"),
    (dict(decoder_ffn_dim=48), "encoder_ffn_dim (40) != decoder_ffn_dim (48)"),
    (dict(decoder_vocab_size=500), "decoder_vocab_size"),
    (dict(activation_function="gelu_new"), "activation_function 'gelu_new'"),
    (dict(d_model=25, encoder_attention_heads=5, decoder_attention_heads=5), "even d_model"),
    (dict(eos_token_id=3), "eos_token_id is 3 but vocab.json"),
    (dict(architectures=["MarianForCausalLM"]), "MarianForCausalLM"),
    (dict(encoder_layers=3), "missing tensor(s) encoder.layers.2"),
    (dict(encoder_ffn_dim=48, decoder_ffn_dim=48), "ffn.fc1.weight has shape"),
    (dict(decoder_layers=0), "decoder_layers must be a positive integer, got 0"),
])
def test_unsupported_config_is_refused_naming_the_field(changes, message, checkpoints,
                                                         tmp_path):
    directory = hh.copy_checkpoint(checkpoints, tmp_path, "a")
    hh.edit_json(directory / "config.json", **changes)
    with pytest.raises(SourceError, match=None) as info:
        import_hf(directory)
    assert message in str(info.value)


def rewrite_weights(directory: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    state = load_file(str(path))
    change(state)
    save_file(state, str(path), metadata={"format": "pt"})


def test_separate_embedding_tables_are_refused(checkpoints, tmp_path):
    directory = hh.copy_checkpoint(checkpoints, tmp_path, "a")
    hh.edit_json(directory / "config.json", share_encoder_decoder_embeddings=False)

    def split(state):
        table = state.pop("model.shared.weight")
        state["model.encoder.embed_tokens.weight"] = table
        state["model.decoder.embed_tokens.weight"] = table + 1.0

    rewrite_weights(directory, split)
    with pytest.raises(SourceError, match="share_encoder_decoder_embeddings is false and "
                                          "decoder.embed_tokens.weight differs"):
        import_hf(directory)


def test_same_tables_without_sharing_are_accepted(checkpoints, tmp_path):
    directory, model = checkpoints["a"]
    copy = hh.copy_checkpoint(checkpoints, tmp_path, "a")
    hh.edit_json(copy / "config.json", share_encoder_decoder_embeddings=False)

    def split(state):
        table = state.pop("model.shared.weight")
        state["model.encoder.embed_tokens.weight"] = table
        state["model.decoder.embed_tokens.weight"] = table.clone()

    rewrite_weights(copy, split)
    imported = import_hf(copy).model
    torch.testing.assert_close(imported.shared.weight, model.model.shared.weight, rtol=0, atol=0)


@pytest.mark.parametrize("extra_key, message", [
    ("model.encoder.layer_norm.weight", "no place in tfserve's model: encoder.layer_norm.weight"),
    ("model.encoder.embed_positions.weight", "not Marian's sinusoidal table"),
    ("lm_head.weight", "tie_word_embeddings is true but lm_head.weight differs"),
])
def test_unexpected_or_conflicting_tensors_are_refused(extra_key, message, checkpoints,
                                                       tmp_path):
    directory = hh.copy_checkpoint(checkpoints, tmp_path, "a")
    shape = {"model.encoder.layer_norm.weight": (24,),
             "model.encoder.embed_positions.weight": (64, 24)}.get(extra_key)

    def add(state):
        tensor = torch.randn(shape) if shape else state["model.shared.weight"] * 2
        state[extra_key] = tensor

    rewrite_weights(directory, add)
    with pytest.raises(SourceError) as info:
        import_hf(directory)
    assert message in str(info.value)


def test_unreadable_pytorch_bin_is_refused(checkpoints, tmp_path):
    directory = hh.copy_checkpoint(checkpoints, tmp_path, "b")
    (directory / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(SourceError, match="cannot read weights file .*pytorch_model.bin"):
        import_hf(directory)


def test_separate_vocabularies_are_refused(checkpoints, tmp_path):
    directory = hh.copy_checkpoint(checkpoints, tmp_path, "a")
    shutil.copy(directory / "vocab.json", directory / "target_vocab.json")
    with pytest.raises(SourceError, match="separate source/target vocabularies"):
        import_hf(directory)
