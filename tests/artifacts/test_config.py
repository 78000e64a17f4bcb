"""ModelConfig (JSON round trips, validation messages that name the field); the server's
settings (every flag bounded, TLS files checked, the newer settings); the metrics endpoint
answering only on /metrics."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from helpers import tiny_config

from tfserve.artifacts.model_config import ConfigError, ModelConfig

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


# -- server settings (tfserve.serving.settings): limits, TLS files, new settings

# every numeric serve flag: the first value outside its range on each side, and the limits
BOUNDS = [
    ("--port", 0, 65535),
    ("--metrics-port", 0, 65535),
    ("--http-port", 0, 65535),
    ("--threads", 0, 1024),
    ("--workers", 1, 256),
    ("--max-batch-size", 1, 4096),
    ("--max-batch-tokens", 1, 2**24),
    ("--max-wait-ms", 0, 10_000),
    ("--wave-wait-steps", 0, 10_000),
    ("--max-queue", 1, 1_000_000),
    ("--max-texts-per-request", 1, 100_000),
    ("--max-message-bytes", 1024, 2**31 - 1),
    ("--grace-seconds", 0, 3600),
    ("--default-max-new-tokens", 0, 1_000_000),
    ("--max-concurrent-streams", 1, 100_000),
    ("--max-connections", 1, 1_000_000),
    ("--max-connection-age-seconds", 0, 86_400),
]
FLOAT_FLAGS = ("--max-wait-ms", "--grace-seconds", "--max-connection-age-seconds")


def _parse_serve_flags(argv: list[str], capsys: pytest.CaptureFixture[str],
                       environ: dict[str, str] | None = None) -> tuple[object, str]:
    """parse_config(argv): (the config, or the exit code when it exited; stderr)."""
    from tfserve.serving.settings import parse_config

    capsys.readouterr()
    try:
        result: object = parse_config(argv, environ=environ or {})
    except SystemExit as exited:
        result = exited.code
    return result, capsys.readouterr().err


def _field(flag: str) -> str:
    return flag[2:].replace("-", "_")


@pytest.mark.parametrize("flag, low, high", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_every_numeric_serve_flag_is_bounded(flag: str, low: int, high: int,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from tfserve.serving.settings import ServerConfig

    message = f"{flag} must be in [{low}, {high}]"
    for value in (low - 1, high + 1):
        code, err = _parse_serve_flags([flag, str(value)], capsys)
        assert code == 2, f"{flag} {value} was accepted"
        assert message in err and err.count("\n") == 1, err
        with pytest.raises(ValueError, match=re.escape(message)):
            ServerConfig(**{_field(flag): value}).validate()
    for value in (low, high):  # the limits themselves are accepted
        config, err = _parse_serve_flags([flag, str(value)], capsys)
        assert getattr(config, _field(flag)) == value, err


@pytest.mark.parametrize("flag", FLOAT_FLAGS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_float_serve_flags_refuse_nan_and_infinity(flag: str, value: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from tfserve.serving.settings import ServerConfig

    code, err = _parse_serve_flags([f"{flag}={value}"], capsys)  # "-inf" is not an option
    assert code == 2
    assert f"{flag} must be in [" in err and f"got {value}" in err
    with pytest.raises(ValueError, match=re.escape(flag)):
        ServerConfig(**{_field(flag): float(value)}).validate()


@pytest.mark.parametrize("flag", [b[0] for b in BOUNDS])
def test_nan_is_refused_for_every_numeric_setting(flag: str) -> None:
    """Values set in Python (not parsed from text) are checked the same way."""
    from tfserve.serving.settings import ServerConfig

    with pytest.raises(ValueError, match=re.escape(f"{flag} must be in [")):
        ServerConfig(**{_field(flag): math.nan}).validate()


def test_limits_apply_to_env_vars_too(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _parse_serve_flags([], capsys, {"TFSERVE_MAX_WAIT_MS": "inf"})
    assert code == 2 and "--max-wait-ms must be in [0, 10000], got inf" in err
    code, err = _parse_serve_flags([], capsys, {"TFSERVE_MAX_MESSAGE_BYTES": str(2**40)})
    assert code == 2 and "--max-message-bytes must be in [1024, 2147483647]" in err


def test_new_server_settings_defaults_flags_and_env(capsys: pytest.CaptureFixture[str]) -> None:
    from tfserve.serving.settings import ServerConfig

    defaults = ServerConfig()
    assert (defaults.tls_client_ca, defaults.metrics_host, defaults.max_concurrent_streams,
            defaults.max_connections, defaults.max_connection_age_seconds) == (
        None, "", 100, 1000, 0.0)
    assert defaults.metrics_bind_host() == "0.0.0.0"
    config, err = _parse_serve_flags(
        ["--host", "10.0.0.5", "--max-concurrent-streams", "7", "--max-connection-age-seconds",
         "30.5"], capsys, {"TFSERVE_METRICS_HOST": "127.0.0.1", "TFSERVE_MAX_CONNECTIONS": "5"})
    assert isinstance(config, ServerConfig), err
    assert (config.metrics_host, config.max_connections, config.max_concurrent_streams,
            config.max_connection_age_seconds) == ("127.0.0.1", 5, 7, 30.5)
    assert config.metrics_bind_host() == "127.0.0.1"
    assert ServerConfig(host="10.0.0.5").metrics_bind_host() == "10.0.0.5"


PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def _tls_files(directory: Path) -> dict[str, Path]:
    files = {name: directory / f"{name}.pem" for name in ("cert", "key", "ca")}
    for path in files.values():
        path.write_text(PEM)
    return files


def test_tls_client_ca_needs_a_server_certificate(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    files = _tls_files(tmp_path)
    code, err = _parse_serve_flags(["--tls-client-ca", str(files["ca"])], capsys)
    assert code == 2 and "--tls-client-ca needs --tls-cert and --tls-key" in err
    config, err = _parse_serve_flags(["--tls-cert", str(files["cert"]), "--tls-key",
                                      str(files["key"]), "--tls-client-ca", str(files["ca"])],
                                     capsys)
    assert config.tls_client_ca == files["ca"], err  # type: ignore[attr-defined]


@pytest.mark.parametrize("flag", ["--tls-cert", "--tls-key", "--tls-client-ca"])
def test_tls_files_are_checked_naming_the_flag(flag: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    files = _tls_files(tmp_path)
    argv = {"--tls-cert": str(files["cert"]), "--tls-key": str(files["key"]),
            "--tls-client-ca": str(files["ca"])}
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(bytes(range(256)) * 4)
    for bad, message in ((tmp_path / "absent.pem", "cannot read it"),
                         (tmp_path, "cannot read it"),  # a directory
                         (garbage, "not a PEM file (no -----BEGIN line)")):
        args = dict(argv, **{flag: str(bad)})
        code, err = _parse_serve_flags([x for pair in args.items() for x in pair], capsys)
        assert code == 2, f"{flag} {bad} was accepted"
        assert f"{flag} {bad}: {message}" in err and err.count("\n") == 1, err


def test_serve_help_mentions_no_runs_or_sessions() -> None:
    """Help texts say what a flag does and why, not when it was measured."""
    from tfserve.serving.settings import _HELP

    for name, text in _HELP.items():
        assert not re.search(r"\bsession\b|\bmeasured\b", text), (name, text)


# -- the metrics endpoint answers only on /metrics ------------------------------------------------


def _get(url: str) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


NOT_METRICS = ["/", "/healthz", "/v2/health/ready", "/metricsz", "/metrics/extra", "/favicon.ico"]


def test_metrics_endpoint_answers_404_except_on_metrics() -> None:
    from tfserve.telemetry.metrics import Metrics

    metrics = Metrics()
    metrics.requests.labels(rpc="Translate", code="OK").inc()
    port = metrics.serve_http(0, "127.0.0.1")
    try:
        base = f"http://127.0.0.1:{port}"
        status, body = _get(f"{base}/metrics")
        assert status == 200 and b'tfserve_requests_total{code="OK",rpc="Translate"} 1.0' in body
        status, body = _get(f"{base}/metrics?name[]=tfserve_requests_total")
        assert status == 200 and b"tfserve_requests_total" in body
        assert b"tfserve_queue_depth" not in body  # the query still filters
        for path in NOT_METRICS:
            status, body = _get(base + path)
            assert status == 404, path
            assert b"tfserve_" not in body
    finally:
        metrics.close()


def test_workers_merged_metrics_answer_only_on_metrics() -> None:
    from tfserve.telemetry.metrics import Metrics, serve_workers_metrics

    workers = [Metrics(), Metrics()]
    workers[1].decoder_steps.inc(3)
    ports = [m.serve_http(0, "127.0.0.1") for m in workers]
    merged = serve_workers_metrics([f"http://127.0.0.1:{p}/metrics" for p in ports], 0,
                                   "127.0.0.1")
    try:
        base = f"http://127.0.0.1:{merged.server_port}"
        status, body = _get(f"{base}/metrics")
        assert status == 200
        assert b'tfserve_worker_up{worker="0"} 1.0' in body
        assert b'tfserve_worker_up{worker="1"} 1.0' in body
        assert b'tfserve_decoder_steps_total{worker="1"} 3.0' in body
        for path in NOT_METRICS:
            assert _get(base + path)[0] == 404, path
    finally:
        merged.shutdown()
        merged.server_close()
        for m in workers:
            m.close()
