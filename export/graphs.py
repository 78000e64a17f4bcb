"""Trace the PyTorch model into the two graphs of the interface (docs/graph-interface.md).

encoder.onnx: input_ids, attention_mask -> encoder_hidden_states, cross_key_l, cross_value_l
decoder.onnx: one KV-cached step for every step, the first included (past of length 0).

The masks (padding, look-ahead) and RoPE are computed inside the graphs from the
attention masks and `position_ids`, because the traced code builds them from its inputs.
Every axis is dynamic; the example inputs use sizes >= 2 so no axis is specialised.
"""

from __future__ import annotations

import functools
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tfserve.artifacts.manifest import TOP_OUTPUTS, decoder_io, encoder_io
from tfserve.model import Seq2SeqTransformer

DEFAULT_OPSET = 17
SUPPORTED_OPSETS = range(14, 21)


class EncoderGraph(nn.Module):
    def __init__(self, model: Seq2SeqTransformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple:
        hidden = self.model.encode(input_ids, attention_mask)  # [B,S,D]
        flat = [t for kv in self.model.cross_kv(hidden) for t in kv]  # each [B,H,S,Dh]
        return (hidden, *flat)


class DecoderGraph(nn.Module):
    def __init__(self, model: Seq2SeqTransformer) -> None:
        super().__init__()
        self.model = model
        self.layers = model.config.decoder_layers

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                self_attention_mask: torch.Tensor, encoder_attention_mask: torch.Tensor,
                *caches: torch.Tensor) -> tuple:
        n = self.layers
        past = [(caches[2 * i], caches[2 * i + 1]) for i in range(n)]
        cross = [(caches[2 * n + 2 * i], caches[2 * n + 2 * i + 1]) for i in range(n)]
        logits, present = self.model.decode_step(
            input_ids, position_ids, self_attention_mask, encoder_attention_mask, past, cross)
        top_log_probs, top_ids = self.model.top_candidates(logits)  # [B,T,K]
        return (logits, *[t for kv in present for t in kv], top_log_probs, top_ids)


def example_inputs(model: Seq2SeqTransformer, float_dtype: torch.dtype) -> tuple[tuple, tuple]:
    """Encoder and decoder example inputs: B=2, S=5, P=3, T=2 (all > 1, so none specialise)."""
    cfg = model.config
    batch, src, past, new = 2, 5, 3, 2
    ids = torch.randint(3, cfg.vocab_size, (batch, src))
    mask = torch.ones(batch, src, dtype=torch.int64)
    mask[1, -2:] = 0
    enc = (ids, mask)
    kv_past = torch.randn(batch, cfg.num_heads, past, cfg.head_dim, dtype=float_dtype)
    kv_cross = torch.randn(batch, cfg.num_heads, src, cfg.head_dim, dtype=float_dtype)
    dec = (
        torch.randint(3, cfg.vocab_size, (batch, new)),
        torch.arange(past, past + new).expand(batch, -1).contiguous(),
        torch.ones(batch, past + new, dtype=torch.int64),
        mask,
        *[kv_past.clone() for _ in range(2 * cfg.decoder_layers)],
        *[kv_cross.clone() for _ in range(2 * cfg.decoder_layers)],
    )
    return enc, dec


@contextmanager
def zero_logits_bias_dropped(model: Seq2SeqTransformer) -> Iterator[None]:
    """Trace without a final logits bias that is all zeros (Marian's usually is).

    Adding zeros is exact, so the graph is unchanged in value, and the decoder saves one
    elementwise pass over the [B,T,V] logits per step (~3% of a beam step at 128 rows).
    """
    bias = model.final_logits_bias
    if bias is None or bool(bias.detach().any()):  # None too for an encoder-only model
        yield
        return
    model.final_logits_bias = None
    try:
        yield
    finally:
        model.final_logits_bias = bias


