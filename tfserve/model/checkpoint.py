"""Checkpoints: config.json + model.safetensors, saved and loaded with shape checks."""

from __future__ import annotations

from pathlib import Path

import torch

from tfserve.artifacts.model_config import ModelConfig
from tfserve.model.transformer import Seq2SeqTransformer


class CheckpointError(ValueError):
    """A missing, corrupt or mismatching checkpoint file; the message names the file."""


# -- positions ------------------------------------------------------------------------------


CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def _stored_state(model: Seq2SeqTransformer) -> dict[str, torch.Tensor]:
    """State dict without tied aliases (safetensors refuses shared storage)."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    # the embedding modules hold the shared table again under their own names
    for key in list(state):
        if key.endswith("tokens.weight"):
            state.pop(key)
    return {k: v.detach().contiguous() for k, v in state.items()}


def save_checkpoint(model: Seq2SeqTransformer, directory: str | Path) -> Path:
    """Write config.json + model.safetensors into directory (created if needed)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save(directory / CONFIG_FILE)
    save_file(_stored_state(model), str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


def load_state(model: Seq2SeqTransformer, path: str | Path) -> None:
    """Load safetensors weights into model, checking every name and shape first."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"weights file not found: {path}")
    try:
        stored = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read weights file {path}: {exc}") from exc
    expected = _stored_state(model)
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match the config: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}"
        )
    for name, tensor in expected.items():
        if stored[name].shape != tensor.shape:
            raise CheckpointError(
                f"{path}: tensor {name} has shape {tuple(stored[name].shape)}, "
                f"the config needs {tuple(tensor.shape)}"
            )
    # strict=False only because the tied aliases were left out of the file on purpose
    model.load_state_dict({k: stored[k].to(t.dtype) for k, t in expected.items()}, strict=False)


def load_checkpoint(directory: str | Path,
                    device: str | torch.device = "cpu") -> Seq2SeqTransformer:
    """Build the model from directory/config.json and load directory/model.safetensors."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {directory}")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"checkpoint config not found: {config_path}")
    try:
        cfg = ModelConfig.load(config_path)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc
    model = Seq2SeqTransformer(cfg)
    load_state(model, directory / WEIGHTS_FILE)
    return model.to(device).eval()
