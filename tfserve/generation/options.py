"""How to search (DecodingOptions and their limits) and what a search returns (Hypothesis).

The options a request sets are declared in tfserve.option_table (name, type, default,
limits): DecodingOptions has a field for each, and validate() checks each against its
declared limits. The fields the server sets itself (a prefix, forced eos, the start token)
are declared here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from tfserve import option_table
from tfserve.option_table import DEFAULT_MAX_NEW_TOKENS, Option

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "DecodingOptions", "Hypothesis"]

_Class = TypeVar("_Class")


def _option_fields(cls: type[_Class]) -> type[_Class]:
    """A class decorator: the class becomes a dataclass with a field per declared option
    (option_table.OPTIONS, in order, with its type and default), then its own fields."""
    own = dict(cls.__dict__.get("__annotations__", {}))
    cls.__annotations__ = {**{declared.name: declared.annotation
                              for declared in option_table.OPTIONS}, **own}
    for declared in option_table.OPTIONS:
        setattr(cls, declared.name, declared.default)
    return dataclass(cls)


def _integer(name: str, value: Any, low: float | None, high: float | None = None,
             why: str = "") -> None:
    """ValueError naming `name` unless value is an integer in [low, high] (None: no bound;
    an upper bound goes with a lower one)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is None:
        return
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}{why}, got {value}")


def _boolean(name: str, value: Any, extra_values: tuple[str, ...] = ()) -> None:
    """ValueError naming `name` unless value is a boolean (or one of extra_values)."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, str)
                                                and value in extra_values):
        return
    if extra_values:
        words = ["true", "false", *(f'"{extra}"' for extra in extra_values)]
        raise ValueError(f"{name} must be {', '.join(words[:-1])} or {words[-1]}, "
                         f"got {value!r}")
    raise ValueError(f"{name} must be a boolean, got {value!r}")


def check_option(declared: Option, value: Any, high: float | None = None,
                 why: str = "") -> None:
    """ValueError naming the option unless `value` is of its type and inside its declared
    limits; `high` (with `why`, said after the range) replaces the upper bound where the
    request decides it. A None value passes where the option's default is None."""
    if value is None and declared.default is None:
        return
    name = declared.name
    if declared.type is bool:
        _boolean(name, value, declared.extra_values)
    elif declared.type is int:
        _integer(name, value, declared.low, high if high is not None else declared.high, why)
    else:  # float, declared with both bounds (which NaN and infinities are outside)
        low, top = declared.low, declared.high
        inside = isinstance(value, (int, float)) and not isinstance(value, bool) and (
            (low < value if declared.low_open else low <= value) and value <= top)
        if not inside:  # one message for a value of another type and one out of range
            raise ValueError(f"{name} must be {declared.limits_text}{declared.off_note}, "
                             f"got {value!r}")


