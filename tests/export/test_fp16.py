"""fp16 exports (`python -m export --dtype fp16`): fused attention always, the parity check
on the device that runs it (recorded in provenance) or a refusal, masks that stay finite in
float16, normalisation statistics and the final log-softmax in float32, and T5's FFN output
projection kept in float32 as transformers keeps it.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, numpy_helper

from export.cli import main as export_main
from export.verify import TOLERANCES, relative_diff
from tests.exported import WORK, checkpoint
from tfserve.generation import DecodingOptions
from tfserve.generation.batch import generate
from tfserve.model import FusedAttention, Seq2SeqTransformer
from tfserve.model.attention import FP16_MASK_BIAS, blocked_to_bias, softmax_fp32
from tfserve.runtime import Runtime

FP16_MAX = float(np.finfo(np.float16).max)  # 65504


def export(source: list[str], out: Path, *flags: str) -> int:
    """`python -m export` of `source` (["--checkpoint", DIR] or ["--from-hf", DIR])."""
    return export_main([*source, "--out", str(out), "--quiet", "--force",
                        "--parity-samples", "0", *flags])


def graph(path: Path) -> onnx.GraphProto:
    return onnx.load(str(path), load_external_data=False).graph


def nodes(path: Path, op_type: str) -> list[onnx.NodeProto]:
    return [node for node in graph(path).node if node.op_type == op_type]


def fp16_scalars(path: Path) -> set[float]:
    """The values of the graph's float16 scalar constants (Constant nodes and initializers)."""
    tensors = [t for t in graph(path).initializer]
    tensors += [attribute.t for node in graph(path).node if node.op_type == "Constant"
                for attribute in node.attribute if attribute.name == "value"]
    return {float(numpy_helper.to_array(t)) for t in tensors
            if t.data_type == TensorProto.FLOAT16 and not list(t.dims)}


@pytest.fixture(scope="module")
def native() -> dict[str, Path]:
    """A tiny native model (RoPE, pre-norm) exported in fp32 and in fp16."""
    out = {}
    for dtype in ("fp32", "fp16"):
        out[dtype] = WORK / f"fp16-suite-{dtype}"
        assert export(["--checkpoint", str(checkpoint())], out[dtype], "--dtype", dtype) == 0
    return out


# -- fused attention, where the parity ran -----------------------------------------------


def test_fp16_graphs_fuse_every_attention_and_record_where_parity_ran(native):
    from export.graphs import fp16_parity_device

    manifest = json.loads((native["fp16"] / "model.json").read_text())
    provenance, parity = manifest["provenance"], manifest["parity"]
    # this machine: onnxruntime's CPU provider runs fp16 MultiHeadAttention, or a CUDA device
    assert provenance["parity_device"] == fp16_parity_device() in ("cpu", "cuda")
    assert provenance["attention"] == "fused" and provenance["verified"] is True
    assert parity["device"] == provenance["parity_device"] and parity["passed"]
    layers = 2  # tiny_config: 2 encoder and 2 decoder layers
    assert len(nodes(native["fp16"] / "encoder.onnx", "MultiHeadAttention")) == layers
    assert len(nodes(native["fp16"] / "decoder.onnx", "MultiHeadAttention")) == 2 * layers
    for name in ("encoder.onnx", "decoder.onnx"):  # no standard-op attention beside them
        assert not nodes(native["fp16"] / name, "Softmax")
    print(f"fp16 vs eager fp32: max relative logits diff "
          f"{parity['max_rel_diff']['max_logits']:.2e}, greedy "
          f"{parity['greedy_random_sources']['identical']}/"
          f"{parity['greedy_random_sources']['sentences']}")


def test_the_parity_device_prefers_cuda_then_the_cpu(monkeypatch):
    import export.graphs as graphs

    for runs, expected in ((lambda provider: True, "cuda"),
                           (lambda provider: provider == "CPUExecutionProvider", "cpu"),
                           (lambda provider: False, None)):
        monkeypatch.setattr(graphs, "runs_fp16_attention", runs)
        assert graphs.fp16_parity_device() == expected


