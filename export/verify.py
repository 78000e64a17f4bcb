"""Numerical parity of exported graphs against the eager PyTorch model.

Checked at export time, at shapes other than the trace example: the encoder (hidden states
and every layer's cross K/V), the first decoder step (empty past) and cached steps (one
token, then several at once), and greedy tokens over sample sentences; for an encoder-only
model, its hidden states and mean-pooled embeddings (encoder_parity). The report goes into
model.json; `python -m export` refuses to publish artifacts whose report did not pass.

Logits pass when each is within `atol + rtol * scale` of the eager model's, where scale is
the largest |eager logit| at the same position (the rule of torch.testing.assert_close with
the row's magnitude for the element's own). The rounding difference of a logit is a few
epsilons of the magnitudes summed into it, which the whole row shares: measured on a random
Marian model whose logits reach |22|, the differences are alike (max 5e-4 to 9e-4 over 24
steps) whether the logit itself is near 0 or near |20|. One absolute bound refuses such a
model although it is exact to fp32 rounding (greedy outputs token-identical), and an
elementwise relative term (|eager| of the logit itself) does not cover the logits near 0 of
a large row: on that model it put the worst difference at 4.2 times its bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tfserve.generation import DecodingOptions
from tfserve.generation.batch import generate
from tfserve.model import Seq2SeqTransformer
from tfserve.model.eager import EagerBackend
from tfserve.runtime import Runtime
from tfserve.text.inputs import pool


@dataclass(frozen=True)
class Tolerance:
    """Bound on |onnx - eager| per logit: atol + rtol * (largest |eager logit| of its row)."""

    atol: float
    rtol: float

    def ratio(self, got: np.ndarray, ref: np.ndarray) -> float:
        """The worst |got - ref| / allowed over the logits [..., V]: <= 1 passes."""
        if not ref.size:
            return 0.0
        allowed = self.atol + self.rtol * _row_scale(ref)  # [..., 1]
        # atol = rtol = 0 (or an all-zero row) allows nothing but equality: a floor keeps the
        # ratio finite (the report is JSON, which has no infinity)
        allowed = np.maximum(allowed, np.finfo(np.float32).tiny)
        return float((np.abs(got - ref) / allowed).max())

    def to_dict(self) -> dict[str, Any]:
        return {"atol": self.atol, "rtol": self.rtol,
                "rule": "|onnx - eager| <= atol + rtol * max |eager| over the logit's row"}


def _row_scale(logits: np.ndarray) -> np.ndarray:
    """[..., V] -> [..., 1]: the largest |logit| of each position."""
    return np.abs(logits).max(axis=-1, keepdims=True)


def relative_diff(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / (largest |ref| of the row) over the logits [..., V]."""
    if not ref.size:
        return 0.0
    scale = _row_scale(ref)  # [..., 1]
    diff = np.abs(got - ref)
    return float((diff / np.where(scale > 0, scale, 1.0)).max())


# Per precision, on every logit of every step checked.
# fp32: the graphs sum in another order than PyTorch (fused Q/K/V GEMM and attention, other
# GEMM blocking), so logits carry rounding of some fp32 epsilons (1.2e-7) per layer times the
# magnitudes summed. Measured |diff| / row scale: 4e-7 to 1.2e-6 on the native test models,
# the demo and a random Marian model with logits near |5|; 5e-6 on a random Marian model
# whose logits reach |23| (|diff| 1.2e-4, over the former absolute bound); 1e-5 to 9.4e-5 on
# random models initialized at std 0.5 to 0.7, several times the usual scale, where
# saturated attention amplifies rounding. rtol 1e-4 passes them all; a real export fault (a
# wrong mask, position or weight) moves logits by a sizeable fraction of their scale (one
# output weight column 1% off: 7e-3). atol 1e-4 (the former absolute bound) covers rows of
# small logits, whose rounding is that of the larger terms summed into them.
# fp16 graphs are compared with the fp32 eager model: storing a value in fp16 alone rounds it
# by up to 2^-11 = 4.9e-4 of its magnitude; rtol 1e-2 allows ~20 such roundings accumulated
# over the layers, atol 5e-2 is the former bound (measured on CPU: 7e-4 to 1.3e-3 of the row
# scale, |diff| 2e-3 to 3.3e-3, 0.02 to 0.04 of the tolerance). They are checked on CUDA
# when a device is there (where they are served), else on the CPU
# (export.graphs.fp16_parity_device).
# int8 has no logits bound: its logits differ by design and it is judged on greedy outputs.
TOLERANCES = {"fp32": Tolerance(atol=1e-4, rtol=1e-4), "fp16": Tolerance(atol=5e-2, rtol=1e-2)}
# fraction of greedy outputs identical to the eager model, per precision
MIN_GREEDY_AGREEMENT = {"fp32": 1.0, "fp16": 0.95, "int8": 0.9}


