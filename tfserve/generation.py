"""Search over a step function: greedy, beam search and sampling, written once for every backend.

The search code sees numpy logits and an opaque KV cache; a backend (`tfserve.runtime`'s
ONNX Runtime sessions, or `tfserve.eager`'s PyTorch model) runs the encoder and one decoder
step and knows how to select, concatenate and trim cache rows. It imports numpy only.

The searches advance rows that `tfserve.batch.DecodeBatch` (continuous batching) steps for
many of them at once; offline `tfserve.batch.generate` is that loop with every search added
up front.

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
from dataclasses import dataclass
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


def narrow_first(backend: Backend, caches: Sequence[Cache], first_rows: np.ndarray | None,
                 first_time: tuple[int, int] | None) -> list[Cache]:
    """`caches` with the first one cut to `first_time` and `first_rows` by separate copies:
    `Backend.concat_rows` for a backend (or a case) that cannot take them in its own pass."""
    first = caches[0]
    if first_time is not None:
        first = backend.slice_time(first, *first_time)
    if first_rows is not None:
        first = backend.take_rows(first, first_rows)
    return [first, *caches[1:]]


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
        # set by DecodeBatch.step when this search raised: it ended with this error, alone
        self.error: BaseException | None = None

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