@contextmanager
def fused_attention(model: Seq2SeqTransformer, enabled: bool) -> Iterator[None]:
    """Trace attention as ONNX Runtime's MultiHeadAttention op while the block runs."""
    before = model.use_fused_attention
    model.use_fused_attention = enabled
    try:
        yield
    finally:
        model.use_fused_attention = before


# the devices the export's parity check may run fp16 graphs on, best first: CUDA (where
# fp16 graphs are served) when this onnxruntime has it and a device is there, else the CPU
FP16_PARITY_PROVIDERS = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}
FP16_MIN_OPSET = 17  # the first with LayerNormalization (statistics in float32: stash_type 1)


@functools.cache
def runs_fp16_attention(provider: str) -> bool:
    """Whether ONNX Runtime's `provider` (an ort name, e.g. "CPUExecutionProvider") runs
    com.microsoft.MultiHeadAttention in fp16 as the graphs use it (an additive bias and a
    past K/V): one node on that provider alone, run once; False where the provider is
    missing, cannot start (no device) or has no such kernel."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    if provider not in ort.get_available_providers():
        return False

    def value(name: str, shape: list[int]) -> Any:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT16, shape)

    # q, k, v [1,1,4] over 2 heads of 2; bias [1,1,1,2]; past K/V [1,2,1,2]
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "", "bias", "pk", "pv"],
                            ["y", "key", "value"], domain="com.microsoft", num_heads=2)
    inputs = [value(n, [1, 1, 4]) for n in "qkv"] + [value("bias", [1, 1, 1, 2]),
                                                     value("pk", [1, 2, 1, 2]),
                                                     value("pv", [1, 2, 1, 2])]
    outputs = [value("y", [1, 1, 4]), value("key", [1, 2, 2, 2]), value("value", [1, 2, 2, 2])]
    model = helper.make_model(helper.make_graph([node], "probe", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17),
                                             helper.make_opsetid("com.microsoft", 1)])
    feeds = {info.name: np.ones([d.dim_value for d in info.type.tensor_type.shape.dim],
                                np.float16) for info in inputs}
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a missing device is an answer here, not an error
    if provider != "CPUExecutionProvider":
        # that provider alone: a node it has no kernel for fails the session instead of
        # falling back to the CPU provider (an option ONNX Runtime refuses for the CPU's own)
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    try:
        session = ort.InferenceSession(model.SerializeToString(), options,
                                       providers=[provider])
        if session.get_providers()[0] != provider:
            return False
        out = session.run(["y"], feeds)[0]
    except Exception:  # onnxruntime's own classes: no such kernel, device or library
        return False
    return bool(np.isfinite(out).all())


def fp16_parity_device() -> str | None:
    """Where the export's parity check runs fp16 graphs, whose attention is always the fused
    op: "cuda" when this onnxruntime runs it on a CUDA device, else "cpu" when its CPU
    provider runs it in fp16, else None (no device here can check the graphs)."""
    for device, provider in FP16_PARITY_PROVIDERS.items():
        if runs_fp16_attention(provider):
            return device
    return None


FP16_PARITY_NEEDS = ("onnxruntime-gpu with a CUDA device, or an onnxruntime whose CPU provider "
                     "runs com.microsoft.MultiHeadAttention in float16")


def attention_nodes(path: Path) -> int:
    """The com.microsoft.MultiHeadAttention nodes of a graph file (its weights unread)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return sum(node.op_type == "MultiHeadAttention" and node.domain == "com.microsoft"
               for node in graph.node)


def expected_attention_nodes(model: Seq2SeqTransformer, graph: str) -> int:
    """How many fused attention nodes graph "encoder.onnx" / "decoder.onnx" of `model` has:
    one per encoder layer; a self- and a cross-attention per decoder layer."""
    cfg = model.config
    return cfg.encoder_layers if graph == "encoder.onnx" else 2 * cfg.decoder_layers


