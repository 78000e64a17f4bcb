"""The files of a Hugging Face checkpoint directory, for every importer: JSON files, the
weight files (safetensors preferred, sharded or not, or `torch.load(weights_only=True)`), and
loading mapped tensors into the model with every name and shape checked.

Only JSON, safetensors and `torch.load(weights_only=True)` are used: nothing is unpickled
beyond plain tensors, and transformers is not needed.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch

from export.sources import SourceError
from tfserve.model import Seq2SeqTransformer

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"


def checkpoint_name(directory: Path) -> str:
    """The model's name: the directory's, or "ORG/NAME" for a Hugging Face cache snapshot
    (`.../models--ORG--NAME/snapshots/HASH`, what huggingface_hub downloads to), whose own
    name is a commit hash."""
    resolved = directory.absolute()
    parts = resolved.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        repo = parts[-3][len("models--"):].split("--")
        if all(repo):
            return "/".join(repo)
    return directory.resolve().name


def read_json(path: Path, what: str) -> Any:
    """The JSON in `path`; SourceError naming it (and `what` it is) when missing or bad."""
    if not path.is_file():
        raise SourceError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SourceError(f"cannot read {path}: {exc}") from exc


def weight_files(directory: Path) -> list[Path]:
    """The weight files, safetensors preferred (as transformers does)."""
    for single, index in ((SAFETENSORS_FILE, SAFETENSORS_INDEX), (TORCH_FILE, TORCH_INDEX)):
        if (directory / single).is_file():
            return [directory / single]
        if (directory / index).is_file():
            data = read_json(directory / index, "weights index")
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise SourceError(f"{directory / index} has no weight_map")
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not isinstance(shard, str) or Path(shard).name != shard:
                    raise SourceError(f"{directory / index} names an invalid shard {shard!r}")
                if not (directory / shard).is_file():
                    raise SourceError(f"weights shard not found: {directory / shard} "
                                      f"(named by {index})")
            return [directory / shard for shard in shards]
    others = [name for name in ("tf_model.h5", "flax_model.msgpack")
              if (directory / name).is_file()]
    hint = f" (found only {', '.join(others)}: convert to safetensors)" if others else ""
    raise SourceError(f"no weights found in {directory}: expected {SAFETENSORS_FILE} or "
                      f"{TORCH_FILE}{hint}")


def read_weights(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of the weight files; safetensors, or torch.load(weights_only=True)."""
    state: dict[str, torch.Tensor] = {}
    for path in paths:
        if path.suffix == ".safetensors":
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            try:
                part = load_file(str(path))
            except (SafetensorError, OSError, ValueError) as exc:
                raise SourceError(f"cannot read weights file {path}: {exc}") from exc
        else:
            try:
                part = torch.load(path, map_location="cpu", weights_only=True)
            except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError,
                    AttributeError, TypeError) as exc:
                raise SourceError(f"cannot read weights file {path} (weights_only): "
                                  f"{str(exc).splitlines()[0] if str(exc) else exc!r}") from exc
            if not isinstance(part, dict) or not all(
                    isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in part.items()):
                raise SourceError(f"{path} does not hold a state dict of named tensors")
        state.update(part)
    return state


def load_weights(model: Seq2SeqTransformer, mapped: dict[str, torch.Tensor], where: str) -> None:
    expected = model.state_dict()
    for name, tensor in mapped.items():
        if name not in expected:  # a key map bug, not a checkpoint problem
            raise SourceError(f"{where}: internal key map names unknown parameter {name}")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise SourceError(f"{where}: tensor for {name} has shape {tuple(tensor.shape)}, "
                              f"config.json needs {tuple(expected[name].shape)}")
    result = model.load_state_dict(mapped, strict=False)
    aliases = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    left = [k for k in result.missing_keys if k not in aliases and not k.endswith("tokens.weight")]
    if left or result.unexpected_keys:
        raise SourceError(f"{where}: weights left unset: {left[:5]}")


# -- mapping a state dict: what every importer checks the same way ---------------------------

# the stacks' copies of the token table, as transformers stores tied embeddings
EMBEDDING_ALIASES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def shared_table(state: dict[str, torch.Tensor], where: str, tied_head: bool = False,
                 shown_name: str = "model.shared.weight") -> torch.Tensor:
    """The one token table: `shared.weight`, or what the stacks hold (which must equal it);
    with tied_head, a stored lm_head.weight must equal it too. shown_name: the table's name
    in the checkpoint, for the error when there is none."""
    tables = {name: state[name] for name in ("shared.weight", *EMBEDDING_ALIASES)
              if name in state}
    if not tables:
        raise SourceError(f"{where}: no token embedding table ({shown_name})")
    reference_name = "shared.weight" if "shared.weight" in tables else next(iter(tables))
    reference = tables[reference_name]
    for name, table in tables.items():
        if name != reference_name and not same_tensor(table, reference):
            raise SourceError(f"{where}: {name} differs from the shared embedding "
                              f"{reference_name}; tfserve's model has one token table")
    head = state.get("lm_head.weight")
    if tied_head and head is not None and not same_tensor(head, reference):
        raise SourceError(f"{where}: tie_word_embeddings is true but lm_head.weight differs "
                          "from the shared embedding")
    return reference


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def _listed(names: list[str]) -> str:
    return f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"


def refuse_unexpected(names: list[str], where: str) -> None:
    """SourceError naming the checkpoint's tensors (sorted) that have no place in the model."""
    if names:
        raise SourceError(f"{where}: tensor(s) with no place in tfserve's model: "
                          f"{_listed(sorted(names))}")


def refuse_missing(state: dict[str, torch.Tensor], wanted: list[str], where: str,
                   asks: str) -> None:
    """SourceError naming the wanted tensors the checkpoint lacks; asks: what config.json
    asks for (the layer counts), said with them."""
    missing = sorted(k for k in wanted if k not in state)
    if missing:
        raise SourceError(f"{where}: missing tensor(s) {_listed(missing)} (config.json asks "
                          f"for {asks})")


def float_tensor(state: dict[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    """state[name] as float32; SourceError when it is not a floating-point tensor. A stored
    final_logits_bias [1,V] becomes [V]."""
    tensor = state[name]
    if name == "final_logits_bias" and tensor.dim() == 2 and tensor.shape[0] == 1:
        tensor = tensor[0]  # [1,V] -> [V]
    if not tensor.is_floating_point():
        raise SourceError(f"{where}: tensor {name} has dtype {tensor.dtype}, not float")
    return tensor.float()


def decoder_layers(value: int, where: Path) -> int:
    """config.json's decoder_layers for a family that decodes: positive (ModelConfig takes 0
    for encoder-only models, which only T5 encoders are)."""
    if value < 1:
        raise SourceError(f"{where}: decoder_layers must be a positive integer, got {value}")
    return value
