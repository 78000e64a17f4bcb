"""Documents through the server (issue 36): a request's texts split into sentences, each
sentence a row of the continuous batch, the translations joined back in the layout; HTML;
the document limits; streaming a document segment by segment; n-best per segment.

Served: the bundled demo (English number phrases into French, no language codes), over
gRPC and HTTP/JSON. Greedy answers are compared with the same sentences translated one by
one (split_sentences=false, one text each) and joined with the original layout
(DocumentPlan.assemble). Every wait is for a state (a Gate holding the decoder), never a
sleep.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from server_helpers import Gate, ServerThread, free_port, http_json, server_args, wait_queued

from tfserve.proto import translator_pb2 as pb2
from tfserve.proto import translator_pb2_grpc as pb2_grpc
from tfserve.text.documents import plan_document

# the issue's example: eleven numbers, one text
NUMBERS = ("seven. eight. nine. ten. eleven. twelve. thirteen. fourteen. fifteen. sixteen. "
           "seventeen.")
LAYOUT = "seven.\n\n  twenty-one. three hundred and forty-two.\n- eight thousand and five.\n"
GREEDY = {"numBeams": 1, "maxNewTokens": 24}


@pytest.fixture(scope="module")
def server(demo_model: Path) -> Any:
    # --max-wait-ms 0 --wave-wait-steps 0: queued rows join a running batch at the worker's
    # next pass (the shared-batch test steps the decoder by hand)
    args = server_args(demo_model, "--http-port", str(free_port()), "--max-wait-ms", "0",
                       "--wave-wait-steps", "0", "--max-document-sentences", "40",
                       "--max-document-characters", "20000")
    with ServerThread(args) as running:
        yield running


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> Any:
    with grpc.insecure_channel(server.target) as channel:
        yield pb2_grpc.TranslatorStub(channel)


def translate(server: ServerThread, texts: list[str], **fields: Any) -> tuple[int, Any]:
    """POST /v1/translate with greedy options unless given."""
    body = {"texts": texts, "options": fields.pop("options", GREEDY), **fields}
    return http_json(server, "POST", "/v1/translate", body)


def one_by_one(server: ServerThread, text: str, format: str = "text") -> str:
    """The document's sentences each translated alone (one text, not split), joined with
    the original layout."""
    plan = plan_document(text, format=format)
    status, answer = translate(server, plan.rows, splitSentences=False)
    assert status == 200, answer
    return plan.assemble([t["hypotheses"][0].get("text", "")
                          for t in answer["translations"]]).text


def sse_events(server: ServerThread, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data of every event of POST /v1/translate:stream, the `done` one last."""
    import urllib.request

    request = urllib.request.Request(server.http_url + "/v1/translate:stream",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        text = answer.read().decode()
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append({"event": lines.get("event", "message"), **json.loads(lines["data"])})
    return events


# -- item 1: sentences as rows, joined in the layout ----------------------------------------


def test_the_issues_eleven_numbers_come_back_eleven(server: ServerThread) -> None:
    status, answer = translate(server, [NUMBERS])
    assert status == 200, answer
    translation = answer["translations"][0]
    assert len(translation["segments"]) == 11
    text = translation["hypotheses"][0]["text"]
    assert text == one_by_one(server, NUMBERS)
    # split_sentences=false keeps today's behaviour: one text, one sequence
    status, whole = translate(server, [NUMBERS], splitSentences=False)
    assert status == 200
    assert "segments" not in whole["translations"][0]
    assert whole["translations"][0]["hypotheses"][0]["text"] != text


def test_a_document_equals_its_sentences_translated_one_by_one_in_its_layout(
        server: ServerThread, stub: Any) -> None:
    expected = one_by_one(server, LAYOUT)
    assert expected.startswith("sept") and "\n\n  " in expected and "\n- " in expected
    status, answer = translate(server, [LAYOUT, "seven"])
    assert status == 200, answer
    document, single = answer["translations"]
    assert document["hypotheses"][0]["text"] == expected
    # a text of one sentence is a document of one segment
    assert len(single["segments"]) == 1
    reply = stub.Translate(pb2.TranslateRequest(texts=[LAYOUT],
                                                options=pb2.DecodingOptions(num_beams=1,
                                                                            max_new_tokens=24)))
    assert reply.translations[0].hypotheses[0].text == expected


def test_segments_carry_source_and_target_spans(server: ServerThread) -> None:
    status, answer = translate(server, [LAYOUT])
    assert status == 200
    translation = answer["translations"][0]
    text = translation["hypotheses"][0]["text"]
    plan = plan_document(LAYOUT)
    segments = translation["segments"]
    assert [(s.get("sourceStart", 0), s["sourceEnd"]) for s in segments] == plan.source_spans
    alone = [t["hypotheses"][0]["text"] for t in
             translate(server, plan.rows, splitSentences=False)[1]["translations"]]
    assert [text[s.get("targetStart", 0):s["targetEnd"]] for s in segments] == alone
    # the document's token ids are its segments' one after the other
    assert len(translation["hypotheses"][0]["tokenIds"]) > len(segments)


def test_a_documents_sentences_are_rows_of_the_batch_shared_with_other_clients(
        server: ServerThread) -> None:
    """The first document's four sentences hold the decoder (a Gate): four rows; a second
    client's document of three sentences queues and joins between two steps: seven rows
    decode together. Each answer equals the same document alone."""
    first = "seven. eight. nine. ten."
    second = "eleven. twelve. thirteen."
    options = {"numBeams": 1, "minNewTokens": 8, "maxNewTokens": 12}
    with ThreadPoolExecutor(2) as pool:
        with Gate(server.scheduler) as gate:
            a = pool.submit(translate, server, [first], options=options)
            assert gate.wait_held() == 4
            b = pool.submit(translate, server, [second], options=options)
            wait_queued(server.scheduler, 3)
            for _ in range(6):
                gate.step()
                if gate.wait_held() == 7:
                    break
            assert gate.wait_held() == 7, gate.calls
        together = [a.result(120), b.result(120)]
    for text, (status, answer) in zip((first, second), together):
        assert status == 200
        alone = translate(server, [text], options=options)[1]
        assert answer["translations"] == alone["translations"]


def test_a_sentence_over_the_source_limit_is_split_not_cut(server: ServerThread) -> None:
    """The demo takes 64 source tokens: a run of 60 numbers without punctuation is split
    into pieces within the limit, each translated; without splitting it is refused naming
    the limit, or cut with truncate, as before."""
    long_text = " ".join(["seven thousand"] * 60)
    status, answer = translate(server, [long_text])
    assert status == 200, answer
    segments = answer["translations"][0]["segments"]
    assert len(segments) > 1
    assert segments[-1]["sourceEnd"] == len(long_text)
    status, refused = translate(server, [long_text], splitSentences=False)
    assert status == 400
    assert "over the limit of 64 source tokens" in refused["error"]["message"]
    status, cut = translate(server, [long_text], splitSentences=False, truncate=True)
    assert status == 200


def test_n_best_of_a_document_is_each_segments_kth_hypothesis(server: ServerThread) -> None:
    options = {"numBeams": 3, "numReturnSequences": 2, "maxNewTokens": 24}
    text = "seven. twenty-one."
    status, answer = translate(server, [text], options=options)
    assert status == 200, answer
    translation = answer["translations"][0]
    assert len(translation["hypotheses"]) == 2
    plan = plan_document(text)
    alone = translate(server, plan.rows, splitSentences=False, options=options)[1]
    per_segment = [t["hypotheses"] for t in alone["translations"]]
    for k, document in enumerate(translation["hypotheses"]):
        assert document["text"] == plan.assemble([h["text"] for h in
                                                  (s[k] for s in per_segment)]).text
        assert document["score"] == pytest.approx(sum(s[k]["score"] for s in per_segment),
                                                  abs=1e-4)
    for found, expected in zip(translation["segments"], per_segment):
        assert found["hypotheses"] == expected


def test_sampling_works_per_sentence_with_a_seed(server: ServerThread) -> None:
    options = {"doSample": True, "seed": "5", "maxNewTokens": 24}
    status, first = translate(server, [NUMBERS], options=options)
    assert status == 200
    assert first["translations"] == translate(server, [NUMBERS],
                                              options=options)[1]["translations"]
    assert len(first["translations"][0]["segments"]) == 11


# -- item 2: formats ------------------------------------------------------------------------


def test_html_keeps_its_markup_and_translates_its_text(server: ServerThread) -> None:
    page = "<h1>seven</h1>\n<p>twenty-one. <b>eight</b>.</p><!-- nine --><code>ten</code>"
    status, answer = translate(server, [page], format="html")
    assert status == 200, answer
    text = answer["translations"][0]["hypotheses"][0]["text"]
    assert text == one_by_one(server, page, "html")
    assert text.startswith("<h1>sept</h1>\n<p>") and "<b>" in text
    assert text.endswith("<!-- nine --><code>ten</code>")
    # broken markup is read leniently
    status, answer = translate(server, ["<p>seven. <b>eight</p"], format="html")
    assert status == 200, answer


@pytest.mark.parametrize(("fields", "named"), [
    ({"format": "markdown"}, "format must be one of text, html, got 'markdown'"),
    ({"format": "html", "splitSentences": False}, "format 'html' needs split_sentences"),
    ({"sourceLanguage": "auto"}, "source_language 'auto' needs a multilingual model"),
])
def test_bad_document_fields_are_400_naming_the_field(server: ServerThread, stub: Any,
                                                      fields: dict[str, Any],
                                                      named: str) -> None:
    status, answer = translate(server, ["seven."], **fields)
    assert status == 400, answer
    assert named in answer["error"]["message"]
    message = json_format.ParseDict({"texts": ["seven."], **fields}, pb2.TranslateRequest())
    with pytest.raises(grpc.RpcError) as caught:
        stub.Translate(message)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in caught.value.details()


# -- item 5: bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "named"), [
    ("seven. " * 5000, "over the limit of 20000 characters per document "
                       "(--max-document-characters)"),
    ("seven. " * 41, "texts[0]: text has more than 40 sentences"),
    ("seven\ud800eight.", "Unpaired surrogate at TranslateRequest.texts[0]"),
    ("a" * 19_999, "sentences"),  # no punctuation: pieces within the row limit, too many
])
def test_a_document_over_a_limit_is_a_400_naming_it(server: ServerThread, text: str,
                                                    named: str) -> None:
    status, answer = translate(server, [text])
    assert status == 400, answer
    assert named in answer["error"]["message"]


