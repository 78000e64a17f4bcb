"""Search over a step function: greedy, beam search and sampling, written once for every backend.

The search code sees numpy logits and an opaque KV cache; a backend (`tfserve.runtime`'s
ONNX Runtime sessions, or `tfserve.eager`'s PyTorch model) runs the encoder and one decoder
step and knows how to select, concatenate and trim cache rows. It imports numpy only.

`DecodeBatch` is the one decoding loop. It holds the rows of many searches at once; between
two steps finished searches leave and new ones join (continuous batching), which the
per-row `position_ids` and `self_attention_mask` of the decoder interface make possible:
a row that joins late has holes (mask 0) where the others have history. Offline `generate`
is the same loop with every search added up front.

Every search starts from a single row holding the decoder start token; beam search and
sampling fan out to their beams / samples after the first step, so the first step and the
cross-attention K/V are never computed per beam.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

DEFAULT_MAX_NEW_TOKENS = 256
Cache = Any  # a backend's per-layer tensors; the search code never looks inside


class StepOutput(NamedTuple):
    """One decoder call, as the search sees it."""

    logits: np.ndarray  # float32 [B,T,V]
    present: Cache
    # where the backend computes them (graph revision 2): each position's best
    # log-probabilities [B,T,K], best first, and their token ids [B,T,K]
    top_log_probs: np.ndarray | None = None
    top_ids: np.ndarray | None = None


class Backend(Protocol):
    """What the search needs from a model: an encoder, one decoder step, cache row ops."""

    vocab_size: int
    eos_token_id: int
    pad_token_id: int  # never generated (as Marian's bad_words_ids), unless it is also eos
    # step accepts cross K/V and encoder mask with B/G rows, row r using row r // G
    grouped_cross: bool
    decoder_start_token_id: int
    max_target_positions: int

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[Any, Cache]:
        """input_ids/attention_mask int64 [B,S] -> (hidden states [B,S,D], cross K/V cache)."""

    def step(
        self,
        input_ids: np.ndarray,
        position_ids: np.ndarray,
        self_attention_mask: np.ndarray,
        encoder_attention_mask: np.ndarray,
        past: Cache,
        cross: Cache,
    ) -> StepOutput:
        """One decoder call: logits float32 [B,T,V] as numpy, the present cache, and each
        position's top candidates where the backend has them."""

    def empty_past(self, rows: int) -> Cache:
        """A self-attention cache of length 0 for `rows` rows."""

    def take_rows(self, cache: Cache, index: np.ndarray, reuse: bool = False) -> Cache:
        """Rows `index` of every tensor (axis 0): reorder, duplicate or drop rows.

        reuse: the caller hands `cache` over, so its storage may be rewritten in place.
        """

    def concat_rows(self, caches: Sequence[Cache], length: int | None = None,
                    left: bool = False, first_rows: np.ndarray | None = None,
                    first_time: tuple[int, int] | None = None) -> Cache:
        """Rows of several caches stacked (axis 0). Their time axes (2) must agree, unless
        `length` is given: then each is zero-padded to it on the left or on the right (in the
        same pass, where the backend can). first_rows: only these rows of the first cache,
        in this order; first_time: only positions [start, stop) of its time axis (both
        taken in the same pass, where the backend can)."""

    def pad_time(self, cache: Cache, length: int, left: bool) -> Cache:
        """Zero-pad the time axis (2) to `length`, on the left or on the right."""

    def slice_time(self, cache: Cache, start: int, stop: int) -> Cache:
        """Keep positions [start, stop) of the time axis (2)."""


# -- options --------------------------------------------------------------------------------


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
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0
                and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.length_penalty, (int, float))
                and math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
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


_POOL: ThreadPoolExecutor | None = None
PARALLEL_MIN_ELEMENTS = 1 << 20  # below this, threads cost more than they save
SCORE_BLOCK_ELEMENTS = 1 << 18  # rows per score_rows block: ~1 MiB of float32 logits


def _threaded(logits: np.ndarray) -> bool:
    """Whether a pass over logits [R,V] is worth splitting by rows over threads."""
    return (os.cpu_count() or 1) >= 2 and logits.size >= PARALLEL_MIN_ELEMENTS and (
        logits.shape[0] >= 2)


def _row_chunks(logits: np.ndarray) -> list[np.ndarray]:
    if not _threaded(logits):
        return [logits]
    return np.array_split(logits, min(os.cpu_count() or 1, logits.shape[0]))


