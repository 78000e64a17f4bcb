"""What the core answers a translation with, whatever the transport: each hypothesis with its
text (`TextHypothesis`), decoded once by the model that made it, so that no front end needs
the model's tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tfserve.generation import Hypothesis

Decode = Callable[[list[int]], str]  # token ids -> text (the tokenizer's decode)


@dataclass(frozen=True)
class TextHypothesis:
    """One hypothesis as clients get it: its text, its token ids, its score."""

    text: str
    token_ids: list[int]
    score: float


def with_text(found: Hypothesis, decode: Decode, text: str | None = None) -> TextHypothesis:
    """`found` with its text (decoded unless given)."""
    if text is None:
        text = decode(found.token_ids)
    return TextHypothesis(text, found.token_ids, found.score)


def with_texts(results: Sequence[list[Hypothesis]], decode: Decode
               ) -> list[list[TextHypothesis]]:
    """A translate job's results (the hypotheses of each input, in order), with their texts."""
    return [[with_text(found, decode) for found in hypotheses] for hypotheses in results]
