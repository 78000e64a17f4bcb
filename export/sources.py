"""Checkpoint sources for the export: native tfserve checkpoints and foreign ones via importers.

A `Source` is what the export template needs: the eager model, where its tokenizer files
are, which files to hash for provenance, and sample sentences for the greedy parity check.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tfserve.model import CONFIG_FILE, WEIGHTS_FILE, Seq2SeqTransformer, load_checkpoint
from tfserve.text.tokenizer import Tokenizer, TokenizerError, TokenizerSpec

TOKENIZER_FILE = "tokenizer.json"
SAMPLES_FILE = "samples.txt"


class SourceError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file."""


@dataclass
class Source:
    model: Seq2SeqTransformer
    directory: Path  # where the tokenizer files are
    tokenizer_spec: TokenizerSpec
    weight_files: list[Path]
    kind: str  # "native" or an importer name such as "hf-marian"
    sample_texts: list[str] = field(default_factory=list)
    # the checkpoint's generation settings (tfserve.artifacts.generation_defaults), HF field names
    generation: dict[str, Any] = field(default_factory=dict)
    # tokenizer files the importer built (name -> text) for a checkpoint that ships them in
    # another form, written into the artifacts in place of copies; how they were built
    built_files: dict[str, str] = field(default_factory=dict)
    built_note: str = ""

    @property
    def tokenizer_files(self) -> list[str]:
        return self.tokenizer_spec.files()


def read_tokenizer_spec(directory: Path) -> TokenizerSpec:
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        raise SourceError(f"tokenizer spec not found: {path}")
    try:
        return TokenizerSpec.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, TypeError) as exc:
        raise SourceError(f"cannot read {path}: {exc}") from exc


def load_native(directory: Path) -> Source:
    model = load_checkpoint(directory)
    spec = read_tokenizer_spec(directory)
    try:
        tokenizer = Tokenizer(directory, spec)
    except TokenizerError as exc:
        raise SourceError(str(exc)) from exc
    if tokenizer.vocab_size > model.config.vocab_size:
        raise SourceError(f"{directory}: tokenizer vocabulary ({tokenizer.vocab_size}) is "
                          f"larger than the model's vocab_size ({model.config.vocab_size})")
    samples_path = directory / SAMPLES_FILE
    samples = samples_path.read_text(encoding="utf-8").splitlines() if samples_path.is_file() \
        else []
    return Source(model, directory, spec, [directory / CONFIG_FILE, directory / WEIGHTS_FILE],
                  "native", [s for s in samples if s.strip()])


def load_source(checkpoint: Path | None = None, hf_dir: Path | None = None) -> Source:
    """The bundled demo when neither is given."""
    if hf_dir is not None:
        from export.importers import import_hf

        return import_hf(hf_dir)
    if checkpoint is None:
        from tfserve.demo import CHECKPOINT_DIR

        checkpoint = CHECKPOINT_DIR
    return load_native(Path(checkpoint))
