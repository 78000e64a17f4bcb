"""The user-facing API: texts in, translations (or sentence embeddings) out.

    from tfserve import Translator
    translator = Translator("artifacts/opus-mt-en-de", device="cpu")
    translator.translate(["Hello world."], num_beams=4)

Input checks are the same for every front end (Python API, CLI, gRPC): each bad input is a
ValueError naming the field and the limit. They live in tfserve.inputs, which the scheduler
imports too, and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tfserve.batch import generate
from tfserve.generation import Backend, DecodingOptions, Hypothesis
from tfserve.inputs import (
    DEFAULT_MAX_TEXTS,
    ENCODER_CALL_TOKENS,
    MAX_CHARS_PER_TOKEN,
    POOLINGS,
    check_texts,
    encoder_hidden_states,
    length_groups,
    pool,
    tokenize_sources,
)
from tfserve.scheduler.config import SchedulerConfig
from tfserve.tokenizer import Tokenizer

# the input helpers are re-exported: the server and older callers import them from here
__all__ = [
    "DEFAULT_MAX_TEXTS",
    "ENCODER_CALL_TOKENS",
    "MAX_CHARS_PER_TOKEN",
    "POOLINGS",
    "Encoding",
    "Translation",
    "Translator",
    "check_texts",
    "decoding_options",
    "encoder_hidden_states",
    "length_groups",
    "pool",
    "tokenize_sources",
]


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
        max_batch_size: int = SchedulerConfig.max_batch_size,
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
                     max_batch_size: int = SchedulerConfig.max_batch_size) -> Translator:
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
