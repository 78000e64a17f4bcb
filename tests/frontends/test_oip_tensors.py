"""The Open Inference Protocol's tensors <-> the core's plain values (tfserve.frontends.
oip_tensors): pure functions, no server."""

from __future__ import annotations

import numpy as np
import pytest

from tfserve.frontends.oip_tensors import (
    MAX_ERROR_CHARS,
    InferRequest,
    Tensor,
    bounded,
    bytes_elements,
    check_streamable,
    chunk_outputs,
    embedding_outputs,
    encode_input,
    model_inputs,
    model_outputs,
    option_types,
    parameter_field,
    protocol_error,
    protocol_field_names,
    raw_contents,
    request_timeout,
    shape_text,
    shown_value,
    translate_input,
    translation_outputs,
    wants_binary,
)
from tfserve.scheduler import Encoded
from tfserve.serving.results import TextHypothesis
from tfserve.serving.status import InvalidArgument, ModelNotFound
from tfserve.serving.stream import Chunk


def texts(*values: str, shape: tuple[int, ...] | None = None, name: str = "text") -> Tensor:
    data = [value.encode() for value in values]
    return Tensor(name, "BYTES", shape if shape is not None else (len(data),), data)


def request(*inputs: Tensor, outputs: tuple[str, ...] = (), **parameters: object
            ) -> InferRequest:
    return InferRequest("demo", "abc", "id-1", inputs, outputs, parameters)


def test_translate_input_takes_texts_languages_prefix_and_every_option() -> None:
    given = translate_input(request(
        texts("seven", "eight"), texts("sept", name="target_prefix", shape=(1,)),
        num_beams=4, length_penalty=1, temperature=0.5, early_stopping=True,
        source_language="en", target_language="fr", truncate=True, binary_data_output=True))
    assert (given.model, given.version, list(given.texts)) == ("demo", "abc", ["seven", "eight"])
    assert list(given.target_prefix) == ["sept"] and given.truncate
    assert (given.source_language, given.target_language) == ("en", "fr")
    options = given.options
    assert (options.num_beams, options.length_penalty, options.temperature,
            options.early_stopping) == (4, 1.0, 0.5, True)
    assert isinstance(options.length_penalty, float)  # an integer given for a float option
    # the prefix as a parameter, and a [N, 1] text tensor
    given = translate_input(request(texts("a", "b", shape=(2, 1)), target_prefix="x"))
    assert list(given.texts) == ["a", "b"] and list(given.target_prefix) == ["x"]


def test_option_types_follow_the_native_options() -> None:
    types = option_types()
    assert types["num_beams"] is int and types["top_p"] is float
    assert types["do_sample"] is bool and "max_new_tokens" in types


