"""The user-facing API: texts in, translations (or sentence embeddings) out.

    from tfserve import Translator
    translator = Translator("artifacts/opus-mt-en-de", device="cpu")
    translator.translate(["Hello world."], num_beams=4)

    nllb = Translator("artifacts/nllb-200-distilled-600M")
    nllb.translate(["Hello world."], source_language="eng_Latn", target_language="fra_Latn")
    nllb.translate(["Hello.", "Hello."], target_language=["fra_Latn", "deu_Latn"])

    document = nllb.translate_document(open("page.html").read(), format="html",
                                       source_language="auto", target_language="fra_Latn")
    document.text, document.segments, document.detected_language, document.confidence

Options a call leaves unset take the checkpoint's own generation defaults (its
generation_config.json, recorded in the manifest: opus-mt asks for beam search, NLLB for a
max_length); `Translator.generation_defaults` holds them. Languages, target prefixes and the
options are turned into ids and DecodingOptions by tfserve.text.translation_inputs, as the server
does.

Input checks are the same for every front end (Python API, CLI, gRPC): each bad input is a
ValueError naming the field and the limit. They live in tfserve.text.inputs, which the scheduler
imports too, and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tfserve.artifacts.generation_defaults import GenerationDefaults
from tfserve.generation import Backend, DecodingOptions, Hypothesis
from tfserve.generation.batch import generate
from tfserve.scheduler.scheduler_config import SchedulerConfig
from tfserve.text.inputs import (
    DEFAULT_MAX_TEXTS,
    ENCODER_CALL_TOKENS,
    MAX_CHARS_PER_TOKEN,
    POOLINGS,
    check_texts,
    encoder_hidden_states,
    length_groups,
    pool,
)
from tfserve.text.tokenizer import Tokenizer
from tfserve.text.translation_inputs import model_languages, request_options, source_ids

if TYPE_CHECKING:  # the document path is imported when first used (sentence splitting,
    # language detection and the serving core's document module cost seconds to import)
    from tfserve.serving.documents import TranslatedSegment
    from tfserve.text.documents import DocumentLimits


def _per_text(value: Any, name: str, count: int) -> list[Any]:
    """One value per text: the value for all, or a list with one per text."""
    if value is None or isinstance(value, str):
        return [value] * count
    if not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a string or a list of strings, got "
                         f"{type(value).__name__}")
    if len(value) != count:
        raise ValueError(f"{name} holds {len(value)} items for {count} texts: give one, or "
                         "one per text")
    return list(value)


# the input helpers are re-exported: the server and older callers import them from here
__all__ = [
    "DEFAULT_MAX_TEXTS",
    "ENCODER_CALL_TOKENS",
    "MAX_CHARS_PER_TOKEN",
    "POOLINGS",
    "DocumentTranslation",
    "Encoding",
    "Translation",
    "Translator",
    "check_texts",
    "decoding_options",
    "encoder_hidden_states",
    "length_groups",
    "pool",
]


@dataclass
class Translation:
    text: str
    token_ids: list[int]
    score: float


@dataclass
class DocumentTranslation:
    """A translated document (Translator.translate_document): its text in the source's
    layout, each segment's source and target spans ([start, end) code points of the source
    and of `text`; with several hypotheses, each segment's own alternatives), the language
    detected (source_language "auto": the model's code and the detector's confidence), and
    the n-best documents (hypotheses[0] is `text`; hypothesis k joins every segment's k-th
    hypothesis, its score the sum of theirs)."""

    text: str
    segments: list[TranslatedSegment]
    detected_language: str | None
    confidence: float | None
    hypotheses: list[Translation]


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
        self._setup(runtime, runtime.tokenizer, max_batch_size,
                    runtime.manifest.generation_defaults)
        self.runtime = runtime

    @classmethod
    def from_backend(cls, backend: Backend, tokenizer: Tokenizer,
                     max_batch_size: int = SchedulerConfig.max_batch_size,
                     generation_defaults: GenerationDefaults | None = None) -> Translator:
        """Wrap another backend (e.g. tfserve.model.eager.EagerBackend) behind the same API."""
        translator = cls.__new__(cls)
        translator._setup(backend, tokenizer, max_batch_size,
                          generation_defaults or GenerationDefaults())
        translator.runtime = None
        return translator

    def _setup(self, backend: Backend, tokenizer: Tokenizer, max_batch_size: int,
               generation_defaults: GenerationDefaults) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.backend = backend
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_source_tokens = int(getattr(backend, "max_source_positions", 512))
        self.generation_defaults = generation_defaults
        config = getattr(backend, "config", None) or getattr(
            getattr(backend, "model", None), "config", None)
        # a model without language codes accepts its own languages (and no other)
        self.model_languages = (getattr(config, "source_language", ""),
                                getattr(config, "target_language", ""))
        self.encoder_only = bool(getattr(config, "encoder_only", False))

    @property
    def languages(self) -> list[str]:
        """The language codes of a multilingual model (empty for others)."""
        return model_languages(self.tokenizer)

    def _batches(self, sources: list[list[int]]) -> list[list[int]]:
        """Indices grouped into length-sorted batches, so rows in a batch need little padding."""
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
        return [order[i : i + self.max_batch_size] for i in range(0, len(order),
                                                                  self.max_batch_size)]

    def translate_hypotheses(self, texts: Sequence[str], options: DecodingOptions | None = None,
                             truncate: bool = False, *,
                             source_language: str | Sequence[str] | None = None,
                             target_language: str | Sequence[str] | None = None,
                             target_prefix: str | Sequence[str] | None = None,
                             **overrides: Any) -> list[list[Translation]]:
        """The n-best list (num_return_sequences entries) for each text, in input order.

        source_language, target_language, target_prefix: one for all texts, or a list with
        one per text (texts into different languages decode in one batch). A multilingual
        model needs a target_language. options / overrides: the decoding options set; the
        checkpoint's generation defaults fill the others (a DecodingOptions object sets
        all of its fields).
        """
        if self.encoder_only:
            raise ValueError("this model is an encoder-only model (decoder_layers 0, a T5 "
                             "encoder): it embeds (encode), it does not translate")
        texts = check_texts(texts, max_texts=10**9)
        given = self._given_options(options, overrides)
        per_text = [_per_text(value, name, len(texts)) for name, value in (
            ("source_language", source_language), ("target_language", target_language),
            ("target_prefix", target_prefix))]
        sources: list[list[int]] = []
        per_source: list[DecodingOptions] = []
        prepared: dict[tuple[Any, ...], DecodingOptions] = {}
        limit = self.backend.max_target_positions - 1
        for index, (text, source, target, prefix) in enumerate(zip(texts, *per_text)):
            sources += self._source(text, index, source, truncate)
            key = (target, prefix)
            if key not in prepared:
                prepared[key] = request_options(
                    self.tokenizer, self.generation_defaults, given,
                    self.backend.decoder_start_token_id, limit, target, prefix,
                    self.backend.vocab_size, self.model_languages[1])
            per_source.append(prepared[key])
        return self._generate(sources, per_source)

    def _generate(self, sources: list[list[int]], per_source: list[DecodingOptions]
                  ) -> list[list[Translation]]:
        """The hypotheses of each source, decoded in length-sorted batches."""
        results: list[list[Hypothesis]] = [[] for _ in sources]
        for batch in self._batches(sources):
            input_ids, attention_mask = self.tokenizer.pad_batch([sources[i] for i in batch])
            outputs = generate(self.backend, input_ids, attention_mask,
                               [per_source[i] for i in batch])
            for index, hyps in zip(batch, outputs):
                results[index] = hyps
        return [[Translation(self.tokenizer.decode(h.token_ids), h.token_ids, h.score)
                 for h in hyps] for hyps in results]

    def translate_document(self, text: str, options: DecodingOptions | None = None, *,
                           format: str = "text", source_language: str | None = None,
                           target_language: str | None = None,
                           split_sentences: bool = True, truncate: bool = False,
                           limits: DocumentLimits | None = None,
                           **overrides: Any) -> DocumentTranslation:
        """One document (a text, or HTML with format="html") translated sentence by
        sentence, in its layout, as the server translates each text of a request
        (tfserve.serving.documents): its sentences decode in batches together, a sentence
        over the model's source limit is split further (never cut), and the answer joins
        them back with their spans.

        source_language: a model's code, None for its default, or "auto" (a multilingual
        model: detected once from the whole text). split_sentences=False translates the
        text as one sequence (over the limit: a ValueError, or cut with truncate=True).
        limits: characters and sentences (DocumentLimits' defaults when None). Errors are
        ValueErrors naming the field and the limit.
        """
        from tfserve.serving.documents import DocumentRequest, plan_documents
        from tfserve.text.documents import DocumentLimits

        if self.encoder_only:
            raise ValueError("this model is an encoder-only model (decoder_layers 0, a T5 "
                             "encoder): it embeds (encode), it does not translate")
        texts = check_texts([text], max_texts=1)
        documents = plan_documents(
            self.tokenizer, texts, DocumentRequest(split_sentences, format,
                                                   source_language or ""),
            self.max_source_tokens, limits or DocumentLimits(), truncate,
            self.model_languages[0])
        options = request_options(
            self.tokenizer, self.generation_defaults, self._given_options(options, overrides),
            self.backend.decoder_start_token_id, self.backend.max_target_positions - 1,
            target_language, None, self.backend.vocab_size, self.model_languages[1])
        rows = self._generate(documents.sources, [options] * len(documents.sources))
        answer = documents.result(0, rows)
        hypotheses = [Translation(h.text, h.token_ids, h.score) for h in answer.hypotheses]
        detected = answer.detected
        return DocumentTranslation(
            hypotheses[0].text, answer.segments,
            detected.language if detected is not None else None,
            detected.confidence if detected is not None else None, hypotheses)

    def _source(self, text: str, index: int, source_language: str | None,
                truncate: bool) -> list[list[int]]:
        """One text's source ids; errors name it texts[index]."""
        try:
            return source_ids(self.tokenizer, [text], source_language, self.max_source_tokens,
                              truncate, self.model_languages[0])
        except ValueError as exc:
            message = str(exc)
            if message.startswith("texts[0]"):
                raise type(exc)(f"texts[{index}]{message[len('texts[0]'):]}") from exc
            raise

    def _given_options(self, options: DecodingOptions | None,
                       overrides: dict[str, Any]) -> dict[str, Any]:
        """The decoding option fields a call sets: every field of an options object, and
        the keyword overrides."""
        unknown = sorted(set(overrides) - set(DecodingOptions.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown decoding option(s): {', '.join(unknown)}")
        given = {}
        if options is not None:
            given = {name: value for name, value in options.__dict__.items()
                     if name not in ("prefix_token_ids", "prefix_counts_as_new",
                                     "decoder_start_token_id")}
            if given.get("max_new_tokens") is None:
                del given["max_new_tokens"]
        return {**given, **overrides}

    def translate(self, texts: Sequence[str], options: DecodingOptions | None = None,
                  truncate: bool = False, **overrides: Any) -> list[str]:
        """The best translation of each text, in input order (translate_hypotheses' keyword
        arguments: source_language, target_language, target_prefix, options)."""
        return [hyps[0].text for hyps in
                self.translate_hypotheses(texts, options, truncate, **overrides)]

    def encode(self, texts: Sequence[str], pooling: str = "mean", truncate: bool = False,
               source_language: str | None = None) -> list[Encoding]:
        """Encoder hidden states and a pooled embedding per text, in input order; the texts
        framed as translate frames them (source_language: a multilingual model's code)."""
        texts = check_texts(texts, max_texts=10**9)
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        sources = source_ids(self.tokenizer, texts, source_language, self.max_source_tokens,
                             truncate, self.model_languages[0])
        out: list[Encoding | None] = [None] * len(texts)
        for batch in self._batches(sources):
            input_ids, attention_mask = self.tokenizer.pad_batch([sources[i] for i in batch])
            hidden = encoder_hidden_states(self.backend, input_ids, attention_mask)
            pooled = pool(hidden, attention_mask, pooling)
            for row, index in enumerate(batch):
                length = len(sources[index])
                out[index] = Encoding(hidden[row, :length].copy(), pooled[row], sources[index])
        return [e for e in out if e is not None]