@_option_fields
class DecodingOptions:
    """How to search. Defaults give greedy decoding up to 256 new tokens (or the model's limit).

    Its first fields are the options a request sets, tfserve.option_table.OPTIONS, each
    with its declared type and default; the fields declared below follow them.

    max_new_tokens None means min(256, the model's target positions - 1, less an input
    prefix), set by validate().

    Output controls, all off by default (the searches then run exactly as without them):

    - prefix_token_ids: the output's first tokens, forced. A target language token
      (NLLB, M2M100, mBART-50) and a target prefix (text the output must start with) are
      both such a prefix; requests with different prefixes decode in the same batch. The
      forced tokens are part of every Hypothesis.token_ids and add 0 to its score (the
      forced token's log-probability in the constrained distribution). How they count is
      prefix_counts_as_new's choice:
      False (a target prefix; transformers' generate(decoder_input_ids=[[start, *prefix]])):
      they are decoder input, not new tokens: max_new_tokens and min_new_tokens count the
      tokens after them, and a beam's length (for length_penalty) leaves them out;
      True (forced tokens; transformers' forced_bos_token_id for a single token): they are
      the first new tokens: max_new_tokens, min_new_tokens and the beam length count them.
    - repetition_penalty (transformers' RepetitionPenaltyLogitsProcessor): every token
      already in the decoder sequence (the start token and the prefix included) has its
      score divided by the penalty where positive and multiplied by it where negative.
      As in transformers, greedy search and sampling penalise the logits (before the
      softmax, temperature and filters), beam search penalises the log-probabilities.
    - no_repeat_ngram_size (transformers' NoRepeatNGramLogitsProcessor): no n-gram of this
      size occurs twice in the decoder sequence (the start token and the prefix included):
      a token that would complete a repeat is banned.
    - forced_eos (transformers' forced_eos_token_id, ForcedEOSTokenLogitsProcessor, with
      the model's eos as the forced token): the max_new_tokens-th new token is eos
      whatever the model scores, so an output that reaches the limit ends with eos (and
      has max_new_tokens - 1 tokens after an input prefix) instead of being cut. As in
      transformers the forced eos adds 0 to the score (beam search: the beam's sum, then
      divided by max_new_tokens ** length_penalty), it overrides min_new_tokens (which
      max_new_tokens bounds) and the repetition controls, and it takes the place of a
      prefix token counted as new that would fall on that step (max_new_tokens <= the
      prefix's length).
    - decoder_start_token_id: the token decoding starts from, for this request (None: the
      model's). mBART-cc25 starts from the target language token, so each request names
      its own; rows of one batch may start from different tokens. It is the first token of
      the decoder sequence the repetition controls see.

    early_stopping (beam search, transformers' values): False stops when no running beam,
    scored at its current length, can beat the worst of num_beams finished hypotheses;
    True as soon as num_beams hypotheses finished; "never" when no running beam can beat
    it scored at max_new_tokens (with length_penalty > 0; otherwise as False): the
    canonical beam search, which runs longer.

    Scores with these controls: a hypothesis' score is the sum of its tokens' model
    log-probabilities, a repeated token's multiplied by the repetition penalty (as
    transformers' beam search scores them), forced tokens 0; the bans (the model's banned
    tokens, eos before min_new_tokens, repeated n-grams) never renormalise.
    """

    prefix_token_ids: tuple[int, ...] = ()
    prefix_counts_as_new: bool = False
    forced_eos: bool = False
    decoder_start_token_id: int | None = None  # None: the model's

    # the declared limits (tfserve.option_table), by their DecodingOptions names
    MAX_BEAMS = option_table.MAX_BEAMS
    MAX_ABS_LENGTH_PENALTY = option_table.MAX_ABS_LENGTH_PENALTY
    MIN_TEMPERATURE = option_table.MIN_TEMPERATURE
    MAX_TEMPERATURE = option_table.MAX_TEMPERATURE
    MAX_REPETITION_PENALTY = option_table.MAX_REPETITION_PENALTY
    MIN_REPETITION_PENALTY = option_table.MIN_REPETITION_PENALTY
    MAX_NO_REPEAT_NGRAM_SIZE = option_table.MAX_NO_REPEAT_NGRAM_SIZE

    def validate(self, max_new_tokens_limit: int | None = None, *,
                 vocab_size: int | None = None, eos_token_id: int | None = None
                 ) -> DecodingOptions:
        """Raise ValueError naming the first option outside its limit.

        max_new_tokens_limit: the model's target positions - 1 (the start token takes one);
        an input prefix takes its length more. vocab_size and eos_token_id, where given,
        check prefix_token_ids and decoder_start_token_id against the model (make_search
        checks eos again).

        Returns the options to use: self, or a copy with max_new_tokens filled in when it is
        None and prefix_token_ids as a tuple of ints (the caller's object is never changed,
        so it can be reused with another model).
        """
        prefix = self._checked_prefix(vocab_size, eos_token_id)
        if not isinstance(self.prefix_counts_as_new, (bool, np.bool_)):
            raise ValueError(f"prefix_counts_as_new must be a boolean, "
                             f"got {self.prefix_counts_as_new!r}")
        input_prefix = 0 if self.prefix_counts_as_new else len(prefix)
        limit = max_new_tokens_limit
        if limit is not None and input_prefix:
            if input_prefix >= limit:
                raise ValueError(f"prefix_token_ids has {input_prefix} tokens, over the "
                                 f"model's limit of {limit - 1} (its target positions less "
                                 f"the start token and one new token)")
            limit -= input_prefix
        if self.max_new_tokens is None or prefix is not self.prefix_token_ids:
            max_new_tokens = self.max_new_tokens
            if max_new_tokens is None:
                max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, limit or DEFAULT_MAX_NEW_TOKENS)
            return dataclasses.replace(self, max_new_tokens=max_new_tokens,
                                       prefix_token_ids=prefix).validate(
                max_new_tokens_limit, vocab_size=vocab_size, eos_token_id=eos_token_id)

        # the bounds a request decides: the model's limit less an input prefix, and the
        # beams a search keeps (a sampled request's samples are bounded by the table only)
        highs = {"max_new_tokens": (limit, f" (the model's limit less the {input_prefix} "
                                           f"tokens of prefix_token_ids)"
                                    if input_prefix and limit is not None else ""),
                 "min_new_tokens": (self.max_new_tokens, "")}
        for declared in option_table.OPTIONS:
            high, why = highs.get(declared.name, (None, ""))
            if declared.name == "num_return_sequences" and not self.do_sample:
                high = self.num_beams
            check_option(declared, getattr(self, declared.name), high, why)
        if self.prefix_counts_as_new and self.max_new_tokens < len(prefix):
            raise ValueError(f"max_new_tokens must be >= the {len(prefix)} tokens of "
                             f"prefix_token_ids when prefix_counts_as_new is set, "
                             f"got {self.max_new_tokens}")
        if self.do_sample and self.num_beams > 1:
            raise ValueError("num_beams must be 1 when do_sample is set (no beam sampling)")
        _boolean("forced_eos", self.forced_eos)
        if self.decoder_start_token_id is not None:
            high = vocab_size - 1 if vocab_size is not None else None
            _integer("decoder_start_token_id", self.decoder_start_token_id, 0, high,
                     " (a token id of the model)" if high is not None else "")
        return self

    def _checked_prefix(self, vocab_size: int | None, eos_token_id: int | None
                        ) -> tuple[int, ...]:
        """prefix_token_ids as a tuple of ints, or ValueError naming the field."""
        value = self.prefix_token_ids
        if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list, np.ndarray)):
            raise ValueError(f"prefix_token_ids must be a sequence of token ids, got {value!r}")
        for token in value:
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
                raise ValueError(f"prefix_token_ids must hold integer token ids, got {token!r}")
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                bound = f"in [0, {vocab_size - 1}]" if vocab_size is not None else ">= 0"
                raise ValueError(f"prefix_token_ids must hold token ids {bound}, got {token}")
            if eos_token_id is not None and token == eos_token_id:
                raise ValueError(f"prefix_token_ids must not contain the eos token "
                                 f"(id {eos_token_id}): the output would end inside its prefix")
        if isinstance(value, tuple) and all(type(token) is int for token in value):
            return value  # already in shape: validate() returns self
        return tuple(int(token) for token in value)


@dataclass
class Hypothesis:
    """One output sequence: token ids (no start token, no eos) and its score.

    token_ids begin with the options' prefix_token_ids, whether they count as new tokens or
    not (unless forced_eos ended the output inside a prefix counted as new). Greedy and
    sampling scores are the sum of the model's log-probabilities of the tokens (eos
    included when it was produced); beam scores are that sum divided by
    length ** length_penalty, length counting the eos and the new tokens (not an input
    prefix: see DecodingOptions). Forced prefix tokens and a forced eos add 0; with a
    repetition_penalty a repeated token's log-probability is multiplied by it.
    """

    token_ids: list[int]
    score: float
    finished: bool = True  # False: stopped by max_new_tokens before eos
