"""SentencePiece tokenizer with the special-token conventions of Marian-style translators.

Two modes, chosen by what the artifacts carry:
- native: one SentencePiece model (or one per side) whose piece ids are the model's ids;
- vocab: SentencePiece only splits text into pieces, and a vocab.json maps pieces to the
  model's ids (Marian: source.spm / target.spm + one shared vocab.json); pieces missing from
  the vocab become unk.

Source sequences end with eos. Decoding drops special tokens. Imports numpy and sentencepiece
only, so it is part of the serving path.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

WORD_BOUNDARY = "\u2581"  # SentencePiece's word-boundary mark '▁', a space in decoded text


class TokenizerError(ValueError):
    """Bad tokenizer files or input; the message names the file or field."""


@dataclass
class TokenizerSpec:
    """How a tokenizer is stored in an artifacts or checkpoint directory (goes in model.json)."""

    source: str = "source.spm"
    target: str | None = None  # None: the source model serves both sides
    vocab: str | None = None  # None: native mode, SentencePiece ids are model ids
    pad_token_id: int = 0
    eos_token_id: int = 1
    unk_token_id: int = 2
    decoder_start_token_id: int = 0
    extra_special_ids: list[int] = field(default_factory=list)

    def files(self) -> list[str]:
        return [f for f in (self.source, self.target, self.vocab) if f]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenizerSpec:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise TokenizerError(f"unknown tokenizer field(s): {', '.join(unknown)}")
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


class Tokenizer:
    """Text <-> token ids for one translation direction."""

    def __init__(self, directory: str | Path, spec: TokenizerSpec) -> None:
        directory = Path(directory)
        self.directory = directory
        self.spec = spec
        self.source_spm = _load_spm(directory / spec.source)
        self.target_spm = _load_spm(directory / spec.target) if spec.target else self.source_spm
        self.piece_to_id: dict[str, int] | None = None
        self.id_to_piece: dict[int, str] | None = None
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

    def encode(self, text: str) -> list[int]:
        """Source ids of one text, ending with eos."""
        return self._ids(self.source_spm, text) + [self.eos_id]

    def encode_target(self, text: str) -> list[int]:
        """Target-side ids of one text, ending with eos (training labels, references)."""
        return self._ids(self.target_spm, text) + [self.eos_id]

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
        if self.id_to_piece is not None:
            return self.id_to_piece.get(token_id, "<unk>")
        return self.target_spm.IdToPiece(token_id)
