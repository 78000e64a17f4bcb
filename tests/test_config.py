"""ModelConfig: JSON round trips and validation messages that name the field."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_config

from tfserve.config import ConfigError, ModelConfig

NON_DEFAULT = dict(
    vocab_size=123,
    d_model=48,
    num_heads=4,
    encoder_layers=3,
    decoder_layers=1,
    ffn_dim=96,
    activation="silu",
    norm="pre",
    positions="rope",
    sinusoidal_layout="half",
    rope_base=500.0,
    max_source_positions=77,
    max_target_positions=66,
    scale_embedding=False,
    tie_word_embeddings=False,
    final_logits_bias=True,
    layer_norm_eps=1e-6,
    dropout=0.1,
    attention_bias=False,
    pad_token_id=5,
    eos_token_id=6,
    unk_token_id=7,
    decoder_start_token_id=8,
    name="round-trip",
    source_language="en",
    target_language="fr",
    extra={"origin": "test", "nested": {"list": [1, 2, 3]}},
)


@pytest.mark.parametrize("values", [dict(vocab_size=50), NON_DEFAULT], ids=["defaults", "custom"])
def test_json_round_trip(values: dict) -> None:
    cfg = ModelConfig(**values)
    text = cfg.to_json()
    assert json.loads(text) == cfg.to_dict()
    again = ModelConfig.from_json(text)
    assert again == cfg, f"from_json(to_json()) changed the config: {again} != {cfg}"
    assert again.to_json() == text


def test_save_load_round_trip(tmp_path) -> None:
    cfg = ModelConfig(**NON_DEFAULT)
    path = tmp_path / "config.json"
    cfg.save(path)
    assert ModelConfig.load(path) == cfg


def test_derived_properties() -> None:
    cfg = tiny_config()
    assert cfg.head_dim == 16
    assert cfg.embed_scale == pytest.approx(32**0.5)
    assert tiny_config(scale_embedding=False).embed_scale == 1.0


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(d_model=30, num_heads=4), "num_heads"),
        (dict(d_model=30, num_heads=4), "d_model"),
        (dict(activation="tanh"), "activation"),
        (dict(norm="sandwich"), "norm"),
        (dict(positions="alibi"), "positions"),
        (dict(sinusoidal_layout="zigzag"), "sinusoidal_layout"),
        (dict(vocab_size=-5), "vocab_size"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(pad_token_id=50), "pad_token_id"),
        (dict(pad_token_id=-1), "pad_token_id"),
        (dict(eos_token_id=99), "eos_token_id"),
        (dict(unk_token_id=50), "unk_token_id"),
        (dict(decoder_start_token_id=50), "decoder_start_token_id"),
        (dict(num_heads=0), "num_heads"),
        (dict(encoder_layers=0), "encoder_layers"),
        (dict(ffn_dim=-1), "ffn_dim"),
        (dict(max_target_positions=0), "max_target_positions"),
        (dict(d_model=32.0), "d_model"),
        (dict(dropout=1.0), "dropout"),
        (dict(layer_norm_eps=0.0), "layer_norm_eps"),
        (dict(rope_base=-1.0), "rope_base"),
    ],
)
def test_invalid_config_names_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        tiny_config(**overrides)


def test_odd_head_dim_with_rope() -> None:
    with pytest.raises(ConfigError, match="positions='rope'") as info:
        tiny_config(d_model=30, num_heads=2, positions="rope")  # head dim 15
    assert "15" in str(info.value)
    tiny_config(d_model=30, num_heads=2, positions="learned")  # fine without rope
    tiny_config(d_model=36, num_heads=6, positions="rope")  # head dim 6 is even: fine


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_unknown_json_field() -> None:
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_json(json.dumps({"vocab_size": 10, "hidden_size": 4}))


def test_invalid_json() -> None:
    with pytest.raises(ConfigError, match="JSON"):
        ModelConfig.from_json('{"vocab_size": 10,')


def test_json_must_be_an_object() -> None:
    with pytest.raises(ConfigError, match="object"):
        ModelConfig.from_json("[1, 2]")


def test_missing_vocab_size() -> None:
    with pytest.raises(ConfigError, match="vocab_size"):
        ModelConfig.from_json(json.dumps({"d_model": 32, "num_heads": 2}))


def test_invalid_value_in_json_names_the_field() -> None:
    with pytest.raises(ConfigError, match="activation"):
        ModelConfig.from_json(json.dumps({"vocab_size": 10, "activation": "tanh"}))
    with pytest.raises(ConfigError, match="d_model"):
        ModelConfig.from_json(json.dumps({"vocab_size": 10, "d_model": "512"}))


def test_load_errors_name_the_file(tmp_path) -> None:
    missing = tmp_path / "missing.json"
    with pytest.raises(ConfigError) as info:
        ModelConfig.load(missing)
    assert str(missing) in str(info.value)
    broken = tmp_path / "broken.json"
    broken.write_text('{"vocab_size": 10, "norm": "middle"}')
    with pytest.raises(ConfigError, match="norm") as info:
        ModelConfig.load(broken)
    assert str(broken) in str(info.value)


@pytest.mark.parametrize("field", ["dropout", "rope_base", "layer_norm_eps"])
def test_wrongly_typed_float_field_names_the_field(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_json(json.dumps({"vocab_size": 10, field: "high"}))


def test_string_for_boolean_field_is_refused() -> None:
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        ModelConfig.from_json(json.dumps({"vocab_size": 10, "tie_word_embeddings": "false"}))
