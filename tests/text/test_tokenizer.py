"""Tokenizer: eos, round trips, padding, unknown characters, special tokens, vocab mode, the
registry of kinds.

The tests run against a tiny SentencePiece model trained in the session (always) and against
the demo checkpoint's tokenizer when tfserve/demo/checkpoint/tokenizer.json exists.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tfserve.demo.data import english, french
from tfserve.text.tokenizer import (
    KINDS,
    TOKENIZER_KINDS,
    Tokenizer,
    TokenizerError,
    TokenizerSpec,
)
from tfserve.text.tokenizers.sentencepiece import (
    SentencePieceTokenizer,
    SentencePieceVocabTokenizer,
)

DEMO_DIR = Path(__file__).resolve().parents[2] / "tfserve" / "demo" / "checkpoint"
DEMO_SPEC = DEMO_DIR / "tokenizer.json"
NUMBERS = [0, 7, 16, 21, 71, 80, 91, 101, 999, 1234, 80_080, 171_717, 999_999]
UNKNOWN_TEXTS = ["中文", "数字 😀", "one 🙂 two", "☃", "\u200b", "Ω≈ç√"]


def _tiny(directory: Path) -> Tokenizer:
    return Tokenizer(directory, TokenizerSpec(source="source.spm"))


@pytest.fixture(params=["tiny", "demo"])
def tokenizer(request, tiny_spm_dir: Path) -> Tokenizer:
    if request.param == "tiny":
        return _tiny(tiny_spm_dir)
    if not DEMO_SPEC.is_file():
        pytest.skip("no demo checkpoint tokenizer")
    spec = TokenizerSpec.from_dict(json.loads(DEMO_SPEC.read_text(encoding="utf-8")))
    return Tokenizer(DEMO_DIR, spec)


def test_ids_and_specials(tokenizer: Tokenizer) -> None:
    assert (tokenizer.pad_id, tokenizer.eos_id, tokenizer.unk_id) == (0, 1, 2)
    assert tokenizer.vocab_size == tokenizer.source_spm.GetPieceSize()
    assert tokenizer.id_to_token(1) == "</s>"


def test_encode_appends_eos(tokenizer: Tokenizer) -> None:
    for text in ["one hundred", "cent", ""]:
        ids = tokenizer.encode(text)
        assert ids[-1] == tokenizer.eos_id, f"{text!r} -> {ids}"
        assert tokenizer.eos_id not in ids[:-1]
        assert tokenizer.encode_target(text)[-1] == tokenizer.eos_id
    assert tokenizer.encode("") == [tokenizer.eos_id]


@pytest.mark.parametrize("number", NUMBERS)
def test_round_trip_on_demo_phrases(tokenizer: Tokenizer, number: int) -> None:
    for text in (english(number), french(number)):
        ids = tokenizer.encode(text)
        assert tokenizer.unk_id not in ids, f"{text!r} has unknown pieces: {ids}"
        assert tokenizer.decode(ids) == text


def test_batch_encode_pads(tokenizer: Tokenizer) -> None:
    texts = ["one", "two hundred and thirty-four thousand", "", "cinq cent"]
    input_ids, attention_mask = tokenizer.encode_batch(texts)
    expected = [tokenizer.encode(t) for t in texts]
    width = max(len(e) for e in expected)
    assert input_ids.shape == attention_mask.shape == (len(texts), width)
    assert input_ids.dtype == attention_mask.dtype == np.int64
    for row, ids in enumerate(expected):
        assert input_ids[row, : len(ids)].tolist() == ids
        assert (input_ids[row, len(ids) :] == tokenizer.pad_id).all()
        assert attention_mask[row].tolist() == [1] * len(ids) + [0] * (width - len(ids))


@pytest.mark.parametrize("text", UNKNOWN_TEXTS)
def test_unknown_characters_map_to_unk(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids[-1] == tokenizer.eos_id
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    if text.strip("\u200b"):
        assert tokenizer.unk_id in ids, f"{text!r} -> {ids}"
    # decoding drops each unk (no "⁇" or "<unk>" in the text) and keeps the known words
    decoded = tokenizer.decode(ids)
    assert decoded.split() == [word for word in text.split() if word.isascii()], decoded
    assert decoded == tokenizer.decode([i for i in ids if i != tokenizer.unk_id])
    input_ids, _ = tokenizer.encode_batch([text, "one"])
    assert input_ids.shape[0] == 2


def test_decode_drops_special_tokens(tokenizer: Tokenizer) -> None:
    body = tokenizer.encode("three hundred")[:-1]
    specials = [tokenizer.pad_id, tokenizer.eos_id, tokenizer.unk_id, tokenizer.decoder_start_id]
    noisy = [tokenizer.decoder_start_id, *body[:1], tokenizer.unk_id, *body[1:],
             tokenizer.eos_id, tokenizer.pad_id, tokenizer.pad_id]
    assert tokenizer.decode(noisy) == "three hundred"
    assert tokenizer.decode(specials) == ""
    assert tokenizer.decode(np.array(noisy, dtype=np.int64)) == "three hundred"


def test_max_length(tokenizer: Tokenizer) -> None:
    texts = ["one", "nine hundred ninety-nine thousand nine hundred ninety-nine", "two"]
    long_len = len(tokenizer.encode(texts[1]))
    with pytest.raises(TokenizerError, match=r"texts\[1\]"):
        tokenizer.encode_batch(texts, max_length=long_len - 1)
    input_ids, attention_mask = tokenizer.encode_batch(texts, max_length=4, truncate=True)
    assert input_ids.shape == (3, 4)
    assert input_ids[1].tolist() == tokenizer.encode(texts[1])[:3] + [tokenizer.eos_id]
    assert attention_mask[1].tolist() == [1, 1, 1, 1]
    assert input_ids[0].tolist()[: len(tokenizer.encode("one"))] == tokenizer.encode("one")
    # exactly at the limit is fine
    tokenizer.encode_batch(texts, max_length=long_len)


@pytest.mark.parametrize("bad", [123, None, b"one", ["one"]])
def test_non_string_input(tokenizer: Tokenizer, bad) -> None:
    with pytest.raises(TokenizerError, match="string"):
        tokenizer.encode(bad)
    with pytest.raises(TokenizerError, match="string"):
        tokenizer.encode_batch(["one", bad])


def test_empty_batch(tokenizer: Tokenizer) -> None:
    with pytest.raises(TokenizerError):
        tokenizer.encode_batch([])


# -- vocab mode ----------------------------------------------------------------------------------


def _write_vocab(directory: Path, tok: Tokenizer, dropped: set[str]) -> dict[str, int]:
    """vocab.json: specials at 0/1/2, every other piece in reverse order, `dropped` left out."""
    sp = tok.source_spm
    pieces = [sp.IdToPiece(i) for i in range(sp.GetPieceSize())]
    specials = ["<pad>", "</s>", "<unk>"]
    assert pieces[:3] == specials
    others = [p for p in reversed(pieces[3:]) if p not in dropped]
    vocab = {p: i for i, p in enumerate(specials + others)}
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    return vocab


def test_vocab_mode_maps_pieces_through_vocab(tiny_spm_dir: Path) -> None:
    native = _tiny(tiny_spm_dir)
    dropped = {p for p in native.source_spm.EncodeAsPieces("seven") if p != "▁"}
    assert dropped, "the tiny model should split 'seven' into pieces"
    vocab = _write_vocab(tiny_spm_dir, native, dropped)
    tok = Tokenizer(tiny_spm_dir, TokenizerSpec(source="source.spm", vocab="vocab.json"))
    assert tok.vocab_size == len(vocab)

    text = "three hundred and forty-two"
    pieces = native.source_spm.EncodeAsPieces(text)
    ids = tok.encode(text)
    assert ids == [vocab[p] for p in pieces] + [tok.eos_id]
    assert ids != native.encode(text), "the vocab's different order should change the ids"
    assert tok.decode(ids) == text

    ids = tok.encode("seven 中文")
    assert tok.unk_id in ids
    expected = [vocab.get(p, tok.unk_id) for p in native.source_spm.EncodeAsPieces("seven 中文")]
    assert ids == expected + [tok.eos_id]
    assert tok.id_to_token(vocab[pieces[0]]) == pieces[0]
    assert tok.id_to_token(10_000) == "<unk>"


def test_vocab_mode_errors(tiny_spm_dir: Path) -> None:
    spec = TokenizerSpec(source="source.spm", vocab="vocab.json")
    with pytest.raises(TokenizerError, match="vocab.json"):
        Tokenizer(tiny_spm_dir, spec)  # missing
    (tiny_spm_dir / "vocab.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match="vocab.json"):
        Tokenizer(tiny_spm_dir, spec)
    (tiny_spm_dir / "vocab.json").write_text('{"a": "1"}', encoding="utf-8")
    with pytest.raises(TokenizerError, match="vocab.json"):
        Tokenizer(tiny_spm_dir, spec)


# -- files and spec --------------------------------------------------------------------------------


def test_missing_or_corrupt_sentencepiece_model(tmp_path: Path) -> None:
    spec = TokenizerSpec(source="source.spm")
    with pytest.raises(TokenizerError, match="source.spm"):
        Tokenizer(tmp_path, spec)
    (tmp_path / "source.spm").write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(TokenizerError, match="source.spm"):
        Tokenizer(tmp_path, spec)


def test_special_id_outside_vocabulary(tiny_spm_dir: Path) -> None:
    with pytest.raises(TokenizerError, match="eos_token_id"):
        Tokenizer(tiny_spm_dir, TokenizerSpec(source="source.spm", eos_token_id=100_000))


def test_spec_round_trip_and_unknown_field() -> None:
    spec = TokenizerSpec(source="a.spm", target="b.spm", vocab="v.json", extra_special_ids=[5])
    assert TokenizerSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.files() == ["a.spm", "b.spm", "v.json"]
    with pytest.raises(TokenizerError, match="bos_token_id"):
        TokenizerSpec.from_dict({"source": "a.spm", "bos_token_id": 3})


# -- kinds ---------------------------------------------------------------------------------------


def test_every_registered_kind_is_a_tokenizer_class() -> None:
    for kind, entry in TOKENIZER_KINDS.items():
        cls = entry.load()
        assert entry.kind == kind and issubclass(cls, Tokenizer) and cls is not Tokenizer, kind
    assert KINDS == tuple(TOKENIZER_KINDS)


def test_construction_builds_the_class_of_the_kind_and_mode(tiny_spm_dir: Path) -> None:
    native = _tiny(tiny_spm_dir)
    assert type(native) is SentencePieceTokenizer
    _write_vocab(tiny_spm_dir, native, set())
    vocab = Tokenizer(tiny_spm_dir, TokenizerSpec(source="source.spm", vocab="vocab.json"))
    assert type(vocab) is SentencePieceVocabTokenizer and isinstance(vocab, Tokenizer)


@pytest.mark.parametrize("kind", ["wordpiece", "", None, "SentencePiece"])
def test_unknown_kind_names_the_field_and_the_known_kinds(tiny_spm_dir: Path, kind) -> None:
    message = r"tokenizer\.kind must be one of sentencepiece, hf-json, t5-spiece, spm-vocab"
    with pytest.raises(TokenizerError, match=message):
        TokenizerSpec.from_dict({"source": "source.spm", "kind": kind})
    with pytest.raises(TokenizerError, match=message):
        Tokenizer(tiny_spm_dir, TokenizerSpec(source="source.spm", kind=kind))


def test_spiece_model_reads_what_sentencepiece_reads(tiny_spm_bytes: bytes) -> None:
    """tfserve's own ModelProto messages (any protobuf runtime) read a model file's pieces,
    trainer and normalizer fields as sentencepiece's generated module does, and keep the
    fields they do not declare when the model is written again."""
    sentencepiece_model_pb2 = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    from tfserve.text.tokenizers.spiece_model import parse_model

    ours = parse_model(tiny_spm_bytes)
    theirs = sentencepiece_model_pb2.ModelProto()
    theirs.ParseFromString(tiny_spm_bytes)
    assert [(p.piece, p.score, p.type) for p in ours.pieces] == \
        [(p.piece, p.score, p.type) for p in theirs.pieces]
    for name in ("model_type", "unk_id", "eos_piece"):
        assert getattr(ours.trainer_spec, name) == getattr(theirs.trainer_spec, name), name
    assert ours.normalizer_spec.precompiled_charsmap == \
        theirs.normalizer_spec.precompiled_charsmap
    ours.pieces.add(piece="\u2581zz", score=-99.0)
    theirs.pieces.add(piece="\u2581zz", score=-99.0)
    again = sentencepiece_model_pb2.ModelProto()
    again.ParseFromString(ours.SerializeToString())
    assert again == theirs
    with pytest.raises(Exception, match="(?i)error|truncated|parse"):
        parse_model(b"\x0a\xff")
