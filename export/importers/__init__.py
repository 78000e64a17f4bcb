"""Importers for foreign checkpoints: a Hugging Face directory -> an export `Source`.

`import_hf(directory)` reads `config.json`, picks the importer registered for its
`model_type` (checked against `architectures` when the config lists them) and returns the
`export.sources.Source` that `python -m export --from-hf DIR` exports like a native checkpoint.

Every refusal is an `export.sources.SourceError` whose message names the file or the config
field; the CLI prints it as one line and exits with code 2.

Adding a family is one module with a function
`load(directory: Path, config: dict) -> Source` and one `Importer` entry in `IMPORTERS`.
Modules are imported only when their model type is asked for, so the registry itself is cheap.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from export.sources import Source, SourceError

HF_CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class Importer:
    """One supported checkpoint family."""

    model_type: str  # config.json "model_type"
    architectures: tuple[str, ...]  # config.json "architectures" this importer can hold
    module: str  # module holding `load(directory, config) -> Source`
    description: str

    def loader(self) -> Callable[[Path, dict[str, Any]], Source]:
        return importlib.import_module(self.module).load


IMPORTERS: dict[str, Importer] = {
    "marian": Importer(
        model_type="marian",
        architectures=("MarianMTModel",),
        module="export.importers.marian",
        description="MarianMT / opus-mt translation models",
    ),
    "t5": Importer(
        model_type="t5",
        architectures=("T5ForConditionalGeneration", "T5EncoderModel"),
        module="export.importers.t5",
        description="T5, Flan-T5, MADLAD-400; T5 encoders (Encode only)",
    ),
    "mt5": Importer(
        model_type="mt5",
        architectures=("MT5ForConditionalGeneration", "MT5EncoderModel"),
        module="export.importers.t5",
        description="mT5; mT5 encoders (Encode only)",
    ),
    "bart": Importer(
        model_type="bart",
        architectures=("BartForConditionalGeneration", "BartModel"),
        module="export.importers.bart",
        description="BART, distilbart",
    ),
    "mbart": Importer(
        model_type="mbart",
        architectures=("MBartForConditionalGeneration", "MBartModel"),
        module="export.importers.mbart",
        description="mBART-50, mBART-cc25",
    ),
    "m2m_100": Importer(
        model_type="m2m_100",
        architectures=("M2M100ForConditionalGeneration", "M2M100Model"),
        module="export.importers.m2m_100",
        description="M2M100, NLLB-200",
    ),
}


def supported_model_types() -> list[str]:
    return sorted(IMPORTERS)


def describe_supported() -> str:
    """'marian (MarianMTModel)' for every registered importer, for error messages."""
    return ", ".join(f"{key} ({', '.join(IMPORTERS[key].architectures)})"
                     for key in supported_model_types())


def read_hf_config(directory: Path) -> dict[str, Any]:
    """directory/config.json as a dict; SourceError naming the path when missing or bad."""
    if not directory.exists():
        raise SourceError(f"Hugging Face checkpoint directory not found: {directory}")
    if not directory.is_dir():
        raise SourceError(f"--from-hf {directory} is not a directory")
    path = directory / HF_CONFIG_FILE
    if not path.is_file():
        raise SourceError(f"Hugging Face config not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"cannot read {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise SourceError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise SourceError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def select_importer(config: dict[str, Any], config_path: Path) -> Importer:
    """The importer for this config: by model_type, else by architectures."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise SourceError(f"{config_path}: architectures must be a list of class names, "
                          f"got {architectures!r}")
    if model_type is None:
        for importer in IMPORTERS.values():
            if any(a in importer.architectures for a in architectures):
                return importer
        raise SourceError(f"{config_path} has no model_type (architectures {architectures}); "
                          f"supported model types: {describe_supported()}")
    importer = IMPORTERS.get(model_type) if isinstance(model_type, str) else None
    if importer is None:
        raise SourceError(f"unsupported model_type {model_type!r} in {config_path}; "
                          f"supported model types: {describe_supported()}")
    if architectures and not any(a in importer.architectures for a in architectures):
        raise SourceError(f"{config_path}: architectures {architectures} are not supported for "
                          f"model_type {model_type!r}; supported: "
                          f"{', '.join(importer.architectures)}")
    return importer


def import_hf(directory: str | Path) -> Source:
    """A local Hugging Face checkpoint directory -> the Source the export template needs."""
    directory = Path(directory)
    config = read_hf_config(directory)
    importer = select_importer(config, directory / HF_CONFIG_FILE)
    return importer.loader()(directory, config)


__all__ = ["IMPORTERS", "Importer", "import_hf", "read_hf_config", "select_importer",
           "supported_model_types"]