def test_control_characters_are_layout(server: ServerThread) -> None:
    status, answer = translate(server, ["seven.\x00\x07eight.\x1b"])
    assert status == 200, answer
    text = answer["translations"][0]["hypotheses"][0]["text"]
    assert "\x00\x07" in text and text.endswith("\x1b")


def test_a_refused_document_affects_nothing_else_in_the_batch(server: ServerThread) -> None:
    """A refused document is refused before it reaches the scheduler: a document in
    flight (held by the Gate) answers as alone."""
    text = "seven. eight."
    alone = translate(server, [text])
    with ThreadPoolExecutor(1) as pool:
        with Gate(server.scheduler) as gate:
            running = pool.submit(translate, server, [text])
            gate.wait_held()
            status, _ = translate(server, ["seven. " * 41])
            assert status == 400
        assert running.result(120)[1]["translations"] == alone[1]["translations"]


def test_a_request_over_the_sentences_limit_all_texts_together_is_a_400(
        server: ServerThread) -> None:
    status, answer = translate(server, ["seven. " * 30, "eight. " * 30])
    assert status == 400, answer
    assert "texts split into more than 40 sentences, over the limit of sentences per " \
        "request (--max-document-sentences)" in answer["error"]["message"]


def test_detect_on_a_model_without_language_codes(server: ServerThread) -> None:
    status, answer = http_json(server, "POST", "/v1/detect",
                               {"texts": ["The cat sleeps on the sofa in the sun."]})
    assert status == 200, answer
    [detection] = answer["detections"]
    assert detection["language"] == "en" and "modelLanguage" not in detection
    status, answer = http_json(server, "POST", "/v1/detect", {"texts": ["x" * 20001]})
    assert status == 400
    assert "(--max-document-characters)" in answer["error"]["message"]


