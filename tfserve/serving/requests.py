"""Requests as plain values, checked and turned into scheduler jobs the same way for every
transport.

A front end converts its message (protobuf, JSON) into `TranslateInput` / `EncodeInput` and
`OptionFields`; `Submitter` checks them (each bad input an `InvalidArgument` naming the
field and its limit), tokenizes, and submits to the scheduler. Request ids are checked here
too (`check_request_id`), and client strings in messages are cut by `shown`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tfserve.generation import DecodingOptions
from tfserve.inputs import POOLINGS, check_texts, tokenize_sources
from tfserve.scheduler import Job, Scheduler, StreamEvent
from tfserve.serving.status import InvalidArgument
from tfserve.settings import ServerConfig

if TYPE_CHECKING:
    from tfserve.serving.calls import Call

MAX_REQUEST_ID_CHARS = 128  # echoed in metadata and logs: short, printable ASCII only
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
    if not all(" " <= char <= "~" for char in value):
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


@dataclass(frozen=True)
class OptionFields:
    """A request's decoding options as sent: 0 (or None, for fields that may be 0) means
    "not given", and the server's default applies."""

    max_new_tokens: int = 0
    min_new_tokens: int = 0
    num_beams: int = 0
    length_penalty: float | None = None
    early_stopping: bool = False
    num_return_sequences: int = 0
    do_sample: bool = False
    temperature: float | None = None
    top_k: int = 0
    top_p: float | None = None
    seed: int | None = None


def decoding_options(fields: OptionFields, default_max_new_tokens: int) -> DecodingOptions:
    """OptionFields -> generation.DecodingOptions, defaults filled in (not validated yet)."""
    return DecodingOptions(
        max_new_tokens=fields.max_new_tokens or default_max_new_tokens or None,
        min_new_tokens=fields.min_new_tokens,
        num_beams=fields.num_beams or 1,
        length_penalty=1.0 if fields.length_penalty is None else fields.length_penalty,
        early_stopping=fields.early_stopping,
        num_return_sequences=fields.num_return_sequences or 1,
        do_sample=fields.do_sample,
        temperature=1.0 if fields.temperature is None else fields.temperature,
        top_k=fields.top_k,
        top_p=1.0 if fields.top_p is None else fields.top_p,
        seed=fields.seed,
    )


@dataclass(frozen=True)
class TranslateInput:
    """A translate request: texts or token ids (one of them), and how to decode them."""

    texts: Sequence[str] = ()
    token_ids: Sequence[Sequence[int]] = ()
    truncate: bool = False
    options: OptionFields = field(default_factory=OptionFields)


@dataclass(frozen=True)
class EncodeInput:
    """An encode request: texts, the pooling ("" for mean), per-token states or not."""

    texts: Sequence[str] = ()
    truncate: bool = False
    pooling: str = ""
    return_hidden_states: bool = False


class Submitter:
    """Checks requests against the model's and the server's limits and submits them."""

    def __init__(self, runtime: Any, config: ServerConfig, scheduler: Scheduler) -> None:
        self.tokenizer = runtime.tokenizer
        self.config = config
        self.scheduler = scheduler
        self.max_source_tokens = int(runtime.max_source_positions)
        self.vocab_size = int(runtime.vocab_size)

    async def sources(self, request: TranslateInput, call: Call) -> list[list[int]]:
        """Token ids per input from texts or token_ids, with the shared checks."""
        if len(request.texts) and len(request.token_ids):
            raise InvalidArgument("texts and token_ids are mutually exclusive: give one")
        if len(request.token_ids):
            call.texts = len(request.token_ids)
            return self.token_sources(request.token_ids, request.truncate)
        call.texts = len(request.texts)
        return await self.tokenize(request.texts, request.truncate)

    async def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        """check_texts + tokenize_sources; large requests are tokenized off the event loop,
        so that they do not stall every other call."""
        with field_errors():
            checked = check_texts(list(texts), max_texts=self.config.max_texts_per_request)
            args = (self.tokenizer, checked, self.max_source_tokens, truncate)
            if sum(len(text) for text in checked) <= INLINE_TOKENIZE_CHARS:
                return tokenize_sources(*args)
            return await asyncio.to_thread(tokenize_sources, *args)

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

    def options(self, fields: OptionFields) -> DecodingOptions:
        """The request's decoding options, validated; errors name `options.<field>`."""
        with field_errors("options."):
            options = decoding_options(fields, self.config.default_max_new_tokens)
            return options.validate(max_new_tokens_limit=self.scheduler.max_new_tokens_limit)

    async def submit_translate(self, request: TranslateInput, call: Call,
                               on_event: Callable[[StreamEvent], None] | None = None) -> Job:
        """Check, tokenize and queue a translate request; on_event streams its tokens."""
        sources = await self.sources(request, call)
        options = self.options(request.options)
        with field_errors("options."):
            return self.scheduler.submit_translate(sources, options, deadline=call.deadline,
                                                   on_event=on_event)

    async def submit_encode(self, request: EncodeInput, call: Call) -> Job:
        """Check, tokenize and queue an encode request."""
        call.texts = len(request.texts)
        pooling = request.pooling or "mean"
        if pooling not in POOLINGS:
            raise InvalidArgument(f"pooling must be one of {', '.join(POOLINGS)}, "
                                  f"got {shown(pooling)}")
        sources = await self.tokenize(request.texts, request.truncate)
        with field_errors():
            return self.scheduler.submit_encode(sources, pooling, request.return_hidden_states,
                                                deadline=call.deadline)
