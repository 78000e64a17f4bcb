"""A translation request's languages, target prefix and decoding options -> the source ids
and the DecodingOptions to search with, the same for every front end.

    sources = source_ids(tokenizer, texts, source_language="eng_Latn", max_source_tokens=1024)
    options = request_options(tokenizer, defaults, {"num_beams": 4}, start_token_id=2,
                              max_new_tokens_limit=1023, target_language="fra_Latn")

- Source: the text's tokens in the frame its model puts them in (tfserve.text.languages: a
  multilingual model's source language token where its family puts it, eos); truncation
  keeps the frame whole and cuts the text, as transformers' tokenizers truncate.
- Target: a multilingual model's target language becomes the forced first output token
  (`DecodingOptions.prefix_token_ids`, counted as a new token like transformers'
  forced_bos_token_id), or, for a model that starts decoding from it (mBART-cc25), the
  request's decoder start token (`DecodingOptions.decoder_start_token_id`, transformers'
  decoder_start_token_id); either way requests into different languages share a batch. A
  model whose checkpoint forces a first token (BART's forced_bos_token_id) gets that one. A
  target
  prefix (text the translation must start with) follows the forced token; with one, the
  forced tokens and the prefix are decoder input, as in transformers'
  `generate(decoder_input_ids=[[start, *forced, *prefix]])`, and the translation's text
  starts with the prefix.
- Options: those the request sets, the checkpoint's generation defaults for the others
  (tfserve.artifacts.generation_defaults), validated: every bad value is a ValueError naming the
  request's field and its limit.

Only numpy-free Python on top of the tokenizer and the generation options: the serving path
(the server's request checks) and the Translator both call it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tfserve.artifacts.generation_defaults import GenerationDefaults
from tfserve.generation import DecodingOptions
from tfserve.text.inputs import MAX_CHARS_PER_TOKEN
from tfserve.text.languages import LanguageError
from tfserve.text.tokenizer import Tokenizer

MAX_PREFIX_CHARS = 4096  # a target prefix longer than this cannot fit any model's target


class PrefixError(ValueError):
    """A target prefix the model cannot take; `problem` is what is wrong with it, which the
    message gives after the field's name (a server names the prefix's place instead)."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"target_prefix {problem}")
        self.problem = problem


def model_languages(tokenizer: Tokenizer) -> list[str]:
    """The language codes a model takes in source_language / target_language (ModelInfo's
    list); empty for a model without language codes."""
    return tokenizer.languages.names if tokenizer.languages is not None else []


def source_ids(tokenizer: Tokenizer, texts: Sequence[str], source_language: str | None = None,
               max_source_tokens: int = 512, truncate: bool = False,
               model_source_language: str = "") -> list[list[int]]:
    """Token ids per text, framed for its model (module docstring).

    A text over max_source_tokens tokens is an error naming it (`texts[i]`), or, with
    truncate, cut: its own tokens are cut so that the frame (language token, eos) fits. A
    text of more than MAX_CHARS_PER_TOKEN characters per token cannot fit: it is refused (or
    cut) before the tokenizer sees it. model_source_language: a model without language
    codes accepts its own source language (ModelInfo's source_language) and no other.
    """
    if source_language and tokenizer.languages is None:
        if source_language != model_source_language:
            raise LanguageError(_no_codes("source_language", source_language,
                                          model_source_language))
        source_language = None
    before, after = tokenizer.frame(source_language)
    room = max_source_tokens - len(before) - len(after)
    if room < 1:
        raise ValueError(f"max_source_tokens {max_source_tokens} leaves no room for a text "
                         f"beside the model's {len(before) + len(after)} framing tokens")
    char_limit = max_source_tokens * MAX_CHARS_PER_TOKEN
    sources = []
    for index, text in enumerate(texts):
        if len(text) > char_limit:
            if not truncate:
                raise ValueError(f"texts[{index}] is {len(text)} characters, over the limit of "
                                 f"{char_limit} ({MAX_CHARS_PER_TOKEN} per source token; "
                                 "truncate=True cuts it)")
            text = text[:char_limit]
        ids = tokenizer.encode_text(text)
        if len(ids) > room:
            if not truncate:
                raise ValueError(f"texts[{index}] is {len(ids) + len(before) + len(after)} "
                                 f"tokens, over the limit of {max_source_tokens} source tokens "
                                 "(truncate=True cuts it)")
            ids = ids[:room]
        sources.append(before + ids + after)
    return sources


