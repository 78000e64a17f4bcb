"""Beam search: num_beams running hypotheses, length penalty, early stopping (True, False,
"never"), n-best."""

from __future__ import annotations

import math

import numpy as np

from tfserve.generation.kernels import top_k_unordered
from tfserve.generation.options import DecodingOptions, Hypothesis
from tfserve.generation.search import Search, register_search


@register_search("beam", lambda options: not options.do_sample and options.num_beams > 1)
class BeamSearch(Search):
    """Beam search keeping num_beams running hypotheses and the best finished ones.

    Each step scores 2 * num_beams candidates so that enough non-eos continuations remain
    after the eos candidates are set aside. An eos candidate outside the top num_beams is
    ignored. With early_stopping True the search ends as soon as num_beams hypotheses
    finished; with False, when no running beam, scored at its current length, can still
    beat the worst kept hypothesis; with "never", scored at max_new_tokens where
    length_penalty > 0 (a longer beam may still win), so it runs longer.

    Lengths (length_penalty, the stopping heuristic) count new tokens only: an input prefix
    is left out, as transformers leaves out its decoder_input_ids. With repetition controls
    each row's log-probabilities are penalised before the candidates are ranked, as
    transformers' beam search does. With forced_eos, the last step's only candidate per
    row is eos at log-probability 0: every running beam finishes with its score so far,
    divided by max_new_tokens ** length_penalty (transformers' ForcedEOSTokenLogitsProcessor
    leaves eos the only finite candidate of each beam).
    """

    def __init__(self, options: DecodingOptions, eos_token_id: int, start_token_id: int) -> None:
        super().__init__(options, eos_token_id, start_token_id)
        self.beams: list[list[int]] = [[]]
        self.beam_scores = np.zeros(1, np.float64)
        self.branched = False  # whether a step of its own ran (the beams fanned out)

    def normalized(self, sum_logprobs: float, length: int) -> float:
        return sum_logprobs / (length**self.options.length_penalty)

    def keep_finished(self, tokens: list[int], sum_logprobs: float, complete: bool) -> None:
        length = len(tokens) - self.input_prefix + (1 if complete else 0)
        self.finished.append(Hypothesis(tokens, self.normalized(sum_logprobs, length), complete))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.options.num_beams :]

    def candidates_per_row(self) -> int:
        """Tokens per row `advance` must see: 2K, plus one in case eos is blocked (0: it
        finds its own, after the repetition controls, or needs none for a forced step)."""
        if self.forcing or self.ending or self.controls is not None:
            return 0
        return 2 * self.options.num_beams + 1

    def top_needed(self) -> int:
        return self.needs(2 * self.options.num_beams)

    def histories(self) -> np.ndarray:
        return np.array([[self.start, *beam] for beam in self.beams], np.int64)  # [rows,L]

    def advance(self, logits: np.ndarray, lse: np.ndarray,
                best: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        if self.ending:
            return self._end()
        if self.forcing:
            return self._force()
        if self.controls is not None:
            # [rows,V] log-probabilities, penalised as transformers' beam search does
            log_probs = self.controls.apply(logits - lse[:, None], self.histories())
            per_row = min(2 * self.options.num_beams + 1, logits.shape[1])
            best = top_k_unordered(log_probs, per_row)  # [rows, 2K+1]
            values = np.take_along_axis(log_probs, best, axis=-1)
            return self._select(best, values, self.beam_scores, logits.shape[1])
        # the best 2K candidates overall are among each row's best 2K tokens: rank those only
        if best is None:
            per_row = min(self.candidates_per_row(), logits.shape[1])
            best = top_k_unordered(logits, per_row)  # [rows, 2K+1]
        values = np.take_along_axis(logits, best, axis=-1)
        # offset: beam score minus the row's normaliser
        return self._select(best, values, self.beam_scores - lse, logits.shape[1])

    def advance_candidates(self, ids: np.ndarray, log_probs: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
        if self.ending:
            return self._end()
        if self.forcing:
            return self._force()
        return self._select(ids, log_probs, self.beam_scores, int(ids.max()) + 1)

    def _end(self) -> tuple[np.ndarray, np.ndarray]:
        """The forced eos for every running beam, log-probability 0 (past min_new_tokens:
        transformers' forced eos overrides its ban).

        transformers starts beams 1..num_beams-1 as copies of beam 0 at score -1e9, so that
        the first step spreads beam 0's continuations alone. A search the forced eos ends
        before any step of its own (max_new_tokens 1, or forced tokens up to it) still has
        them, and transformers returns them too: num_beams - 1 more hypotheses with the one
        row's tokens, scored (its sum - 1e9) / length ** length_penalty."""
        rows = len(self.beams)
        copies = [] if self.branched else [
            (list(self.beams[0]), float(self.beam_scores[0]) - 1e9)] * (self.options.num_beams - 1)
        chosen = self._select(np.full((rows, 1), self.eos, np.int64),
                              np.zeros((rows, 1), np.float32), self.beam_scores, self.eos + 1,
                              allow_eos=True)
        for tokens, score in copies:
            self.keep_finished(tokens, score, complete=True)
        return chosen

    def _force(self) -> tuple[np.ndarray, np.ndarray]:
        """A prefix token for the single row, log-probability 0 (next_forced counts it
        where it is new)."""
        token = self.next_forced()
        return self._select(np.array([[token]], np.int64), np.zeros((1, 1), np.float32),
                            self.beam_scores, token + 1, decided=False)

    def _select(self, best: np.ndarray, values: np.ndarray, offset: np.ndarray, vocab: int,
                decided: bool = True, allow_eos: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Keep the best num_beams continuations among candidates best [rows,k] whose
        scores are offset [rows] + values [rows,k]; vocab: any bound above the token ids;
        decided: a new token (the search's own choice or the forced eos), not a prefix
        token; allow_eos: eos even before min_new_tokens (the forced eos)."""
        num_beams = self.options.num_beams
        rows = best.shape[0]
        if self.generated < self.options.min_new_tokens and not allow_eos:
            values = np.where(best == self.eos, -np.inf, values)  # eos not allowed yet
        scores_2k = (offset[:, None] + values).ravel()
        flat_2k = (np.arange(rows)[:, None] * vocab + best).ravel()  # beam * V + token
        count = min(2 * num_beams, scores_2k.size)
        top = np.lexsort((flat_2k, -scores_2k))[:count]  # best first, ties by beam then token
        if decided:
            self.generated += 1
        self.branched = self.branched or (decided and not allow_eos)
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
        never = isinstance(self.options.early_stopping, str)  # "never" (validate)
        if not never and self.options.early_stopping:
            return True
        # heuristic (transformers' _check_early_stop_heuristic): the best running beam,
        # scored at its current length (early_stopping False) or, with "never" and a positive
        # length_penalty, at max_new_tokens (its best possible length), cannot beat the worst
        # kept hypothesis
        length = self.generated
        if never and self.options.length_penalty > 0:
            length = self.options.max_new_tokens
        attainable = self.normalized(float(self.beam_scores.max()), length)
        return self.finished[-1].score >= attainable
