"""A document's rows -> its answer and its stream, without a model (tfserve.serving.documents,
tfserve.serving.stream.DocumentChunks): the n-best documents, and the chunks of rows whose
events arrive out of order, which must come out segment by segment, adding up to the
answer's text."""

from __future__ import annotations

from tfserve.generation import Hypothesis
from tfserve.scheduler import StreamEvent
from tfserve.serving.documents import Documents
from tfserve.serving.results import TextHypothesis
from tfserve.serving.stream import DocumentChunks
from tfserve.text.documents import plan_document

TEXT = "one. two.\n\n  three."  # three segments: "one.", "two.", "three."


def decode(ids: list[int]) -> str:
    """Token 1 is 'x', 2 is 'y', ...; each token a word."""
    return " ".join(chr(ord("w") + i) for i in ids)


def documents(*texts: str) -> Documents:
    plans = [plan_document(text) for text in texts]
    first, row_of = [], []
    for index, plan in enumerate(plans):
        first.append(len(row_of))
        row_of += [(index, segment) for segment in range(len(plan.rows))]
    return Documents([[5, 1]] * len(row_of), row_of, first, list(plans), [None] * len(plans))


def test_the_n_best_documents_join_each_segments_kth_hypothesis() -> None:
    planned = documents(TEXT)
    rows = [[TextHypothesis("A", [1], -1.0), TextHypothesis("a", [2], -2.0)],
            [TextHypothesis("B", [3], -0.5)],  # fewer: its last stands in
            [TextHypothesis("C", [4], -0.25), TextHypothesis("c", [5], -3.0)]]
    [answer] = planned.results(rows)
    assert [h.text for h in answer.hypotheses] == ["A B\n\n  C", "a B\n\n  c"]
    assert answer.hypotheses[1].token_ids == [2, 3, 5]
    assert answer.hypotheses[1].score == -5.5
    spans = [(s.target_start, s.target_end) for s in answer.segments]
    assert [answer.hypotheses[0].text[a:b] for a, b in spans] == ["A", "B", "C"]
    assert [len(s.hypotheses) for s in answer.segments] == [2, 1, 2]


def test_a_documents_chunks_come_in_segment_order_whatever_the_rows_order() -> None:
    """Rows 2 and 1 decide tokens (and finish) before row 0: their chunks wait, then come
    after segment 0's, each segment's first chunk starting with its separator."""
    planned = documents(TEXT, "four")
    stream = DocumentChunks(planned, decode)
    events = [StreamEvent(2, [3]), StreamEvent(1, [2]), StreamEvent(3, [1]),
              StreamEvent(2, [], [Hypothesis([3], -1.0)]),
              StreamEvent(0, [1]),
              StreamEvent(1, [2], [Hypothesis([2, 2], -2.0)]),
              StreamEvent(3, [], [Hypothesis([1], -0.5)]),
              StreamEvent(0, [], [Hypothesis([1], -0.25)])]
    chunks = [chunk for event in events for chunk in stream.push(event)]
    first = [c for c in chunks if c.index == 0]
    assert [c.segment for c in first] == sorted(c.segment for c in first)
    assert "".join(c.text_delta for c in first) == "x y y\n\n  z"
    firsts: dict[int, str] = {}
    for chunk in first:
        assert chunk.text_delta.startswith(chunk.separator)
        firsts.setdefault(chunk.segment, chunk.separator)
    assert firsts == {0: "", 1: " ", 2: "\n\n  "}
    assert first[-1].done and first[-1].final is not None
    assert first[-1].final.text == "x y y\n\n  z"
    assert [(s.source_start, s.source_end) for s in first[-1].segments] == \
        [(0, 4), (5, 9), (13, 19)]
    # the other text's one segment streamed as it came, before the first text finished
    second = [c for c in chunks if c.index == 1]
    assert chunks.index(second[-1]) < chunks.index(first[-1])
    assert "".join(c.text_delta for c in second) == "x" and second[-1].done
