"""How to search (DecodingOptions and their limits) and what a search returns (Hypothesis)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

DEFAULT_MAX_NEW_TOKENS = 256


@dataclass
class DecodingOptions:
    """How to search. Defaults give greedy decoding up to 256 new tokens (or the model's limit).

    max_new_tokens None means min(256, the model's target positions - 1), set by validate().
    """

    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    num_return_sequences: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int | None = None

    MAX_BEAMS = 16
    # beyond these the scores over- or underflow (length ** length_penalty) or the tempered
    # distribution is all one token or all noise; common settings sit well inside
    MAX_ABS_LENGTH_PENALTY = 10.0
    MIN_TEMPERATURE = 1e-4
    MAX_TEMPERATURE = 100.0

    def validate(self, max_new_tokens_limit: int | None = None) -> DecodingOptions:
        """Raise ValueError naming the first option outside its limit.

        Returns the options to use: self, or a copy with max_new_tokens filled in when it is
        None (the caller's object is never changed, so it can be reused with another model).
        """
        if self.max_new_tokens is None:
            return dataclasses.replace(self, max_new_tokens=min(
                DEFAULT_MAX_NEW_TOKENS, max_new_tokens_limit or DEFAULT_MAX_NEW_TOKENS)
            ).validate(max_new_tokens_limit)

        def integer(name: str, low: int, high: int | None = None) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value < low or (high is not None and value > high):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"{name} must be {bound}, got {value}")

        integer("max_new_tokens", 1, max_new_tokens_limit)
        integer("min_new_tokens", 0, self.max_new_tokens)
        integer("num_beams", 1, self.MAX_BEAMS)
        integer("top_k", 0)
        if self.do_sample:
            if self.num_beams > 1:
                raise ValueError("num_beams must be 1 when do_sample is set (no beam sampling)")
            integer("num_return_sequences", 1, self.MAX_BEAMS)
        else:
            integer("num_return_sequences", 1, self.num_beams)
        if not (isinstance(self.temperature, (int, float)) and not isinstance(
                self.temperature, bool)
                and self.MIN_TEMPERATURE <= self.temperature <= self.MAX_TEMPERATURE):
            raise ValueError(f"temperature must be in [{self.MIN_TEMPERATURE}, "
                             f"{self.MAX_TEMPERATURE}], got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        limit = self.MAX_ABS_LENGTH_PENALTY
        if not (isinstance(self.length_penalty, (int, float))
                and not isinstance(self.length_penalty, bool)
                and -limit <= self.length_penalty <= limit):
            raise ValueError(f"length_penalty must be in [{-limit}, {limit}], "
                             f"got {self.length_penalty!r}")
        if self.seed is not None:
            integer("seed", 0, 2**63 - 1)
        return self


@dataclass
class Hypothesis:
    """One output sequence: token ids (no start token, no eos) and its score.

    Greedy and sampling scores are the sum of the model's log-probabilities of the tokens
    (eos included when it was produced); beam scores are that sum divided by
    length ** length_penalty, length counting the eos.
    """

    token_ids: list[int]
    score: float
    finished: bool = True  # False: stopped by max_new_tokens before eos