def _no_codes(field_name: str, value: str, own: str) -> str:
    shown = value if len(value) <= 40 else f"{value[:40]}..."
    if own:
        return (f"{field_name} {shown!r} is not this model's: it translates "
                f"{'from' if field_name == 'source_language' else 'into'} {own!r} only")
    return f"{field_name} {shown!r} is not accepted: this model has no language codes"


def forced_tokens(tokenizer: Tokenizer, defaults: GenerationDefaults,
                  target_language: str | None = None, model_target_language: str = ""
                  ) -> list[int]:
    """The output's forced first tokens: the target language token of a multilingual
    model that forces it, else the checkpoint's forced_bos_token_id, else none."""
    conventions = tokenizer.languages
    if conventions is None:
        if target_language and target_language != model_target_language:
            raise LanguageError(_no_codes("target_language", target_language,
                                          model_target_language))
        forced = defaults.forced_bos_token_id
        return [forced] if forced is not None else []
    token_id = conventions.target_id(target_language)
    return [token_id] if token_id is not None else []


def start_token(tokenizer: Tokenizer, start_token_id: int, target_language: str | None = None
                ) -> int | None:
    """The request's own decoder start token: the target language token of a model that
    starts decoding from it (mBART-cc25); None where the model's start token
    (`start_token_id`) serves, as for every other model and a request that names none."""
    conventions = tokenizer.languages
    token_id = conventions.start_id(target_language) if conventions is not None else None
    return token_id if token_id != start_token_id else None


def prefix_ids(tokenizer: Tokenizer, target_prefix: str | None) -> list[int]:
    """The tokens of a target prefix (its text's own tokens, nothing added)."""
    if not target_prefix:
        return []
    if not isinstance(target_prefix, str):
        raise PrefixError(f"must be a string, got {type(target_prefix).__name__}")
    if len(target_prefix) > MAX_PREFIX_CHARS:
        raise PrefixError(f"is {len(target_prefix)} characters, over the limit of "
                          f"{MAX_PREFIX_CHARS}")
    ids = tokenizer.encode_text(target_prefix)
    for token, name in ((tokenizer.eos_id, "end-of-sequence"), (tokenizer.pad_id, "padding")):
        if token in ids:
            raise PrefixError(f"must not contain the {name} token "
                              f"({tokenizer.id_to_token(token)!r})")
    return ids


def request_options(tokenizer: Tokenizer, defaults: GenerationDefaults,
                    given: Mapping[str, Any], start_token_id: int, max_new_tokens_limit: int,
                    target_language: str | None = None, target_prefix: str | None = None,
                    vocab_size: int | None = None, model_target_language: str = ""
                    ) -> DecodingOptions:
    """The DecodingOptions of a request (module docstring), validated.

    given: the DecodingOptions fields the request sets (unset ones left out: the
    checkpoint's defaults fill them). max_new_tokens_limit: the model's target positions
    less the start token. Errors are ValueErrors naming the request's field.
    """
    unknown = sorted(set(given) - set(DecodingOptions.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown decoding option(s): {', '.join(unknown)}")
    for name in ("prefix_token_ids", "prefix_counts_as_new", "decoder_start_token_id"):
        if name in given:
            raise ValueError(f"{name} is set from target_language and target_prefix, not "
                             "given")
    forced = forced_tokens(tokenizer, defaults, target_language, model_target_language)
    start = start_token(tokenizer, start_token_id, target_language)
    prefix = prefix_ids(tokenizer, target_prefix)
    tokens = forced + prefix
    # forced tokens alone count as new tokens (transformers' forced_bos_token_id); with a
    # target prefix all are decoder input (transformers' decoder_input_ids)
    counts_as_new = not prefix
    input_prefix = 0 if counts_as_new else len(tokens)
    if input_prefix >= max_new_tokens_limit:
        raise PrefixError(f"is {len(prefix)} tokens, over the limit of "
                          f"{max_new_tokens_limit - 1 - len(forced)} for this model")
    fields = defaults.merge(given, input_prefix, max_new_tokens_limit - input_prefix,
                            tokenizer.eos_id)
    options = DecodingOptions(**fields, prefix_token_ids=tuple(tokens),
                              prefix_counts_as_new=counts_as_new, decoder_start_token_id=start)
    return options.validate(max_new_tokens_limit, vocab_size=vocab_size,
                            eos_token_id=tokenizer.eos_id)
