"""Sampling: independent samples from the tempered, filtered distribution."""

from __future__ import annotations

import numpy as np

from tfserve.generation.kernels import filter_logits, log_softmax
from tfserve.generation.options import DecodingOptions, Hypothesis
from tfserve.generation.search import Search, register_search


@register_search("sampling", lambda options: bool(options.do_sample))
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
