"""The decoding options' table (tfserve/option_table.py): each option declared once, and
everything else derived from it.

The table agrees with the wire contract (every option is the proto field of its name and
type, every field of the proto's DecodingOptions an option); DecodingOptions' fields and
checks follow it; and an option declared in the table reaches every front end: the CLI's
flags, the client's keywords, the proto and HTTP/JSON mappings, the OpenAPI schema the
playground builds its controls from, and a checkpoint's generation defaults. A new proto
field needs regenerated stubs, so the option declared at test time is one the proto has,
taken out of the table first: it reaches nothing until it is declared again.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tfserve import option_table
from tfserve.artifacts.generation_defaults import GenerationDefaults, beam_fields, hf_fields
from tfserve.cli import add_decoding_args, decoding_kwargs
from tfserve.client import options_message
from tfserve.frontends.messages import check_options, from_json, pb2, translate_input
from tfserve.frontends.openapi import input_limits, message_schemas
from tfserve.generation import DecodingOptions
from tfserve.generation.options import check_option
from tfserve.option_table import OPTIONS, SEARCHES, Option
from tfserve.serving.settings import ServerConfig

PAGE = Path(__file__).resolve().parents[2] / "tfserve" / "frontends" / "static" / "index.html"
# the options the playground names itself: doSample and numBeams choose its searches, and
# ModelInfo's limits become hints on these controls
NAMED_BY_THE_PAGE = {"do_sample", "num_beams", "max_new_tokens", "num_return_sequences"}


def json_name(name: str) -> str:
    """The field's name in protobuf's JSON mapping."""
    return pb2.DecodingOptions.DESCRIPTOR.fields_by_name[name].json_name


# -- the table and the wire ---------------------------------------------------------------


def test_every_option_is_a_proto_field_of_its_type_and_every_field_is_declared() -> None:
    check_options()
    fresh = Option("typical_p", float, 1.0, "Typical p", "typical sampling's mass", low=0,
                   high=1, low_open=True)
    with pytest.raises(ValueError, match=r"^decoding option typical_p: there is no field "
                                         r"tfserve\.v1\.DecodingOptions\.typical_p"):
        check_options((*OPTIONS, fresh))
    retyped = dataclasses.replace(option_table.option("top_k"), type=float, high=10.0)
    with pytest.raises(ValueError, match=r"^decoding option top_k \(float\) does not fit "
                                         r"tfserve\.v1\.DecodingOptions\.top_k \(int32\)$"):
        check_options(tuple(retyped if o.name == "top_k" else o for o in OPTIONS))
    ids = Option("ids", int, 0, "Ids", "token ids", low=0)
    with pytest.raises(ValueError, match=r"^decoding option ids \(int\) does not fit "
                                         r"tfserve\.v1\.TokenIds\.ids \(repeated int64\)$"):
        check_options((ids,), pb2.TokenIds.DESCRIPTOR)
    with pytest.raises(ValueError, match=r"^tfserve\.v1\.DecodingOptions field\(s\) seed not "
                                         r"declared in tfserve\.option_table$"):
        check_options(tuple(o for o in OPTIONS if o.name != "seed"))


def test_declarations_are_whole() -> None:
    """Names and flags once each, a float with both bounds, searches the page knows, a
    default inside the option's own limits."""
    names = [o.name for o in OPTIONS]
    flags = [o.cli_flag for o in OPTIONS]
    assert len(set(names)) == len(names) and len(set(flags)) == len(flags)
    for declared in OPTIONS:
        assert declared.type in (int, float, bool), declared.name
        if declared.type is float:
            assert declared.low is not None and declared.high is not None, declared.name
        assert set(declared.searches) <= set(SEARCHES), declared.name
        check_option(declared, declared.default)
        assert (declared.default is None) == (declared.unset is not None), declared.name


def test_decoding_options_has_a_field_per_option_with_its_default() -> None:
    fields = dataclasses.fields(DecodingOptions)
    assert [f.name for f in fields[:len(OPTIONS)]] == list(option_table.names())
    assert [f.default for f in fields[:len(OPTIONS)]] == [o.default for o in OPTIONS]
    assert [f.name for f in fields[len(OPTIONS):]] == [
        "prefix_token_ids", "prefix_counts_as_new", "forced_eos", "decoder_start_token_id"]


