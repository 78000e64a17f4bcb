"""Streamed translation, whatever the transport: the tokens the scheduler decides at each step
become text deltas that add up to the final text.

`TokenStream` carries one job's `StreamEvent`s from the worker thread to the event loop and
turns them into `Chunk`s, each input's last one with its hypotheses' texts; `TextDelta` is the
text logic for one row. A front end only converts each chunk into its own message.

A document (a text split into sentences: tfserve.serving.documents) is several rows of the
job, decoded side by side; its chunks go out segment after segment, in order (a later
segment's events wait until the one before it has finished), each segment's first chunk
beginning with the layout text in front of it (`separator`) and the input's last chunk
carrying the layout after the last segment, so that an input's text deltas still add up to
its whole text. An HTML segment goes out in one chunk once it is complete (its escaping and
inline markup depend on the whole sentence's translation).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from tfserve.generation import Hypothesis
from tfserve.scheduler import Job, StreamEvent
from tfserve.serving.documents import DetectedLanguage, Documents, TranslatedSegment
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
    more than one, with their texts; for a document, its segments and detected language
    too. `segment` is the document's segment the chunk belongs to, `separator` (on a
    segment's first chunk) the layout text that text_delta begins with."""

    index: int
    text_delta: str
    token_ids: list[int]
    done: bool = False
    final: TextHypothesis | None = None
    hypotheses: list[TextHypothesis] = field(default_factory=list)
    segment: int = 0
    separator: str = ""
    segments: list[TranslatedSegment] = field(default_factory=list)
    detected: DetectedLanguage | None = None


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

    async def chunks(self, decode: Decode, documents: Documents | None = None
                     ) -> AsyncIterator[Chunk]:
        """A chunk whenever an input's text grows, and one last chunk per input; with
        `documents` (the job's rows planned from the request's texts), the rows' events
        become their documents' chunks (DocumentChunks)."""
        if documents is not None:
            order = DocumentChunks(documents, decode)
            while (event := await self.events.get()) is not None:
                for chunk in order.push(event):
                    yield chunk
            return
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


class _Streamed:
    """One input's place in its stream: the segment being sent, the events of later
    segments held until their turn, the text sent so far, the finished segments'
    hypotheses, and its layout."""

    def __init__(self, documents: Documents, index: int, decode: Decode) -> None:
        self.rows = documents.rows_of(index)
        self.per_token = documents.streams_tokens(index)
        self.separators, self.trailing = documents.layout(index)
        self.current = 0
        self.delta = TextDelta(decode)
        self.separator_sent = False
        self.held: dict[int, list[StreamEvent]] = {}
        self.sent: list[str] = []
        self.found: list[list[TextHypothesis]] = []


class DocumentChunks:
    """A document stream's row events -> its inputs' chunks, each input's segments in order
    (module docstring). Events of a segment that is not yet the input's current one are
    held (at most the document's tokens), then sent as soon as its turn comes."""

    def __init__(self, documents: Documents, decode: Decode) -> None:
        self.documents = documents
        self.decode = decode
        self.inputs: dict[int, _Streamed] = {}

    def push(self, event: StreamEvent) -> Iterator[Chunk]:
        """The chunks one row event lets out (none while its segment waits its turn)."""
        index, segment = self.documents.row_of[event.index]
        state = self.inputs.get(index)
        if state is None:
            state = self.inputs[index] = _Streamed(self.documents, index, self.decode)
        if segment != state.current:
            state.held.setdefault(segment, []).append(event)
            return
        yield from self._sent(index, state, event)
        # the segments after a finished one may have finished (or begun) already
        while state.current < len(state.rows) and state.current in state.held:
            for held in state.held.pop(state.current):
                yield from self._sent(index, state, held)

    def _sent(self, index: int, state: _Streamed, event: StreamEvent) -> Iterator[Chunk]:
        """The chunk of an event of the input's current segment (and the input's last)."""
        segment = state.current
        separator = "" if state.separator_sent else state.separators[segment]
        if not event.done:
            text = state.delta.push(event.token_ids)
            if text and state.per_token:
                state.separator_sent = True
                state.sent.append(separator + text)
                yield Chunk(index, separator + text, state.delta.take_unsent(), segment=segment,
                            separator=separator)
            return
        assert event.hypotheses is not None
        head = state.delta.push(event.token_ids)
        best = event.hypotheses[0]
        best_text = self.decode(best.token_ids)
        new_tokens, rest = state.delta.finish(best, best_text)
        found = [with_text(best, self.decode, best_text),
                 *(with_text(h, self.decode) for h in event.hypotheses[1:])]
        state.found.append(found)
        piece = head + rest if state.per_token else self.documents.rendered(
            index, segment, best_text)
        text, tokens = separator + piece, state.delta.take_unsent() + new_tokens
        state.current += 1
        state.delta = TextDelta(self.decode)
        state.separator_sent = False
        if state.current < len(state.rows):
            state.sent.append(text)
            yield Chunk(index, text, tokens, segment=segment, separator=separator)
            return
        answer = self.documents.result(index, state.found)
        final = answer.hypotheses[0]
        sent = "".join(state.sent) + text
        if final.text.startswith(sent):
            text += final.text[len(sent):]  # the layout after the last segment
        else:  # never seen; the deltas would not add up
            log.warning("streamed document %r is not a prefix of the final %r", sent,
                        final.text)
        hypotheses = [TextHypothesis(h.text, h.token_ids, h.score) for h in answer.hypotheses]
        yield Chunk(index, text, tokens, done=True, final=hypotheses[0],
                    hypotheses=hypotheses if len(hypotheses) > 1 else [], segment=segment,
                    separator=separator, segments=answer.segments, detected=answer.detected)
