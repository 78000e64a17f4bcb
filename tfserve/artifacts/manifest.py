"""The artifacts manifest (`model.json`): what `python -m export` writes and the runtime reads.

Layout of an artifacts directory (docs/artifacts.md):

    model.json     this manifest
    encoder.onnx   input_ids, attention_mask -> encoder_hidden_states, cross_key_l, cross_value_l
    decoder.onnx   one KV-cached step (docs/graph-interface.md); none for an encoder-only
                   model (model.decoder_layers 0), whose manifest has no "decoder" graph
    tokenizer files named by manifest["tokenizer"]

Pure JSON + dataclasses: part of the serving path.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from tfserve.artifacts.generation_defaults import GenerationDefaults, hf_fields, pad_ban
from tfserve.artifacts.model_config import ConfigError, ModelConfig
from tfserve.text.tokenizer import TokenizerSpec

FORMAT_VERSION = 1
# How export builds the graphs behind the same interface (2: fused attention, fusable
# reshapes, top candidates; 3: one Q/K/V GEMM; 4: weights in external data files;
# 5: cross K/V and encoder mask may have one row per group of rows; 6: the grouped
# cross-attention's reshapes share their shape ops across layers, no Cast of fp32 logits;
# 7: fp32 RoPE as com.microsoft.RotaryEmbedding over cos/sin tables, constant-size
# rotate_half slices; 8: a tied output projection reads the token table (FusedMatMul,
# transB), tensors both graphs hold stored once in shared_weights.data); an exported demo
# made by an older revision is re-exported on first use.
GRAPH_REVISION = 8
GROUPED_CROSS_REVISION = 5  # the first revision whose decoder takes grouped cross rows
SHARED_TABLE_REVISION = 8  # the first whose decoder lists its tied token table as an input
MANIFEST_FILE = "model.json"


# model.json's special_tokens section -> the model fields it repeats (for readers of the
# manifest that do not parse the model config)
SPECIAL_TOKENS = {"pad": "pad_token_id", "eos": "eos_token_id", "unk": "unk_token_id",
                  "decoder_start": "decoder_start_token_id"}


class ManifestError(ValueError):
    """An unreadable or inconsistent artifacts directory; the message names the file."""


def inside(directory: Path, name: str) -> bool:
    """Whether `directory / name`, links resolved, lies in `directory`: the files of an
    artifacts directory, model.json included, are confined to it, so that a manifest or a
    link in it cannot make the server read (and report on) files elsewhere."""
    return (directory / name).resolve().is_relative_to(directory.resolve())


def encoder_io(layers: int) -> tuple[list[str], list[str]]:
    outputs = ["encoder_hidden_states"]
    for layer in range(layers):
        outputs += [f"cross_key_{layer}", f"cross_value_{layer}"]
    return ["input_ids", "attention_mask"], outputs


# Optional decoder outputs (graph revision 2): each position's best log-probabilities
# [B,T,K] (sorted, best first) and their token ids [B,T,K], K = min(TOP_CANDIDATES, V).
# LogSoftmax + TopK in the graph replace the search's pass over [B,V] logits in numpy for
# greedy and beam rows; K covers 2 x 16 beams plus the two tokens a search may ban (one
# banned token, such as opus-mt's pad, and eos before min_new_tokens); with more banned
# tokens, 16 beams decide from the full logits (DecodeBatch).
TOP_OUTPUTS = ("top_log_probs", "top_ids")
TOP_CANDIDATES = 34


def decoder_io(layers: int) -> tuple[list[str], list[str]]:
    inputs = ["input_ids", "position_ids", "self_attention_mask", "encoder_attention_mask"]
    for layer in range(layers):
        inputs += [f"past_key_{layer}", f"past_value_{layer}"]
    for layer in range(layers):
        inputs += [f"cross_key_{layer}", f"cross_value_{layer}"]
    outputs = ["logits"]
    for layer in range(layers):
        outputs += [f"present_key_{layer}", f"present_value_{layer}"]
    return inputs, outputs


@dataclass
class Manifest:
    config: ModelConfig
    tokenizer: TokenizerSpec
    dtype: str = "fp32"  # element type of float inputs/outputs: fp32 or fp16
    quantization: str | None = None  # "int8": dynamically quantized MatMuls (CPU)
    opset: int = 17
    encoder_file: str = "encoder.onnx"
    decoder_file: str = "decoder.onnx"
    # the graphs' external weights ("" for exports that kept them inside the .onnx files)
    encoder_data: str = "encoder.onnx.data"
    decoder_data: str = "decoder.onnx.data"
    parity: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    # the checkpoint's generation settings (tfserve.artifacts.generation_defaults), HF field names
    generation: dict[str, Any] = field(default_factory=dict)
    # the tokens no search produces ("banned_token_ids": bad_words_ids' single-token
    # entries, as transformers bans them). None: a manifest written before the field, which
    # keeps the rule it was served with, pad banned unless it is eos (`banned_tokens`): its
    # outputs do not change with an upgrade, an opus-mt export keeps its ban, and a
    # re-export records the checkpoint's own
    banned_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.config.encoder_only:  # no decoder graph
            self.decoder_file = self.decoder_data = ""

    @property
    def generation_defaults(self) -> GenerationDefaults:
        return GenerationDefaults(self.generation)

    def banned_tokens(self) -> tuple[int, ...]:
        """The tokens the searches never produce on this model (see banned_token_ids)."""
        if self.banned_token_ids is None:
            return pad_ban(self.config.pad_token_id, self.config.eos_token_id)
        return tuple(self.banned_token_ids)

    def to_dict(self) -> dict[str, Any]:
        layers = self.config.decoder_layers
        enc_in, enc_out = encoder_io(layers)
        dec_in, dec_out = decoder_io(layers)
        cfg = self.config
        graphs = {"encoder": {"file": self.encoder_file, "data": self.encoder_data,
                              "inputs": enc_in, "outputs": enc_out}}
        if not cfg.encoder_only:
            graphs["decoder"] = {"file": self.decoder_file, "data": self.decoder_data,
                                 "inputs": dec_in, "outputs": dec_out}
        return {
            "format_version": self.format_version,
            "model": cfg.to_dict(),
            "special_tokens": {
                "pad": cfg.pad_token_id,
                "eos": cfg.eos_token_id,
                "unk": cfg.unk_token_id,
                "decoder_start": cfg.decoder_start_token_id,
            },
            "tokenizer": self.tokenizer.to_dict(),
            "graphs": graphs,
            "opset": self.opset,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "parity": self.parity,
            "provenance": self.provenance,
            "generation": self.generation,
            **({} if self.banned_token_ids is None
               else {"banned_token_ids": list(self.banned_token_ids)}),
        }

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / MANIFEST_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        directory = Path(directory)
        path = directory / MANIFEST_FILE
        if not directory.is_dir():
            raise ManifestError(f"artifacts directory not found: {directory}")
        if not path.is_file():
            raise ManifestError(f"no {MANIFEST_FILE} in {directory}: export a model with "
                                "`python -m export --out DIR` first")
        if not inside(directory, MANIFEST_FILE):  # not read: a link to a file elsewhere
            raise ManifestError(f"{path} leads outside {directory} (a symbolic link): the "
                                "manifest must lie in its artifacts directory")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ManifestError(f"cannot read {path}: {exc}") from exc
        try:
            version = data["format_version"]
            if version != FORMAT_VERSION:
                raise ManifestError(f"{path}: format_version {version} is not supported "
                                    f"(this tfserve reads {FORMAT_VERSION})")
            config = ModelConfig.from_dict(data["model"])
            # an encoder-only model has no decoder graph; any other must have one
            if not config.encoder_only and "decoder" not in data["graphs"]:
                raise ManifestError(f"{path}: graphs.decoder is required unless "
                                    "model.decoder_layers is 0 (an encoder-only model)")
            decoder = {} if config.encoder_only else data["graphs"]["decoder"]
            manifest = cls(
                config=config,
                tokenizer=TokenizerSpec.from_dict(data["tokenizer"]),
                dtype=data.get("dtype", "fp32"),
                quantization=data.get("quantization"),
                opset=int(data.get("opset", 17)),
                encoder_file=data["graphs"]["encoder"]["file"],
                decoder_file="" if config.encoder_only else decoder["file"],
                encoder_data=data["graphs"]["encoder"].get("data", ""),
                decoder_data=decoder.get("data", ""),
                parity=data.get("parity", {}),
                provenance=data.get("provenance", {}),
                generation=_generation(data),
                banned_token_ids=_banned_token_ids(data),
            )
            GenerationDefaults(manifest.generation)
        except (KeyError, TypeError) as exc:
            raise ManifestError(f"{path} is missing or mistypes field {exc}") from exc
        except (ConfigError, ValueError) as exc:
            if isinstance(exc, ManifestError):
                raise
            raise ManifestError(f"{path}: {exc}") from exc
        if manifest.dtype not in ("fp32", "fp16"):
            raise ManifestError(f"{path}: dtype must be fp32 or fp16, got {manifest.dtype!r}")
        graph_files = (manifest.encoder_file, manifest.decoder_file, manifest.encoder_data,
                       manifest.decoder_data)
        for name in (*graph_files, *manifest.tokenizer.files()):
            if not name:
                continue
            if not inside(directory, name):  # links included
                raise ManifestError(f"{path} names {name!r}, which is outside {directory}")
            if not (directory / name).is_file():
                raise ManifestError(f"{path} names {name}, which is missing from {directory}")
        vocab_size = manifest.config.vocab_size  # the model's own ids are checked by its config
        spec = manifest.tokenizer
        for field_name in ("pad_token_id", "eos_token_id", "unk_token_id",
                           "decoder_start_token_id"):
            value = getattr(spec, field_name, None)
            if isinstance(value, int) and not 0 <= value < vocab_size:
                raise ManifestError(f"{path}: tokenizer.{field_name} is {value}, outside the "
                                    f"vocabulary [0, {vocab_size})")
        _check_special_tokens(path, data, manifest.config)
        for token in manifest.banned_token_ids or ():
            if not 0 <= token < vocab_size:
                raise ManifestError(f"{path}: banned_token_ids holds {token}, outside the "
                                    f"vocabulary [0, {vocab_size})")
        return manifest


def _check_special_tokens(path: Path, data: dict[str, Any], config: ModelConfig) -> None:
    """special_tokens (optional) repeats the model's ids: each one present must be an id of
    the vocabulary and the model's own, or a reader of model.json would use another token
    than the one served."""
    special = data.get("special_tokens", {})
    if not isinstance(special, dict):
        raise ManifestError(f"{path}: special_tokens must be an object of token ids, got "
                            f"{type(special).__name__}")
    for key, field_name in SPECIAL_TOKENS.items():
        if key not in special:
            continue
        value, served = special[key], getattr(config, field_name)
        if isinstance(value, bool) or not isinstance(value, int) or not (
                0 <= value < config.vocab_size):
            raise ManifestError(f"{path}: special_tokens.{key} is {value!r}, outside the "
                                f"vocabulary [0, {config.vocab_size})")
        if value != served:
            raise ManifestError(f"{path}: special_tokens.{key} is {value}, but "
                                f"model.{field_name} is {served}")


def _banned_token_ids(data: dict[str, Any]) -> list[int] | None:
    """model.json's banned_token_ids (None where the export predates it); ValueError when it
    is not a list of token ids."""
    if "banned_token_ids" not in data:
        return None
    value = data["banned_token_ids"]
    if not isinstance(value, list) or any(
            isinstance(token, bool) or not isinstance(token, int) for token in value):
        raise ValueError(f"banned_token_ids must be a list of token ids, got {value!r}")
    return value


def _generation(data: dict[str, Any]) -> dict[str, Any]:
    """The manifest's generation settings; exports made before the field existed kept them
    in model.extra.hf_generation."""
    if "generation" in data:
        return data["generation"]
    extra = data["model"].get("extra") if isinstance(data["model"], dict) else None
    recorded = extra.get("hf_generation") if isinstance(extra, dict) else None
    if not isinstance(recorded, dict):
        return {}
    known = hf_fields()
    return {k: v for k, v in recorded.items() if k in known and v is not None}


# -- what a graph file declares ---------------------------------------------------------------
# A minimal reader of the ONNX protobuf: the serving path has no `onnx` package, and ONNX
# Runtime does not show a graph's initializers. It reads names, shapes, element types, node
# inputs and external data locations, and skips tensor contents (a graph with its weights
# inside is read through a memory map, never copied). Field numbers from onnx/onnx.proto.
_MODEL_GRAPH = 7
_GRAPH_NODE, _GRAPH_INITIALIZER = 1, 5
_NODE_INPUT, _NODE_OUTPUT, _NODE_OP_TYPE, _NODE_ATTRIBUTE = 1, 2, 4, 5
_ATTRIBUTE_TENSOR = 5
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_NAME, _TENSOR_EXTERNAL_DATA = 1, 2, 8, 13
_ENTRY_KEY, _ENTRY_VALUE = 1, 2
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


@dataclass
class GraphFacts:
    """What an ONNX file declares, read without running it."""

    tensors: dict[str, tuple[int, ...]]  # initializers and Constant outputs -> their dims
    nodes: list[tuple[str, list[str]]]  # (op_type, inputs) of the top-level nodes
    external_files: set[str]  # external data locations its tensors name

    def position_tables(self) -> list[tuple[str, int]]:
        """(name, rows) of the position tables the graph reads: RotaryEmbedding's cos cache,
        and 2-D constant tables a Gather reads at positions (position_ids, or positions the
        graph computes); the token table, read at input_ids, is not one."""
        tables = []
        for op_type, inputs in self.nodes:
            if op_type == "RotaryEmbedding" and len(inputs) >= 3:
                name = inputs[2]  # (input, position_ids, cos_cache, sin_cache)
            elif op_type == "Gather" and len(inputs) == 2 and inputs[1] != "input_ids":
                name = inputs[0]  # (data, indices)
            else:
                continue
            dims = self.tensors.get(name)
            if dims is not None and len(dims) == 2:
                tables.append((name, dims[0]))
        return tables


def read_graph_facts(path: Path) -> GraphFacts:
    """GraphFacts of an ONNX file; ManifestError naming the file when it is not one."""
    try:
        with path.open("rb") as handle:
            if not path.stat().st_size:
                raise ValueError("the file is empty")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _model_facts(data)
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read the graph ({exc.strerror or exc})") from None
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        detail = str(exc) if isinstance(exc, ValueError) else "truncated or malformed"
        raise ManifestError(f"{path}: not a loadable ONNX graph ({detail})") from None


def _model_facts(data: mmap.mmap) -> GraphFacts:
    facts = GraphFacts({}, [], set())
    graphs = [(a, b) for number, wire, a, b in _fields(data, 0, len(data))
              if number == _MODEL_GRAPH and wire == _LENGTH]
    if not graphs:
        raise ValueError("no graph in the file")
    for start, end in graphs:
        for number, wire, a, b in _fields(data, start, end):
            if wire != _LENGTH:
                continue
            if number == _GRAPH_INITIALIZER:
                _tensor_facts(data, a, b, None, facts)
            elif number == _GRAPH_NODE:
                _node_facts(data, a, b, facts)
    return facts


def _node_facts(data: mmap.mmap, start: int, end: int, facts: GraphFacts) -> None:
    inputs, outputs, op_type, tensors = [], [], "", []
    for number, wire, a, b in _fields(data, start, end):
        if wire != _LENGTH:
            continue
        if number == _NODE_INPUT:
            inputs.append(data[a:b].decode("utf-8"))
        elif number == _NODE_OUTPUT:
            outputs.append(data[a:b].decode("utf-8"))
        elif number == _NODE_OP_TYPE:
            op_type = data[a:b].decode("utf-8")
        elif number == _NODE_ATTRIBUTE:
            tensors += [(c, d) for n, w, c, d in _fields(data, a, b)
                        if n == _ATTRIBUTE_TENSOR and w == _LENGTH]
    facts.nodes.append((op_type, inputs))
    for a, b in tensors:  # a Constant's value: its output is the tensor
        _tensor_facts(data, a, b, outputs[0] if op_type == "Constant" and outputs else None,
                      facts)


def _tensor_facts(data: mmap.mmap, start: int, end: int, name: str | None,
                  facts: GraphFacts) -> None:
    tensor = _tensor_fields(data, start, end)
    facts.external_files.update(value for key, value in tensor.external_data
                                if key == "location")
    name = tensor.name if name is None else name
    if name:
        facts.tensors[name] = tuple(tensor.dims)


class _TensorFields(NamedTuple):
    """What a TensorProto declares besides its contents."""

    name: str  # "" without one
    data_type: int  # TensorProto.DataType, 0 without one
    dims: list[int]
    external_data: list[tuple[str, str]]  # its (key, value) entries: location, offset, ...


def _tensor_fields(data: mmap.mmap, start: int, end: int) -> _TensorFields:
    """The TensorProto in data[start:end]: its name, element type, dims and external data."""
    name, data_type, dims, external = "", 0, [], []
    for number, wire, a, b in _fields(data, start, end):
        if number == _TENSOR_DIMS and wire == _VARINT:
            dims.append(a)
        elif number == _TENSOR_DIMS and wire == _LENGTH:  # packed
            position = a
            while position < b:
                value, position = _varint(data, position)
                dims.append(value)
        elif number == _TENSOR_DATA_TYPE and wire == _VARINT:
            data_type = a
        elif number == _TENSOR_NAME and wire == _LENGTH:
            name = data[a:b].decode("utf-8")
        elif number == _TENSOR_EXTERNAL_DATA and wire == _LENGTH:
            entry = {n: data[c:d].decode("utf-8") for n, w, c, d in _fields(data, a, b)
                     if w == _LENGTH}
            if _ENTRY_KEY in entry and _ENTRY_VALUE in entry:
                external.append((entry[_ENTRY_KEY], entry[_ENTRY_VALUE]))
    return _TensorFields(name, data_type, dims, external)


def _field_spans(data: mmap.mmap | bytes, start: int, end: int
                 ) -> Iterator[tuple[int, int, int, int, int]]:
    """The fields of the message in data[start:end] as (number, wire type, first, a, b): the
    whole field (key included) is data[first:b], its value data[a:b] (a length-delimited
    field's bytes, a varint's encoding, a fixed-size field's bytes)."""
    position = start
    while position < end:
        first = position
        key, position = _varint(data, position)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            _, after = _varint(data, position)
        elif wire == _LENGTH:
            length, position = _varint(data, position)
            after = position + length
        elif wire in (_FIXED64, _FIXED32):
            after = position + (8 if wire == _FIXED64 else 4)
        else:
            raise ValueError(f"wire type {wire} is not in ONNX files")
        if after > end:
            raise ValueError("truncated: a field runs past the end of its message")
        yield number, wire, first, position, after
        position = after


def _fields(data: mmap.mmap, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """The fields of the message in data[start:end] as (number, wire type, a, b): a varint's
    value in a, a length-delimited field's bytes at data[a:b]; fixed-size fields skipped."""
    for number, wire, _, a, b in _field_spans(data, start, end):
        if wire == _VARINT:
            yield number, wire, _varint(data, a)[0], 0
        elif wire == _LENGTH:
            yield number, wire, a, b


def _varint(data: mmap.mmap | bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
        if shift > 63:
            raise ValueError("a malformed varint")
