"""Beam search: num_beams running hypotheses, length penalty, early stopping (True, False,
"never"), n-best."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np

from tfserve.generation.kernels import top_k_unordered
from tfserve.generation.options import DecodingOptions, Hypothesis
from tfserve.generation.search import GroupDecision, Search, register_search


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
        # the beams' tokens as parent pointers, one entry per step: (each row's parent row
        # in the step before, each row's token), so that a step appends its choice instead
        # of copying every beam's tokens; a beam's tokens are built when it finishes
        self._steps: list[tuple[list[int], list[int]]] = []
        self.beam_scores = np.zeros(1, np.float64)  # [rows]: each running beam's sum
        self.branched = False  # whether a step of its own ran (the beams fanned out)
        self._history: tuple[int, np.ndarray] | None = None  # (steps, histories()) of the last call

    @property
    def beams(self) -> list[list[int]]:
        """Each running beam's tokens so far (a prefix included), row by row."""
        return [self._tokens_of(row) for row in range(len(self.beam_scores))]

    def _tokens_of(self, row: int) -> list[int]:
        """The tokens so far of running row `row`, built from the steps' parent pointers."""
        tokens = []
        for parents, chosen in reversed(self._steps):
            tokens.append(chosen[row])
            row = parents[row]
        tokens.reverse()
        return tokens

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
        """[rows, L], read-only: kept from call to call, so that a step appends one column
        to the last step's histories (reordered by its parents) instead of rebuilding every
        row."""
        steps, rows = len(self._steps), len(self.beam_scores)
        cached = self._history
        if cached is not None and cached[0] == steps:
            return cached[1]
        if cached is not None and cached[0] == steps - 1 and steps:
            parents, tokens = self._steps[-1]
            history = np.concatenate([cached[1][parents],
                                      np.array(tokens, np.int64)[:, None]], axis=1)
        else:
            history = np.array([[self.start, *self._tokens_of(row)] for row in range(rows)],
                               np.int64).reshape(rows, steps + 1)
        history.flags.writeable = False  # the next call builds on it
        self._history = (steps, history)
        return history

    def group_key(self) -> Hashable | None:
        if self.controls is not None or self.forcing or self.ending:
            return None
        return ("beam", self.eos, self.options.num_beams, len(self.beam_scores))

    @classmethod
    def decide_group(cls, searches: Sequence[Search], ids: np.ndarray, log_probs: np.ndarray
                     ) -> GroupDecision:
        """`_select` of M searches with the same num_beams and rows r at once: ids, log_probs
        [M*r,K]. The same ranking (score descending, then beam * V + token ascending) and the
        same rule: eos among the first num_beams finishes a hypothesis, the first num_beams
        finite other candidates continue."""
        first: BeamSearch = searches[0]  # type: ignore[assignment]
        num_beams, eos, count = first.options.num_beams, first.eos, len(searches)
        rows, k = ids.shape[0] // count, ids.shape[1]
        offset = np.concatenate([s.beam_scores for s in searches])  # type: ignore[attr-defined]
        blocked = [s.generated < s.options.min_new_tokens for s in searches]
        values = log_probs
        if any(blocked):  # eos not allowed yet
            values = np.where(np.repeat(blocked, rows)[:, None] & (ids == eos), -np.inf,
                              log_probs)  # [M*r,K]
        row_scores = offset[:, None] + values  # [M*r,K] float64
        take = min(2 * num_beams, rows * k)
        # a search's best `take` are among each of its rows' best `take`: where the first
        # `take` columns, or else take + 2 (room for eos and pad set to -inf), hold every
        # row's best `take`, strictly above the rest (or the rest are -inf, never chosen),
        # rank those only
        for cut in (take, take + 2):
            if cut >= k:
                break
            included = row_scores[:, :cut]
            kth = (included.min(axis=1) if cut == take  # [M*r] each row's take-th best
                   else np.partition(included, cut - take, axis=1)[:, cut - take])
            rest = row_scores[:, cut:].max(axis=1)  # [M*r]
            below = rest < kth
            if below.all() or (below | (rest == -np.inf)).all():
                ids, row_scores, k = ids[:, :cut], included, cut
                break
        # one sort of complex keys, which numpy orders by real then imaginary part: -score,
        # then beam * 2**32 + token (exact in a float64), as _select's lexsort
        key = np.empty((count, rows, k), np.complex128)  # [M,r,K]
        np.negative(row_scores.reshape(count, rows, k), out=key.real)
        np.add(ids.reshape(count, rows, k), (np.arange(rows, dtype=np.int64) << 32)[:, None],
               out=key.imag)
        ranked = np.sort(key.reshape(count, rows * k), axis=1)[:, :take]  # [M,take] best first
        ranked_scores = -ranked.real  # [M,take]
        flat = ranked.imag.astype(np.int64)
        beam, token = flat >> 32, flat & 0xFFFFFFFF  # [M,take]
        is_eos = token == eos
        if (take >= num_beams and not is_eos[:, :num_beams].any()
                and np.isfinite(ranked_scores[:, num_beams - 1]).all()):
            # the common step: nothing ends, the first num_beams continue, in rank order
            parents = (np.arange(0, count * rows, rows)[:, None] + beam[:, :num_beams]).ravel()
            tokens = token[:, :num_beams]
            return GroupDecision(parents, tokens.ravel(),
                                 list(range(0, count * num_beams + 1, num_beams)),
                                 (beam[:, :num_beams].tolist(), tokens.tolist(),
                                  ranked_scores[:, :num_beams], {}))
        # `_select` stops at the first non-finite score, skips eos, and stops at num_beams
        # continuations (never before rank num_beams, so every eos ranked lower is seen)
        alive = np.logical_and.accumulate(np.isfinite(ranked_scores), axis=1)  # [M,take]
        ends = alive & is_eos
        goes_on = alive & ~is_eos
        keep = goes_on & (np.cumsum(goes_on, axis=1) <= num_beams)  # [M,take]
        finishing: dict[int, list[tuple[int, float]]] = {}
        for member, rank in zip(*np.nonzero(ends[:, :num_beams])):  # in (search, rank) order
            finishing.setdefault(int(member), []).append(
                (int(beam[member, rank]), float(ranked_scores[member, rank])))
        kept_beams = beam[keep]  # [n] member by member, best first, as _select orders them
        parents = np.nonzero(keep)[0] * rows + kept_beams  # [n] rows of the group
        bounds = [0, *np.cumsum(keep.sum(axis=1)).tolist()]
        tokens = token[keep]
        kept_scores = ranked_scores[keep]
        beam_list, token_list = kept_beams.tolist(), tokens.tolist()
        spans = list(zip(bounds, bounds[1:]))
        return GroupDecision(parents, tokens, bounds,
                             ([beam_list[a:b] for a, b in spans],
                              [token_list[a:b] for a, b in spans],
                              [kept_scores[a:b] for a, b in spans], finishing))

    def take_decision(self, decision: GroupDecision, index: int) -> None:
        parents, tokens, scores, finishing = decision.detail
        self.generated += 1
        self.branched = True
        if finishing:
            for beam, score in finishing.get(index, ()):
                self.keep_finished(self._tokens_of(beam), score, complete=True)
        self._continue(parents[index], tokens[index], scores[index])

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
        rows = len(self.beam_scores)
        copies = [] if self.branched else [
            (self._tokens_of(0), float(self.beam_scores[0]) - 1e9)] * (self.options.num_beams - 1)
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
                    self.keep_finished(self._tokens_of(beam), score, complete=True)
                continue
            parents.append(beam)
            tokens.append(token)
            scores.append(score)
            if len(parents) == num_beams:
                break
        self._continue(parents, tokens, np.array(scores, np.float64))
        if self.done:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.array(parents, np.int64), np.array(tokens, np.int64)

    def _continue(self, parents: list[int], tokens: list[int], scores: np.ndarray) -> None:
        """The step's running beams: row i continues row parents[i] with tokens[i], its sum
        scores[i] [rows]; then whether the search is done (every running beam kept as an
        unfinished hypothesis at max_new_tokens)."""
        self._steps.append((parents, tokens))
        self.beam_scores = scores
        # is_done, without the call while fewer than num_beams hypotheses finished
        self.done = (len(self.finished) >= self.options.num_beams or not parents) and (
            self.is_done())
        if not self.done and self.generated >= self.options.max_new_tokens:
            for row, score in enumerate(scores.tolist()):
                self.keep_finished(self._tokens_of(row), score, complete=False)
            self.done = True

    def is_done(self) -> bool:
        if not len(self.beam_scores):
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
