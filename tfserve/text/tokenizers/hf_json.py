"""The "hf-json" kind: a Hugging Face `tokenizer.json` run by the `tokenizers` library (what
transformers' fast tokenizers run).

Its normalizer, pre-tokenizer and model split the text; its special tokens (added tokens
marked special) are matched in the text as transformers does; its post-processor adds what
the model expects around a source (T5: `</s>` after it; BART: `<s>` before and `</s>`
after). Encoding and decoding are transformers' `tokenizer(text).input_ids` and
`tokenizer.decode(ids, skip_special_tokens=True)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tfserve.text.tokenizer import Tokenizer, TokenizerError

FRAME_PROBE = "a"  # a text whose ids show what a tokenizer adds around a text


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


class HFJsonTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (`hf_tokenizer`) read from `spec.source`."""

    def _hf_tokenizer(self, path: Path) -> Any:
        """The `tokenizers.Tokenizer` of the kind's file."""
        return load_hf_json(path)

    def _load(self) -> int:
        path = self.directory / self.spec.source
        self.hf_tokenizer = self._hf_tokenizer(path)
        vocab_size = int(self.hf_tokenizer.get_vocab_size(with_added_tokens=True))
        if vocab_size < 1:
            raise TokenizerError(f"{path} has an empty vocabulary")
        return vocab_size

    def _kind_special_ids(self) -> set[int]:
        # the added tokens marked special (T5: <pad>, </s>, <unk>, the <extra_id_N>)
        return {int(i) for i, token in self.hf_tokenizer.get_added_tokens_decoder().items()
                if token.special}

    def _framed_ids(self, text: str) -> list[int]:
        """The text's ids with what the post-processor adds around them."""
        return list(self.hf_tokenizer.encode(text, add_special_tokens=True).ids)

    def _text_ids(self, text: str) -> list[int]:
        return list(self.hf_tokenizer.encode(text, add_special_tokens=False).ids)

    def _target_ids(self, text: str) -> list[int]:
        # a multilingual model's post-processor holds the language it was saved with
        return self._framed_ids(text) if self.languages is None else super()._target_ids(text)

    def _own_frame(self) -> tuple[list[int], list[int]]:
        """What the post-processor adds around a text's ids."""
        text = self._text_ids(FRAME_PROBE)
        full = self._framed_ids(FRAME_PROBE)
        for start in range(len(full) - len(text) + 1):
            if full[start:start + len(text)] == text:
                return full[:start], full[start + len(text):]
        raise TokenizerError(f"{self.directory / self.spec.source}: its post-processor "
                             "changes the text's tokens; tfserve places only tokens around "
                             "them")

    def _decode_kept(self, ids: list[int]) -> str:
        # ids the model has beyond the tokenizer's vocabulary (T5 pads it to a multiple of
        # 128) have no text
        kept = [i for i in ids if 0 <= i < self.vocab_size]
        return str(self.hf_tokenizer.decode(kept, skip_special_tokens=True))

    def id_to_token(self, token_id: int) -> str:
        return self.hf_tokenizer.id_to_token(token_id) or "<unk>"