def test_no_device_for_the_fused_fp16_graphs_is_a_refusal(monkeypatch, capsys, tmp_path):
    """Where neither a CUDA device nor the CPU provider runs the fused fp16 attention, the
    export refuses, naming what is needed, and writes nothing (no standard-op fallback)."""
    import export.graphs as graphs

    monkeypatch.setattr(graphs, "runs_fp16_attention", lambda provider: False)
    out = tmp_path / "out"
    assert export(["--checkpoint", str(checkpoint())], out, "--dtype", "fp16") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no device here runs the fused fp16 attention" in err
    assert "onnxruntime-gpu with a CUDA device" in err and "--allow-unverified" in err
    assert not out.exists()


def test_allow_unverified_publishes_fused_graphs_marked_unchecked(monkeypatch, tmp_path):
    import export.graphs as graphs

    monkeypatch.setattr(graphs, "runs_fp16_attention", lambda provider: False)
    out = tmp_path / "out"
    assert export(["--checkpoint", str(checkpoint())], out, "--dtype", "fp16",
                  "--allow-unverified") == 0
    manifest = json.loads((out / "model.json").read_text())
    assert (manifest["provenance"]["parity_device"], manifest["provenance"]["verified"],
            manifest["provenance"]["attention"]) == ("none", False, "fused")
    parity = manifest["parity"]
    assert (parity["verified"], parity["passed"], parity["device"]) == (False, False, "none")
    assert "--allow-unverified" in parity["note"]
    assert len(nodes(out / "decoder.onnx", "MultiHeadAttention")) == 4


def test_fp16_below_opset_17_is_refused(capsys, tmp_path):
    """Before opset 17 torch writes LayerNorm as float16 ops (its mean in float16)."""
    out = tmp_path / "out"
    assert export(["--checkpoint", str(checkpoint())], out, "--dtype", "fp16",
                  "--opset", "16") == 2
    assert "--dtype fp16 needs --opset 17 or later" in capsys.readouterr().err
    assert not out.exists()


# -- masks ------------------------------------------------------------------------------


def test_fp16_mask_bias_cannot_overflow():
    """float16's minimum plus a negative score rounds to -inf, and a fully masked row then
    normalises to NaN; the bounded bias keeps both finite."""
    score = torch.tensor(-100.0, dtype=torch.float16)
    assert torch.isinf(score + torch.finfo(torch.float16).min)  # why not the minimum
    blocked = torch.tensor([[[[True, False, True]]]])  # [1,1,1,3]
    assert blocked_to_bias(blocked, torch.float16).tolist() == [[[[FP16_MASK_BIAS, 0.0,
                                                                   FP16_MASK_BIAS]]]]
    assert torch.isfinite(score + FP16_MASK_BIAS)
    # the fused op's reference maths in float16: q k^T = -600 for every key, all masked
    q = torch.full((1, 2, 8), 5.0, dtype=torch.float16)  # [B,T,D], 2 heads of 4
    k = torch.full((1, 2, 6, 4), -15.0, dtype=torch.float16)  # [B,H,S,Dh]
    v = torch.randn(1, 2, 6, 4).half()
    bias = blocked_to_bias(torch.ones(1, 1, 2, 6, dtype=torch.bool), torch.float16)
    out, _, _ = FusedAttention.forward(None, q, k, v, bias, None, None, 2, 1.0)
    assert torch.isfinite(out).all()
    out_min, _, _ = FusedAttention.forward(None, q, k, v, torch.full_like(
        bias, torch.finfo(torch.float16).min), None, None, 2, 1.0)
    assert torch.isnan(out_min).all()  # the former bias