@pytest.mark.parametrize(("bad", "named"), [
    (request(texts("a"), num_beams="4"), "parameters.num_beams must be an integer, got '4'"),
    (request(texts("a"), num_beams=True), "parameters.num_beams must be an integer"),
    (request(texts("a"), temperature=False), "parameters.temperature must be a number"),
    (request(texts("a"), do_sample=1), "parameters.do_sample must be a boolean, got 1"),
    (request(texts("a"), target_language=3), "parameters.target_language must be a string"),
    (request(texts("a"), beams=4), "parameters.beams is not a parameter of this model"),
    (request(texts("a"), pooling="mean"), "parameters.pooling is not a parameter"),
    (request(), "inputs: the input 'text' (BYTES [N], the texts) is missing"),
    (request(texts("a"), texts("b")), "inputs[1].name: the input 'text' is given twice"),
    (request(texts("a", name="texts")), "inputs[0].name is 'texts', not an input"),
    (request(Tensor("text", "FP32", (1,), [1.0])),
     "inputs[0].datatype of 'text' must be BYTES, got 'FP32'"),
    (request(texts("a", shape=(1, 2))), "text: the shape must be [N] or [N, 1], got [1, 2]"),
    (request(texts("a", "b", shape=(3,))), "text: the shape [3] holds 3 elements, the data 2"),
    (request(texts(shape=(0,))), "text must not be empty"),
    (request(Tensor("text", "BYTES", (2,), [b"ok", b"\xff"])), "text[1] is not UTF-8 text"),
    (request(texts("a"), texts("b", name="target_prefix"), target_prefix="c"),
     "target_prefix is given both as an input and as a parameter"),
    (request(texts("a"), outputs=("translations",)),
     "outputs[0].name is 'translations', not an output of this model; its outputs are "
     "translation, score"),
    (request(texts("a"), outputs=("score", "score")), "outputs[1].name: the output 'score'"),
    # client values, however large, cut (issue 39 item 6)
    (request(texts("a"), num_beams=list(range(100_000))),
     "parameters.num_beams must be an integer, got a list of 100000 items"),
    (request(texts("a"), num_beams=10 ** 30), "parameters.num_beams must fit in 64 bits, "
     "got 1000000000000000000000000000000"),
    (request(texts("a"), temperature=10 ** 400),  # float() of it would overflow
     "parameters.temperature must fit in 64 bits, got an integer of 401 digits"),
    (request(texts("a"), target_prefix="x\ud800"),
     "parameters.target_prefix is not UTF-8 text (a lone surrogate at character 1)"),
    (request(texts("a"), **{"x" * 50: 1}),
     "parameters['xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... (50 characters)] is not a "
     "parameter of this model"),
    (request(texts("a", shape=(1,) * 1000)),
     "text: the shape must be [N] or [N, 1], got [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, ... "
     "(1000 dimensions)"),
    (request(Tensor("text", "BYTES", (10 ** 50,), [b"a"])),
     f"text: the shape [{'1' + '0' * 38}... (1 dimension) holds an "
     "integer of 51 digits elements, the data 1"),
    (request(texts("a", name="n" * 1000)), "inputs[0].name is 'nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn"
     "nnnnnnn'... (1000 characters), not an input"),
])
def test_bad_translate_requests_name_the_field(bad: InferRequest, named: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        translate_input(bad)
    assert str(raised.value).startswith(named), str(raised.value)


def test_encode_input_and_its_checks() -> None:
    given = encode_input(request(texts("seven"), pooling="max", truncate=True))
    assert (list(given.texts), given.pooling, given.truncate) == (["seven"], "max", True)
    with pytest.raises(InvalidArgument, match=r"^parameters\.num_beams is not a parameter"):
        encode_input(request(texts("a"), num_beams=2))
    with pytest.raises(InvalidArgument, match=r"^inputs\[1\]\.name is 'target_prefix'"):
        encode_input(request(texts("a"), texts("b", name="target_prefix")))
    with pytest.raises(InvalidArgument, match=r"^outputs\[0\]\.name is 'translation'"):
        encode_input(request(texts("a"), outputs=("translation",)))


def test_transport_parameters() -> None:
    assert request_timeout(request(texts("a"))) is None
    assert request_timeout(request(texts("a"), timeout=2_500_000)) == 2.5
    for bad in (0, -1, 86_400_000_001):
        with pytest.raises(InvalidArgument, match=r"^parameters\.timeout must be in \[1, "):
            request_timeout(request(texts("a"), timeout=bad))
    with pytest.raises(InvalidArgument, match=r"^parameters\.timeout must be an integer"):
        request_timeout(request(texts("a"), timeout=1.5))
    assert wants_binary(request(texts("a"), binary_data_output=True))
    assert not wants_binary(request(texts("a")))
    with pytest.raises(InvalidArgument, match="binary_data_output must be a boolean"):
        wants_binary(request(texts("a"), binary_data_output="yes"))


def test_core_messages_are_renamed_to_the_protocol_fields() -> None:
    assert protocol_field_names("texts[1] is empty") == "text[1] is empty"
    assert protocol_field_names("texts holds 300 items, over the limit of 256") == (
        "text holds 300 items, over the limit of 256")
    assert protocol_field_names("options.num_beams must be in [1, 16], got 20") == (
        "parameters.num_beams must be in [1, 16], got 20")
    assert protocol_field_names("target_language 'xx' is not a language of this model") == (
        "parameters.target_language 'xx' is not a language of this model")
    assert protocol_field_names("target_prefix[0] is 300 tokens") == (
        "target_prefix[0] is 300 tokens")
    assert protocol_field_names("model 'x' is not served here") == "model 'x' is not served here"


def test_client_values_in_messages() -> None:
    assert shown_value("ab") == "'ab'"
    assert shown_value("a" * 41) == f"{'a' * 40!r}... (41 characters)"
    assert [shown_value(value) for value in (None, True, 1.5, -7, 10 ** 39, 10 ** 40)] == [
        "null", "True", "1.5", "-7", str(10 ** 39), "an integer of 41 digits"]
    assert [shown_value(value) for value in ([1], [], {"a": "b" * 10_000}, b"x")] == [
        "a list of 1 item", "a list of 0 items", "an object", "a bytes"]
    assert shape_text((2, 1)) == "[2, 1]" and shape_text(()) == "[]"
    assert parameter_field("num_beams") == "parameters.num_beams"
    assert parameter_field("a.b") == "parameters['a.b']"
    assert parameter_field("x" * 41) == f"parameters[{'x' * 40!r}... (41 characters)]"


def test_protocol_errors_are_bounded_and_keep_their_type() -> None:
    assert bounded("short") == "short" and bounded("a\ud800b") == "a\\ud800b"
    cut = bounded("x" * 5000)
    assert len(cut) == MAX_ERROR_CHARS and cut.endswith("... (5000 characters)")
    try:
        raise ModelNotFound("m" * 5000)
    except ModelNotFound as exc:
        remade = protocol_error(exc)
    assert type(remade) is ModelNotFound and len(str(remade)) == MAX_ERROR_CHARS
    assert remade.__traceback__ is not None  # the log of an INTERNAL error keeps its frames
    renamed = protocol_error(InvalidArgument("texts[1] is empty"))
    assert type(renamed) is InvalidArgument and str(renamed) == "text[1] is empty"
    kept = InvalidArgument("parameters.x is fine")
    assert protocol_error(kept) is kept
    # an exception not made of its message alone stays as it is (its answer is bounded)
    odd = UnicodeEncodeError("utf-8", "\ud800" * 3000, 0, 1, "surrogates not allowed")
    assert protocol_error(odd) is odd


def hypothesis(text: str, score: float) -> TextHypothesis:
    return TextHypothesis(text, [1, 2], score)


def test_translation_outputs_shapes_and_order() -> None:
    one = [[hypothesis("sept", -0.5)], [hypothesis("huit", -0.25)]]
    translation, score = translation_outputs(one)
    assert (translation.name, translation.datatype, translation.shape) == (
        "translation", "BYTES", (2,))
    assert translation.data == ["sept", "huit"]
    assert (score.datatype, score.shape, score.data.dtype) == ("FP32", (2,), np.float32)
    assert score.data.tolist() == [-0.5, -0.25]
    several = [[hypothesis("a", -1), hypothesis("b", -2)], [hypothesis("c", -3),
                                                            hypothesis("d", -4)]]
    (only_score,) = translation_outputs(several, ["score"])
    assert only_score.shape == (2, 2) and only_score.data.tolist() == [-1, -2, -3, -4]


def test_embedding_outputs() -> None:
    encoded = [Encoded([1, 2], np.arange(3, dtype=np.float32), None),
               Encoded([3], np.ones(3, dtype=np.float32), None)]
    (embedding,) = embedding_outputs(encoded)
    assert (embedding.name, embedding.datatype, embedding.shape) == ("embedding", "FP32", (2, 3))
    assert embedding.data.tolist() == [0, 1, 2, 1, 1, 1]
    assert model_outputs(True, 3)[0].shape == (-1, 3)
    assert [spec.name for spec in model_inputs(True)] == ["text"]


def test_chunk_outputs() -> None:
    outputs, parameters = chunk_outputs(Chunk(1, "sep", [5]))
    assert [(t.name, t.shape, t.data) for t in outputs] == [("translation", (1,), ["sep"])]
    assert parameters == {"index": 1, "done": False}
    outputs, parameters = chunk_outputs(Chunk(0, "t", [6], done=True,
                                              final=hypothesis("sept", -0.5)))
    assert [t.name for t in outputs] == ["translation", "score"]
    assert outputs[1].data.tolist() == [-0.5] and parameters["done"] is True
    check_streamable(translate_input(request(texts("a"), num_return_sequences=1)))
    with pytest.raises(InvalidArgument, match=r"^parameters\.num_return_sequences: a stream"):
        check_streamable(translate_input(request(texts("a"), num_return_sequences=2)))


def test_raw_bytes_round_trip_and_malformed_contents() -> None:
    tensor = Tensor("translation", "BYTES", (3,), ["sept", "", "é"])
    raw = raw_contents(tensor)
    assert raw == b"\x04\x00\x00\x00sept\x00\x00\x00\x00\x02\x00\x00\x00\xc3\xa9"
    assert bytes_elements(raw, "text") == [b"sept", b"", "é".encode()]
    assert bytes_elements(b"", "text") == []
    with pytest.raises(InvalidArgument, match="^text: the raw BYTES contents end inside"):
        bytes_elements(b"\x04\x00", "text")
    with pytest.raises(InvalidArgument, match="^text: a raw BYTES element of 9 bytes runs past"):
        bytes_elements(b"\x09\x00\x00\x00abc", "text")
    scores = Tensor("score", "FP32", (2,), np.asarray([0.5, -1.0], np.float32))
    assert np.frombuffer(raw_contents(scores), "<f4").tolist() == [0.5, -1.0]
