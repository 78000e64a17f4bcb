"""Text <-> token ids, in the modes the artifacts name (`TokenizerSpec.kind`).

- "sentencepiece", the SentencePiece modes with the special-token conventions of
  Marian-style translators:
  - native: one SentencePiece model (or one per side) whose piece ids are the model's ids;
  - vocab: SentencePiece only splits text into pieces, and a vocab.json maps pieces to the
    model's ids (Marian: source.spm / target.spm + one shared vocab.json); pieces missing
    from the vocab become unk.
  Source sequences end with eos (appended here).
- "hf-json": a Hugging Face `tokenizer.json` run by the `tokenizers` library (what
  transformers' fast tokenizers run): its normalizer, pre-tokenizer and model split the text,
  its special tokens (added tokens marked special) are matched in the text as transformers
  does, and its post-processor adds what the model expects around a source (T5: `</s>`).
- "t5-spiece": a T5 `spiece.model` without a tokenizer.json, mapped as transformers'
  T5Tokenizer maps it: the SentencePiece pieces and scores as a Unigram model, `extra_ids`
  sentinels `<extra_id_N>` on top of the vocabulary (`<extra_id_0>` last), `</s>` appended,
  no bos; run by `tokenizers` like "hf-json".
- "spm-vocab": M2M100's SentencePiece model + vocab.json with added tokens matched in the
  text, as transformers' M2M100Tokenizer does (`tfserve.text.spm_vocab`).

Multilingual models (`TokenizerSpec.languages`, `tfserve.text.languages`) put a source language
token around the text: `encode(text, source_language)` tokenizes the text alone (a
tokenizer.json's own post-processor holds the language it was saved with) and frames it
with the request's language token and eos, where the family puts them.

Decoding drops special tokens (language tokens included). Imports numpy, sentencepiece and
(for the tokenizer.json modes) tokenizers only, so it is part of the serving path.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

from tfserve.text.languages import LanguageConventions, LanguageError
from tfserve.text.spm_vocab import AddedToken, SpmVocabError, SpmVocabText

WORD_BOUNDARY = "\u2581"  # SentencePiece's word-boundary mark '▁', a space in decoded text
KINDS = ("sentencepiece", "hf-json", "t5-spiece", "spm-vocab")
FRAME_PROBE = "a"  # a text whose ids show what a tokenizer adds around a text


class TokenizerError(ValueError):
    """Bad tokenizer files or input; the message names the file or field."""


@dataclass
class TokenizerSpec:
    """How a tokenizer is stored in an artifacts or checkpoint directory (goes in model.json)."""

    # the file of every kind: the source SentencePiece model, the tokenizer.json (hf-json)
    # or the spiece.model (t5-spiece)
    source: str = "source.spm"
    target: str | None = None  # None: the source model serves both sides
    vocab: str | None = None  # None: native mode, SentencePiece ids are model ids
    pad_token_id: int = 0
    eos_token_id: int = 1
    unk_token_id: int = 2
    decoder_start_token_id: int = 0
    extra_special_ids: list[int] = field(default_factory=list)
    kind: str = "sentencepiece"  # one of KINDS
    extra_ids: int = 0  # t5-spiece: the number of <extra_id_N> sentinels
    # spm-vocab: the tokens matched in the text (AddedToken dicts)
    added_tokens: list[dict[str, Any]] = field(default_factory=list)
    # multilingual models: LanguageConventions as a dict (None: no languages)
    languages: dict[str, Any] | None = None

    def files(self) -> list[str]:
        return [f for f in (self.source, self.target, self.vocab) if f]

    def to_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        # older readers know neither field: written only where a model has them
        for name in ("added_tokens", "languages"):
            if not data[name]:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenizerSpec:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise TokenizerError(f"unknown tokenizer field(s): {', '.join(unknown)}")
        kind = data.get("kind", "sentencepiece")
        if kind not in KINDS:
            raise TokenizerError(f"tokenizer kind must be one of {KINDS}, got {kind!r}")
        return cls(**data)


def _load_spm(path: Path) -> spm.SentencePieceProcessor:
    if not path.is_file():
        raise TokenizerError(f"SentencePiece model not found: {path}")
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(path.read_bytes())
    except (RuntimeError, OSError) as exc:
        raise TokenizerError(f"cannot load SentencePiece model {path}: {exc}") from exc
    return processor


class HFText:
    """A `tokenizers.Tokenizer`: encoding with its post-processor, decoding without special
    tokens, as transformers' fast tokenizers run it (`tokenizer(text).input_ids`,
    `tokenizer.decode(ids, skip_special_tokens=True)`)."""

    def __init__(self, tokenizer: Any, where: Path) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        if self.vocab_size < 1:
            raise TokenizerError(f"{where} has an empty vocabulary")
        # the added tokens marked special (T5: <pad>, </s>, <unk>, the <extra_id_N>)
        self.special_ids = {int(i) for i, token in tokenizer.get_added_tokens_decoder().items()
                            if token.special}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)


def load_hf_json(path: Path) -> Any:
    """A tokenizer.json as a `tokenizers.Tokenizer`; TokenizerError naming the file."""
    from tokenizers import Tokenizer as HFTokenizer

    if not path.is_file():
        raise TokenizerError(f"tokenizer file not found: {path}")
    try:
        return HFTokenizer.from_str(path.read_text(encoding="utf-8"))
    except Exception as exc:  # OSError, UnicodeDecodeError, tokenizers' own
        raise TokenizerError(f"cannot load tokenizer file {path}: "
                             f"{str(exc).splitlines()[0] if str(exc) else exc!r}") from exc


def t5_from_spiece(path: Path, extra_ids: int) -> Any:
    """A T5 spiece.model as the `tokenizers.Tokenizer` transformers' T5Tokenizer builds from it
    (transformers 5: T5Tokenizer.__init__ and the T5 SentencePiece conversion).

    The pieces and their scores as a Unigram model (unk at the model's unk id, no byte
    fallback), then `extra_ids` sentinels <extra_id_{extra_ids-1}> .. <extra_id_0> at the
    following ids; the model's precompiled normalizer; whitespace split and '▁' word marks;
    the model's control pieces (<pad>, </s>), its unk piece, its user-defined pieces and the
    sentinels matched in the text and dropped from decoded text as special tokens; </s>
    appended.
    """
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import Unigram

    if not path.is_file():
        raise TokenizerError(f"SentencePiece model not found: {path}")
    if isinstance(extra_ids, bool) or not isinstance(extra_ids, int) or extra_ids < 0:
        raise TokenizerError(f"tokenizer extra_ids must be an integer >= 0, got {extra_ids!r}")
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as exc:  # protobuf's DecodeError, OSError
        raise TokenizerError(f"cannot load SentencePiece model {path}: {exc}") from exc
    if not proto.pieces:
        raise TokenizerError(f"cannot load SentencePiece model {path}: no pieces")
    if proto.trainer_spec.model_type != 1:  # UNIGRAM
        raise TokenizerError(f"{path} is not a unigram SentencePiece model (T5's kind)")
    vocab = [(piece.piece, piece.score) for piece in proto.pieces]
    sentinels = [f"<extra_id_{i}>" for i in range(extra_ids - 1, -1, -1)]
    vocab += [(token, 0.0) for token in sentinels]
    tokenizer = HFTokenizer(Unigram(vocab, unk_id=proto.trainer_spec.unk_id,
                                    byte_fallback=False))
    charsmap = proto.normalizer_spec.precompiled_charsmap
    if charsmap:
        tokenizer.normalizer = normalizers.Precompiled(charsmap)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement=WORD_BOUNDARY, prepend_scheme="always", split=True),
    ])
    tokenizer.decoder = decoders.Metaspace(replacement=WORD_BOUNDARY, prepend_scheme="always",
                                           split=True)
    # sentencepiece ModelProto.SentencePiece.Type: transformers lists the control and
    # user-defined pieces (MADLAD's <2xx>) among T5Tokenizer's special tokens
    unknown, control, user_defined = 2, 3, 4
    special = [p.piece for p in proto.pieces if p.type in (unknown, control, user_defined)]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t in special + sentinels])
    eos = proto.trainer_spec.eos_piece or "</s>"
    eos_id = tokenizer.token_to_id(eos)
    if eos_id is None:
        raise TokenizerError(f"{path} has no eos piece {eos!r}")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=["$A", eos], pair=["$A", eos, "$B", eos], special_tokens=[(eos, eos_id)])
    return tokenizer


class Tokenizer:
    """Text <-> token ids for one translation direction."""

    def __init__(self, directory: str | Path, spec: TokenizerSpec) -> None:
        directory = Path(directory)
        self.directory = directory
        self.spec = spec
        self.piece_to_id: dict[str, int] | None = None
        self.id_to_piece: dict[int, str] | None = None
        self.hf: HFText | None = None
        if spec.kind not in KINDS:
            raise TokenizerError(f"tokenizer kind must be one of {KINDS}, got {spec.kind!r}")
        self.spm_vocab: SpmVocabText | None = None
        if spec.kind == "spm-vocab":
            self._load_spm_vocab(directory, spec)
        elif spec.kind != "sentencepiece":
            path = directory / spec.source
            loaded = (load_hf_json(path) if spec.kind == "hf-json"
                      else t5_from_spiece(path, spec.extra_ids))
            self.hf = HFText(loaded, path)
            self.source_spm = self.target_spm = None
            self.vocab_size = self.hf.vocab_size
        else:
            self._load_sentencepiece(directory, spec)
        self.pad_id = spec.pad_token_id
        self.eos_id = spec.eos_token_id
        self.unk_id = spec.unk_token_id
        self.decoder_start_id = spec.decoder_start_token_id
        for name in ("pad_token_id", "eos_token_id", "unk_token_id", "decoder_start_token_id"):
            value = getattr(spec, name)
            if not 0 <= value < self.vocab_size:
                raise TokenizerError(
                    f"tokenizer {name}={value} is outside the vocabulary [0, {self.vocab_size})"
                )
        self.special_ids = {self.pad_id, self.eos_id, self.unk_id, self.decoder_start_id,
                            *spec.extra_special_ids}
        if self.hf is not None:
            self.special_ids |= self.hf.special_ids
        if self.spm_vocab is not None:
            self.special_ids |= self.spm_vocab.special_ids
        self.languages: LanguageConventions | None = None
        if spec.languages is not None:
            try:
                self.languages = LanguageConventions.from_dict(spec.languages)
            except (TypeError, ValueError) as exc:
                raise TokenizerError(f"tokenizer {exc}") from exc
            for code, token_id in self.languages.codes.items():
                if token_id >= self.vocab_size:
                    raise TokenizerError(f"tokenizer languages: {code!r} has token id "
                                         f"{token_id}, outside the vocabulary "
                                         f"[0, {self.vocab_size})")
            # a language token is never part of a translation's text
            self.special_ids |= set(self.languages.codes.values())
        self._frame = self._own_frame()

    def _load_spm_vocab(self, directory: Path, spec: TokenizerSpec) -> None:
        if not spec.vocab:
            raise TokenizerError("tokenizer kind spm-vocab needs a vocab file")
        try:
            added = [AddedToken.from_dict(token) for token in spec.added_tokens]
            self.spm_vocab = SpmVocabText(directory / spec.source, directory / spec.vocab,
                                          added, spec.unk_token_id)
        except SpmVocabError as exc:
            raise TokenizerError(str(exc)) from exc
        self.source_spm = self.target_spm = self.spm_vocab.processor
        self.vocab_size = self.spm_vocab.vocab_size
        if spec.languages:
            codes = spec.languages.get("codes") if isinstance(spec.languages, dict) else None
            if isinstance(codes, dict) and codes:
                ids = [i for i in codes.values() if isinstance(i, int)]
                self.vocab_size = max([self.vocab_size, *(i + 1 for i in ids)])

    def _own_frame(self) -> tuple[list[int], list[int]]:
        """What encoding adds around a text's ids when the model has no languages: eos
        after it (SentencePiece modes), or what a tokenizer.json's post-processor adds
        (T5: </s> after; BART: <s> before and </s> after)."""
        if self.hf is None:
            return [], [self.eos_id]
        text = self.hf.tokenizer.encode(FRAME_PROBE, add_special_tokens=False).ids
        full = self.hf.encode(FRAME_PROBE)
        for start in range(len(full) - len(text) + 1):
            if full[start:start + len(text)] == text:
                return full[:start], full[start + len(text):]
        raise TokenizerError(f"{self.directory / self.spec.source}: its post-processor "
                             "changes the text's tokens; tfserve places only tokens around "
                             "them")

    def _load_sentencepiece(self, directory: Path, spec: TokenizerSpec) -> None:
        self.source_spm = _load_spm(directory / spec.source)
        self.target_spm = _load_spm(directory / spec.target) if spec.target else self.source_spm
        if spec.vocab:
            vocab_path = directory / spec.vocab
            try:
                vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
            except FileNotFoundError as exc:
                raise TokenizerError(f"vocab file not found: {vocab_path}") from exc
            except (OSError, json.JSONDecodeError) as exc:
                raise TokenizerError(f"cannot read vocab file {vocab_path}: {exc}") from exc
            if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
                raise TokenizerError(f"{vocab_path} must map pieces to integer ids")
            self.piece_to_id = vocab
            self.id_to_piece = {i: p for p, i in vocab.items()}
            self.vocab_size = max(vocab.values()) + 1
        else:
            self.vocab_size = self.source_spm.GetPieceSize()

    # -- encoding -------------------------------------------------------------------------

    def _ids(self, processor: spm.SentencePieceProcessor, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"text must be a string, got {type(text).__name__}")
        if self.piece_to_id is None:
            return list(processor.EncodeAsIds(text))
        prefix: list[int] = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            # a target-language code (multilingual opus-mt: ">>fr<< text") is one vocab
            # token, not SentencePiece input, as in MarianTokenizer
            prefix = [self.piece_to_id.get(text[: end + 2], self.unk_id)]
            text = text[end + 2 :]
        return prefix + [self.piece_to_id.get(p, self.unk_id)
                         for p in processor.EncodeAsPieces(text)]

    def encode(self, text: str, source_language: str | None = None) -> list[int]:
        """Source ids of one text: its tokens in their frame (eos after them; a
        multilingual model's source language token where its family puts it, the
        checkpoint's default language when none is given)."""
        before, after = self.frame(source_language)
        return before + self.encode_text(text) + after

    def encode_text(self, text: str) -> list[int]:
        """The ids of one text's own tokens, no eos or other token added."""
        if not isinstance(text, str):
            raise TokenizerError(f"text must be a string, got {type(text).__name__}")
        if self.hf is not None:
            return list(self.hf.tokenizer.encode(text, add_special_tokens=False).ids)
        if self.spm_vocab is not None:
            return self.spm_vocab.encode(text)
        return self._ids(self.source_spm, text)

    def frame(self, source_language: str | None = None) -> tuple[list[int], list[int]]:
        """The ids that go before and after a source text's own ids. A source_language
        of a model without languages is refused naming the field (LanguageError, a
        ValueError)."""
        if self.languages is None:
            if source_language:
                raise LanguageError("source_language is not accepted: this model has no "
                                    "language codes")
            return list(self._frame[0]), list(self._frame[1])
        return self.languages.frame(self.languages.source_id(source_language), self.eos_id)

    def encode_target(self, text: str) -> list[int]:
        """Target-side ids of one text, ending with eos (training labels, references)."""
        if self.hf is not None and self.languages is None:
            return self._hf_ids(text)
        if self.hf is not None or self.spm_vocab is not None:
            return self.encode_text(text) + [self.eos_id]
        return self._ids(self.target_spm, text) + [self.eos_id]

    def _hf_ids(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"text must be a string, got {type(text).__name__}")
        assert self.hf is not None
        return self.hf.encode(text)

    def pad_batch(self, sequences: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Right-pad id lists into input_ids and attention_mask, both int64 [B,S]."""
        if not sequences:
            raise TokenizerError("cannot pad an empty batch")
        width = max(len(s) for s in sequences)
        input_ids = np.full((len(sequences), width), self.pad_id, dtype=np.int64)
        attention_mask = np.zeros((len(sequences), width), dtype=np.int64)
        for row, seq in enumerate(sequences):
            input_ids[row, : len(seq)] = seq
            attention_mask[row, : len(seq)] = 1
        return input_ids, attention_mask

    def encode_batch(
        self, texts: Sequence[str], max_length: int | None = None, truncate: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Encode and right-pad texts; input_ids and attention_mask int64 [B,S].

        A text longer than max_length tokens (eos included) is an error naming its index,
        unless truncate=True, which keeps the first max_length - 1 tokens and the eos.
        """
        if isinstance(texts, str):
            raise TokenizerError("texts must be a list of strings, got one string")
        if max_length is not None and max_length < 1:
            raise TokenizerError(f"max_length must be >= 1, got {max_length}")
        sequences = [self.encode(t) for t in texts]
        if max_length is not None:
            for index, seq in enumerate(sequences):
                if len(seq) > max_length:
                    if not truncate:
                        raise TokenizerError(
                            f"texts[{index}] is {len(seq)} tokens, over the limit of {max_length}"
                        )
                    sequences[index] = seq[: max_length - 1] + [self.eos_id]
        return self.pad_batch(sequences)

    # -- decoding -------------------------------------------------------------------------

    def decode(self, ids: Sequence[int]) -> str:
        """Target text of ids, special tokens dropped."""
        kept = [int(i) for i in ids if int(i) not in self.special_ids]
        if self.spm_vocab is not None:
            return self.spm_vocab.decode(kept)
        if self.hf is not None:
            # ids the model has beyond the tokenizer's vocabulary (T5 pads it to a multiple
            # of 128) have no text
            return self.hf.decode([i for i in kept if 0 <= i < self.vocab_size])
        if self.id_to_piece is None:
            kept = [i for i in kept if 0 <= i < self.vocab_size]
            return self.target_spm.DecodeIds(kept).strip()
        pieces = [self.id_to_piece[i] for i in kept if i in self.id_to_piece]
        # A shared vocab.json holds source pieces that target.spm does not know, and
        # SentencePiece copies an unknown piece verbatim, word-boundary marks included
        # ('▁w5▁w6'); every mark left is a space, as MarianTokenizer.convert_tokens_to_string
        # makes it. strip: a dropped unk can leave a space at either end.
        text = self.target_spm.DecodePieces(pieces).replace(WORD_BOUNDARY, " ")
        return text.strip()

    def id_to_token(self, token_id: int) -> str:
        if self.spm_vocab is not None:
            return self.spm_vocab.id_to_piece.get(token_id, "<unk>")
        if self.hf is not None:
            return self.hf.id_to_token(token_id) or "<unk>"
        if self.id_to_piece is not None:
            return self.id_to_piece.get(token_id, "<unk>")
        return self.target_spm.IdToPiece(token_id)
