"""Streamed translation, whatever the transport: the tokens the scheduler decides at each step
become text deltas that add up to the final text.

`TokenStream` carries one job's `StreamEvent`s from the worker thread to the event loop and
turns them into `Chunk`s, each input's last one with its hypotheses' texts; `TextDelta` is the
text logic for one input. A front end only converts each chunk into its own message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tfserve.generation import Hypothesis
from tfserve.scheduler import Job, StreamEvent
from tfserve.serving.results import Decode, TextHypothesis, with_text

log = logging.getLogger("tfserve.server")


class TextDelta:
    """Turns the tokens of one streamed input into text deltas that add up to its final text.

    SentencePiece text is decoded from the whole token prefix each time (a piece's leading
    '▁' becomes a space only after another piece), and a trailing U+FFFD (a byte-fallback
    character not yet complete) is held back until the next token completes it. Tokens that
    add no text yet wait in `unsent` and go out with the next chunk that has text.
    """

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self.unsent: list[int] = []
        self.text = ""

    def take_unsent(self) -> list[int]:
        """The tokens pushed since the last chunk (they go out with the next one)."""
        tokens, self.unsent = self.unsent, []
        return tokens

    def push(self, token_ids: list[int]) -> str:
        """Add a step's tokens; the text they complete ("" while nothing is complete)."""
        self.tokens.extend(token_ids)
        self.unsent.extend(token_ids)
        full = self.decode(self.tokens)
        if full.endswith("\ufffd") or not full.startswith(self.text):
            return ""
        delta, self.text = full[len(self.text):], full
        return delta

    def finish(self, final: Hypothesis, final_text: str) -> tuple[list[int], str]:
        """(token ids not sent yet, the rest of the text) for the last chunk."""
        sent = len(self.tokens)
        new_tokens = (final.token_ids[sent:] if final.token_ids[:sent] == self.tokens
                      else list(final.token_ids))
        if not final_text.startswith(self.text):  # never seen; the deltas would not add up
            log.warning("streamed text %r is not a prefix of the final %r", self.text,
                        final_text)
            return new_tokens, final_text
        return new_tokens, final_text[len(self.text):]


@dataclass
class Chunk:
    """One streamed piece of input `index`: new text and the tokens behind it. The last one
    (`done`) carries the best hypothesis, and every hypothesis when the request asked for
    more than one, with their texts."""

    index: int
    text_delta: str
    token_ids: list[int]
    done: bool = False
    final: TextHypothesis | None = None
    hypotheses: list[TextHypothesis] = field(default_factory=list)


class TokenStream:
    """One streamed job's events, handed from the worker thread to this event loop.

        stream = TokenStream(loop)
        job = scheduler.submit_translate(..., on_event=stream.on_event)
        stream.end_with(job)
        async for chunk in stream.chunks(tokenizer.decode): ...
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.events: asyncio.Queue[StreamEvent | None] = asyncio.Queue()

    def on_event(self, event: StreamEvent) -> None:
        """The scheduler's callback (worker thread): hand off only."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def end_with(self, job: Job) -> None:
        """End the stream when the job ends (success or failure): the end arrives after its
        last event, as both go through call_soon_threadsafe from the worker thread, which
        keeps their order."""
        job.future.add_done_callback(
            lambda _: self.loop.call_soon_threadsafe(self.events.put_nowait, None))

    async def chunks(self, decode: Decode) -> AsyncIterator[Chunk]:
        """A chunk whenever an input's text grows, and one last chunk per input."""
        deltas: dict[int, TextDelta] = {}
        while True:
            event = await self.events.get()
            if event is None:
                return
            delta = deltas.setdefault(event.index, TextDelta(decode))
            if not event.done:
                text = delta.push(event.token_ids)
                if text:  # a chunk only when there is text (the tokens ride along with it)
                    yield Chunk(event.index, text, delta.take_unsent())
                continue
            assert event.hypotheses is not None
            head = delta.push(event.token_ids)  # the last step's token, when it was not eos
            best = event.hypotheses[0]
            best_text = decode(best.token_ids)
            new_tokens, rest = delta.finish(best, best_text)
            final = with_text(best, decode, best_text)
            # every hypothesis only when the request asked for more than one
            hypotheses = [final, *(with_text(found, decode) for found in event.hypotheses[1:])]
            yield Chunk(event.index, head + rest, delta.take_unsent() + new_tokens, done=True,
                        final=final, hypotheses=hypotheses if len(hypotheses) > 1 else [])
