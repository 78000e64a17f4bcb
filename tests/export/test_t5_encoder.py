"""T5 encoders (T5EncoderModel / MT5EncoderModel checkpoints, as sentence-embedding models
ship them): `python -m export --from-hf DIR` exports the encoder graph alone, the runtime
and the server answer Encode from it, and Translate is refused naming the model.

The checkpoints are random encoders built with transformers at odd sizes (d_model 36, 3
heads of 10, gated FFN 52, 3 layers; buckets and max distance off their defaults) with a
tokenizer trained here (tests/t5_helpers.py); the reference is transformers' own encoder
loaded from the same files.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only, never the hub
transformers = pytest.importorskip("transformers")

import hf_import_helpers as hh  # noqa: E402
import t5_helpers as th  # noqa: E402
from gpu_helpers import needs_cuda  # noqa: E402
from server_helpers import ServerThread, free_port  # noqa: E402

from export.cli import main as export_main  # noqa: E402
from export.importers import import_hf  # noqa: E402
from export.sources import SourceError  # noqa: E402
from tfserve.artifacts.manifest import Manifest  # noqa: E402
from tfserve.client import Client, ServerError  # noqa: E402
from tfserve.runtime import Runtime  # noqa: E402
from tfserve.translator import Translator  # noqa: E402

SIZES = dict(d_model=36, d_kv=10, d_ff=52, num_layers=3, num_heads=3,
             relative_attention_num_buckets=12, relative_attention_max_distance=20)
ENCODERS = {"t5": dict(feed_forward_proj="gated-gelu"), "mt5": {}}
REFUSED = ("model: this model is an encoder-only model (decoder_layers 0, a T5 encoder): it "
           "answers Encode, not Translate")


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """name -> (checkpoint directory, transformers encoder, artifacts directory)."""
    spiece = th.train_t5_spm()
    built = {}
    for seed, (name, options) in enumerate(ENCODERS.items()):
        directory = tmp_path_factory.mktemp("hf") / f"{name}-encoder"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = th.write_encoder_checkpoint(directory, spiece, name, seed=seed,
                                                **SIZES, **options)
        out = tmp_path_factory.mktemp("artifacts") / name
        assert export_main(["--from-hf", str(directory), "--out", str(out), "--quiet"]) == 0
        built[name] = (directory, model, out)
    return built


def reference(encoder, directory: Path, texts: list[str]):
    """transformers' hidden states [B,S,D], attention mask [B,S] and mean pooling [B,D]."""
    tokenizer = hh.auto_tokenizer(directory)
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden = encoder(**batch).last_hidden_state
    mask = batch["attention_mask"]
    weights = mask[..., None].float()
    return hidden.numpy(), mask.numpy(), ((hidden * weights).sum(1) / weights.sum(1)).numpy()


def relative(got: np.ndarray, expected: np.ndarray) -> float:
    """max |got - expected| / the largest |expected| of the row."""
    scale = np.abs(expected).max(axis=-1, keepdims=True)
    return float((np.abs(got - expected) / scale).max())


