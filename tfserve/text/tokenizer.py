"""Text <-> token ids: the `Tokenizer` every kind of tokenizer files implements, the spec that
names the files in model.json (`TokenizerSpec`), and the registry of kinds.

A kind (`TokenizerSpec.kind`) is one class under `tfserve.text.tokenizers`, registered in
`TOKENIZER_KINDS`:
- "sentencepiece": SentencePiece models with the special-token conventions of Marian-style
  translators, native (piece ids are the model's ids) or vocab mode (a vocab.json maps the
  pieces to the model's ids: Marian's source.spm / target.spm + one shared vocab.json);
- "hf-json": a Hugging Face `tokenizer.json` run by the `tokenizers` library, as
  transformers' fast tokenizers run it;
- "t5-spiece": a T5 `spiece.model` without a tokenizer.json, mapped as transformers'
  T5Tokenizer maps it, then run like "hf-json";
- "spm-vocab": M2M100's SentencePiece model + vocab.json with added tokens matched in the
  text, as transformers' M2M100Tokenizer does.

`Tokenizer(directory, spec)` builds the class registered for `spec.kind`; the kind's class
loads its files and says how one text becomes its own ids and ids become text. Framing,
special ids, language tokens, padding and length limits are the same for every kind and
live here.

Multilingual models (`TokenizerSpec.languages`, `tfserve.text.languages`) put a source language
token around the text: `encode(text, source_language)` tokenizes the text alone (a
tokenizer.json's own post-processor holds the language it was saved with) and frames it
with the request's language token and eos, where the family puts them.

Decoding drops special tokens (language tokens included). The kinds import numpy,
sentencepiece and (for the tokenizer.json kinds) tokenizers only, so they are part of the
serving path. Adding a kind is one module with a Tokenizer subclass and one entry in
`TOKENIZER_KINDS`; a module is imported only when its kind is asked for.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tfserve.text.languages import LanguageConventions, LanguageError

WORD_BOUNDARY = "\u2581"  # SentencePiece's word-boundary mark '▁', a space in decoded text


class TokenizerError(ValueError):
    """Bad tokenizer files or input; the message names the file or field."""


@dataclass(frozen=True)
class TokenizerKind:
    """One registered kind of tokenizer files."""

    kind: str  # TokenizerSpec.kind
    module: str  # the module holding the class
    class_name: str  # a Tokenizer subclass
    description: str

    def load(self) -> type[Tokenizer]:
        return getattr(importlib.import_module(self.module), self.class_name)


TOKENIZER_KINDS: dict[str, TokenizerKind] = {
    "sentencepiece": TokenizerKind(
        "sentencepiece", "tfserve.text.tokenizers.sentencepiece", "SentencePieceTokenizer",
        "SentencePiece model(s), native ids or mapped through vocab.json (Marian)"),
    "hf-json": TokenizerKind(
        "hf-json", "tfserve.text.tokenizers.hf_json", "HFJsonTokenizer",
        "a Hugging Face tokenizer.json (BART, mBART, NLLB, T5)"),
    "t5-spiece": TokenizerKind(
        "t5-spiece", "tfserve.text.tokenizers.t5_spiece", "T5SpieceTokenizer",
        "a T5 spiece.model without tokenizer.json (Flan-T5, MADLAD-400)"),
    "spm-vocab": TokenizerKind(
        "spm-vocab", "tfserve.text.tokenizers.spm_vocab", "SpmVocabTokenizer",
        "a SentencePiece model + vocab.json with added tokens (M2M100)"),
}
KINDS = tuple(TOKENIZER_KINDS)


def tokenizer_kind(kind: Any) -> TokenizerKind:
    """The registry entry of `kind`; TokenizerError naming tokenizer.kind and the known
    kinds otherwise."""
    entry = TOKENIZER_KINDS.get(kind) if isinstance(kind, str) else None
    if entry is None:
        raise TokenizerError(f"tokenizer.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return entry


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
        tokenizer_kind(data.get("kind", "sentencepiece"))
        return cls(**data)


def check_text(text: Any) -> str:
    """text itself when it is a string; TokenizerError otherwise."""
    if not isinstance(text, str):
        raise TokenizerError(f"text must be a string, got {type(text).__name__}")
    return text


class Tokenizer(ABC):
    """Text <-> token ids for one translation direction.

    `Tokenizer(directory, spec)` returns an instance of the class registered for
    `spec.kind`. A kind implements `_load` (its files; the vocabulary size), `_text_ids`
    (one text's own tokens), `_decode_kept` (ids without special tokens -> text) and
    `id_to_token`; it overrides `_target_ids`, `_own_frame` and `_kind_special_ids` where
    its files say more than the spec does.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Tokenizer:
        if cls is Tokenizer:
            spec = kwargs["spec"] if "spec" in kwargs else args[1]
            cls = tokenizer_kind(spec.kind).load().for_spec(spec)
        return super().__new__(cls)

    @classmethod
    def for_spec(cls, spec: TokenizerSpec) -> type[Tokenizer]:
        """The class of this kind that reads `spec`'s files (a kind with modes picks one)."""
        return cls

    def __init__(self, directory: str | Path, spec: TokenizerSpec) -> None:
        tokenizer_kind(spec.kind)
        self.directory = Path(directory)
        self.spec = spec
        self.vocab_size = self._load()
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
                            *spec.extra_special_ids, *self._kind_special_ids()}
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

    # -- what a kind implements -------------------------------------------------------------

    @abstractmethod
    def _load(self) -> int:
        """Load the files `self.spec` names in `self.directory`; the vocabulary size."""

    @abstractmethod
    def _text_ids(self, text: str) -> list[int]:
        """The ids of one text's own tokens (text is a string)."""

    @abstractmethod
    def _decode_kept(self, ids: list[int]) -> str:
        """The text of ids whose special tokens are already dropped."""

    @abstractmethod
    def id_to_token(self, token_id: int) -> str:
        """The piece or token of one id."""

    def _target_ids(self, text: str) -> list[int]:
        """Target-side ids of one text, eos included."""
        return self._text_ids(text) + [self.eos_id]

    def _kind_special_ids(self) -> set[int]:
        """Ids the kind's files mark special, beyond the spec's (dropped from text)."""
        return set()

    def _own_frame(self) -> tuple[list[int], list[int]]:
        """What encoding adds around a text's ids when the model has no languages: eos
        after it."""
        return [], [self.eos_id]

    # -- encoding ---------------------------------------------------------------------------

    def encode(self, text: str, source_language: str | None = None) -> list[int]:
        """Source ids of one text: its tokens in their frame (eos after them; a
        multilingual model's source language token where its family puts it, the
        checkpoint's default language when none is given)."""
        before, after = self.frame(source_language)
        return before + self.encode_text(text) + after

    def encode_text(self, text: str) -> list[int]:
        """The ids of one text's own tokens, no eos or other token added."""
        return self._text_ids(check_text(text))

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
        return self._target_ids(check_text(text))

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

    # -- decoding ---------------------------------------------------------------------------

    def decode(self, ids: Sequence[int]) -> str:
        """Target text of ids, special tokens dropped."""
        return self._decode_kept([int(i) for i in ids if int(i) not in self.special_ids])
