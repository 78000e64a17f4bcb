"""Sources joining a real runtime's DecodeBatch in waves, some cancelled: the schedule the
device-step, static-cache and replay tests run on two placements to compare them."""

from __future__ import annotations

import numpy as np

from tfserve.generation import DecodingOptions, Hypothesis, make_search
from tfserve.generation.batch import DecodeBatch, Joining
from tfserve.runtime import Runtime


def sources(runtime: Runtime, lengths: list[int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random source rows of `lengths` tokens plus eos, right-padded: ids and mask [N,S]."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(3, runtime.vocab_size, size=n).tolist() + [runtime.eos_token_id]
            for n in lengths]
    return runtime.tokenizer.pad_batch(rows)


def decode_waves(runtime: Runtime, options: list[DecodingOptions], lengths: list[int],
                 waves: dict[int, list[int]], cancel: dict[int, int], seed: int,
                 own_width: bool = False, runs: list[int] | None = None,
                 rows: list[int] | None = None) -> dict[int, list[Hypothesis]]:
    """Sources of `lengths` (options[i] for source i) joining a running batch at the steps
    of `waves` (step -> the sources), source `cancel[step]` cancelled before that step:
    each source's hypotheses. own_width: a wave is encoded at its own longest source's
    width (else at all the sources'). runs / rows: the ONNX Runtime runs of each step / the
    batch's rows at each step."""
    ids, mask = sources(runtime, lengths, seed)
    options = [o.validate(runtime.max_target_positions - 1) for o in options]
    batch = DecodeBatch(runtime)
    results: dict[int, list[Hypothesis]] = {}
    for step in range(40):
        if step in waves:
            wave = waves[step]
            width = int(mask[wave].sum(axis=1).max()) if own_width else ids.shape[1]
            wave_ids, wave_mask = ids[wave, :width], mask[wave, :width]  # [N,S]
            _, cross = runtime.encode(wave_ids, wave_mask)
            searches = [make_search(options[r], runtime.eos_token_id,
                                    runtime.decoder_start_token_id) for r in wave]
            batch.join([Joining(searches, wave, cross, wave_mask)])
        if step in cancel:
            assert len(batch.remove({cancel[step]})) == 1  # between steps, mid-decode
        if not len(batch):
            if step > max(waves):
                break
            continue
        if rows is not None:
            rows.append(batch.rows)
        before = runtime.counters.runs
        for tag, search in batch.step():
            results[tag] = search.results()
        if runs is not None:
            runs.append(runtime.counters.runs - before)
    return results