def test_the_export_reports_an_encoders_parity(encoders, tmp_path, capsys):
    """Without --quiet, the last line reports the hidden states' and the embeddings'
    agreement (an encoder's report has no logits)."""
    directory, _, _ = encoders["t5"]
    out = tmp_path / "out"
    assert export_main(["--from-hf", str(directory), "--out", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"exported {out}: parity passed: max |hidden states diff| ")
    cosine = float(last.split("embedding cosine >= ")[1].split()[0])
    assert 0.9999 <= cosine <= 1.0 and last.endswith(" over 16 sources")


@pytest.mark.parametrize("name", list(ENCODERS))
def test_an_encoder_checkpoint_exports_the_encoder_graph_alone(name, encoders):
    _, _, out = encoders[name]
    manifest = Manifest.load(out)
    assert manifest.config.decoder_layers == 0 and manifest.config.encoder_only
    data = json.loads((out / "model.json").read_text(encoding="utf-8"))
    assert list(data["graphs"]) == ["encoder"]
    assert data["graphs"]["encoder"]["outputs"] == ["encoder_hidden_states"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("decoder")) == []
    parity = data["parity"]
    assert parity["passed"] and parity["tolerance_ratio"] < 1.0
    assert parity["embeddings"]["sources"] == 16
    assert parity["embeddings"]["min_cosine"] > 1 - 1e-6


def test_an_encoder_loads_where_the_cache_would_live_on_the_device(encoders):
    """The placement CUDA chooses (device_cache, as with IO binding) has no KV cache to hold
    for an encoder: the runtime loads and encodes as on the host (before, building the
    empty cache-row graphs failed the load)."""
    _, _, out = encoders["t5"]
    texts = th.sentences(4, seed=7)
    runtime = Runtime(out, intra_op_threads=1, device_cache=True)
    assert runtime.device_cache is False
    ids, mask = runtime.tokenizer.encode_batch(texts)
    np.testing.assert_array_equal(runtime.hidden_states(ids, mask),
                                  Runtime(out, intra_op_threads=1).hidden_states(ids, mask))


@pytest.mark.parametrize("name", list(ENCODERS))
def test_embeddings_and_hidden_states_match_the_transformers_encoder(name, encoders):
    """Mean pooling and every token's hidden state == transformers' encoder (last hidden
    state, after its final RMSNorm) within 1e-5 of the row's scale, on texts longer than the
    max distance; over Translator.encode and over the server's Encode (gRPC and HTTP)."""
    directory, encoder, out = encoders[name]
    texts = th.sentences(12, seed=5, high=36)
    hidden, mask, pooled = reference(encoder, directory, texts)
    assert mask.sum(axis=1).max() > SIZES["relative_attention_max_distance"]
    encodings = Translator(out, intra_op_threads=1).encode(texts)
    assert relative(np.stack([e.embedding for e in encodings]), pooled) < 1e-5
    for row, encoding in enumerate(encodings):
        length = int(mask[row].sum())
        assert relative(encoding.hidden_states, hidden[row, :length]) < 1e-5
    args = ["--model", str(out), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
            "--http-port", str(free_port()), "--threads", "1", "--log-level", "warning"]
    with ServerThread(args) as server, Client(server.target, timeout=60) as client:
        served = client.encode(texts, per_token=True)
        assert relative(np.stack([e.embedding for e in served]), pooled) < 1e-5
        assert relative(served[0].hidden_states, hidden[0, :int(mask[0].sum())]) < 1e-5
        body = json.dumps({"texts": texts[:2]}).encode()
        request = urllib.request.Request(f"{server.http_url}/v1/encode", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert relative(np.array([e["embedding"] for e in answer["embeddings"]]),
                        pooled[:2]) < 1e-5


@pytest.mark.gpu
@needs_cuda
def test_cuda_embeddings_match_cpu(encoders):
    """An encoder on CUDA: the embeddings of the CPU run within TF32's rounding (measured
    on an H100: 9.5e-4 of the row's scale)."""
    _, _, out = encoders["t5"]
    texts = th.sentences(20, seed=6, high=36)
    cpu = np.stack([e.embedding for e in Translator(out, intra_op_threads=1).encode(texts)])
    cuda = Translator(out, device="cuda")
    assert cuda.runtime is not None and cuda.runtime.describe()["providers"][0] == \
        "CUDAExecutionProvider"
    assert relative(np.stack([e.embedding for e in cuda.encode(texts)]), cpu) < 1e-2


def test_translate_is_refused_naming_the_model_and_encode_goes_on(encoders):
    """Translate and TranslateStream (gRPC), POST /v1/translate (HTTP) and
    Translator.translate refuse an encoder with INVALID_ARGUMENT / 400 / ValueError saying
    what it answers; the server keeps answering Encode; ModelInfo shows no decoder."""
    _, _, out = encoders["t5"]
    translator = Translator(out, intra_op_threads=1)
    with pytest.raises(ValueError, match="encoder-only model .* it does not translate"):
        translator.translate(["the cat"])
    with pytest.raises(ValueError, match="encoder-only model"):
        Runtime(out, intra_op_threads=1).step(*[np.zeros((1, 1), np.int64)] * 4, [], [])
    # a decoding default over the model's positions does not concern a model that does not
    # decode: the server starts
    args = ["--model", str(out), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
            "--http-port", str(free_port()), "--threads", "1", "--log-level", "warning",
            "--default-max-new-tokens", "5000"]
    with ServerThread(args) as server, Client(server.target, timeout=60) as client:
        for call in (lambda: client.translate(["the cat"]),
                     lambda: list(client.translate_stream(["the cat"]))):
            with pytest.raises(ServerError) as raised:
                call()
            assert raised.value.code().name == "INVALID_ARGUMENT"
            assert raised.value.details() == REFUSED
        body = json.dumps({"texts": ["the cat"]}).encode()
        request = urllib.request.Request(f"{server.http_url}/v1/translate", data=body,
                                          headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 400
        assert json.loads(refused.value.read())["error"] == {"code": "INVALID_ARGUMENT",
                                                             "message": REFUSED}
        info = client.model_info()
        assert (info.decoder_layers, info.encoder_layers) == (0, SIZES["num_layers"])
        # no decoding limits or defaults for a model that does not decode
        assert (info.limits.default_max_new_tokens, info.limits.max_beams) == (0, 0)
        assert not info.generation_defaults.HasField("max_new_tokens")
        assert info.parity.passed
        assert len(client.encode(["the cat", "one two"])) == 2


def test_loadgen_drives_encode_over_both_transports(encoders, capsys):
    """`loadgen --rpc encode`: Encode calls over gRPC and POST /v1/encode over HTTP, the same
    texts in the same order, counted as embedded texts and source tokens; no errors."""
    from tfserve.bench.loadgen import main as loadgen

    _, _, out = encoders["t5"]
    port = free_port()
    args = ["--model", str(out), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
            "--http-port", str(port), "--threads", "1", "--log-level", "warning"]
    with ServerThread(args) as server:
        code = loadgen(["--server", server.target, "--http", f"127.0.0.1:{port}", "--rpc",
                        "encode", "--concurrency", "1,2", "--requests", "6", "--duration",
                        "600", "--texts-per-request", "2", "--warmup", "1", "--processes",
                        "1", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert code == 0
    assert [(r["transport"], r["concurrency"]) for r in rows] == [
        ("grpc", 1), ("http", 1), ("grpc", 2), ("http", 2)]
    assert all(r["requests"] == 6 and r["errors"] == 0 and r["texts"] == 12 for r in rows)
    assert rows[0]["tokens"] == rows[1]["tokens"] > 12  # source tokens, eos included
    assert loadgen(["--rpc", "encode", "--offline", str(out)]) == 2
    assert loadgen(["--rpc", "encode", "--num-beams", "4"]) == 2  # a decoding option


def test_tools_that_need_a_decoder_refuse_an_encoder(encoders, capsys):
    from tfserve.bench.step_profile import main as step_profile

    _, _, out = encoders["t5"]
    with pytest.raises(SystemExit) as stopped:
        step_profile([str(out)])
    assert stopped.value.code == 2
    assert "is an encoder-only model (model.decoder_layers 0): it has no decoder step" in \
        capsys.readouterr().err


def test_int8_and_fp16_encoders_pass_their_parity_check(encoders, tmp_path):
    """int8 (judged on the embeddings' direction) and fp16 (hidden states within the fp16
    tolerance) exports of an encoder; their embeddings stay close to transformers'."""
    directory, encoder, _ = encoders["t5"]
    texts = th.sentences(8, seed=6, high=36)
    _, _, pooled = reference(encoder, directory, texts)
    for flags in (["--quantize", "int8"], ["--dtype", "fp16"]):
        out = tmp_path / flags[1]
        assert export_main(["--from-hf", str(directory), "--out", str(out), "--quiet",
                            *flags]) == 0
        parity = json.loads((out / "model.json").read_text(encoding="utf-8"))["parity"]
        assert parity["passed"] and parity["precision"] == flags[1]
        got = np.stack([e.embedding for e in Translator(out, intra_op_threads=1).encode(texts)])
        cosine = (got * pooled).sum(1) / (np.linalg.norm(got, axis=1)
                                          * np.linalg.norm(pooled, axis=1))
        assert cosine.min() > 0.98, flags


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["T5EncoderModel"]),
     "architectures ['T5EncoderModel'] (an encoder-only checkpoint), but the weights hold "
     "decoder tensors (decoder.block.0."),
    (dict(is_encoder_decoder=False),
     "is_encoder_decoder is False (an encoder-only checkpoint), but the weights hold "
     "decoder tensors"),
])
def test_an_encoder_config_over_decoder_weights_is_refused(changes, message, tmp_path):
    """config.json saying "encoder" while the weights hold a decoder: refused, naming both."""
    directory = tmp_path / "t5"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        th.write_checkpoint(directory, th.train_t5_spm(), **SIZES)
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(SourceError) as info:
        import_hf(directory)
    assert message in str(info.value)
