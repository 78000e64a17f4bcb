"""The user-facing API: texts in, translations (or sentence embeddings) out.

    from tfserve import Translator
    translator = Translator("artifacts/opus-mt-en-de", device="cpu")
    translator.translate(["Hello world."], num_beams=4)

Input checks live here, once, for every front end (Python API, CLI, gRPC): each bad input is
a ValueError naming the field and the limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tfserve.batch import generate
from tfserve.generation import Backend, DecodingOptions, Hypothesis
from tfserve.tokenizer import Tokenizer

POOLINGS = ("mean", "max", "first")
DEFAULT_MAX_TEXTS = 256
# longer than any tokenizer piece (SentencePiece's default limit is 16 characters)
MAX_CHARS_PER_TOKEN = 64


@dataclass
class Translation:
    text: str
    token_ids: list[int]
    score: float


@dataclass
class Encoding:
    """Per-token hidden states [len,D] (eos included) and the pooled sentence embedding [D]."""

    hidden_states: np.ndarray
    embedding: np.ndarray
    token_ids: list[int]


def pool(hidden: np.ndarray, mask: np.ndarray, pooling: str) -> np.ndarray:
    """Sentence embeddings [B,D] from hidden states [B,S,D] over tokens where mask [B,S] is 1."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if pooling == "first":
        return hidden[:, 0, :].astype(np.float32)
    weights = mask.astype(np.float32)[..., None]  # [B,S,1]
    if pooling == "mean":
        return (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1.0)
    return np.where(weights > 0, hidden, -np.inf).max(axis=1).astype(np.float32)


def encoder_hidden_states(backend: Backend, input_ids: np.ndarray,
                          attention_mask: np.ndarray) -> np.ndarray:
    """Hidden states [B,S,D] float32, without the cross K/V when the backend can skip them."""
    only_hidden = getattr(backend, "hidden_states", None)
    if only_hidden is not None:
        return only_hidden(input_ids, attention_mask)
    return np.asarray(backend.encode(input_ids, attention_mask)[0], dtype=np.float32)


ENCODER_CALL_TOKENS = 32  # one more encoder call costs about this many padded tokens


