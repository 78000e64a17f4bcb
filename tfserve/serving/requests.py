"""Requests as plain values, checked and turned into scheduler jobs the same way for every
transport.

A front end converts its message (protobuf, JSON) into `TranslateInput` / `EncodeInput` and
`OptionFields`; `Submitter` checks them (each bad input an `InvalidArgument` naming the
field and its limit), tokenizes, and submits to the scheduler. Request ids are checked here
too (`check_request_id`), and client strings in messages are cut by `shown`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Protocol

from tfserve import option_table
from tfserve.artifacts.generation_defaults import GenerationDefaults
from tfserve.generation import DecodingOptions
from tfserve.scheduler import Job, Scheduler, StreamEvent
from tfserve.serving.documents import (
    DocumentRequest,
    Documents,
    check_format,
    plan_documents,
)
from tfserve.serving.served_model import ServedModel
from tfserve.serving.settings import ServerConfig
from tfserve.serving.status import InvalidArgument
from tfserve.text.documents import DocumentLimits
from tfserve.text.inputs import POOLINGS, check_texts
from tfserve.text.languages import LanguageError
from tfserve.text.translation_inputs import PrefixError, request_options, source_ids

MAX_REQUEST_ID_CHARS = 128  # echoed in metadata and logs: short, printable ASCII only
# the characters of a request id, as a regular expression (checks and the OpenAPI document)
REQUEST_ID_PATTERN = "^[ -~]*$"
INLINE_TOKENIZE_CHARS = 4096  # larger requests are tokenized on a thread, off the event loop


def shown(value: str, limit: int = 40) -> str:
    """A client's string for an error message or a log: repr, cut to `limit` characters."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def check_request_id(value: str) -> str:
    """The request id as given, or InvalidArgument: it is echoed in response metadata, which
    takes printable ASCII only, and in every log line, so it is short."""
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id is {len(value)} characters, over the limit of "
                              f"{MAX_REQUEST_ID_CHARS}")
    if not re.fullmatch(REQUEST_ID_PATTERN, value):
        raise InvalidArgument(f"request_id {shown(value)} must be printable ASCII "
                              "(no control characters, no non-ASCII)")
    return value


@contextmanager
def field_errors(prefix: str = "") -> Iterator[None]:
    """Turn the ValueErrors of the shared input checks into InvalidArgument, field-prefixed."""
    try:
        yield
    except InvalidArgument:
        raise
    except ValueError as exc:
        raise InvalidArgument(f"{prefix}{exc}") from exc


def _given(self: Any) -> dict[str, Any]:
    """The DecodingOptions fields the request sets (tfserve.text.translation_inputs'
    `given`: the others take the defaults)."""
    return {name: value for name, value in self.__dict__.items() if value is not None}


# a frozen dataclass with a field per declared decoding option (tfserve.option_table), each
# None by default, and given()
OptionFields = make_dataclass(
    "OptionFields", [(declared.name, declared.annotation | None, None)
                     for declared in option_table.OPTIONS],
    frozen=True, namespace={"given": _given})
OptionFields.__module__ = __name__
OptionFields.__doc__ = """A request's decoding options as sent, one field per option of
tfserve.option_table: None means "not given" (a proto field at 0, or an `optional` one left
unset), and the model's generation default, else the server's, applies."""


@dataclass(frozen=True)
class TranslateInput:
    """A translate request: the model it names ("": the default model) and, optionally, its
    version ("": whichever serves), texts or token ids (one of them), their languages,
    target prefixes (none, one for all inputs, or one per input), and how to decode them.
    Texts are documents, split into sentences, unless split_sentences is False (None: the
    default, true); `format` is "text" ("" too) or "html"; source_language may be "auto"
    (tfserve.serving.documents)."""

    model: str = ""
    version: str = ""
    texts: Sequence[str] = ()
    token_ids: Sequence[Sequence[int]] = ()
    truncate: bool = False
    options: OptionFields = field(default_factory=OptionFields)
    source_language: str = ""
    target_language: str = ""
    target_prefix: Sequence[str] = ()
    split_sentences: bool | None = None
    format: str = ""

    @property
    def document(self) -> DocumentRequest:
        """How its texts are read as documents."""
        return DocumentRequest(self.split_sentences, self.format, self.source_language)


@dataclass(frozen=True)
class DetectInput:
    """A detect request: the model whose language codes to map to (as TranslateInput),
    and texts."""

    model: str = ""
    version: str = ""
    texts: Sequence[str] = ()


@dataclass(frozen=True)
class EncodeInput:
    """An encode request: the model and version it names (as TranslateInput), texts, the
    pooling ("" for mean), per-token states or not, and the texts' language ("" for the
    model's default)."""

    model: str = ""
    version: str = ""
    texts: Sequence[str] = ()
    truncate: bool = False
    pooling: str = ""
    return_hidden_states: bool = False
    source_language: str = ""