def test_fp16_graphs_mask_with_the_bounded_bias_and_stay_finite(native):
    """The graphs' masks hold FP16_MASK_BIAS, never float16's minimum; a source row whose
    keys are all masked and a decoder row whose own keys are all masked give finite
    outputs."""
    for name in ("encoder.onnx", "decoder.onnx"):
        scalars = fp16_scalars(native["fp16"] / name)
        assert FP16_MASK_BIAS in scalars and -FP16_MAX not in scalars, name
    runtime = Runtime(native["fp16"])
    ids = np.array([[5, 6, 7, 1], [8, 9, 1, 0]], np.int64)
    mask = np.array([[1, 1, 1, 1], [0, 0, 0, 0]], np.int64)  # row 1: every key masked
    hidden, cross = runtime.encode(ids, mask)
    assert np.isfinite(hidden).all() and all(np.isfinite(t).all() for t in cross)
    past = runtime.empty_past(2)
    out = runtime.step(np.array([[0], [0]], np.int64), np.zeros((2, 1), np.int64),
                       np.array([[1], [0]], np.int64), mask, past, cross)
    assert np.isfinite(out.logits).all() and all(np.isfinite(t).all() for t in out.present)


# -- float32 statistics -------------------------------------------------------------------


def test_fp16_graphs_keep_norm_and_softmax_statistics_in_fp32(native):
    """LayerNormalization with stash_type 1 (its mean and variance in float32; 1 is the
    default when the attribute is absent), the top candidates' LogSoftmax over a float32
    cast of the logits; the fused attention normalises in float32 in its kernels, and the
    unfused maths (softmax_fp32) in float32 too."""
    decoder = native["fp16"] / "decoder.onnx"
    for name in ("encoder.onnx", "decoder.onnx"):
        norms = nodes(native["fp16"] / name, "LayerNormalization")
        assert norms, name
        for node in norms:
            stash = {a.name: a.i for a in node.attribute}.get("stash_type", 1)
            assert stash == 1, name
    producers = {out: node for node in graph(decoder).node for out in node.output}
    (log_softmax,) = nodes(decoder, "LogSoftmax")
    cast = producers[log_softmax.input[0]]
    assert cast.op_type == "Cast" and cast.attribute[0].i == TensorProto.FLOAT
    scores = torch.zeros(1, 4096, dtype=torch.float16)  # float16 sums stop at 2048
    assert softmax_fp32(scores).dtype == torch.float16
    assert float(softmax_fp32(scores).float().sum()) == pytest.approx(1.0, abs=1e-3)
    assert float(scores.float().softmax(-1).sum()) == pytest.approx(1.0, abs=1e-6)


# -- T5: the FFN output projection in float32 ---------------------------------------------


WO_GAIN, UP_GAIN = 500.0, 100.0  # FFN outputs ~1e5 to 2e5, their inputs below 1e3


@pytest.fixture(scope="module")
def t5_v11(tmp_path_factory) -> Path:
    """A random T5 v1.1-style checkpoint (gated-gelu, untied lm_head) built with transformers,
    its FFN scaled so that every layer's output (wo) exceeds float16's range while wo's inputs
    stay well inside it (where T5 v1.1 checkpoints overflow in float16)."""
    pytest.importorskip("transformers")
    import t5_helpers as th
    from safetensors.torch import load_file, save_file

    directory = tmp_path_factory.mktemp("t5v11") / "t5-v1_1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        th.write_checkpoint(directory, th.train_t5_spm(), model_type="t5", untied=True,
                            eos_boost=1.0, d_model=32, num_heads=4, d_kv=8, d_ff=64,
                            num_layers=2, num_decoder_layers=2,
                            relative_attention_num_buckets=8,
                            relative_attention_max_distance=16,
                            feed_forward_proj="gated-gelu")
    path = directory / "model.safetensors"
    state = load_file(str(path))
    for key in state:
        if key.endswith("DenseReluDense.wi_1.weight"):
            state[key] = state[key] * UP_GAIN
        elif key.endswith("DenseReluDense.wo.weight"):
            state[key] = state[key] * WO_GAIN
    save_file(state, str(path), metadata={"format": "pt"})
    return directory


