"""What translates one batch of a job: a local Translator, or running servers.

The job (job.py) needs four things of an engine: a length per text (to sort and budget
batches; for a local model, the source tokens and whether the text is over the model's
limit), a blocking `translate` of one batch, how many such calls may run at once, and a
fingerprint of the model for the journal. Both engines answer a bad input with a ValueError
(the server's INVALID_ARGUMENT arrives as a ServerError, which `is_bad_input` recognises), so
the job can retry a failed batch row by row and charge only the bad row.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

# a server status that says "try elsewhere or later", not "this input is wrong"
RETRY_ELSEWHERE = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED",
                   "INTERNAL", "UNKNOWN")


class Engine(Protocol):
    concurrency: int  # translate() calls the job may run at once
    max_batch_size: int  # rows per translate() call at most (a server's advertised limit)
    exact_lengths: bool  # length() counts source tokens (else: a sort key only)
    failovers: int  # calls retried on another address so far
    max_source_tokens: int  # the model's source limit (a sentence piece's budget)

    def fingerprint(self) -> dict[str, Any]: ...

    def count_tokens(self, text: str) -> int | None:
        """Source tokens of a text, framing included; None where unknown (a server)."""

    def length(self, text: str) -> tuple[int, str | None]:
        """The text's source length and, where known, why it is over the model's limit."""

    def translate(self, texts: Sequence[str], truncate: bool) -> list[tuple[str, int]]:
        """(translation, target tokens) per text, in order."""


def is_bad_input(error: BaseException) -> bool:
    """A ValueError (the Translator's input checks), or a server's INVALID_ARGUMENT."""
    code = getattr(error, "code", None)
    if callable(code):
        return getattr(code(), "name", "") == "INVALID_ARGUMENT"
    return isinstance(error, ValueError)


def manifest_digest(artifacts_dir: str | Path) -> str:
    """The sha256 of an export's model.json (which names its graphs' and weights' hashes)."""
    return hashlib.sha256((Path(artifacts_dir) / "model.json").read_bytes()).hexdigest()


class LocalEngine:
    """A Translator in this process; one call at a time (ONNX Runtime uses the threads), run
    on a worker thread so that reading and tokenizing the next buffer overlaps decoding."""

    concurrency = 1
    exact_lengths = True

    def __init__(self, translator: Any, model_id: str, **decoding: Any) -> None:
        from tfserve.text.translation_inputs import source_ids

        self.translator, self.model_id, self.decoding = translator, model_id, decoding
        self.max_batch_size = translator.max_batch_size
        self.failovers = 0
        self._source_ids = source_ids
        self._source_language = decoding.get("source_language")

    def fingerprint(self) -> dict[str, Any]:
        return {"model": self.model_id}

    @property
    def max_source_tokens(self) -> int:
        return int(self.translator.max_source_tokens)

    def count_tokens(self, text: str) -> int | None:
        tokenizer = self.translator.tokenizer
        before, after = tokenizer.frame(self._source_language)
        return len(before) + len(tokenizer.encode_text(text)) + len(after)

    def length(self, text: str) -> tuple[int, str | None]:
        translator = self.translator
        try:
            ids = self._source_ids(translator.tokenizer, [text], self._source_language,
                                   translator.max_source_tokens, False,
                                   translator.model_languages[0])
        except ValueError as exc:  # over the limit (or a bad language: every row says so)
            return translator.max_source_tokens, str(exc).replace("texts[0] ", "", 1)
        return len(ids[0]), None

    def translate(self, texts: Sequence[str], truncate: bool) -> list[tuple[str, int]]:
        hypotheses = self.translator.translate_hypotheses(list(texts), truncate=truncate,
                                                          **self.decoding)
        return [(best[0].text, len(best[0].token_ids)) for best in hypotheses]


class ServerEngine:
    """One or several tfserve servers: up to `in_flight` calls at once, each of at most the
    server's max_texts_per_request texts (GetModelInfo), spread over the addresses in turn;
    a call that fails for a reason other than its input is retried on the next address."""

    exact_lengths = False

    def __init__(self, addresses: Sequence[str], model: str = "", in_flight: int = 0,
                 timeout: float | None = None, attempts: int = 0, **decoding: Any) -> None:
        from tfserve.client import Client

        if not addresses:
            raise ValueError("--server: no address given")
        self.addresses = list(addresses)
        self.clients = [Client(address, timeout=timeout) for address in self.addresses]
        self.model, self.decoding = model, decoding
        self.concurrency = in_flight or 4 * len(self.addresses)
        self.attempts = attempts or 2 * len(self.addresses) + 1
        self.failovers = 0
        self._turn = itertools.count()
        self._lock = threading.Lock()
        info, error = None, None
        for client in self.clients:  # the first address that answers describes the model
            try:
                info = client.model_info(model=model)
                break
            except Exception as exc:  # noqa: BLE001 - tried on the next address
                error = exc
        if info is None:
            raise RuntimeError(f"no server answered GetModelInfo: {error}") from error
        self.info = info
        limit = int(info.limits.max_texts_per_request) or 256
        self.max_batch_size = limit
        self.max_source_tokens = int(info.max_source_tokens) or 512

    def batch_note(self, batch: int) -> str | None:
        """Why the server decodes fewer of the job's lines at once than a batch holds, where
        it does: its --max-batch-size counts rows, and each line takes one row per beam."""
        rows = int(self.info.limits.max_batch_size)
        defaults = self.info.generation_defaults
        beams = self.decoding.get("num_beams") or (
            defaults.num_beams if defaults.HasField("num_beams") else 1)
        if not rows or rows // beams >= batch:
            return None
        return (f"the server decodes {rows} rows at once ({max(rows // beams, 1)} lines at "
                f"{beams} beams), fewer than a batch of {batch} lines: its --max-batch-size "
                f"{batch * beams} decodes a whole batch at once")

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def fingerprint(self) -> dict[str, Any]:
        return {"model": f"server:{self.info.model or self.info.model_name}@{self.info.version}"}

    def count_tokens(self, text: str) -> int | None:
        return None  # no tokenizer here: plan_document counts UTF-8 bytes (never fewer)

    def length(self, text: str) -> tuple[int, str | None]:
        # no tokenizer here: characters order the buffer well enough for the server's batching,
        # and the server checks the limit (INVALID_ARGUMENT, which the job retries row by row)
        return len(text), None

    def translate(self, texts: Sequence[str], truncate: bool) -> list[tuple[str, int]]:
        with self._lock:
            first = next(self._turn)
        error: BaseException | None = None
        for attempt in range(self.attempts):
            client = self.clients[(first + attempt) % len(self.clients)]
            try:
                # each text one sequence: the job splits documents itself (--split-sentences)
                hypotheses = client.translate_hypotheses(list(texts), truncate=truncate,
                                                         model=self.model, split_sentences=False,
                                                         **self.decoding)
            except Exception as exc:
                if is_bad_input(exc):
                    raise
                code = getattr(exc, "code", None)
                name = getattr(code(), "name", "") if callable(code) else ""
                if name and name not in RETRY_ELSEWHERE:
                    raise
                error = exc
                with self._lock:
                    self.failovers += 1
                continue
            return [(best[0].text, len(best[0].token_ids)) for best in hypotheses]
        assert error is not None
        raise error