def export_graphs(model: Seq2SeqTransformer, directory: Path, opset: int,
                  float_dtype: torch.dtype = torch.float32, fused: bool = True) -> list[Path]:
    """Write encoder.onnx and decoder.onnx into directory (an encoder-only model: encoder.onnx
    alone); returns their paths.

    fused: attention as ONNX Runtime's com.microsoft.MultiHeadAttention (one node each, in
    fp32 and fp16 graphs); False traces it as standard ONNX ops (MatMul, Softmax, ...), a
    form `python -m export` never writes, kept for comparisons.
    """
    model = model.eval()
    layers = model.config.decoder_layers
    enc_in, enc_out = encoder_io(layers)
    dec_in, dec_out = decoder_io(layers)
    dec_out = dec_out + list(TOP_OUTPUTS)
    enc_example, dec_example = example_inputs(model, float_dtype)

    enc_axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "source_len"},
        "attention_mask": {0: "batch", 1: "source_len"},
        "encoder_hidden_states": {0: "batch", 1: "source_len"},
    }
    dec_axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "new_len"},
        "position_ids": {0: "batch", 1: "new_len"},
        "self_attention_mask": {0: "batch", 1: "total_len"},
        # its own name: with one row per group of rows (beams), Bc may differ from B, and a
        # shared name would let ONNX Runtime's shape optimisations assume Bc == B
        "encoder_attention_mask": {0: "cross_batch", 1: "source_len"},
        "logits": {0: "batch", 1: "new_len"},
        **{name: {0: "batch", 1: "new_len"} for name in TOP_OUTPUTS},
    }
    for name in enc_out[1:]:
        enc_axes[name] = {0: "batch", 2: "source_len"}
    for name in dec_in[4:]:
        if name.startswith("past"):
            dec_axes[name] = {0: "batch", 2: "past_len"}
        else:
            dec_axes[name] = {0: "cross_batch", 2: "source_len"}
    for name in dec_out[1: 1 + 2 * layers]:
        dec_axes[name] = {0: "batch", 2: "total_len"}

    encoder_path, decoder_path = directory / "encoder.onnx", directory / "decoder.onnx"
    graphs = [(EncoderGraph(model), enc_example, encoder_path, enc_in, enc_out, enc_axes)]
    if not model.config.encoder_only:
        graphs.append((DecoderGraph(model), dec_example, decoder_path, dec_in, dec_out,
                       dec_axes))
    with (warnings.catch_warnings(), torch.no_grad(), zero_logits_bias_dropped(model),
          fused_attention(model, fused)):
        warnings.simplefilter("ignore")  # tracer warnings about python ints from shapes
        for module, args, path, names_in, names_out, axes in graphs:
            # a graph over 2 GB (NLLB-600M's decoder: two 256k x 1024 tables) is written
            # by torch with one external file per tensor beside it: trace into a scratch
            # directory and keep one graph file (+ one data file when it needs one)
            scratch = directory / f".trace-{path.stem}"
            scratch.mkdir()
            try:
                torch.onnx.export(
                    module, args, str(scratch / path.name), input_names=names_in,
                    output_names=names_out, dynamic_axes=axes, opset_version=opset,
                    dynamo=False, do_constant_folding=True,
                    custom_opsets={"com.microsoft": 1} if fused else None,
                )
                gather_graph(scratch / path.name, path)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    return [graph[2] for graph in graphs]


def gather_graph(traced: Path, path: Path) -> None:
    """Move the traced graph to `path`; its external tensors, if torch wrote any, into one
    `<name>.data` file beside it."""
    if [p for p in traced.parent.iterdir() if p != traced] == []:
        traced.replace(path)
        return
    import onnx

    model = onnx.load(str(traced))  # with its external tensors
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)


def is_large(path: Path) -> bool:
    """Whether a graph and its external data are too large for one protobuf (2 GB)."""
    data = path.with_name(path.name + ".data")
    size = path.stat().st_size + (data.stat().st_size if data.is_file() else 0)
    return size >= 2**31 - 2**26


