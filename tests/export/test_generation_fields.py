"""The generation settings the Marian and T5 importers read from a checkpoint are the fields
of tfserve.artifacts.generation_defaults.hf_fields(): each decoding option is declared once,
in tfserve.option_table, and an option marked `checkpoint` there is read by every importer."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from export.importers import marian, t5
from tfserve import option_table
from tfserve.artifacts.generation_defaults import RULED_FIELDS, hf_fields

# a generation_config.json with a field of every kind: a table option, a ruled field, a field
# tfserve does not read, and an unset one
GENERATION_CONFIG = {"num_beams": 4, "repetition_penalty": 1.2, "max_length": 64,
                     "bad_words_ids": [[7]], "top_k": 50, "temperature": 0.7,
                     "length_penalty": None}


def write_generation_config(directory: Path, data: dict) -> Path:
    (directory / "generation_config.json").write_text(json.dumps(data), encoding="utf-8")
    return directory


@pytest.mark.parametrize("read", [lambda d: marian.generation_defaults(d, {}),
                                  t5.generation_defaults], ids=["marian", "t5"])
def test_importers_read_the_table_checkpoint_options(tmp_path: Path, read, monkeypatch) -> None:
    directory = write_generation_config(tmp_path, GENERATION_CONFIG)
    # the fields a checkpoint sets: the table's checkpoint options and the ruled fields;
    # sampling's top_k and temperature are not checkpoint options, an unset one is left out
    assert read(directory) == {"num_beams": 4, "repetition_penalty": 1.2, "max_length": 64,
                               "bad_words_ids": [[7]]}
    # an option newly marked `checkpoint` in the table is read with no importer changed
    table = tuple(option_table.OPTIONS)
    top_k = next(declared for declared in table if declared.name == "top_k")
    monkeypatch.setattr(option_table, "OPTIONS", tuple(
        replace(top_k, checkpoint=True) if declared is top_k else declared
        for declared in table))
    assert read(directory)["top_k"] == 50
    assert "top_k" in hf_fields()


def test_marian_reads_config_json_then_generation_config(tmp_path: Path) -> None:
    directory = write_generation_config(tmp_path, {"num_beams": 6})
    config = {"num_beams": 4, "forced_eos_token_id": 0, "max_length": 512,
              "bad_words_ids": [[58100]], "d_model": 512}
    assert marian.generation_defaults(directory, config) == {
        "num_beams": 6, "forced_eos_token_id": 0, "max_length": 512,
        "bad_words_ids": [[58100]]}


def test_no_importer_keeps_a_list_of_its_own() -> None:
    for module in (marian, t5):
        assert not hasattr(module, "GENERATION_KEYS"), module.__name__
    assert set(RULED_FIELDS) <= set(hf_fields())