class Counted(Protocol):
    """What the submitter reads and writes of a call (tfserve.serving.calls.Call): its
    deadline, and how many inputs it holds (its access-log record's `texts`)."""

    deadline: float | None
    texts: int


ENCODER_ONLY = ("model: this model is an encoder-only model (decoder_layers 0, a T5 encoder): "
                "it answers Encode, not Translate")


class Submitter:
    """Checks one model's requests against its limits and the server's, and submits them to
    its scheduler.

    Texts, languages, target prefixes and options become source ids and DecodingOptions
    through tfserve.text.translation_inputs, as in the Translator: the source language's token
    where the model's family puts it (truncation keeps it), the target language as the
    forced first token, and the model's generation defaults (model.json "generation",
    under the server's --default-max-new-tokens) for every option the request leaves unset.
    """

    def __init__(self, runtime: ServedModel, config: ServerConfig, scheduler: Scheduler
                 ) -> None:
        self.tokenizer = runtime.tokenizer
        self.config = config
        self.scheduler = scheduler
        self.max_source_tokens = int(runtime.max_source_positions)
        self.vocab_size = int(runtime.vocab_size)
        self.start_token_id = int(runtime.decoder_start_token_id)
        # a model without language codes accepts its own languages, and no other
        self.model_languages = (runtime.config.source_language, runtime.config.target_language)
        self.generation_defaults = server_defaults(runtime.manifest.generation_defaults,
                                                   config.default_max_new_tokens)
        self.encoder_only = bool(runtime.config.encoder_only)
        self.document_limits = DocumentLimits(config.max_document_characters,
                                              config.max_document_sentences)

    async def documents(self, request: TranslateInput, call: Counted) -> Documents:
        """The request's rows: each text a document split into sentences (unless the
        request turns splitting off: one row per text), or the token-id inputs as given;
        with the shared checks. Large requests are planned off the event loop."""
        if len(request.texts) and len(request.token_ids):
            raise InvalidArgument("texts and token_ids are mutually exclusive: give one")
        if len(request.token_ids):
            check_format(request.format)  # known, though only texts are read by it
            sources = await self.sources(request, call)
            count = len(sources)
            return Documents(sources, [(index, 0) for index in range(count)],
                             list(range(count)), [None] * count, [None] * count)
        call.texts = len(request.texts)
        with field_errors():
            texts = check_texts(list(request.texts),
                                max_texts=self.config.max_texts_per_request)
        args = (self.tokenizer, texts, request.document, self.max_source_tokens,
                self.document_limits, request.truncate, self.model_languages[0])
        if sum(len(text) for text in texts) <= INLINE_TOKENIZE_CHARS:
            return plan_documents(*args)
        return await asyncio.to_thread(plan_documents, *args)

    async def sources(self, request: TranslateInput, call: Counted) -> list[list[int]]:
        """Token ids per input from texts or token_ids, with the shared checks."""
        if len(request.texts) and len(request.token_ids):
            raise InvalidArgument("texts and token_ids are mutually exclusive: give one")
        if len(request.token_ids):
            call.texts = len(request.token_ids)
            if request.source_language:
                raise InvalidArgument("source_language applies to texts: token_ids are the "
                                      "source as given (its language token among them)")
            return self.token_sources(request.token_ids, request.truncate)
        call.texts = len(request.texts)
        return await self.tokenize(request.texts, request.truncate, request.source_language)

    async def tokenize(self, texts: Sequence[str], truncate: bool,
                       source_language: str = "") -> list[list[int]]:
        """check_texts + translation_inputs.source_ids; large requests are tokenized off the
        event loop, so that they do not stall every other call."""
        with field_errors():
            checked = check_texts(list(texts), max_texts=self.config.max_texts_per_request)
            args = (self.tokenizer, checked, source_language or None, self.max_source_tokens,
                    truncate, self.model_languages[0])
            if sum(len(text) for text in checked) <= INLINE_TOKENIZE_CHARS:
                return source_ids(*args)
            return await asyncio.to_thread(source_ids, *args)

    def token_sources(self, sequences: Sequence[Sequence[int]],
                      truncate: bool) -> list[list[int]]:
        """Token-id inputs checked against the vocabulary and the source length, eos-ended."""
        limit = self.config.max_texts_per_request
        if len(sequences) > limit:
            raise InvalidArgument(f"token_ids holds {len(sequences)} items, over the limit of "
                                  f"{limit}")
        eos = self.tokenizer.eos_id
        sources = []
        for index, sequence in enumerate(sequences):
            ids = [int(i) for i in sequence]
            if not ids:
                raise InvalidArgument(f"token_ids[{index}] is empty")
            for position, token in enumerate(ids):
                if not 0 <= token < self.vocab_size:
                    raise InvalidArgument(f"token_ids[{index}].ids[{position}] is {token}, "
                                          f"outside the vocabulary [0, {self.vocab_size})")
            if ids[-1] != eos:
                ids.append(eos)
            if len(ids) > self.max_source_tokens:
                if not truncate:
                    raise InvalidArgument(
                        f"token_ids[{index}] is {len(ids)} tokens, over the limit of "
                        f"{self.max_source_tokens} source tokens (truncate=true cuts it)")
                ids = ids[: self.max_source_tokens - 1] + [eos]
            sources.append(ids)
        return sources

    async def options(self, request: TranslateInput, count: int) -> list[DecodingOptions]:
        """The decoding options of each of the request's `count` inputs (inputs differ only
        by their target prefix), validated; errors name `options.<field>`,
        `target_language` or `target_prefix[i]`. Long prefixes are tokenized off the event
        loop."""
        prefixes = target_prefixes(request.target_prefix, count)
        if sum(len(prefix) for _, prefix in prefixes) <= INLINE_TOKENIZE_CHARS:
            return self._options(request, prefixes)
        return await asyncio.to_thread(self._options, request, prefixes)

    def _options(self, request: TranslateInput,
                 prefixes: list[tuple[str, str]]) -> list[DecodingOptions]:
        given = request.options.given()
        built: dict[str, DecodingOptions] = {}  # one object per distinct prefix
        for field_name, prefix in prefixes:
            if prefix in built:
                continue
            try:
                built[prefix] = request_options(
                    self.tokenizer, self.generation_defaults, given, self.start_token_id,
                    self.scheduler.max_new_tokens_limit, request.target_language or None,
                    prefix or None, self.vocab_size, self.model_languages[1])
            except ValueError as exc:
                raise request_error(exc, field_name) from exc
        return [built[prefix] for _, prefix in prefixes]

    async def submit_translate(self, request: TranslateInput, call: Counted,
                               on_event: Callable[[StreamEvent], None] | None = None) -> Job:
        """Check, tokenize and queue a translate request; on_event streams its tokens."""
        return (await self.submit_documents(request, call, on_event))[0]

    async def submit_documents(self, request: TranslateInput, call: Counted,
                               on_event: Callable[[StreamEvent], None] | None = None
                               ) -> tuple[Job, Documents]:
        """Check, plan and queue a translate request: one job whose inputs are every
        text's rows (a document's sentences are ordinary rows of the continuous batch);
        on_event streams the rows' tokens (StreamEvent.index: the row). A target prefix
        applies to its text's first row."""
        if self.encoder_only:
            raise InvalidArgument(ENCODER_ONLY)
        documents = await self.documents(request, call)
        per_input = await self.options(request, documents.count)
        options = per_input
        if len(documents.sources) != documents.count:
            plain = per_input[0] if not len(request.target_prefix) else \
                self._options(request, [("target_prefix", "")])[0]
            options = [per_input[index] if segment == 0 else plain
                       for index, segment in documents.row_of]
        with field_errors("options."):
            job = self.scheduler.submit_translate(documents.sources, options,
                                                  deadline=call.deadline, on_event=on_event)
        return job, documents

    async def submit_encode(self, request: EncodeInput, call: Counted) -> Job:
        """Check, tokenize and queue an encode request."""
        call.texts = len(request.texts)
        pooling = request.pooling or "mean"
        if pooling not in POOLINGS:
            raise InvalidArgument(f"pooling must be one of {', '.join(POOLINGS)}, "
                                  f"got {shown(pooling)}")
        sources = await self.tokenize(request.texts, request.truncate, request.source_language)
        with field_errors():
            return self.scheduler.submit_encode(sources, pooling, request.return_hidden_states,
                                                deadline=call.deadline)