def t5_sources(runtime: Runtime, count: int = 24) -> tuple[np.ndarray, np.ndarray]:
    import t5_helpers as th

    texts = th.sentences(count, seed=5, high=30)
    return runtime.tokenizer.pad_batch([runtime.tokenizer.encode(t) for t in texts])


def test_t5_ffn_outputs_exceed_fp16_and_wo_stays_fp32(t5_v11):
    """The checkpoint does overflow: every FFN output beyond 65504 in transformers (fp32),
    and a model cast to float16 entirely gives non-finite states, where the one that keeps
    the FFN output projection in float32 (the importer's keep_in_fp32_modules) does not."""
    from transformers import T5ForConditionalGeneration

    from export.importers import import_hf

    hf = T5ForConditionalGeneration.from_pretrained(str(t5_v11)).eval()
    peaks: dict[str, tuple[float, float]] = {}
    for name, module in hf.named_modules():
        if name.endswith("DenseReluDense.wo"):
            module.register_forward_hook(lambda m, args, out, name=name: peaks.__setitem__(
                name, (float(args[0].abs().max()), float(out.abs().max()))))
    model: Seq2SeqTransformer = import_hf(t5_v11).model
    ids = torch.randint(3, 200, (4, 20))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        hf(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.zeros(4, 3).long())
        assert len(peaks) == 4
        assert all(inputs < 1e3 and outputs > FP16_MAX for inputs, outputs in peaks.values())
        assert model.config.extra["keep_in_fp32_modules"] == ["ffn.fc2"]
        half = Seq2SeqTransformer(model.config)
        half.load_state_dict(model.state_dict())
        assert not torch.isfinite(half.eval().to(torch.float16).encode(ids, mask)).all()
        kept = model.to_precision(torch.float16)
        assert kept.encoder_layers[0].ffn.fc2.weight.dtype == torch.float32
        assert kept.encoder_layers[0].ffn.fc1.weight.dtype == torch.float16
        assert torch.isfinite(kept.encode(ids, mask)).all()


class Fp16Arithmetic:
    """onnx's reference evaluator for the graphs, in float16 arithmetic as a GPU runs them.

    ONNX Runtime's CPU provider runs float16 MatMuls in float32 (it casts around the nodes
    it has no float16 kernel for), so a float16 value that overflows on a GPU stays finite
    there: the CPU cannot show an overflow. The reference evaluator stores every float16
    result as float16 (inf beyond 65504). Its MatMul and the fused attention below
    accumulate in float32 and round the result to the output's type, as GPU kernels do.
    """

    @staticmethod
    def ops() -> list[type]:
        from onnx.reference.op_run import OpRun

        class MatMul(OpRun):
            op_domain = ""

            def _run(self, a, b):  # float32 accumulation, the result in the inputs' type
                return ((a.astype(np.float32) @ b.astype(np.float32)).astype(
                    np.result_type(a, b)),)

        class MultiHeadAttention(OpRun):
            op_domain = "com.microsoft"

            def _run(self, q, k, v, bias=None, key_padding_mask=None, attention_bias=None,
                     past_key=None, past_value=None, num_heads=None, scale=None):
                rows, new, width = q.shape
                head_dim = width // num_heads

                def heads(x):  # [B,T,H*Dh] -> [B,H,T,Dh]
                    return x.astype(np.float32).reshape(rows, -1, num_heads, head_dim) \
                        .transpose(0, 2, 1, 3)

                cross = k.ndim == 4  # cached K/V [B,H,S,Dh]
                keys, values = (k, v) if cross else (heads(k), heads(v))
                if past_key is not None:
                    keys = np.concatenate([past_key, keys], axis=2)
                    values = np.concatenate([past_value, values], axis=2)
                keys, values = keys.astype(np.float32), values.astype(np.float32)
                scores = heads(q) @ keys.transpose(0, 1, 3, 2) * scale \
                    + attention_bias.astype(np.float32)  # [B,H,T,Tk]
                weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
                weights /= weights.sum(axis=-1, keepdims=True)
                out = (weights @ values).transpose(0, 2, 1, 3).reshape(rows, new, width)
                if cross:
                    return (out.astype(q.dtype),)
                return out.astype(q.dtype), keys.astype(q.dtype), values.astype(q.dtype)

        return [MatMul, MultiHeadAttention]

    def __init__(self, artifacts: Path) -> None:
        from onnx.reference import ReferenceEvaluator

        self.encoder, self.decoder = (
            ReferenceEvaluator(onnx.load(str(artifacts / name)), new_ops=self.ops())
            for name in ("encoder.onnx", "decoder.onnx"))