def quantize_int8(directory: Path, files: list[str]) -> None:
    """Dynamic int8 quantization of the MatMul weights (per channel) and of the embedding
    tables (Gather), in place.

    Activations stay float and are quantized on the fly per call: the CPU recipe of ONNX
    Runtime for Transformers. Quantizing the Gathers too halves the artifacts of an
    opus-mt-base-sized model (195 -> 96 MB) and its peak RSS by ~90 MiB at equal speed.
    """
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    # the quantizer logs advice on the root logger for every model; not useful here
    logging.getLogger().setLevel(logging.ERROR)
    for name in files:
        source = directory / name
        target = directory / (name + ".int8")
        large = is_large(source)
        # reduce_range: 7-bit weights. A CPU without VNNI (AVX2 only) multiplies u8 x s8 pairs
        # with VPMADDUBSW, whose 16-bit sums saturate at full range; artifacts are served on
        # whatever CPU the user has, so they keep the range every CPU computes exactly
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8,
                         per_channel=True, reduce_range=True,
                         op_types_to_quantize=["MatMul", "Gather"],
                         use_external_data_format=large)
        target.replace(source)
        if large:  # its tensors went to <target>.data, which the graph names
            source.with_name(source.name + ".data").unlink(missing_ok=True)


SHARED_WEIGHTS_FILE = "shared_weights.data"  # the tensors both graphs hold, stored once
SHARED_MIN_BYTES = 1 << 20  # smaller tensors held by both graphs are not worth sharing
SHARED_ALIGNMENT = 4096  # offsets in the shared file: page-aligned, so each maps as is


def store_weights_externally(directory: Path, files: list[str]) -> None:
    """Store each weight once, outside the graph files, in place.

    - A decoder whose output projection is its token embedding transposed (tied
      embeddings) reads the embedding itself (`tie_output_projection`): the traced graph
      holds the table twice, once per layout.
    - A tensor that several graphs hold with the same contents (the embedding the encoder
      and the decoder share, equal position tables), from SHARED_MIN_BYTES on, goes once
      into SHARED_WEIGHTS_FILE, which every such graph names; `tfserve.runtime` maps it once
      and hands the same buffer to both sessions.
    - Every other initializer goes into `<graph>.data` beside its graph, and so do the
      large constants torch traces as Constant nodes (tables it computes from the config,
      such as sinusoidal positions: `constants_to_initializers`).

    ONNX Runtime maps external data files into memory instead of parsing the weights out of
    the protobuf and copying them: loading the opus-mt-base-sized export peaks at 366 MiB
    instead of 552 (fp32) and 148 instead of 198 (int8), at the same speed.
    int8 exports (`quantize_int8`, run before this) keep an int8 projection of their own:
    ONNX Runtime's int8 MatMuls read no transposed weight, and the quantized table and
    projection differ in layout and scales; their encoder and decoder tables are equal
    and stored once.
    """
    import onnx

    models = {name: onnx.load(str(directory / name)) for name in files}
    for model in models.values():
        constants_to_initializers(model)
        tie_output_projection(model)
    shared = directory / SHARED_WEIGHTS_FILE
    shared.unlink(missing_ok=True)
    if share_tensors(list(models.values()), shared):
        shared.chmod((directory / files[0]).stat().st_mode & 0o777)
    for name, model in models.items():
        path = directory / name
        data = path.with_name(name + ".data")
        data.unlink(missing_ok=True)
        onnx.save_model(model, str(path), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data.name, size_threshold=1024)
        data.touch()  # model.json names it, even if every tensor went to the shared file
        # onnx creates it owner-only; it must be as readable as the graph (a container's
        # non-root user reads artifacts exported by root)
        data.chmod(path.stat().st_mode & 0o777)
        # the tensors a large graph's quantization kept apart are all in `data` now
        path.with_name(name + ".int8.data").unlink(missing_ok=True)


