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