def server_defaults(model_defaults: GenerationDefaults,
                    default_max_new_tokens: int | None) -> GenerationDefaults:
    """The model's generation defaults under the server's --default-max-new-tokens, which
    takes precedence over the checkpoint's max_new_tokens / max_length (and, like them,
    never exceeds what the model can take after a target prefix)."""
    if not default_max_new_tokens:
        return model_defaults
    return GenerationDefaults({**model_defaults.fields,
                               "max_new_tokens": default_max_new_tokens})


def target_prefixes(given: Sequence[str], count: int) -> list[tuple[str, str]]:
    """(the field name errors use, the prefix) for each of `count` inputs: none given, one
    for every input, or one per input."""
    if not len(given):
        return [("target_prefix", "")] * count
    if len(given) == 1:
        return [("target_prefix[0]", given[0])] * count
    if len(given) != count:
        raise InvalidArgument(f"target_prefix holds {len(given)} items for {count} inputs: "
                              "give none, one for every input, or one per input")
    return [(f"target_prefix[{index}]", prefix) for index, prefix in enumerate(given)]


def request_error(exc: ValueError, prefix_field: str) -> InvalidArgument:
    """translation_inputs' error as the request's field: a language error (LanguageError)
    names its own field, a target prefix error (PrefixError) the prefix's place in the
    request, anything else is an option's (`options.<field>`)."""
    if isinstance(exc, LanguageError):
        return InvalidArgument(str(exc))
    if isinstance(exc, PrefixError):
        return InvalidArgument(f"{prefix_field} {exc.problem}")
    return InvalidArgument(f"options.{exc}")