def test_model_info_shows_the_document_limits(server: ServerThread) -> None:
    status, info = http_json(server, "GET", "/v1/model")
    assert status == 200
    assert info["limits"]["maxDocumentCharacters"] == 20000
    assert info["limits"]["maxDocumentSentences"] == 40


# -- item 4: streaming ----------------------------------------------------------------------


def test_a_streamed_document_comes_sentence_by_sentence_in_order(server: ServerThread,
                                                                 stub: Any) -> None:
    expected = one_by_one(server, LAYOUT)
    plan = plan_document(LAYOUT)
    events = sse_events(server, {"texts": [LAYOUT], "options": GREEDY})
    assert events[-1]["event"] == "done"
    chunks = events[:-1]
    assert "".join(c.get("textDelta", "") for c in chunks) == expected
    segments = [c.get("segment", 0) for c in chunks]
    assert segments == sorted(segments) and segments[-1] == len(plan.rows) - 1
    # each segment's first chunk carries the layout in front of it
    firsts = {}
    for chunk in chunks:
        firsts.setdefault(chunk.get("segment", 0), chunk)
    bare = plan.assemble([""] * len(plan.rows))
    layout = [bare.text[(bare.segments[i - 1].target_end if i else 0):s.target_start]
              for i, s in enumerate(bare.segments)]
    assert [firsts[i].get("separator", "") for i in range(len(plan.rows))] == layout
    for chunk in firsts.values():
        assert chunk.get("textDelta", "").startswith(chunk.get("separator", ""))
    last = chunks[-1]
    assert last["done"] and last["final"]["text"] == expected
    assert len(last["segments"]) == len(plan.rows)
    # gRPC: the same chunks
    request = pb2.TranslateRequest(texts=[LAYOUT], options=pb2.DecodingOptions(
        num_beams=1, max_new_tokens=24))
    streamed = list(stub.TranslateStream(request))
    assert "".join(c.text_delta for c in streamed) == expected
    assert [c.segment for c in streamed] == segments


def test_a_streamed_html_document_adds_up_to_the_answer(server: ServerThread) -> None:
    page = "<p>seven. <b>eight</b>.</p>\n<p>nine &amp; ten.</p>"
    status, answer = translate(server, [page], format="html")
    assert status == 200
    events = sse_events(server, {"texts": [page], "format": "html", "options": GREEDY})
    assert "".join(e.get("textDelta", "") for e in events[:-1]) == \
        answer["translations"][0]["hypotheses"][0]["text"]
