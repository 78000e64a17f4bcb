"""The "t5-spiece" kind: a T5 `spiece.model` without a tokenizer.json, mapped as
transformers' T5Tokenizer maps it and run by `tokenizers` like "hf-json"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tfserve.text.tokenizer import WORD_BOUNDARY, TokenizerError
from tfserve.text.tokenizers.hf_json import HFJsonTokenizer
from tfserve.text.tokenizers.spiece_model import (
    CONTROL,
    UNIGRAM,
    UNKNOWN,
    parse_model,
)


def t5_from_spiece(path: Path, extra_ids: int) -> Any:
    """A T5 spiece.model as the `tokenizers.Tokenizer` transformers' T5Tokenizer builds from it
    (transformers 5: T5Tokenizer.__init__ and the T5 SentencePiece conversion).

    The pieces and their scores as a Unigram model (unk at the model's unk id, no byte
    fallback), then `extra_ids` sentinels <extra_id_{extra_ids-1}> .. <extra_id_0> at the
    following ids; the model's precompiled normalizer; whitespace split and '▁' word marks;
    the model's control pieces (<pad>, </s>), its unk piece and the sentinels matched in the
    text and dropped from decoded text as special tokens; </s> appended.

    The user-defined pieces (MADLAD-400's <2xx>) stay pieces of the Unigram model, as
    SentencePiece treats them and as transformers >= 5.25 converts them: "<2fr> the cat" is
    ['▁', '<2fr>', '▁the', '▁cat', '</s>'], the ids MADLAD was trained on (T5X encodes its
    inputs with SentencePiece itself), and decoding keeps "<2fr>" as text. transformers <= 5.24
    matched them as special added tokens, which drops the '▁' before them and restarts the
    word after them (['<2fr>', '▁the', '▁cat', '</s>']).
    """
    from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import Unigram

    if not path.is_file():
        raise TokenizerError(f"SentencePiece model not found: {path}")
    if isinstance(extra_ids, bool) or not isinstance(extra_ids, int) or extra_ids < 0:
        raise TokenizerError(f"tokenizer extra_ids must be an integer >= 0, got {extra_ids!r}")
    try:
        proto = parse_model(path.read_bytes())
    except Exception as exc:  # protobuf's DecodeError, OSError
        raise TokenizerError(f"cannot load SentencePiece model {path}: {exc}") from exc
    if not proto.pieces:
        raise TokenizerError(f"cannot load SentencePiece model {path}: no pieces")
    if proto.trainer_spec.model_type != UNIGRAM:
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
    # the control pieces and unk are T5Tokenizer's special tokens; the user-defined pieces are
    # not added tokens (see above): the Unigram model emits them whole, as SentencePiece does
    special = [p.piece for p in proto.pieces if p.type in (UNKNOWN, CONTROL)]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t in special + sentinels])
    eos = proto.trainer_spec.eos_piece or "</s>"
    eos_id = tokenizer.token_to_id(eos)
    if eos_id is None:
        raise TokenizerError(f"{path} has no eos piece {eos!r}")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=["$A", eos], pair=["$A", eos, "$B", eos], special_tokens=[(eos, eos_id)])
    return tokenizer


class T5SpieceTokenizer(HFJsonTokenizer):
    """spec.source is the spiece.model; spec.extra_ids its <extra_id_N> sentinels."""

    def _hf_tokenizer(self, path: Path) -> Any:
        return t5_from_spiece(path, self.spec.extra_ids)