@pytest.mark.parametrize("declared", [o for o in OPTIONS if o.high is not None
                                      and o.name != "num_return_sequences"],
                         ids=lambda o: o.name)
def test_validate_holds_each_option_to_its_declared_range(declared: Option) -> None:
    """The bounds are accepted, a value past either is refused naming the option and its
    range (num_return_sequences' bound is the request's num_beams: test_cli, test_server)."""
    sampling = {"do_sample": True} if "sample" in declared.searches else {}
    step = 1 if declared.type is int else 1e-6
    inside = [declared.high] + ([] if declared.low_open else [declared.low])
    for value in inside:
        DecodingOptions(**{declared.name: value}, **sampling).validate(100)
    for value in (declared.low if declared.low_open else declared.low - step,
                  declared.high + step):
        with pytest.raises(ValueError) as refused:
            DecodingOptions(**{declared.name: value}, **sampling).validate(100)
        assert str(refused.value).startswith(f"{declared.name} must be "
                                             f"{declared.limits_text}"), refused.value


# -- a new option reaches every front end ---------------------------------------------------


def reached(name: str) -> dict[str, Any]:
    """Where the option `name` shows, as each front end derives it from the table now: None
    where it does not."""
    where: dict[str, Any] = {}
    parser = argparse.ArgumentParser()
    add_decoding_args(parser)
    flags = {action.dest: action for action in parser._actions}
    where["cli"] = flags[name].help if name in flags else None
    if name in flags:
        args = parser.parse_args([flags[name].option_strings[0], "3"])
        assert decoding_kwargs(args) == {name: 3}
    try:
        where["client"] = getattr(options_message(**{name: 3}), name)
    except ValueError as unknown:
        assert str(unknown) == f"unknown decoding option(s): {name}"
        where["client"] = None
    message = pb2.TranslateRequest(texts=["seven"])
    setattr(message.options, name, 3)
    where["grpc"] = translate_input(message).options.given().get(name)
    body = f'{{"texts": ["seven"], "options": {{"{json_name(name)}": 3}}}}'.encode()
    where["http"] = translate_input(from_json(body, pb2.TranslateRequest)).options.given().get(
        name)
    schemas = message_schemas(["TranslateRequest"], input_limits(ServerConfig()))
    schema = schemas["DecodingOptions"]["properties"][json_name(name)]
    # what the playground builds a control from (its place, label, limits, hint)
    where["openapi"] = {key: schema[key] for key in (
        "title", "description", "maximum", "x-tfserve-searches") if key in schema} or None
    try:
        defaults = GenerationDefaults({name: 3})
    except ValueError as unknown:
        assert str(unknown).startswith(f"generation.{name} is not a setting tfserve reads")
        where["checkpoint"] = None
    else:
        where["checkpoint"] = (defaults.decoding_fields().get(name), hf_fields()[name],
                               name in beam_fields(),
                               name in defaults.merge({"do_sample": True}))
    return where


def test_a_new_option_reaches_every_front_end(monkeypatch: pytest.MonkeyPatch) -> None:
    declared = option_table.option("no_repeat_ngram_size")
    without = tuple(o for o in OPTIONS if o is not declared)
    monkeypatch.setattr(option_table, "OPTIONS", without)
    assert reached(declared.name) == dict.fromkeys(
        ("cli", "client", "grpc", "http", "openapi", "checkpoint"))

    new = dataclasses.replace(declared, label="Fresh control", help="a fresh declaration",
                              high=32, searches=("beam",))
    monkeypatch.setattr(option_table, "OPTIONS", (*without, new))
    described = "a fresh declaration (in [0, 32]; default: 0, off)"
    assert reached(declared.name) == {
        "cli": described, "client": 3, "grpc": 3, "http": 3,
        "openapi": {"title": "Fresh control", "description": described, "maximum": 32,
                    "x-tfserve-searches": ["beam"]},
        # copied from generation_config.json, and only beam search reads it now
        "checkpoint": (3, (int,), True, False),
    }


def test_the_playground_names_no_option_of_its_own() -> None:
    """The page's controls come from the server's schema: besides the options it knows by
    design, no option's JSON name or control id is written in it."""
    page = PAGE.read_text()
    for declared in OPTIONS:
        if declared.name in NAMED_BY_THE_PAGE:
            continue
        for written in (json_name(declared.name), declared.name.replace("_", "-")):
            assert written not in page, f"the playground names {written}"
