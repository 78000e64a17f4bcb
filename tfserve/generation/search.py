"""The per-sentence search state every strategy extends, and the registry of strategies.

A strategy is a Search subclass registered with `register_search(name, applies)`, where
`applies` tells from the options whether it is the one to run; `make_search` builds the one
strategy whose test accepts the options. The tests are disjoint, so the order in which the
strategy modules register does not matter.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np

from tfserve.generation.controls import RepetitionControls
from tfserve.generation.options import DecodingOptions, Hypothesis
from tfserve.step import SampleDraws


class GroupDecision(NamedTuple):
    """The next rows of several searches decided together (`Search.decide_group`), before
    any of them takes its part (`Search.take_decision`)."""

    parents: np.ndarray  # [n] int64: each next row's parent, an index into the group's rows
    tokens: np.ndarray  # [n] int64: each next row's token
    # [M+1]: search j's next rows are [bounds[j], bounds[j+1]), unless taking its part ends it
    bounds: list[int]
    detail: Any  # the strategy's own: what take_decision reads


class Search:
    """The per-sentence search state; subclasses decide tokens from log-probabilities.

    `advance` receives the logits [rows, V] of this search's current rows and their
    logsumexp [rows] (log-probabilities are logits - logsumexp; banned tokens are -inf in the
    logits but not in the logsumexp), and returns, for each of its next rows, the parent row
    and the new token.

    The first steps of a search with options.prefix_token_ids produce those tokens whatever
    the logits (`forcing`, `next_forced`); the search stays a single row until they are
    all out, so beams and samples fan out from the end of the prefix. With
    options.forced_eos the step of the max_new_tokens-th new token produces eos whatever
    the logits (`ending`), before any prefix token.

    Searches that decide from top candidates may also decide a step together, in a few numpy
    operations over all of them instead of one call each: those with equal `group_key`s go
    to `decide_group` at once, then each takes its part (`take_decision`); the outcome is
    that of `advance_candidates` on each.

    start_token_id is the model's decoder start token; options.decoder_start_token_id,
    where set, replaces it: the search's first row holds it (`last_tokens`), which is the
    input of its first decoder step.
    """

    def __init__(self, options: DecodingOptions, eos_token_id: int, start_token_id: int) -> None:
        self.options = options
        self.eos = eos_token_id
        if options.decoder_start_token_id is not None:
            start_token_id = int(options.decoder_start_token_id)
        self.start = start_token_id
        self.prefix = tuple(int(token) for token in options.prefix_token_ids)
        if eos_token_id in self.prefix:
            raise ValueError(f"prefix_token_ids must not contain the eos token "
                             f"(id {eos_token_id}): the output would end inside its prefix")
        self.forced = 0  # prefix tokens produced so far
        # prefix tokens that are decoder input rather than new tokens (see DecodingOptions)
        self.input_prefix = 0 if options.prefix_counts_as_new else len(self.prefix)
        self.controls = RepetitionControls.of(options)
        self.generated = 0  # new tokens decided so far, per row (an input prefix not counted)
        self.done = False
        self.finished: list[Hypothesis] = []
        self.rows = 1  # its rows in the batch (DecodeBatch keeps it after every step)
        # the input of its first decoder step (DecodeBatch keeps every row's next input)
        self.last_tokens = np.array([start_token_id], dtype=np.int64)
        self.streamed: list[int] = []  # tokens appended by the last step, for streaming
        # set by DecodeBatch.step when this search raised: it ended with this error, alone
        self.error: BaseException | None = None

    @property
    def forcing(self) -> bool:
        """Whether the next step produces a prefix token (unless it is `ending`)."""
        return self.forced < len(self.prefix)

    @property
    def ending(self) -> bool:
        """Whether the next step produces the forced eos: options.forced_eos is set and it
        decides the max_new_tokens-th new token (transformers forces eos at max_length - 1
        decoder tokens, which counts the start token and an input prefix). An input prefix
        (not counted as new) comes out first: it is transformers' decoder input, which
        the forced eos cannot replace."""
        options = self.options
        if not options.forced_eos:
            return False
        input_prefix_left = self.forcing and not options.prefix_counts_as_new
        return not input_prefix_left and self.generated == options.max_new_tokens - 1

    def next_forced(self) -> int:
        """The prefix token of this step; counts it as new where the options say so."""
        token = self.prefix[self.forced]
        self.forced += 1
        if self.options.prefix_counts_as_new:
            self.generated += 1
        return token

    def histories(self) -> np.ndarray:
        """Each current row's decoder sequence [rows, L], start token first (what the
        repetition controls look at)."""
        raise NotImplementedError

    def needs(self, count: int) -> int:
        """What `top_needed` answers for a strategy that decides from `count` candidates:
        a forced step needs none (1: any will do), repetition controls need every token."""
        if self.forcing or self.ending:
            return 1
        return 0 if self.controls is not None else count

    def block_eos(self, logits: np.ndarray) -> np.ndarray:
        if self.generated < self.options.min_new_tokens:
            logits = logits.copy()
            logits[:, self.eos] = -np.inf
        return logits

    def block_eos_candidates(self, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
        """block_eos for candidates: `values` [rows,K] of the token ids [rows,K]."""
        if self.generated < self.options.min_new_tokens:
            return np.where(ids == self.eos, -np.inf, values)
        return values

    def candidates_per_row(self) -> int:
        """Best tokens per row the batch should find for `advance` (0: none needed)."""
        return 0

    def top_needed(self) -> int:
        """Best tokens per row `advance_candidates` needs, banned ones not counted (0: the
        search needs the whole distribution, and only `advance` serves it)."""
        return 0

    def advance_candidates(self, ids: np.ndarray, log_probs: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
        """`advance` from each row's best tokens only: ids [rows,K] and their
        log-probabilities [rows,K] (banned tokens already -inf)."""
        raise NotImplementedError

    def device_draw(self) -> SampleDraws | None:
        """For a search whose step needs whole rows (top_needed 0, or more candidates than
        the backend gives): the draws the backend may make for it where the logits are,
        rows among its own (`SampleDraws`), so that no row comes to the host; None where it
        reads the rows itself (the default). Changes nothing: `advance_drawn` takes the
        drawn tokens, after the step."""
        return None

    def advance_drawn(self, tokens: np.ndarray, log_probs: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
        """`advance` from the tokens [S] drawn as this step's `device_draw` asked, with their
        log-probabilities [S] (logit - logsumexp of the row)."""
        raise NotImplementedError

    def group_key(self) -> Hashable | None:
        """What this step's searches must share to be decided together by `decide_group`
        (None: this step is its own, through `advance_candidates`: a forced token, the
        forced eos, repetition controls, or a strategy without a group decision). Searches
        of one strategy with equal keys have equal `top_needed()`."""
        return None

    @classmethod
    def decide_group(cls, searches: Sequence[Search], ids: np.ndarray, log_probs: np.ndarray
                     ) -> GroupDecision:
        """The step of `searches` (all with one group_key) from their rows' best tokens:
        ids [n,K] and log-probabilities [n,K] (banned tokens already -inf), the searches'
        rows one after the other. Changes no search: each then takes its part."""
        raise NotImplementedError

    def take_decision(self, decision: GroupDecision, index: int) -> None:
        """Take part `index` of a group's decision: the state `advance_candidates` leaves.
        Its next rows are the decision's (see GroupDecision.bounds), none if it is done."""
        raise NotImplementedError

    def advance(self, logits: np.ndarray, lse: np.ndarray,
                best: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """best: each row's top candidates_per_row() token ids (any order), when the batch
        computed them for all rows at once."""
        raise NotImplementedError

    def results(self) -> list[Hypothesis]:
        ordered = sorted(self.finished, key=lambda h: -h.score)
        return ordered[: self.options.num_return_sequences]


class Strategy(NamedTuple):
    """One entry of the registry."""

    name: str
    applies: Callable[[DecodingOptions], bool]  # whether these options ask for this strategy
    search: type[Search]


_STRATEGIES: dict[str, Strategy] = {}
SearchType = TypeVar("SearchType", bound=type[Search])


def register_search(name: str, applies: Callable[[DecodingOptions], bool]
                    ) -> Callable[[SearchType], SearchType]:
    """Class decorator: add a Search subclass to the strategies `make_search` chooses from.

    applies(options) must be false for the options every other strategy accepts.
    """

    def register(search: SearchType) -> SearchType:
        if name in _STRATEGIES:
            raise ValueError(f"a search strategy named {name!r} is already registered "
                             f"({_STRATEGIES[name].search.__name__})")
        _STRATEGIES[name] = Strategy(name, applies, search)
        return search

    return register


def registered_searches() -> dict[str, type[Search]]:
    """Strategy name -> its Search subclass, in the order they registered."""
    return {name: strategy.search for name, strategy in _STRATEGIES.items()}


def make_search(options: DecodingOptions, eos_token_id: int, start_token_id: int) -> Search:
    """The search state of one sentence, of the strategy the options ask for."""
    chosen = [strategy for strategy in _STRATEGIES.values() if strategy.applies(options)]
    if len(chosen) != 1:
        raise ValueError(f"the decoding options fit {len(chosen)} search strategies "
                         f"({[strategy.name for strategy in chosen]}) instead of one of "
                         f"{list(_STRATEGIES)}: {options}")
    return chosen[0].search(options, eos_token_id, start_token_id)
