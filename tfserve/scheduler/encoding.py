"""The worker's encoder runs (`EncoderRuns`): work items padded and cut into length-sorted
batches, one model run per batch; a batch whose run fails is run again input by input, so
that an input the model cannot take fails its own request and not the others of its batch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from tfserve.generation import Backend, make_search
from tfserve.generation.batch import Joining
from tfserve.scheduler.jobs import Encoded, Outcomes, WorkItem
from tfserve.scheduler.scheduler_config import SchedulerConfig
from tfserve.text.inputs import encoder_hidden_states, length_groups, pool


class EncoderRuns:
    """Encoder runs over work items, for the worker thread only. Runs and failures are
    counted and reported through `outcomes`."""

    def __init__(self, backend: Backend, config: SchedulerConfig, outcomes: Outcomes) -> None:
        self.backend = backend
        self.config = config
        self.outcomes = outcomes

    def translate(self, items: list[WorkItem]) -> list[Joining]:
        """Encode translate items: what joins the decoder batch, one group per batch run
        (the searches, the cross K/V, the source mask)."""
        return [group for chunk in self._chunks(items) for group in self._encode_chunk(chunk)]

    def embed(self, items: list[WorkItem]) -> Iterator[tuple[WorkItem, Encoded]]:
        """Encode the inputs of Encode requests: each item's result, batch by batch as each
        run ends (so a request is answered without waiting for the runs after its own)."""
        for chunk in self._chunks(items):
            yield from self._embed_chunk(chunk)

    def select(self, group: Joining, rows: Sequence[int]) -> Joining:
        """An encoded group with only the rows `rows` (of the requests that go on)."""
        index = np.asarray(rows, np.int64)
        return Joining([group.searches[row] for row in rows], [group.tags[row] for row in rows],
                       self.backend.take_rows(group.cross, index),
                       group.encoder_attention_mask[index])

    def _chunks(self, items: list[WorkItem]) -> list[list[WorkItem]]:
        """Length-sorted encoder batches within max_batch_size rows and max_batch_tokens,
        cut where padding would cost more than another encoder call (length_groups)."""
        groups = length_groups([len(item.source) for item in items],
                               self.config.max_batch_size, self.config.max_batch_tokens)
        return [[items[i] for i in group] for group in groups]

    def _pad(self, items: list[WorkItem]) -> tuple[np.ndarray, np.ndarray]:
        """Right-padded input_ids and attention_mask, int64 [B,S]."""
        width = max(len(item.source) for item in items)
        input_ids = np.full((len(items), width), self.backend.pad_token_id, np.int64)
        attention_mask = np.zeros((len(items), width), np.int64)
        for row, item in enumerate(items):
            input_ids[row, : len(item.source)] = item.source
            attention_mask[row, : len(item.source)] = 1
        return input_ids, attention_mask

    def _encode_chunk(self, chunk: list[WorkItem]) -> list[Joining]:
        """One encoder run; when it fails, each input is tried alone."""
        backend = self.backend
        input_ids, attention_mask = self._pad(chunk)
        try:
            _, cross = backend.encode(input_ids, attention_mask)
        except Exception as exc:
            if len(chunk) > 1:
                return [group for item in chunk for group in self._encode_chunk([item])]
            self.outcomes.model_failed("encode", exc, {chunk[0].job})
            return []
        self.outcomes.encoder_ran(chunk)
        searches = []
        for item in chunk:
            options = item.decoding_options
            assert options is not None
            searches.append(make_search(options, backend.eos_token_id,
                                        backend.decoder_start_token_id))
        return [Joining(searches, chunk, cross, attention_mask)]

    def _embed_chunk(self, chunk: list[WorkItem]) -> Iterator[tuple[WorkItem, Encoded]]:
        """One encoder run for Encode requests; when it fails, each input is tried alone."""
        input_ids, attention_mask = self._pad(chunk)
        try:
            hidden = encoder_hidden_states(self.backend, input_ids, attention_mask)
        except Exception as exc:
            if len(chunk) > 1:
                for item in chunk:
                    yield from self._embed_chunk([item])
            else:
                self.outcomes.model_failed("embed", exc, {chunk[0].job})
            return
        self.outcomes.encoder_ran(chunk)
        for row, item in enumerate(chunk):
            length = len(item.source)
            job = item.job
            # pool one row at a time: rows of a chunk may come from requests with
            # different pooling
            embedding = pool(hidden[row : row + 1], attention_mask[row : row + 1],
                             job.pooling)[0]
            states = hidden[row, :length].copy() if job.return_hidden_states else None
            yield item, Encoded(item.source, embedding, states)
