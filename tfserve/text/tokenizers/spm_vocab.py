"""The "spm-vocab" kind: SentencePiece pieces mapped through a vocab.json, with added tokens
matched in the text: M2M100's tokenizer, which ships no tokenizer.json.

transformers' M2M100Tokenizer (a Python tokenizer) encodes a text by
1. splitting it on its added tokens (`<s>`, `<pad>`, `</s>`, `<unk>` and whatever its
   tokenizer_config.json lists), the longest match first, each added token's `lstrip` /
   `rstrip` removing the whitespace next to it;
2. cutting every other piece of text with the SentencePiece model (`sp.encode(text,
   out_type=str)`, which adds the word-boundary mark in front of each piece of text);
3. mapping each SentencePiece piece through vocab.json (a piece missing from it is
   `<unk>`); the language tokens `__xx__` sit after the vocabulary, in the order of its list
   of language codes.
Decoding drops the special tokens and joins the pieces with SentencePiece, stripped. An id
with no piece (neither in vocab.json nor an added token nor a language: the model's made-up
words past the languages, `num_madeup_words`) is the unk token's text where it stands, as
M2M100Tokenizer writes it (`convert_ids_to_tokens` maps it to `<unk>`, and
`convert_tokens_to_string` writes a special token's text between the SentencePiece-joined
runs of pieces): [▁the, 219, ▁cat] -> "the<unk>cat".
`SpmVocabText` does the same with sentencepiece alone; `SpmVocabTokenizer` is the kind's
`Tokenizer` around it (the spec's `added_tokens`; the language tokens after the vocabulary).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sentencepiece as spm

from tfserve.text.tokenizer import Tokenizer, TokenizerError


class SpmVocabError(ValueError):
    """Bad files or settings of an spm-vocab tokenizer; the message names the file."""


@dataclass(frozen=True)
class AddedToken:
    """A token matched in the text before SentencePiece sees it (transformers' AddedToken)."""

    content: str
    id: int
    lstrip: bool = False  # remove the whitespace before it
    rstrip: bool = False  # remove the whitespace after it
    special: bool = True  # dropped from decoded text

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: Any) -> AddedToken:
        if not isinstance(data, dict) or not isinstance(data.get("content"), str) or \
                not data["content"] or not isinstance(data.get("id"), int):
            raise SpmVocabError(f"an added token must have a content string and an integer "
                                f"id, got {data!r}")
        return cls(data["content"], data["id"], bool(data.get("lstrip", False)),
                   bool(data.get("rstrip", False)), bool(data.get("special", True)))


class SpmVocabText:
    """Text <-> ids as M2M100Tokenizer computes them (module docstring)."""

    def __init__(self, spm_path: Path, vocab_path: Path, added: Sequence[AddedToken],
                 unk_token_id: int) -> None:
        if not spm_path.is_file():
            raise SpmVocabError(f"SentencePiece model not found: {spm_path}")
        self.processor = spm.SentencePieceProcessor()
        try:
            self.processor.LoadFromSerializedProto(spm_path.read_bytes())
        except (RuntimeError, OSError) as exc:
            raise SpmVocabError(f"cannot load SentencePiece model {spm_path}: {exc}") from exc
        try:
            vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise SpmVocabError(f"vocab file not found: {vocab_path}") from exc
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SpmVocabError(f"cannot read vocab file {vocab_path}: {exc}") from exc
        if not isinstance(vocab, dict) or not vocab or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for v in vocab.values()):
            raise SpmVocabError(f"{vocab_path} must map pieces to integer ids >= 0")
        self.piece_to_id: dict[str, int] = vocab
        self.unk_id = unk_token_id
        self.added = {token.content: token for token in added}
        self.id_to_piece = {i: p for p, i in vocab.items()}
        self.id_to_piece.update({token.id: token.content for token in added})
        self.vocab_size = max(self.id_to_piece) + 1
        self.unk_text = self.id_to_piece.get(unk_token_id, "<unk>")
        self.special_ids = {token.id for token in added if token.special}
        # the longest added token first at each position (transformers' Trie.split)
        contents = sorted(self.added, key=len, reverse=True)
        self.splitter = re.compile("|".join(re.escape(c) for c in contents)) if contents \
            else None

    def chunks(self, text: str) -> list[str]:
        """The text split on added tokens, whitespace stripped where they ask for it."""
        if self.splitter is None:
            return [text]
        parts: list[str] = []
        position = 0
        for match in self.splitter.finditer(text):
            parts += [text[position:match.start()], match.group()]
            position = match.end()
        parts.append(text[position:])
        for index, part in enumerate(parts):
            token = self.added.get(part) if index % 2 else None
            if token is None:
                continue
            if token.rstrip and index + 1 < len(parts):
                parts[index + 1] = parts[index + 1].lstrip()
            if token.lstrip and index > 0:
                parts[index - 1] = parts[index - 1].rstrip()
        return [part for part in parts if part]

    def encode(self, text: str) -> list[int]:
        """The ids of a text, no special tokens added."""
        ids: list[int] = []
        for chunk in self.chunks(text):
            token = self.added.get(chunk)
            if token is not None:
                ids.append(token.id)
                continue
            for piece in self.processor.EncodeAsPieces(chunk):
                added = self.added.get(piece)
                ids.append(added.id if added is not None
                           else self.piece_to_id.get(piece, self.unk_id))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ids whose special tokens are already removed; an id without a piece
        is the unk token's text (module docstring)."""
        text = ""
        run: list[str] = []  # the pieces since the last id without one
        for i in ids:
            piece = self.id_to_piece.get(i)
            if piece is not None:
                run.append(piece)
                continue
            # each run of pieces is joined on its own (SentencePiece drops the word-boundary
            # mark at the start of a run), the unk text written between them as it is
            text += self.processor.DecodePieces(run) + self.unk_text
            run = []
        return (text + self.processor.DecodePieces(run)).strip()

    def token_to_id(self, token: str) -> int | None:
        added = self.added.get(token)
        return added.id if added is not None else self.piece_to_id.get(token)


class SpmVocabTokenizer(Tokenizer):
    """spec.source is the SentencePiece model, spec.vocab the vocab.json, spec.added_tokens
    the tokens matched in the text."""

    def _load(self) -> int:
        spec = self.spec
        if not spec.vocab:
            raise TokenizerError("tokenizer kind spm-vocab needs a vocab file")
        try:
            added = [AddedToken.from_dict(token) for token in spec.added_tokens]
            self.text = SpmVocabText(self.directory / spec.source, self.directory / spec.vocab,
                                     added, spec.unk_token_id)
        except SpmVocabError as exc:
            raise TokenizerError(str(exc)) from exc
        vocab_size = self.text.vocab_size
        # the language tokens sit after the vocabulary (M2M100); the spec's languages are
        # checked in full once the vocabulary size is known
        codes = spec.languages.get("codes") if isinstance(spec.languages, dict) else None
        if isinstance(codes, dict) and codes:
            ids = [i for i in codes.values() if isinstance(i, int)]
            vocab_size = max([vocab_size, *(i + 1 for i in ids)])
        return vocab_size

    def _kind_special_ids(self) -> set[int]:
        return self.text.special_ids

    def _text_ids(self, text: str) -> list[int]:
        return self.text.encode(text)

    def _decode_kept(self, ids: list[int]) -> str:
        return self.text.decode(ids)

    def id_to_token(self, token_id: int) -> str:
        return self.text.id_to_piece.get(token_id, "<unk>")
