"""The "sentencepiece" kind: SentencePiece models with the special-token conventions of
Marian-style translators.

- native (`spec.vocab` None): one SentencePiece model (or one per side, `spec.target`) whose
  piece ids are the model's ids;
- vocab mode: SentencePiece only splits text into pieces, and a vocab.json maps pieces to the
  model's ids (Marian: source.spm / target.spm + one shared vocab.json); pieces missing from
  the vocab become unk.
Source sequences end with eos (appended by `Tokenizer.encode`).
"""

from __future__ import annotations

import json
from pathlib import Path

import sentencepiece as spm

from tfserve.text.tokenizer import WORD_BOUNDARY, Tokenizer, TokenizerError, TokenizerSpec


def load_spm(path: Path) -> spm.SentencePieceProcessor:
    """A SentencePiece model file; TokenizerError naming the file."""
    if not path.is_file():
        raise TokenizerError(f"SentencePiece model not found: {path}")
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(path.read_bytes())
    except (RuntimeError, OSError) as exc:
        raise TokenizerError(f"cannot load SentencePiece model {path}: {exc}") from exc
    return processor


class SentencePieceTokenizer(Tokenizer):
    """Native mode: SentencePiece ids are the model's ids (vocab mode: the subclass below)."""

    @classmethod
    def for_spec(cls, spec: TokenizerSpec) -> type[Tokenizer]:
        return SentencePieceVocabTokenizer if spec.vocab else SentencePieceTokenizer

    def _load(self) -> int:
        self.source_spm = load_spm(self.directory / self.spec.source)
        self.target_spm = load_spm(self.directory / self.spec.target) if self.spec.target \
            else self.source_spm
        return int(self.source_spm.GetPieceSize())

    def _ids(self, processor: spm.SentencePieceProcessor, text: str) -> list[int]:
        return list(processor.EncodeAsIds(text))

    def _text_ids(self, text: str) -> list[int]:
        return self._ids(self.source_spm, text)

    def _target_ids(self, text: str) -> list[int]:
        return self._ids(self.target_spm, text) + [self.eos_id]

    def _decode_kept(self, ids: list[int]) -> str:
        return self.target_spm.DecodeIds([i for i in ids if 0 <= i < self.vocab_size]).strip()

    def id_to_token(self, token_id: int) -> str:
        return self.target_spm.IdToPiece(token_id)


class SentencePieceVocabTokenizer(SentencePieceTokenizer):
    """Vocab mode: the pieces SentencePiece cuts, mapped to the model's ids by vocab.json."""

    def _load(self) -> int:
        super()._load()
        vocab_path = self.directory / str(self.spec.vocab)
        try:
            vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise TokenizerError(f"vocab file not found: {vocab_path}") from exc
        except (OSError, json.JSONDecodeError) as exc:
            raise TokenizerError(f"cannot read vocab file {vocab_path}: {exc}") from exc
        if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
            raise TokenizerError(f"{vocab_path} must map pieces to integer ids")
        self.piece_to_id: dict[str, int] = vocab
        self.id_to_piece = {i: p for p, i in vocab.items()}
        return max(vocab.values()) + 1

    def _ids(self, processor: spm.SentencePieceProcessor, text: str) -> list[int]:
        prefix: list[int] = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            # a target-language code (multilingual opus-mt: ">>fr<< text") is one vocab
            # token, not SentencePiece input, as in MarianTokenizer
            prefix = [self.piece_to_id.get(text[: end + 2], self.unk_id)]
            text = text[end + 2 :]
        return prefix + [self.piece_to_id.get(p, self.unk_id)
                         for p in processor.EncodeAsPieces(text)]

    def _decode_kept(self, ids: list[int]) -> str:
        pieces = [self.id_to_piece[i] for i in ids if i in self.id_to_piece]
        # A shared vocab.json holds source pieces that target.spm does not know, and
        # SentencePiece copies an unknown piece verbatim, word-boundary marks included
        # ('▁w5▁w6'); every mark left is a space, as MarianTokenizer.convert_tokens_to_string
        # makes it. strip: a dropped unk can leave a space at either end.
        text = self.target_spm.DecodePieces(pieces).replace(WORD_BOUNDARY, " ")
        return text.strip()

    def id_to_token(self, token_id: int) -> str:
        return self.id_to_piece.get(token_id, "<unk>")
