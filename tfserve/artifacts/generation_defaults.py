"""A checkpoint's own decoding settings (Hugging Face `generation_config.json`), used for
every option a request leaves unset.

`python -m export` records them in the manifest (`model.json` "generation"), from the
checkpoint's config.json overlaid by its generation_config.json, as transformers builds its
GenerationConfig. Every front end (Translator, server, CLI) merges a request's options with
them here, in `GenerationDefaults.merge`, so that they mean the same everywhere:

- the decoding options tfserve.option_table marks `checkpoint` -> the same fields
  (early_stopping: true, false or "never"); those only beam search reads (the table's
  searches) not for a request that samples;
- max_new_tokens -> max_new_tokens; else max_length -> max_new_tokens = max_length - 1 -
  input prefix (transformers counts the start token and a given decoder input, a target
  prefix, in max_length); min_length -> min_new_tokens likewise;
- forced_bos_token_id -> the first output token (`prefix_token_ids`); a multilingual
  model's target language takes its place;
- forced_eos_token_id -> forced_eos (eos is the max_new_tokens-th new token), where it is
  the model's eos (an int, or a list of that one id), as in every checkpoint that sets it;
- decoder_start_token_id -> the model's decoder start token (applied at export).

- bad_words_ids -> the tokens no search produces (`GenerationDefaults.banned_token_ids`,
  recorded at export in model.json's "banned_token_ids"): its single-token entries, less
  eos (transformers' NoBadWordsLogitsProcessor drops an [eos] entry); opus-mt bans its pad
  token this way. transformers bans nothing else by default for the families tfserve runs,
  so a T5, BART, mBART, M2M100 or NLLB checkpoint without bad_words_ids may produce pad.

Recorded but not applied (`GenerationDefaults.unapplied`): a forced_eos_token_id other than
the model's eos, bad_words_ids entries of more than one token (transformers bans their last
token where the others end the sequence so far; tfserve does not).
Pure Python: part of the serving path. tfserve.option_table sits below it (it imports nothing
of tfserve), so the artifacts read the decoding options' table without importing generation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tfserve import option_table

# the generation_config.json fields of the rules of their own (module docstring), with the
# type each must have; the option fields a checkpoint sets as they are come from
# tfserve.option_table (hf_fields)
RULED_FIELDS: dict[str, tuple[type, ...]] = {
    "max_length": (int,),
    "max_new_tokens": (int,),
    "min_length": (int,),
    "min_new_tokens": (int,),
    "forced_bos_token_id": (int,),
    "forced_eos_token_id": (int, list),
    "decoder_start_token_id": (int,),
    "bad_words_ids": (list,),
}
# the JSON types a generation_config.json field of an option's type may have
_JSON_KINDS: dict[type, tuple[type, ...]] = {int: (int,), float: (int, float), bool: (bool,)}


def hf_fields() -> dict[str, tuple[type, ...]]:
    """The generation_config.json fields tfserve reads, with the types each must have: the
    decoding options a checkpoint sets (option_table's `checkpoint` ones, under their own
    names), then RULED_FIELDS."""
    copied = {declared.name: _JSON_KINDS[declared.type]
              + tuple({type(value) for value in declared.extra_values})
              for declared in option_table.OPTIONS if declared.checkpoint}
    return {**copied, **RULED_FIELDS}


def beam_fields() -> tuple[str, ...]:
    """The DecodingOptions fields only beam search reads: not applied to a request that
    samples."""
    return tuple(declared.name for declared in option_table.OPTIONS
                 if declared.searches == ("beam",))


def pad_ban(pad_token_id: int, eos_token_id: int) -> tuple[int, ...]:
    """The tokens tfserve banned for every model before model.json recorded a checkpoint's
    bans: the pad token, unless it is also eos. It stays the rule of a manifest without
    "banned_token_ids" and of a backend that names no bans."""
    return (pad_token_id,) if pad_token_id != eos_token_id else ()


def _single_token(entry: Any) -> int | None:
    """The token of a bad_words_ids entry of one token id, else None."""
    if isinstance(entry, list) and len(entry) == 1 and isinstance(entry[0], int) \
            and not isinstance(entry[0], bool):
        return entry[0]
    return None


def from_hf_files(config: Mapping[str, Any], generation_config: Mapping[str, Any] | None
                  ) -> dict[str, Any]:
    """The fields of hf_fields() in config.json, overlaid by generation_config.json (as
    transformers reads a checkpoint); None values (unset) left out."""
    known = hf_fields()
    merged: dict[str, Any] = {}
    for source in (config, generation_config or {}):
        for key in known:
            if key in source:
                merged[key] = source[key]
    return {key: value for key, value in merged.items() if value is not None}


@dataclass
class GenerationDefaults:
    """The checkpoint's generation settings (HF field names), checked."""

    fields: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.fields, dict):
            raise ValueError(f"generation must be a JSON object, got "
                             f"{type(self.fields).__name__}")
        known = hf_fields()
        for key, value in self.fields.items():
            kinds = known.get(key)
            if kinds is None:
                raise ValueError(f"generation.{key} is not a setting tfserve reads "
                                 f"(known: {', '.join(known)})")
            if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
                raise ValueError(f"generation.{key} must be "
                                 f"{' or '.join(k.__name__ for k in kinds)}, got {value!r}")
        stopping = self.fields.get("early_stopping")
        if isinstance(stopping, str) and stopping != "never":
            raise ValueError(f"generation.early_stopping must be true, false or \"never\", "
                             f"got {stopping!r}")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.fields)

    @classmethod
    def from_dict(cls, data: Any) -> GenerationDefaults:
        return cls(dict(data) if isinstance(data, dict) else data)

    @property
    def forced_bos_token_id(self) -> int | None:
        return self.fields.get("forced_bos_token_id")

    def forces_eos(self, eos_token_id: int | None = None) -> bool:
        """Whether forced_eos_token_id asks for the model's eos at max_length (any id
        counts as eos when eos_token_id is not given)."""
        forced = self.fields.get("forced_eos_token_id")
        if forced is None or eos_token_id is None:
            return forced is not None
        return forced == eos_token_id or forced == [eos_token_id]

    def banned_token_ids(self, eos_token_id: int) -> list[int]:
        """The tokens bad_words_ids bans at every step: its single-token entries, eos left
        out as transformers leaves it out; sorted, each once."""
        entries = self.fields.get("bad_words_ids") or []
        tokens = {_single_token(entry) for entry in entries}
        return sorted(token for token in tokens if token is not None and token != eos_token_id)

    def unapplied(self, pad_token_id: int | None = None,
                  eos_token_id: int | None = None) -> list[str]:
        """The recorded settings tfserve does not apply (module docstring). pad_token_id is
        not used: bad_words_ids' single-token entries are applied whichever token they
        name."""
        left = []
        if "forced_eos_token_id" in self.fields and not self.forces_eos(eos_token_id):
            left.append("forced_eos_token_id")
        entries = self.fields.get("bad_words_ids") or []
        if any(_single_token(entry) is None for entry in entries):
            left.append("bad_words_ids")
        return left

    def decoding_fields(self, input_prefix: int = 0, max_new_tokens_limit: int | None = None,
                        eos_token_id: int | None = None) -> dict[str, Any]:
        """The DecodingOptions fields these settings give (module docstring).

        input_prefix: the tokens of a request's prefix that are decoder input rather than
        new tokens (transformers counts them in max_length and min_length).
        max_new_tokens_limit: the model's limit for that prefix; a default never exceeds it.
        eos_token_id: the model's, which forced_eos_token_id must name to be applied.
        """
        values = self.fields
        out: dict[str, Any] = {}
        for declared in option_table.OPTIONS:
            if declared.checkpoint and declared.name in values:
                out[declared.name] = values[declared.name]
        if self.forces_eos(eos_token_id):
            out["forced_eos"] = True
        if "max_new_tokens" in values:
            out["max_new_tokens"] = values["max_new_tokens"]
        elif "max_length" in values:
            out["max_new_tokens"] = values["max_length"] - 1 - input_prefix
        if "max_new_tokens" in out:
            limit = max_new_tokens_limit if max_new_tokens_limit is not None else \
                out["max_new_tokens"]
            out["max_new_tokens"] = max(1, min(out["max_new_tokens"], limit))
        if "min_new_tokens" in values:
            out["min_new_tokens"] = values["min_new_tokens"]
        elif "min_length" in values:
            out["min_new_tokens"] = values["min_length"] - 1 - input_prefix
        if "min_new_tokens" in out:
            ceiling = out.get("max_new_tokens", max_new_tokens_limit)
            out["min_new_tokens"] = max(0, out["min_new_tokens"])
            if ceiling is not None:
                out["min_new_tokens"] = min(out["min_new_tokens"], ceiling)
        return out

    def merge(self, given: Mapping[str, Any], input_prefix: int = 0,
              max_new_tokens_limit: int | None = None, eos_token_id: int | None = None
              ) -> dict[str, Any]:
        """A request's DecodingOptions fields: those it gives (`given`, only the fields it
        set), the checkpoint's for the others; beam settings not for a request that
        samples."""
        defaults = self.decoding_fields(input_prefix, max_new_tokens_limit, eos_token_id)
        if given.get("do_sample"):
            beam_only = beam_fields()
            defaults = {k: v for k, v in defaults.items() if k not in beam_only}
        asked = given.get("max_new_tokens")
        if isinstance(asked, int) and asked > 0 and "min_new_tokens" in defaults:
            defaults["min_new_tokens"] = min(defaults["min_new_tokens"], asked)
        return {**defaults, **given}
