"""Language codes of multilingual models, and where each family puts them.

A multilingual checkpoint names its languages with codes of its own (NLLB-200 `fra_Latn`,
M2M100 `fr`, mBART `fr_XX`), each one token of the vocabulary (M2M100's token is `__fr__`).
The source language's token goes into the source sequence, the target language's into the
decoder's, at places that differ by family (as transformers' tokenizers place them):

| family | source sequence | target language |
|---|---|---|
| NLLB-200 | `[src] text </s>` (`legacy_behaviour`: `text </s> [src]`) | forced first token |
| M2M100 | `[src] text </s>` | forced first token |
| mBART-50 | `[src] text </s>` | forced first token |
| mBART-cc25 (and its fine-tunes) | `text </s> [src]` | the decoder start token |

"forced first token": decoding starts from the model's start token (eos for these
families), and the target language token is the first output token whatever the model
scores (transformers' `forced_bos_token_id`). "decoder start": the target language token is
the token decoding starts from (transformers' `decoder_start_token_id`), the request's own
(`DecodingOptions.decoder_start_token_id`); a request that names no target language starts
from the model's (its configured target). Either way requests with different targets share
a batch.

`LanguageConventions` is stored in the manifest (inside the tokenizer spec); `language_id`
turns a request's code into its token, or refuses it naming the field and valid codes.
Pure Python: part of the serving path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# where the source language token goes: [code] text </s>, or text </s> [code]
SOURCE_LAYOUTS = ("prefix", "suffix")
# what the target language is: the forced first output token, or the decoder start token
TARGET_MODES = ("forced", "start")
SHOWN_CODES = 8  # valid codes named in an error message


class LanguageError(ValueError):
    """A request's language that the model does not have; names the field and valid codes."""


@dataclass
class LanguageConventions:
    """A multilingual model's language codes and where its tokenizer puts them."""

    codes: dict[str, int]  # code as requests name it -> its token id, in the model's order
    source_layout: str = "prefix"  # one of SOURCE_LAYOUTS
    target_mode: str = "forced"  # one of TARGET_MODES
    # the source language of a request that names none: the checkpoint tokenizer's own
    # (its src_lang, as transformers' tokenizer defaults to it); "" makes it required. A
    # request always names its target language (the checkpoint's tgt_lang, where it has
    # one, is the model's target_language in ModelInfo, not a default)
    default_source: str = ""
    # the tokens of the codes where they differ from the codes (M2M100: "fr" -> "__fr__")
    tokens: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.codes, dict) or not self.codes:
            raise ValueError("languages.codes must map at least one language code to its "
                             "token id")
        for code, token_id in self.codes.items():
            if not isinstance(code, str) or not code or isinstance(token_id, bool) or \
                    not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"languages.codes must map codes to token ids >= 0, got "
                                 f"{code!r}: {token_id!r}")
        if self.source_layout not in SOURCE_LAYOUTS:
            raise ValueError(f"languages.source_layout must be one of {SOURCE_LAYOUTS}, "
                             f"got {self.source_layout!r}")
        if self.target_mode not in TARGET_MODES:
            raise ValueError(f"languages.target_mode must be one of {TARGET_MODES}, "
                             f"got {self.target_mode!r}")
        if self.default_source and self.default_source not in self.codes:
            raise ValueError(f"languages.default_source {self.default_source!r} is not one "
                             "of the model's codes")

    # -- manifest ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"codes": dict(self.codes), "source_layout": self.source_layout,
                "target_mode": self.target_mode, "default_source": self.default_source,
                "tokens": dict(self.tokens)}

    @classmethod
    def from_dict(cls, data: Any) -> LanguageConventions:
        if not isinstance(data, dict):
            raise ValueError(f"languages must be a JSON object, got {type(data).__name__}")
        known = {"codes", "source_layout", "target_mode", "default_source", "tokens"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown languages field(s): {', '.join(unknown)}")
        return cls(**data)

    # -- requests ---------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """The codes, in the model's order (ModelInfo lists them)."""
        return list(self.codes)

    def language_id(self, field_name: str, code: str) -> int:
        """The token id of `code`; LanguageError naming `field_name` and valid codes."""
        if not isinstance(code, str):
            raise LanguageError(f"{field_name} must be a string, got {type(code).__name__}")
        token_id = self.codes.get(code)
        if token_id is None:
            shown = code if len(code) <= 40 else f"{code[:40]}..."
            raise LanguageError(f"{field_name} {shown!r} is not a language of this model; "
                                f"{self.some_codes(code)}")
        return token_id

    def some_codes(self, near: str = "") -> str:
        """'valid codes include ...': codes sharing the first letters of `near` first."""
        codes = self.names
        prefix = near[:2].lower()
        close = [c for c in codes if prefix and c.lower().startswith(prefix)]
        shown = (close + [c for c in codes if c not in close])[:SHOWN_CODES]
        more = f" ({len(codes)} in all)" if len(codes) > len(shown) else ""
        return f"valid codes include {', '.join(shown)}{more}"

    def source_id(self, code: str | None) -> int:
        """The source language token of a request (its default when not given)."""
        if not code:
            if not self.default_source:
                raise LanguageError(f"source_language is required by this model; "
                                    f"{self.some_codes()}")
            code = self.default_source
        return self.language_id("source_language", code)

    def target_id(self, code: str | None) -> int | None:
        """The forced first token of a request's target language (None for "start" models,
        whose target language is their decoder start token: `start_id`)."""
        if self.target_mode == "start":
            return None
        if not code:
            raise LanguageError(f"target_language is required by this multilingual model; "
                                f"{self.some_codes()}")
        return self.language_id("target_language", code)

    def start_id(self, code: str | None) -> int | None:
        """The decoder start token of a request's target language for "start" models; None
        for "forced" models and for a request that names no target (the model's own start
        token: its configured target language)."""
        if self.target_mode != "start" or not code:
            return None
        return self.language_id("target_language", code)

    def frame(self, source_token_id: int, eos_token_id: int) -> tuple[list[int], list[int]]:
        """The tokens before and after a source text's tokens."""
        if self.source_layout == "prefix":
            return [source_token_id], [eos_token_id]
        return [], [eos_token_id, source_token_id]