def constants_to_initializers(model: Any, min_bytes: int = 1024) -> None:
    """Turn the graph's Constant nodes holding a tensor of `min_bytes` or more into
    initializers of the same name (an onnx ModelProto, in place), so that they are stored
    with the weights (and once, where both graphs hold them) instead of inside the graph
    file. ONNX Runtime makes initializers of Constant nodes itself: the graph is the same."""
    graph = model.graph
    for node in list(graph.node):
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            continue
        values = [attribute for attribute in node.attribute if attribute.name == "value"]
        if len(node.attribute) != 1 or not values or len(values[0].t.raw_data) < min_bytes:
            continue
        tensor = graph.initializer.add()
        tensor.CopyFrom(values[0].t)
        tensor.name = node.output[0]
        graph.node.remove(node)


def tie_output_projection(model: Any) -> bool:
    """Make the output projection read the token embedding table (an onnx ModelProto, in
    place); returns whether the graph had a projection equal to the table transposed.

    torch traces a tied `lm_head` as MatMul(x [B,T,D], W [D,V]) with W the embedding
    [V,D] transposed, constant-folded into a second initializer. It becomes
    com.microsoft.FusedMatMul(x, table, transB=1), which reads the table as it is (CPU and
    CUDA kernels). The table is also listed among the graph's inputs (an initializer a
    caller may override; `InferenceSession.get_inputs` does not list it): ONNX Runtime
    treats such a tensor as non-constant, so it neither pre-packs a copy of it for the
    projection (its CPU MatMul kernels pack constant weights into a buffer of their own,
    while the Gather keeps reading the table) nor folds anything into a copy.
    """
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    tables = {node.input[0] for node in graph.node
              if node.op_type == "Gather" and len(node.input) == 2
              and node.input[1] == "input_ids" and node.input[0] in initializers
              and len(initializers[node.input[0]].dims) == 2}
    for index, node in enumerate(graph.node):
        weight = initializers.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight is None or len(weight.dims) != 2:
            continue
        for name in sorted(tables):
            table = initializers[name]
            if (table.data_type != weight.data_type
                    or list(table.dims) != list(reversed(weight.dims))
                    or not np.array_equal(numpy_helper.to_array(table).T,
                                          numpy_helper.to_array(weight))):
                continue
            fused = helper.make_node("FusedMatMul", [node.input[0], name], list(node.output),
                                     name=node.name, domain="com.microsoft", transB=1)
            graph.node.remove(node)
            graph.node.insert(index, fused)
            if not any(weight.name in other.input for other in graph.node):
                graph.initializer.remove(weight)
            if name not in {value.name for value in graph.input}:
                graph.input.append(helper.make_tensor_value_info(name, table.data_type,
                                                                 list(table.dims)))
            if "com.microsoft" not in {opset.domain for opset in model.opset_import}:
                model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
            return True
    return False


def share_tensors(models: list[Any], path: Path) -> bool:
    """Write the initializers that several of `models` hold with the same contents (from
    SHARED_MIN_BYTES on) once into `path`, and point each of them there (onnx ModelProtos,
    in place); returns whether there were any."""
    import hashlib

    from onnx import TensorProto
    from onnx.external_data_helper import set_external_data

    holders: dict[tuple[int, tuple[int, ...], bytes], list[tuple[int, Any]]] = {}
    for number, model in enumerate(models):
        for tensor in model.graph.initializer:
            if (tensor.data_location == TensorProto.EXTERNAL or not tensor.HasField("raw_data")
                    or len(tensor.raw_data) < SHARED_MIN_BYTES):
                continue
            key = (tensor.data_type, tuple(tensor.dims),
                   hashlib.sha256(tensor.raw_data).digest())
            holders.setdefault(key, []).append((number, tensor))
    shared = [tensors for tensors in holders.values()
              if len({number for number, _ in tensors}) > 1]
    if not shared:
        return False
    with path.open("wb") as handle:
        for tensors in shared:
            raw = tensors[0][1].raw_data
            offset = -(-handle.tell() // SHARED_ALIGNMENT) * SHARED_ALIGNMENT
            handle.write(b"\0" * (offset - handle.tell()))
            handle.write(raw)
            for _, tensor in tensors:
                set_external_data(tensor, path.name, offset, len(raw))
                tensor.ClearField("raw_data")
    return True
