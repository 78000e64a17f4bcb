"""Python time per decoder step: the continuous batch and the searches, with no model.

    python -m tfserve.bench.search_overhead [--steps 64] [--repeat 5] [--per-member]
                                            [--json OUT]

A decoder step on a GPU takes tens of microseconds; the Python around it (deciding each
row's tokens, finishing searches, moving rows) must take no more. This runs `DecodeBatch`
over `NullBackend`, a Backend whose step costs nothing but handing over precomputed top
candidates and tiny cache tensors, and prints the microseconds per step that remain: the
selection, finishing and row bookkeeping of the cases the benchmarks time (greedy batch 1
and 16, beam 4 x batch 32, sampling batch 16). Rows never finish early (eos is never among
the candidates), so every step carries the whole batch. Greedy and beam members decide
together, strategy by strategy (`Search.decide_group`); --per-member times the reference
path instead, each member through its own `advance_candidates` (DecodeBatch.group_decisions
off). Sampling decides member by member on either path, from the full logits.

Imports numpy only (and tfserve.generation / tfserve.generation.batch).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tfserve.artifacts.manifest import TOP_CANDIDATES
from tfserve.generation import Cache, DecodingOptions, StepOutput, make_search
from tfserve.generation.batch import DecodeBatch

VOCAB = 58_101  # opus-mt's vocabulary
EOS, PAD = 0, 58_100


class NullBackend:
    """The Backend protocol with a free step: top candidates from a fixed pool (eos never
    among them), cache tensors of one head of size 1 ([R,1,P,1]), full logits on demand."""

    vocab_size = VOCAB
    eos_token_id = EOS
    pad_token_id = PAD
    decoder_start_token_id = PAD
    grouped_cross = True
    max_target_positions = 512
    top_candidates = TOP_CANDIDATES

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        pool = 1024  # rows of candidates cycled through
        # each pool row: K distinct ids in 1..VOCAB-2 (never eos 0 nor pad), best first
        self._ids = np.stack([rng.choice(np.arange(1, VOCAB - 1), TOP_CANDIDATES,
                                         replace=False) for _ in range(pool)])  # [pool,K]
        scores = -np.sort(rng.exponential(2.0, (pool, TOP_CANDIDATES)), axis=1)  # [pool,K]
        self._log_probs = scores.astype(np.float32)
        self._offset = 0

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[Any, Cache]:
        rows, source = input_ids.shape
        return None, [np.zeros((rows, 1, source, 1), np.float32)]  # [B,1,S,1]

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray,
             self_attention_mask: np.ndarray, encoder_attention_mask: np.ndarray,
             past: Cache, cross: Cache, need_logits: bool = True) -> StepOutput:
        rows = input_ids.shape[0]
        index = (np.arange(rows) + self._offset) % len(self._ids)  # [R]
        self._offset += rows
        ids = self._ids[index][:, None, :]  # [R,1,K]
        log_probs = self._log_probs[index][:, None, :]  # [R,1,K]
        logits = None
        if need_logits:
            logits = np.full((rows, 1, VOCAB), -30.0, np.float32)  # [R,1,V]
            np.put_along_axis(logits[:, 0], ids[:, 0], log_probs[:, 0], axis=1)
        present = [np.concatenate([t, np.zeros((rows, 1, 1, 1), t.dtype)], axis=2)
                   for t in past]  # [R,1,P+1,1]
        return StepOutput(logits, present, log_probs, ids)

    def empty_past(self, rows: int) -> Cache:
        return [np.zeros((rows, 1, 0, 1), np.float32)]  # [R,1,0,1]

    def take_rows(self, cache: Cache, index: np.ndarray, reuse: bool = False) -> Cache:
        return [t[index] for t in cache]

    def concat_rows(self, caches: Sequence[Cache], length: int | None = None,
                    left: bool = False, first_rows: np.ndarray | None = None,
                    first_time: tuple[int, int] | None = None) -> Cache:
        parts = list(caches)
        if first_time is not None:
            parts[0] = self.slice_time(parts[0], *first_time)
        if first_rows is not None:
            parts[0] = self.take_rows(parts[0], first_rows)
        if length is not None:
            parts = [self.pad_time(part, length, left) for part in parts]
        return [np.concatenate([part[0] for part in parts], axis=0)]

    def pad_time(self, cache: Cache, length: int, left: bool) -> Cache:
        out = []
        for t in cache:
            extra = length - t.shape[2]
            widths = ((0, 0), (0, 0), (extra, 0) if left else (0, extra), (0, 0))
            out.append(np.pad(t, widths) if extra > 0 else t)
        return out

    def slice_time(self, cache: Cache, start: int, stop: int) -> Cache:
        return [t[:, :, start:stop] for t in cache]


CASES = {
    "greedy-b1": (1, DecodingOptions(max_new_tokens=400)),
    "greedy-b16": (16, DecodingOptions(max_new_tokens=400)),
    "beam4-b32": (32, DecodingOptions(num_beams=4, max_new_tokens=400)),
    "sample-b16": (16, DecodingOptions(do_sample=True, top_k=20, seed=1,
                                       max_new_tokens=400)),
}


def measure(name: str, steps: int, repeat: int, per_member: bool = False) -> dict[str, Any]:
    """Best of `repeat` runs: microseconds of DecodeBatch.step per step, after the first
    step (the fan-out of beams) and a warm-up; per_member: the reference path."""
    texts, options = CASES[name]
    best = float("inf")
    for _ in range(repeat):
        backend = NullBackend()
        batch = DecodeBatch(backend, group_decisions=not per_member)
        searches = [make_search(options, EOS, PAD) for _ in range(texts)]
        source = np.ones((texts, 8), np.int64)  # [N,S]
        batch.add(searches, list(range(texts)), backend.encode(source, source)[1], source)
        for _ in range(4):  # warm-up: beams fanned out, caches of a few steps
            batch.step()
        started = time.perf_counter()
        for _ in range(steps):
            batch.step()
        best = min(best, (time.perf_counter() - started) / steps)
    return {"case": name, "rows": batch.rows, "path": "per-member" if per_member else "grouped",
            "us_per_step": round(best * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    from tfserve.argparsing import OneLineParser

    parser = OneLineParser(prog="python -m tfserve.bench.search_overhead",
                           description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=64, help="timed steps per run")
    parser.add_argument("--repeat", type=int, default=5, help="runs per case (best kept)")
    parser.add_argument("--case", choices=sorted(CASES), action="append",
                        help="cases to run (default: all)")
    parser.add_argument("--per-member", action="store_true",
                        help="time the per-member reference path (no group decisions)")
    parser.add_argument("--json", help="also write the rows as a JSON list to this file")
    args = parser.parse_args(argv)
    for name in ("steps", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    rows = [measure(name, args.steps, args.repeat, args.per_member)
            for name in (args.case or list(CASES))]
    for row in rows:
        print(f"{row['case']:12s} {row['rows']:4d} rows  {row['us_per_step']:8.1f} us/step"
              f"  ({row['path']})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