def _as_array(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.float().numpy()
    return np.asarray(x, dtype=np.float32)


def _max_diff(a: Any, b: Any) -> float:
    a, b = _as_array(a), _as_array(b)
    return float(np.abs(a - b).max()) if a.size else 0.0


def _max_abs(x: Any) -> float:
    x = _as_array(x)
    return float(np.abs(x).max()) if x.size else 0.0


def random_batch(vocab: int, rows: int, length: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded random sources: row i has length - i tokens (at least 1)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(rows, length), dtype=np.int64)
    mask = np.ones((rows, length), np.int64)
    for row in range(rows):
        valid = max(1, length - row)
        mask[row, valid:] = 0
        ids[row, valid:] = 0
    return ids, mask


def step_parity(model: Seq2SeqTransformer, runtime: Runtime, rows: int = 3,
                source_len: int = 9, seed: int = 0, tolerance: Tolerance | None = None
                ) -> dict[str, Any]:
    """Encoder, first step, one-token and multi-token cached steps, against the eager model.

    -> {"max_abs_diff": {tensor: max |onnx - eager|}, "max_rel_diff": {logits tensor: max
    |onnx - eager| / largest |eager logit| of the row}, "max_abs_logits": max |eager logit|,
    and with a tolerance "tolerance_ratio": the worst |diff| / allowed over every logit
    (<= 1 passes)}; each also under "max_logits" for the logits tensors together.
    """
    cfg = model.config
    eager = EagerBackend(model)
    ids, mask = random_batch(cfg.vocab_size, rows, min(source_len, cfg.max_source_positions),
                             seed)
    hidden_ref, cross_ref = eager.encode(ids, mask)
    hidden, cross = runtime.encode(ids, mask)
    abs_diff: dict[str, float] = {}
    rel_diff: dict[str, float] = {}  # logits only: relative to the row's largest |logit|

    def record(key: str, got: Any, ref: Any) -> None:
        abs_diff[key] = max(abs_diff.get(key, 0.0), _max_diff(got, ref))

    record("encoder_hidden_states", hidden, hidden_ref)
    for got, ref in zip(cross, [t for kv in cross_ref for t in kv]):
        record("cross_kv", got, ref)
    ratio = largest = 0.0
    rng = np.random.default_rng(seed + 1)
    past_ref, past = eager.empty_past(rows), runtime.empty_past(rows)
    filled = 0
    # first step (P=0, T=1), cached single steps, then three tokens at once
    for name, new in (("first_step", 1), ("cached_step", 1), ("cached_step", 1),
                      ("cached_multi_token_step", 3)):
        tokens = rng.integers(3, cfg.vocab_size, size=(rows, new), dtype=np.int64)
        if filled == 0:
            tokens[:, 0] = cfg.decoder_start_token_id
        positions = np.arange(filled, filled + new, dtype=np.int64)[None].repeat(rows, 0)
        self_mask = np.ones((rows, filled + new), np.int64)
        ref = eager.step(tokens, positions, self_mask, mask, past_ref, cross_ref)
        got = runtime.step(tokens, positions, self_mask, mask, past, cross)
        (logits_ref, past_ref), (logits, past) = ref[:2], got[:2]
        record(f"{name}_logits", logits, logits_ref)
        got_logits, ref_logits = _as_array(logits), _as_array(logits_ref)
        rel_diff[f"{name}_logits"] = max(rel_diff.get(f"{name}_logits", 0.0),
                                         relative_diff(got_logits, ref_logits))
        largest = max(largest, _max_abs(ref_logits))
        if tolerance is not None:
            ratio = max(ratio, tolerance.ratio(got_logits, ref_logits))
        if got.top_log_probs is not None and ref.top_log_probs is not None:
            record("top_log_probs", got.top_log_probs, ref.top_log_probs)
        for p, r in zip(past, [t for kv in past_ref for t in kv]):
            record("present_kv", p, r)
        filled += new
    abs_diff["max_logits"] = max(v for k, v in abs_diff.items() if k.endswith("_logits"))
    rel_diff["max_logits"] = max(rel_diff.values())
    report: dict[str, Any] = {"max_abs_diff": abs_diff, "max_rel_diff": rel_diff,
                              "max_abs_logits": largest}
    if tolerance is not None:
        report["tolerance_ratio"] = ratio
    return report


def greedy_agreement(model: Seq2SeqTransformer, runtime: Runtime,
                     sources: Sequence[Sequence[int]], max_new_tokens: int) -> dict[str, Any]:
    """Fraction of sources whose greedy output over ONNX equals the eager one."""
    if not sources:
        return {"sentences": 0, "identical": 0, "agreement": 1.0}
    options = DecodingOptions(max_new_tokens=max_new_tokens)
    identical = 0
    for start in range(0, len(sources), 32):
        chunk = sources[start : start + 32]
        ids, mask = runtime.tokenizer.pad_batch(chunk)
        ref = generate(EagerBackend(model, banned_token_ids=runtime.banned_token_ids), ids,
                       mask, options)
        out = generate(runtime, ids, mask, options)
        identical += sum(r[0].token_ids == o[0].token_ids for r, o in zip(ref, out))
    return {"sentences": len(sources), "identical": identical,
            "agreement": identical / len(sources)}


# encoder-only models (no logits, no outputs to compare): the hidden states pass by the
# logits' rule with the hidden state's row (its d_model values) for the row, and the mean
# pooled embedding of every sample and random source must point the eager one's way; int8
# is judged on the embeddings alone (measured on a random T5 encoder, 16 sources: lowest
# cosine 1 - 1.2e-7 in fp32, 1 - 2.4e-7 in fp16, 0.9994 in int8)
MIN_EMBEDDING_COSINE = {"fp32": 0.9999, "fp16": 0.999, "int8": 0.98}


def encoder_parity(model: Seq2SeqTransformer, runtime: Runtime,
                   sources: Sequence[Sequence[int]], tolerance: Tolerance | None,
                   seed: int = 0) -> dict[str, Any]:
    """An encoder-only model's hidden states on a random padded batch, and the mean-pooled
    embeddings of `sources`, against the eager model."""
    cfg = model.config
    eager = EagerBackend(model)
    ids, mask = random_batch(cfg.vocab_size, 3, min(9, cfg.max_source_positions), seed)
    ref, got = eager.hidden_states(ids, mask), runtime.hidden_states(ids, mask)  # [B,S,D]
    report: dict[str, Any] = {
        "max_abs_diff": {"encoder_hidden_states": _max_diff(got, ref)},
        "max_rel_diff": {"encoder_hidden_states": relative_diff(got, ref)},
        "max_abs_hidden": _max_abs(ref)}
    if tolerance is not None:
        report["tolerance_ratio"] = tolerance.ratio(got, ref)
    cosines = []
    for start in range(0, len(sources), 32):
        ids, mask = runtime.tokenizer.pad_batch(sources[start: start + 32])
        pooled = [pool(backend.hidden_states(ids, mask), mask, "mean")
                  for backend in (eager, runtime)]  # [B,D] each
        norms = np.linalg.norm(pooled[0], axis=1) * np.linalg.norm(pooled[1], axis=1)
        cosines += ((pooled[0] * pooled[1]).sum(axis=1) / np.maximum(norms, 1e-30)).tolist()
    report["embeddings"] = {"sources": len(sources),
                            "min_cosine": float(min(cosines)) if cosines else 1.0}
    return report


def verify(model: Seq2SeqTransformer, artifacts: Path, dtype: str, quantization: str | None,
           sample_texts: Sequence[str] = (), random_sources: int = 16,
           device: str = "cpu") -> dict[str, Any]:
    """Parity report for artifacts in `artifacts` (loaded on `device`, "cpu" or "cuda", full
    optimization; the cache on the host, so that both backends' tensors are numpy arrays).

    Keys: device, optimization, precision; max_abs_diff and max_rel_diff (per tensor, and
    max_logits over every logits tensor); max_abs_logits; with a logits tolerance for the
    precision, tolerance {atol, rtol, rule} and tolerance_ratio; greedy and
    greedy_random_sources; passed and failures.
    """
    runtime = Runtime(artifacts, device=device, optimization="all", device_cache=False)
    precision = quantization or dtype
    tolerance = TOLERANCES.get(precision)
    report: dict[str, Any] = {"device": device, "optimization": "all", "precision": precision}
    samples = [runtime.tokenizer.encode(t) for t in sample_texts]
    rng = np.random.default_rng(7)
    randoms = [rng.integers(3, model.config.vocab_size, size=int(n)).tolist()
               + [model.config.eos_token_id] for n in rng.integers(2, 12, size=random_sources)]
    if model.config.encoder_only:
        return _encoder_only_verdict(report, encoder_parity(
            model, runtime, samples + randoms, tolerance), tolerance, precision)
    report.update(step_parity(model, runtime, tolerance=tolerance))
    max_new = min(32, model.config.max_target_positions - 1)
    report["greedy"] = greedy_agreement(model, runtime, samples, max_new)
    report["greedy_random_sources"] = greedy_agreement(model, runtime, randoms, max_new)
    report["greedy"]["max_new_tokens"] = max_new
    failures = tolerance_failures(report, tolerance, "max_logits", "logits", "logit")
    needed = MIN_GREEDY_AGREEMENT[precision]
    # reduced precision is judged on real sentences only: on random token soup a trained
    # model's outputs hinge on near-ties that int8 / fp16 rounding flips
    checked = ["greedy"] if precision != "fp32" else ["greedy", "greedy_random_sources"]
    for key in checked:
        if report[key]["sentences"] and report[key]["agreement"] < needed:
            failures.append(f"{key} agreement {report[key]['agreement']:.1%} < {needed:.0%}")
    report["passed"] = not failures
    report["failures"] = failures
    return report


def tolerance_failures(report: dict[str, Any], tolerance: Tolerance | None, key: str,
                       what: str, unit: str) -> list[str]:
    """Record the precision's tolerance in `report`; the failure when the report's
    tolerance_ratio is over 1 (key: the compared tensor's entry in max_abs_diff and
    max_rel_diff; what / unit: its name and one element's, for the message)."""
    if tolerance is None:
        return []
    report["tolerance"] = tolerance.to_dict()
    if report["tolerance_ratio"] <= 1.0:
        return []
    return [f"{what} differ by up to {report['max_abs_diff'][key]:.3g} (relative "
            f"{report['max_rel_diff'][key]:.3g}), {report['tolerance_ratio']:.3g} times the "
            f"allowed {tolerance.atol:g} + {tolerance.rtol:g} * |eager {unit}|"]


def _encoder_only_verdict(report: dict[str, Any], parity: dict[str, Any],
                          tolerance: Tolerance | None, precision: str) -> dict[str, Any]:
    """verify()'s report for an encoder-only model: encoder_parity's figures, passed and
    failures."""
    report.update(parity)
    failures = tolerance_failures(report, tolerance, "encoder_hidden_states",
                                  "encoder hidden states", "value")
    needed = MIN_EMBEDDING_COSINE[precision]
    if parity["embeddings"]["min_cosine"] < needed:
        failures.append(f"embedding cosine {parity['embeddings']['min_cosine']:.6f} < {needed}")
    report["passed"] = not failures
    report["failures"] = failures
    return report