def length_groups(lengths: Sequence[int], max_rows: int, max_tokens: int,
                  call_tokens: int = ENCODER_CALL_TOKENS) -> list[list[int]]:
    """Indices of `lengths` split into encoder batches with the least padded work.

    Sorted by length, then cut (dynamic programming over the cut points) to minimise
    padded tokens (rows x longest) + call_tokens per batch, each batch within max_rows and
    max_tokens padded tokens. One batch of 32 number phrases of 8 to 50 tokens pads to
    1,600 tokens; cut in three it is about 1,000 (an opus-mt-base encoder: ~0.3 ms a token).
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    count = len(order)
    best = [0.0] + [math.inf] * count  # best[j]: cost of grouping the j shortest
    cut = [0] * (count + 1)
    for end in range(1, count + 1):
        width = max(1, lengths[order[end - 1]])  # the longest of any group ending here
        for start in range(end - 1, max(-1, end - 1 - max_rows), -1):
            rows = end - start
            if rows > 1 and rows * width > max_tokens:
                break
            cost = best[start] + rows * width + call_tokens
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], count
    while end > 0:
        groups.append(order[cut[end]: end])
        end = cut[end]
    return groups[::-1]


def check_texts(texts: Any, max_texts: int = DEFAULT_MAX_TEXTS) -> list[str]:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise ValueError("texts must be a list of strings")
    if not texts:
        raise ValueError("texts must not be empty")
    if len(texts) > max_texts:
        raise ValueError(f"texts holds {len(texts)} items, over the limit of {max_texts}")
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"texts[{index}] must be a string, got {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"texts[{index}] is empty")
    return list(texts)


def tokenize_sources(tokenizer: Tokenizer, texts: Sequence[str], max_source_tokens: int,
                     truncate: bool) -> list[list[int]]:
    """Token ids per text; over-long texts are an error naming the text, or truncated.

    A text of more than MAX_CHARS_PER_TOKEN characters per source token cannot fit, whatever
    its pieces: it is refused (or cut) before the tokenizer sees it, so that a huge text
    costs neither the tokenizer's time nor its memory.
    """
    char_limit = max_source_tokens * MAX_CHARS_PER_TOKEN
    sources = []
    for index, text in enumerate(texts):
        if len(text) > char_limit:
            if not truncate:
                raise ValueError(f"texts[{index}] is {len(text)} characters, over the limit of "
                                 f"{char_limit} ({MAX_CHARS_PER_TOKEN} per source token; "
                                 "truncate=True cuts it)")
            text = text[:char_limit]
        ids = tokenizer.encode(text)
        if len(ids) > max_source_tokens:
            if not truncate:
                raise ValueError(f"texts[{index}] is {len(ids)} tokens, over the limit of "
                                 f"{max_source_tokens} source tokens (truncate=True cuts it)")
            ids = ids[: max_source_tokens - 1] + [tokenizer.eos_id]
        sources.append(ids)
    return sources


def decoding_options(options: DecodingOptions | None = None, **overrides: Any) -> DecodingOptions:
    base = options or DecodingOptions()
    if overrides:
        unknown = sorted(set(overrides) - set(DecodingOptions.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown decoding option(s): {', '.join(unknown)}")
        base = DecodingOptions(**{**base.__dict__, **overrides})
    return base


class Translator:
    """Translate and embed texts with an exported model (ONNX Runtime) or any Backend."""

    def __init__(
        self,
        artifacts_dir: str | Path | None = None,
        device: str = "cpu",
        intra_op_threads: int = 0,
        inter_op_threads: int = 0,
        optimization: str = "all",
        max_batch_size: int = 32,
    ) -> None:
        from tfserve.runtime import Runtime

        if artifacts_dir is None:
            from tfserve.demo import default_artifacts

            artifacts_dir = default_artifacts()
        runtime = Runtime(artifacts_dir, device=device, intra_op_threads=intra_op_threads,
                          inter_op_threads=inter_op_threads, optimization=optimization)
        self._setup(runtime, runtime.tokenizer, max_batch_size)
        self.runtime = runtime

    @classmethod
    def from_backend(cls, backend: Backend, tokenizer: Tokenizer,
                     max_batch_size: int = 32) -> Translator:
        """Wrap another backend (e.g. tfserve.eager.EagerBackend) behind the same API."""
        translator = cls.__new__(cls)
        translator._setup(backend, tokenizer, max_batch_size)
        translator.runtime = None
        return translator

    def _setup(self, backend: Backend, tokenizer: Tokenizer, max_batch_size: int) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.backend = backend
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_source_tokens = int(getattr(backend, "max_source_positions", 512))

    def _batches(self, sources: list[list[int]]) -> list[list[int]]:
        """Indices grouped into length-sorted batches, so rows in a batch need little padding."""
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
        return [order[i : i + self.max_batch_size] for i in range(0, len(order),
                                                                  self.max_batch_size)]

    def translate_hypotheses(self, texts: Sequence[str], options: DecodingOptions | None = None,
                             truncate: bool = False, **overrides: Any) -> list[list[Translation]]:
        """The n-best list (num_return_sequences entries) for each text, in input order."""
        texts = check_texts(texts, max_texts=10**9)
        opts = decoding_options(options, **overrides)
        opts = opts.validate(max_new_tokens_limit=self.backend.max_target_positions - 1)
        sources = tokenize_sources(self.tokenizer, texts, self.max_source_tokens, truncate)
        results: list[list[Hypothesis]] = [[] for _ in texts]
        for batch in self._batches(sources):
            input_ids, attention_mask = self.tokenizer.pad_batch([sources[i] for i in batch])
            for index, hyps in zip(batch, generate(self.backend, input_ids, attention_mask, opts)):
                results[index] = hyps
        return [[Translation(self.tokenizer.decode(h.token_ids), h.token_ids, h.score)
                 for h in hyps] for hyps in results]

    def translate(self, texts: Sequence[str], options: DecodingOptions | None = None,
                  truncate: bool = False, **overrides: Any) -> list[str]:
        """The best translation of each text, in input order."""
        return [hyps[0].text for hyps in
                self.translate_hypotheses(texts, options, truncate, **overrides)]

    def encode(self, texts: Sequence[str], pooling: str = "mean",
               truncate: bool = False) -> list[Encoding]:
        """Encoder hidden states and a pooled embedding per text, in input order."""
        texts = check_texts(texts, max_texts=10**9)
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        sources = tokenize_sources(self.tokenizer, texts, self.max_source_tokens, truncate)
        out: list[Encoding | None] = [None] * len(texts)
        for batch in self._batches(sources):
            input_ids, attention_mask = self.tokenizer.pad_batch([sources[i] for i in batch])
            hidden = encoder_hidden_states(self.backend, input_ids, attention_mask)
            pooled = pool(hidden, attention_mask, pooling)
            for row, index in enumerate(batch):
                length = len(sources[index])
                out[index] = Encoding(hidden[row, :length].copy(), pooled[row], sources[index])
        return [e for e in out if e is not None]