def graph_greedy(encoder, decoder, ids: np.ndarray, mask: np.ndarray, layers: int,
                 steps: int, forced: np.ndarray | None = None
                 ) -> tuple[np.ndarray, list[np.ndarray]]:
    """Greedy tokens [B,steps] (argmax, no bans or stop) and each step's logits [B,V] from
    an encoder and a decoder graph run through `.run(None, feeds)` (an ONNX Runtime session
    or a reference evaluator). forced [B,steps]: the tokens fed back instead of the argmax
    (teacher forcing: every step sees forced's prefix)."""
    encoded = encoder.run(None, {"input_ids": ids, "attention_mask": mask})
    rows = len(ids)
    tokens = np.zeros((rows, 1), np.int64)  # T5's decoder start token: pad, 0
    cross = {f"cross_{kind}_{layer}": encoded[1 + 2 * layer + index]
             for layer in range(layers) for index, kind in enumerate(("key", "value"))}
    past = {f"past_{kind}_{layer}": encoded[1][:, :, :0]  # [B,H,0,Dh]
            for layer in range(layers) for kind in ("key", "value")}
    chosen, logits = [], []
    for step in range(steps):
        outputs = decoder.run(None, {
            "input_ids": tokens, "position_ids": np.full((rows, 1), step, np.int64),
            "self_attention_mask": np.ones((rows, step + 1), np.int64),
            "encoder_attention_mask": mask, **past, **cross})
        logits.append(outputs[0][:, -1].astype(np.float32))
        chosen.append(logits[-1].argmax(axis=-1))
        tokens = (chosen[-1] if forced is None else forced[:, step])[:, None]
        past = {name: outputs[1 + index] for index, name in enumerate(past)}
    return np.stack(chosen, axis=1), logits