def _logsumexp_rows(logits: np.ndarray) -> np.ndarray:
    peak = logits.max(axis=-1)  # [R]
    shifted = np.subtract(logits, peak[:, None])
    np.exp(shifted, out=shifted)
    return peak + np.log(shifted.sum(axis=-1))


def top_k_unordered(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of each row's k largest logits [R,k], in no particular order."""
    vocab = logits.shape[-1]
    if k >= vocab:
        return np.broadcast_to(np.arange(vocab), logits.shape)
    return np.argpartition(logits, vocab - k, axis=-1)[:, vocab - k :]


def score_rows(logits: np.ndarray, banned: int | None, k: int
               ) -> tuple[np.ndarray, np.ndarray | None]:
    """One pass over float32 logits [R,V] for a decoder step, edited in place.

    Returns each row's logsumexp [R], taken before token `banned` (if any) is set to -inf,
    and the indices of each row's k largest remaining logits [R,k] in no order (None for
    k = 0). Rows go to the thread pool in blocks of a few rows, so the top-k reads a block
    while it is still in cache from the logsumexp (numpy releases the GIL in both).
    """

    def block(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        lse = _logsumexp_rows(rows)
        if banned is not None:
            rows[:, banned] = -np.inf
        return lse, top_k_unordered(rows, k) if k else None

    if not _threaded(logits):
        return block(logits)
    step = max(1, SCORE_BLOCK_ELEMENTS // logits.shape[1])
    parts = list(numpy_pool().map(block, [logits[i: i + step]
                                          for i in range(0, logits.shape[0], step)]))
    lse = np.concatenate([part[0] for part in parts])
    return lse, np.concatenate([part[1] for part in parts]) if k else None  # type: ignore[misc]


def numpy_pool() -> ThreadPoolExecutor:
    """The process's threads for GIL-releasing numpy work (search and host cache copies)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="tfserve-numpy")
    return _POOL


def logsumexp(logits: np.ndarray) -> np.ndarray:
    """Row-wise log(sum(exp(logits))) of float32 logits [R,V] -> [R].

    log-probabilities are logits - logsumexp[:, None]; searches form them only where needed
    (greedy: one entry per row), which saves several passes over [R, V] per step. Large
    inputs are split by rows over threads (numpy releases the GIL in exp and sum).
    """
    chunks = _row_chunks(logits)
    if len(chunks) == 1:
        return _logsumexp_rows(logits)
    return np.concatenate(list(numpy_pool().map(_logsumexp_rows, chunks)))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of float32 logits [R,V]."""
    return logits - logsumexp(logits)[:, None]


# -- searches -------------------------------------------------------------------------------


class Search:
    """The per-sentence search state; subclasses decide tokens from log-probabilities.

    `advance` receives the logits [rows, V] of this search's current rows and their
    logsumexp [rows] (log-probabilities are logits - logsumexp; banned tokens are -inf in the
    logits but not in the logsumexp), and returns, for each of its next rows, the parent row
    and the new token.
    """

    def __init__(self, options: DecodingOptions, eos_token_id: int, start_token_id: int) -> None:
        self.options = options
        self.eos = eos_token_id
        self.start = start_token_id
        self.generated = 0  # tokens decided so far, per row
        self.done = False
        self.finished: list[Hypothesis] = []
        self.rows = 1
        self.last_tokens = np.array([start_token_id], dtype=np.int64)
        self.streamed: list[int] = []  # tokens appended by the last step, for streaming

    def block_eos(self, logits: np.ndarray) -> np.ndarray:
        if self.generated < self.options.min_new_tokens:
            logits = logits.copy()
            logits[:, self.eos] = -np.inf
        return logits

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

    def advance(self, logits: np.ndarray, lse: np.ndarray,
                best: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """best: each row's top candidates_per_row() token ids (any order), when the batch
        computed them for all rows at once."""
        raise NotImplementedError

    def results(self) -> list[Hypothesis]:
        ordered = sorted(self.finished, key=lambda h: -h.score)
        return ordered[: self.options.num_return_sequences]


class GreedySearch(Search):
    def __init__(self, options: DecodingOptions, eos_token_id: int, start_token_id: int) -> None:
        super().__init__(options, eos_token_id, start_token_id)
        self.tokens: list[int] = []
        self.score = 0.0

    def top_needed(self) -> int:
        return 1

    def advance(self, logits: np.ndarray, lse: np.ndarray,
                best: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        row = self.block_eos(logits)[0]
        token = int(row.argmax())
        return self._choose(token, float(row[token] - lse[0]))

    def advance_candidates(self, ids: np.ndarray, log_probs: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
        values = log_probs[0]
        if self.generated < self.options.min_new_tokens:
            values = np.where(ids[0] == self.eos, -np.inf, values)
        best = int(values.argmax())  # the first of equal maxima, as argmax over the row
        return self._choose(int(ids[0, best]), float(values[best]))

    def _choose(self, token: int, log_prob: float) -> tuple[np.ndarray, np.ndarray]:
        self.score += log_prob
        self.generated += 1
        if token == self.eos:
            self.finished.append(Hypothesis(list(self.tokens), self.score))
            self.done, self.streamed = True, []
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        self.tokens.append(token)
        self.streamed = [token]
        if self.generated >= self.options.max_new_tokens:
            self.finished.append(Hypothesis(list(self.tokens), self.score, finished=False))
            self.done = True
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.zeros(1, np.int64), np.array([token], np.int64)


def filter_logits(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Top-k then nucleus filtering of logits [R,V]; removed entries become -inf.

    Nucleus keeps the smallest set of most likely tokens whose probability reaches top_p
    (the most likely token is always kept).
    """
    logits = logits.copy()
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = np.partition(logits, vocab - top_k, axis=-1)[:, vocab - top_k][:, None]  # [R,1]
        logits[logits < kth] = -np.inf
    if top_p < 1.0:
        order = np.argsort(-logits, axis=-1, kind="stable")  # [R,V] most likely first
        sorted_logits = np.take_along_axis(logits, order, axis=-1)
        probs = np.exp(log_softmax(sorted_logits))
        before = np.cumsum(probs, axis=-1) - probs  # probability mass ahead of each token
        remove_sorted = before >= top_p
        remove_sorted[:, 0] = False
        remove = np.zeros_like(remove_sorted)
        np.put_along_axis(remove, order, remove_sorted, axis=-1)
        logits[remove] = -np.inf
    return logits


class SamplingSearch(Search):
    """num_return_sequences independent samples from the tempered, filtered distribution.

    Each search owns its random generator, seeded from the request, so the same seed gives
    the same output whatever else shares the batch.
    """

    def __init__(self, options: DecodingOptions, eos_token_id: int, start_token_id: int) -> None:
        super().__init__(options, eos_token_id, start_token_id)
        seed = options.seed if options.seed is not None else int(np.random.SeedSequence().entropy
                                                                 % 2**63)
        self.rng = np.random.default_rng(seed)
        self.samples: list[list[int]] = [[]]
        self.scores: list[float] = [0.0]

    def advance(self, logits: np.ndarray, lse: np.ndarray,
                best: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        logits = self.block_eos(logits)
        if self.generated == 0:  # fan the single start row out to the samples
            count = self.options.num_return_sequences
            parents = np.zeros(count, np.int64)
            self.samples = [[] for _ in range(count)]
            self.scores = [0.0] * count
        else:
            parents = np.arange(self.rows, dtype=np.int64)
        scaled = logits[parents] / self.options.temperature  # banned tokens stay -inf
        probs = np.exp(log_softmax(filter_logits(scaled, self.options.top_k, self.options.top_p)))
        self.generated += 1
        keep_parents, keep_tokens, keep_samples, keep_scores = [], [], [], []
        for slot, parent in enumerate(parents):
            # inverse-CDF draw: one uniform per row keeps the stream reproducible
            cdf = np.cumsum(probs[slot], dtype=np.float64)
            token = int(min(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"),
                            len(cdf) - 1))
            while probs[slot, token] == 0.0:  # never land on a filtered-out token
                token -= 1
            score = self.scores[slot] + float(logits[parent, token] - lse[parent])
            tokens = self.samples[slot]
            if token == self.eos:
                self.finished.append(Hypothesis(list(tokens), score))
            elif self.generated >= self.options.max_new_tokens:
                self.finished.append(Hypothesis(tokens + [token], score, finished=False))
            else:
                keep_parents.append(parent)
                keep_tokens.append(token)
                keep_samples.append(tokens + [token])
                keep_scores.append(score)
        self.samples, self.scores = keep_samples, keep_scores
        self.streamed = keep_tokens if self.options.num_return_sequences == 1 else []
        self.done = not keep_parents
        return np.array(keep_parents, np.int64), np.array(keep_tokens, np.int64)

    def results(self) -> list[Hypothesis]:
        return list(self.finished)  # samples in the order they finished; scores are not ranks


class BeamSearch(Search):
    """Beam search keeping num_beams running hypotheses and the best finished ones.

    Each step scores 2 * num_beams candidates so that enough non-eos continuations remain
    after the eos candidates are set aside. An eos candidate outside the top num_beams is
    ignored. With early_stopping the search ends as soon as num_beams hypotheses finished;
    without it, when no running beam can still beat the worst kept hypothesis.
    """

    def __init__(self, options: DecodingOptions, eos_token_id: int, start_token_id: int) -> None:
        super().__init__(options, eos_token_id, start_token_id)
        self.beams: list[list[int]] = [[]]
        self.beam_scores = np.zeros(1, np.float64)

    def normalized(self, sum_logprobs: float, length: int) -> float:
        return sum_logprobs / (length**self.options.length_penalty)

    def keep_finished(self, tokens: list[int], sum_logprobs: float, complete: bool) -> None:
        length = len(tokens) + (1 if complete else 0)
        self.finished.append(Hypothesis(tokens, self.normalized(sum_logprobs, length), complete))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.options.num_beams :]

    def candidates_per_row(self) -> int:
        """Tokens per row `advance` must see: 2K, plus one in case eos is blocked."""
        return 2 * self.options.num_beams + 1

    def top_needed(self) -> int:
        return 2 * self.options.num_beams

    def advance(self, logits: np.ndarray, lse: np.ndarray,
                best: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        # the best 2K candidates overall are among each row's best 2K tokens: rank those only
        if best is None:
            per_row = min(self.candidates_per_row(), logits.shape[1])
            best = top_k_unordered(logits, per_row)  # [rows, 2K+1]
        values = np.take_along_axis(logits, best, axis=-1)
        # offset: beam score minus the row's normaliser
        return self._select(best, values, self.beam_scores - lse, logits.shape[1])

    def advance_candidates(self, ids: np.ndarray, log_probs: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
        return self._select(ids, log_probs, self.beam_scores, int(ids.max()) + 1)

    def _select(self, best: np.ndarray, values: np.ndarray, offset: np.ndarray, vocab: int
                ) -> tuple[np.ndarray, np.ndarray]:
        """Keep the best num_beams continuations among candidates best [rows,k] whose
        scores are offset [rows] + values [rows,k]; vocab: any bound above the token ids."""
        num_beams = self.options.num_beams
        rows = best.shape[0]
        if self.generated < self.options.min_new_tokens:
            values = np.where(best == self.eos, -np.inf, values)  # eos not allowed yet
        scores_2k = (offset[:, None] + values).ravel()
        flat_2k = (np.arange(rows)[:, None] * vocab + best).ravel()  # beam * V + token
        count = min(2 * num_beams, scores_2k.size)
        top = np.lexsort((flat_2k, -scores_2k))[:count]  # best first, ties by beam then token
        self.generated += 1
        parents, tokens, scores = [], [], []
        for rank, (flat, score) in enumerate(zip(flat_2k[top].tolist(),
                                                 scores_2k[top].tolist())):
            beam, token = divmod(flat, vocab)
            if not math.isfinite(score):
                break
            if token == self.eos:
                if rank < num_beams:
                    self.keep_finished(list(self.beams[beam]), score, complete=True)
                continue
            parents.append(beam)
            tokens.append(token)
            scores.append(score)
            if len(parents) == num_beams:
                break
        self.beams = [self.beams[p] + [t] for p, t in zip(parents, tokens)]
        self.beam_scores = np.array(scores, np.float64)
        self.done = self.is_done()
        if not self.done and self.generated >= self.options.max_new_tokens:
            for beam, score in zip(self.beams, self.beam_scores):
                self.keep_finished(list(beam), float(score), complete=False)
            self.done = True
        if self.done:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.array(parents, np.int64), np.array(tokens, np.int64)

    def is_done(self) -> bool:
        if not self.beams:
            return True
        if len(self.finished) < self.options.num_beams:
            return False
        if self.options.early_stopping:
            return True
        # heuristic (as Hugging Face's early_stopping=False): the best running beam, scored at
        # its current length, cannot beat the worst kept hypothesis
        attainable = self.normalized(float(self.beam_scores.max()), self.generated)
        return self.finished[-1].score >= attainable


def make_search(options: DecodingOptions, eos_token_id: int, start_token_id: int) -> Search:
    if options.do_sample:
        return SamplingSearch(options, eos_token_id, start_token_id)
    if options.num_beams > 1:
        return BeamSearch(options, eos_token_id, start_token_id)
    return GreedySearch(options, eos_token_id, start_token_id)


# -- the decoding loop ----------------------------------------------------------------------


@dataclass
class _Member:
    search: Search | _Retired
    tag: Any  # the caller's handle (a request, an index)
    encoder_rows: int = 0  # valid source tokens, for trimming the cross-attention time axis

    @property
    def retired(self) -> bool:
        return isinstance(self.search, _Retired)


class _Retired:
    """The rows of a finished search, left in the batch until the next compaction: they
    step along on pad tokens at position 0, and what the decoder makes of them is ignored.

    Dropping a finished row means a copy of the whole cache (the other rows' self and cross
    K/V): with rows finishing one by one, as sentences of different lengths do, that was a
    copy per step. Retired rows wait for the next join, which copies the cache anyway and
    drops them in the same pass, or for enough of them to be worth a copy of their own
    (`DecodeBatch.RETIRED_SHARE`, `RETIRED_STEPS`).
    """

    def __init__(self, rows: int, pad_token_id: int, since: int) -> None:
        self.rows = rows
        self.since = since  # the batch's step count when it retired
        self.last_tokens = np.full(rows, pad_token_id, np.int64)
        self.parents = np.arange(rows)

    def top_needed(self) -> int:
        return 1  # any candidates will do: they are ignored

    def candidates_per_row(self) -> int:
        return 0


class Joining(NamedTuple):
    """Searches joining a DecodeBatch together with their encoder run's outputs: one start row
    each; `cross` [N,H,S,Dh] per layer and `encoder_attention_mask` [N,S]."""

    searches: Sequence[Search]
    tags: Sequence[Any]
    cross: Cache
    encoder_attention_mask: np.ndarray


@dataclass
class DecodeBatch:
    """Rows of many searches decoded together, one token per step.

    Row bookkeeping (numpy): `position_ids` [R] of the next token, `self_attention_mask`
    [R,P] over the cache; the backend's `past` cache [R,H,P,Dh] per layer. The members'
    rows are contiguous blocks in member order. The encoder side is kept once per member,
    not per row: `cross` [M,H,S,Dh] per layer and `encoder_attention_mask` [M,S], so beams
    never copy their sentence's K/V. When every member has the same number of rows G, the
    decoder gets them as they are (grouped cross-attention, graph revision 5); otherwise
    (or with older graphs) they are repeated to one per row for the step, and that copy is
    kept until the layout changes. `slots` holds every member's rows, finished ones included
    until a compaction (`_Retired`); `members` are the searches still running.
    """

    backend: Backend
    # every member's rows, in row order; finished members' rows stay as _Retired until the
    # next compaction
    slots: list[_Member] = field(default_factory=list)
    past: Cache = None
    cross: Cache = None
    self_attention_mask: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    encoder_attention_mask: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    position_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    steps: int = 0
    _per_row: tuple | None = None  # (layout, cross, its rows repeated per decoder row, mask)
    # decide greedy and beam rows from the backend's top candidates when it has them (off:
    # always from the full logits; both give the same tokens, see tests/test_runtime.py)
    use_top_candidates: bool = True

    # compact (copy the cache without the retired rows) when they are this share of the rows
    # (1/RETIRED_SHARE), or when the oldest retired RETIRED_STEPS steps ago
    RETIRED_SHARE = 8
    RETIRED_STEPS = 8

    @property
    def rows(self) -> int:
        return int(self.position_ids.shape[0])

    @property
    def members(self) -> list[_Member]:
        """The searches still running, in row order."""
        return [member for member in self.slots if not member.retired]

    @property
    def retired_rows(self) -> int:
        return sum(member.search.rows for member in self.slots if member.retired)

    def __len__(self) -> int:
        return sum(1 for member in self.slots if not member.retired)

    def _live_index(self) -> tuple[np.ndarray, np.ndarray]:
        """Rows and slot positions of the running members (the retired ones dropped)."""
        rows, positions, row = [], [], 0
        for position, member in enumerate(self.slots):
            if not member.retired:
                rows.append(np.arange(row, row + member.search.rows))
                positions.append(position)
            row += member.search.rows
        return (np.concatenate(rows) if rows else np.zeros(0, np.int64),
                np.array(positions, np.int64))

    def add(self, searches: Sequence[Search], tags: Sequence[Any], cross: Cache,
            encoder_attention_mask: np.ndarray) -> None:
        """Join new searches (one start row each) with their encoder outputs [N,...]."""
        self.join([Joining(searches, tags, cross, encoder_attention_mask)])

    def join(self, groups: Sequence[Joining]) -> None:
        """Join the searches of several encoder runs at once: the running cache, the
        newcomers' empty history and every group's cross K/V go through one
        `Backend.concat_rows` per cache, not one per group (on the host that is one copy per
        tensor; the device path still concatenates pairwise inside it)."""
        groups = [group for group in groups if len(group.searches)]
        if not groups:
            return
        for group in groups:
            if len(group.searches) != group.encoder_attention_mask.shape[0]:
                raise ValueError("one encoder row per search is required")
        count = sum(len(group.searches) for group in groups)
        masks = [group.encoder_attention_mask.astype(np.int64, copy=False) for group in groups]
        crosses = [group.cross for group in groups]
        # retired rows leave in the copy the join makes anyway, and so do the cache columns
        # that no kept row uses (what _reorder cuts when rows leave between joins)
        keep_rows = keep_slots = past_time = cross_time = None
        if self.rows and self.retired_rows:
            keep_rows, keep_slots = self._live_index()
            self.slots = [self.slots[i] for i in keep_slots]
            self.self_attention_mask = self.self_attention_mask[keep_rows]
            self.encoder_attention_mask = self.encoder_attention_mask[keep_slots]
            self.position_ids = self.position_ids[keep_rows]
            self.last_tokens = self.last_tokens[keep_rows]
            self._per_row = None
            width = self.self_attention_mask.shape[1]
            filled = self.self_attention_mask.any(axis=0)
            first = int(filled.argmax()) if filled.any() else width
            if first > 0:  # holes of every kept row, on the left
                past_time = (first, width)
                self.self_attention_mask = self.self_attention_mask[:, first:]
            src_len = max(member.encoder_rows for member in self.slots)
            if src_len < self.encoder_attention_mask.shape[1]:  # padding of every kept row
                cross_time = (0, src_len)
                self.encoder_attention_mask = self.encoder_attention_mask[:, :src_len]
        if self.rows:
            masks.insert(0, self.encoder_attention_mask)
            crosses.insert(0, self.cross)
        src_len = max(mask.shape[1] for mask in masks)
        backend = self.backend
        # every member's cross K/V and mask padded on the right to the longest source
        self.cross = (backend.pad_time(crosses[0], src_len, left=False) if len(crosses) == 1
                      else backend.concat_rows(crosses, src_len, left=False,
                                               first_rows=keep_slots, first_time=cross_time))
        masks = [_pad_right(mask, src_len) for mask in masks]
        self.encoder_attention_mask = masks[0] if len(masks) == 1 else np.concatenate(masks)
        new_past = backend.empty_past(count)
        if self.rows:
            # the newcomers have no history: holes (mask 0) where the others have a cache
            past_len = self.self_attention_mask.shape[1]
            self.past = backend.concat_rows([self.past, new_past], past_len, left=True,
                                            first_rows=keep_rows, first_time=past_time)
            self.self_attention_mask = np.concatenate(
                [self.self_attention_mask, np.zeros((count, past_len), np.int64)])
        else:
            self.past = new_past
            self.self_attention_mask = np.zeros((count, 0), np.int64)
        starts = []
        for group in groups:
            for search, tag, valid in zip(group.searches, group.tags,
                                          group.encoder_attention_mask.sum(axis=1)):
                self.slots.append(_Member(search, tag, int(valid)))
                starts.append(search.last_tokens[0])
        self.position_ids = np.concatenate([self.position_ids, np.zeros(count, np.int64)])
        self.last_tokens = np.concatenate([self.last_tokens, np.array(starts, np.int64)])

    def remove(self, tags: set[Any]) -> list[Search]:
        """Drop the members with these tags (cancelled, expired) before the next step."""
        keep_index, kept, kept_members, removed, row = [], [], [], [], 0
        for position, member in enumerate(self.slots):
            rows = range(row, row + member.search.rows)
            row += member.search.rows
            if member.retired:
                continue  # a copy is made: retired rows leave with these
            if member.tag in tags:
                removed.append(member.search)  # type: ignore[arg-type]
            else:
                kept.append(member)
                kept_members.append(position)
                keep_index.extend(rows)
        if removed:
            self._reorder(np.array(keep_index, np.int64), kept,
                          np.array(kept_members, np.int64))
        return removed

    def _cross_for_step(self) -> tuple[Cache, np.ndarray]:
        """The cross K/V and encoder mask in the form the decoder takes this step."""
        layout = tuple(member.search.rows for member in self.slots)
        grouped = getattr(self.backend, "grouped_cross", False)
        if len(set(layout)) == 1 and (grouped or layout[0] == 1):
            return self.cross, self.encoder_attention_mask  # [M,...]: G rows per member
        cached = self._per_row
        if cached is None or cached[0] != layout or cached[1] is not self.cross:
            index = np.repeat(np.arange(len(layout)), layout)  # member of each row
            cached = self._per_row = (layout, self.cross,
                                      self.backend.take_rows(self.cross, index),
                                      self.encoder_attention_mask[index])
        return cached[2], cached[3]

    def step(self) -> list[tuple[Any, Search]]:
        """Run one decoder step for every row; returns the members that finished."""
        if not len(self):
            return []
        cross, encoder_attention_mask = self._cross_for_step()
        # [R,P] -> [R,P+1]: the new token's column; the same array is the mask of the cache
        # after the step (the backend only reads it)
        self_attention_mask = np.concatenate(
            [self.self_attention_mask, np.ones((self.rows, 1), np.int64)], axis=1)
        out = self.backend.step(
            self.last_tokens[:, None],  # [R,1]
            self.position_ids[:, None],  # [R,1]
            self_attention_mask,
            encoder_attention_mask,
            self.past,
            cross,
        )
        self.steps += 1
        self.past = out.present
        self.self_attention_mask = self_attention_mask
        # pad is banned after the normaliser is taken, without renormalising: the scores then
        # equal Hugging Face's with Marian's bad_words_ids=[[pad]]
        pad = self.backend.pad_token_id
        banned = pad if pad != self.backend.eos_token_id else None
        top = self._candidates(out, banned)
        if top is None:
            # [R,V]; the backend hands over a fresh array, so score_rows edits it in place;
            # beam candidates of every row come from one threaded pass
            logits = out.logits[:, -1, :].astype(np.float32, copy=False)
            beam_k = max((m.search.candidates_per_row() for m in self.slots), default=0)
            lse, best = score_rows(logits, banned, beam_k)  # [R], [R,k]
        gather, tokens, finished, retired, row = [], [], [], [], 0
        for position, member in enumerate(self.slots):
            search, rows = member.search, member.search.rows
            if isinstance(search, _Retired):
                gather.append(search.parents + row)
                tokens.append(search.last_tokens)
                retired.append(np.arange(row, row + rows))
                row += rows
                continue
            if top is not None:
                parents, new_tokens = search.advance_candidates(
                    top[0][row : row + rows], top[1][row : row + rows])
            else:
                parents, new_tokens = search.advance(
                    logits[row : row + rows], lse[row : row + rows],
                    None if best is None else best[row : row + rows])
            search.rows = len(parents)
            search.last_tokens = new_tokens
            if search.done:  # its rows stay, retired, until the next compaction
                finished.append((member.tag, search))
                self.slots[position] = member = _Member(_Retired(rows, pad, self.steps), None)
                parents, new_tokens = member.search.parents, member.search.last_tokens
                retired.append(np.arange(row, row + rows))
            gather.append(parents + row)
            tokens.append(new_tokens)
            row += rows
        index = np.concatenate(gather) if gather else np.zeros(0, np.int64)  # old row per row
        last_tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.int64)
        self.position_ids = self.position_ids + 1
        if retired:
            self.position_ids[np.concatenate(retired)] = 0  # never past the position table
        if retired and self._compact_now():
            # the retired rows leave: keep_rows are the running rows after this step
            keep_rows, keep_slots = self._live_index()
            self._reorder(index[keep_rows], [self.slots[i] for i in keep_slots], keep_slots)
            last_tokens = last_tokens[keep_rows]
        else:
            self._reorder(index, self.slots, None)  # the encoder side (per member) unchanged
        self.last_tokens = last_tokens
        return finished

    def _compact_now(self) -> bool:
        """Whether the retired rows should leave now rather than at the next join."""
        live = len(self)
        retired = [member.search for member in self.slots if member.retired]
        if not live or not retired:
            return bool(retired)
        share = sum(search.rows for search in retired) * self.RETIRED_SHARE >= self.rows
        oldest = min(search.since for search in retired)  # type: ignore[union-attr]
        return share or self.steps - oldest >= self.RETIRED_STEPS

    def _candidates(self, out: StepOutput, banned: int | None
                    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The step's top candidates (ids [R,K], log-probs [R,K], `banned` at -inf) when the
        backend computed them and every member can decide from them; else None."""
        if out.top_ids is None or out.top_log_probs is None or not self.use_top_candidates:
            return None
        ids, log_probs = out.top_ids[:, -1, :], out.top_log_probs[:, -1, :]
        # K = V: every token is a candidate; else room for the needed ones plus pad and eos
        room = ids.shape[1] if ids.shape[1] >= self.backend.vocab_size else ids.shape[1] - 2
        for member in self.members:
            needed = member.search.top_needed()
            if needed == 0 or needed > room:
                return None
        log_probs = log_probs.astype(np.float32)  # a copy: edited below
        if banned is not None:
            log_probs[ids == banned] = -np.inf
        return ids.astype(np.int64, copy=False), log_probs

    def _reorder(self, index: np.ndarray, members: list[_Member],
                 member_index: np.ndarray | None) -> None:
        """Keep rows `index` (in that order) for `members`, trimming dead cache columns.

        member_index: which of the previous members `members` are (None: the same ones).
        """
        previous_rows = self.rows
        self.slots = members
        if not members:
            self.past = self.cross = None
            self.self_attention_mask = np.zeros((0, 0), np.int64)
            self.encoder_attention_mask = np.zeros((0, 0), np.int64)
            self.position_ids = np.zeros(0, np.int64)
            self.last_tokens = np.zeros(0, np.int64)
            return
        identity = len(index) == previous_rows and bool((index == np.arange(previous_rows)).all())
        if not identity:
            # the past is always this batch's own (a fresh present, or made by add/remove)
            self.past = self.backend.take_rows(self.past, index, reuse=True)
            self.self_attention_mask = self.self_attention_mask[index]
            if member_index is not None:
                self.cross = self.backend.take_rows(self.cross, member_index)
                self.encoder_attention_mask = self.encoder_attention_mask[member_index]
            self.position_ids = self.position_ids[index]
            if len(self.last_tokens) == previous_rows:
                self.last_tokens = self.last_tokens[index]
            # columns that every remaining row has as a hole (left) or as padding (right)
            # are dead weight in every later step: cut them
            filled = self.self_attention_mask.any(axis=0)
            first = int(filled.argmax()) if filled.any() else self.self_attention_mask.shape[1]
            if first > 0:
                stop = self.self_attention_mask.shape[1]
                self.past = self.backend.slice_time(self.past, first, stop)
                self.self_attention_mask = self.self_attention_mask[:, first:]
            src_len = max(m.encoder_rows for m in members)
            if src_len < self.encoder_attention_mask.shape[1]:
                self.cross = self.backend.slice_time(self.cross, 0, src_len)
                self.encoder_attention_mask = self.encoder_attention_mask[:, :src_len]


def _pad_right(mask: np.ndarray, length: int) -> np.ndarray:
    if mask.shape[1] >= length:
        return mask
    return np.pad(mask, ((0, 0), (0, length - mask.shape[1])))


def generate(
    backend: Backend,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    options: DecodingOptions | Sequence[DecodingOptions],
) -> list[list[Hypothesis]]:
    """Translate a batch of encoded sources; one ranked hypothesis list per source.

    `options` may be one DecodingOptions for all sources or one per source.
    """
    count = input_ids.shape[0]
    per_source = [options] * count if isinstance(options, DecodingOptions) else list(options)
    if len(per_source) != count:
        raise ValueError(f"got {len(per_source)} DecodingOptions for {count} sources")
    limit = backend.max_target_positions - 1
    per_source = [opts.validate(max_new_tokens_limit=limit) for opts in per_source]
    _, cross = backend.encode(input_ids, attention_mask)
    batch = DecodeBatch(backend)
    searches = [
        make_search(opts, backend.eos_token_id, backend.decoder_start_token_id)
        for opts in per_source
    ]
    batch.add(searches, list(range(count)), cross, attention_mask)
    results: list[list[Hypothesis]] = [[] for _ in range(count)]
    while len(batch):
        for tag, search in batch.step():
            results[tag] = search.results()
    return results