def test_t5_fp16_export_equals_fp32_where_ffn_outputs_exceed_fp16(t5_v11, tmp_path,
                                                                  monkeypatch):
    """fp32 and fp16 exports of the overflowing checkpoint: the fp16 graphs run wo as a
    float32 MatMul (one per layer) and pass their parity check. Decoded greedily, the fp16
    graphs give the fp32 export's tokens, with finite logits, both on ONNX Runtime's CPU
    provider and in float16 arithmetic (Fp16Arithmetic), where fp16 graphs that keep no
    module in float32 give non-finite states."""
    import onnxruntime as ort

    out = {name: tmp_path / name for name in ("fp32", "fp16", "fp16-all-half")}
    for name, target in out.items():
        with monkeypatch.context() as patch:
            if name == "fp16-all-half":  # the control: wo in float16 as everything else
                patch.setattr(Seq2SeqTransformer, "fp32_module_names", lambda self: [])
            assert export(["--from-hf", str(t5_v11)], target, "--dtype",
                          name[:4]) == 0, name
    parity = json.loads((out["fp16"] / "model.json").read_text())["parity"]
    assert parity["passed"] and parity["greedy_random_sources"]["agreement"] == 1.0
    for name, layers in (("encoder.onnx", 2), ("decoder.onnx", 2)):
        weights = {t.name: t.data_type for t in graph(out["fp16"] / name).initializer}
        fp32_matmuls = [n for n in nodes(out["fp16"] / name, "MatMul")
                        if weights.get(n.input[1]) == TensorProto.FLOAT]
        assert len(fp32_matmuls) == layers, name

    # ONNX Runtime CPU, the searches of the serving path
    fp32, fp16 = Runtime(out["fp32"]), Runtime(out["fp16"])
    ids, mask = t5_sources(fp32)
    options = DecodingOptions(max_new_tokens=20)
    ref, got = generate(fp32, ids, mask, options), generate(fp16, ids, mask, options)
    assert [r[0].token_ids for r in ref] == [g[0].token_ids for g in got]
    assert len({tuple(r[0].token_ids) for r in ref}) > len(ref) // 2  # the source matters

    # float16 arithmetic against the fp32 export on ONNX Runtime
    sessions = [ort.InferenceSession(str(out["fp32"] / name),
                                     providers=["CPUExecutionProvider"])
                for name in ("encoder.onnx", "decoder.onnx")]
    tokens_ref, logits_ref = graph_greedy(*sessions, ids, mask, layers=2, steps=12)
    half = Fp16Arithmetic(out["fp16"])
    with np.errstate(over="ignore", invalid="ignore"):  # the control's overflow
        tokens, logits = graph_greedy(half.encoder, half.decoder, ids, mask, layers=2,
                                      steps=12, forced=tokens_ref)
        all_half = Fp16Arithmetic(out["fp16-all-half"])
        hidden = all_half.encoder.run(["encoder_hidden_states"],
                                      {"input_ids": ids, "attention_mask": mask})[0]
    assert not np.isfinite(hidden).all()  # the control overflows
    assert np.isfinite(np.stack(logits)).all()
    # at each step both saw the same prefix (fp32's tokens). float16 picks fp32's token but
    # where the two are a near tie within the fp16 rule (export.verify): each logit within
    # atol + rtol * |row| of fp32's, so fp32's own gap between them is at most twice that
    fp16_rule = TOLERANCES["fp16"]
    for step, want in enumerate(logits_ref):
        rows = np.flatnonzero(tokens[:, step] != tokens_ref[:, step])
        for row in rows:
            gap = want[row, tokens_ref[row, step]] - want[row, tokens[row, step]]
            assert gap <= 2 * (fp16_rule.atol + fp16_rule.rtol * np.abs(want[row]).max()), \
                (step, row, gap)
    assert (tokens == tokens_ref).mean() >= 0.9
    # the export's fp16 rule: float16 rounds the FFN product (up to ~1e3 here, spacing 0.5)
    # and every elementwise result
    relative = max(relative_diff(got, want) for got, want in zip(logits, logits_ref))
    assert max(TOLERANCES["fp16"].ratio(got, want) for got, want in zip(logits, logits_ref)) \
        <= 1.0
    print(f"T5 v1.1 (FFN outputs > 65504), fp16 in float16 arithmetic vs the fp32 export: "
          f"max relative logits diff {relative:.2e} over 12 steps, greedy identical "
          f"{len(ids)}/{len(ids)}; fp16 on ONNX Runtime CPU vs eager fp32 (parity): "
          f"{parity['max_rel_diff']['max_logits']:.2e}")


def test_to_precision_keeps_only_the_configured_modules_in_fp32():
    """A model whose config keeps no module (every native model) is cast whole; float32
    casts every module back."""
    from tests.exported import demo_vocab_config

    model = Seq2SeqTransformer(demo_vocab_config()).to_precision(torch.float16)
    assert model.fp32_module_names() == []
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    config = demo_vocab_config(extra={"keep_in_fp32_modules": ["ffn.fc2"]})
    model = Seq2SeqTransformer(config).to_precision(torch.float16)
    assert model.fp32_module_names() == [f"{stack}_layers.{i}.ffn.fc2"
                                         for stack in ("encoder", "decoder") for i in range(2)]
    assert {p.dtype for p in model.parameters()} == {torch.float16, torch.float32}
    assert {p.dtype for p in model.to_precision(torch.float32).parameters()} == {torch.float32}
