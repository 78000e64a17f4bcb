"""What the server tells clients about its model and limits: the `tfserve.v1.ModelInfo`
message itself (with its `Limits`, `ParitySummary`, the model's language codes and its
`GenerationDefaults`), which the gRPC adapter sends as it is and the HTTP one as its JSON
mapping.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from google.protobuf.message import Message

from tfserve.artifacts.generation_defaults import GenerationDefaults
from tfserve.artifacts.manifest import Manifest
from tfserve.generation import DecodingOptions
from tfserve.proto import load as load_stubs
from tfserve.serving.requests import server_defaults
from tfserve.serving.served_model import ServedModel
from tfserve.serving.settings import ServerConfig
from tfserve.text.tokenizer import Tokenizer
from tfserve.text.translation_inputs import model_languages
from tfserve.version import __version__

pb2 = load_stubs()[0]
# the messages, by the names the serving package exports
ModelInfo, Limits, ParitySummary = pb2.ModelInfo, pb2.Limits, pb2.ParitySummary


def model_info(runtime: ServedModel, config: ServerConfig, max_new_tokens_limit: int,
               name: str = "", version: str = "") -> Message:
    """The ModelInfo message of `runtime` served with `config` (max_new_tokens_limit: the
    scheduler's) as the model `name` of the repository, at `version`."""
    return describe_model(runtime.manifest, runtime.tokenizer, runtime.describe(), config,
                          max_new_tokens_limit, name, version)


def unloaded_model_info(directory: Path, config: ServerConfig, name: str,
                        version: str) -> Message:
    """The ModelInfo of the artifacts in `directory`, read from model.json and the tokenizer
    without loading the graphs: `device` is the one it would load on, `providers` empty (it
    has no session). ManifestError or TokenizerError when the files are bad."""
    manifest = Manifest.load(directory)
    tokenizer = Tokenizer(directory, manifest.tokenizer)
    # the scheduler's limit once loaded: the start token takes one target position
    limit = manifest.config.max_target_positions - 1
    return describe_model(manifest, tokenizer, {"device": config.device, "providers": []},
                          config, limit, name, version)


def describe_model(manifest: Manifest, tokenizer: Tokenizer, describe: dict[str, Any],
                   config: ServerConfig, max_new_tokens_limit: int, name: str,
                   version: str) -> Message:
    """ModelInfo from a model's manifest, tokenizer and runtime description (device,
    providers). An encoder-only model has no decoding limits or defaults: they stay 0 and
    empty."""
    model = manifest.config
    parity = dict(manifest.parity or {})
    generates = not model.encoder_only
    recorded = manifest.generation_defaults if generates else GenerationDefaults()
    applied = server_defaults(recorded, config.default_max_new_tokens)
    defaults = applied.decoding_fields(0, max_new_tokens_limit, tokenizer.eos_id) \
        if generates else {}
    default_max_new_tokens = (defaults.get("max_new_tokens") or DecodingOptions().validate(
        max_new_tokens_limit).max_new_tokens) if generates else 0
    return ModelInfo(
        model_name=model.name,
        source_language=default_source_language(tokenizer, model.source_language),
        target_language=model.target_language,
        max_source_tokens=model.max_source_positions,
        max_target_tokens=model.max_target_positions,
        vocab_size=model.vocab_size,
        d_model=model.d_model,
        encoder_layers=model.encoder_layers,
        decoder_layers=model.decoder_layers,
        num_heads=model.num_heads,
        positions=model.positions,
        dtype=manifest.dtype,
        quantization=manifest.quantization or "",
        limits=Limits(
            max_texts_per_request=config.max_texts_per_request,
            max_batch_size=config.max_batch_size,
            max_batch_tokens=config.max_batch_tokens,
            max_queue=config.max_queue,
            max_message_bytes=config.max_message_bytes,
            default_max_new_tokens=default_max_new_tokens,
            max_beams=DecodingOptions.MAX_BEAMS if generates else 0,
            max_document_characters=config.max_document_characters,
            max_document_sentences=config.max_document_sentences,
        ),
        device=describe.get("device", config.device),
        providers=describe.get("providers", []),
        tfserve_version=__version__,
        parity=ParitySummary(
            passed=bool(parity.get("passed", False)),
            max_abs_logits_diff=float(parity.get("max_abs_diff", {}).get("max_logits", 0.0)),
            greedy_agreement=float(parity.get("greedy", {}).get("agreement", 0.0)),
            precision=str(parity.get("precision", "")),
            device=str(parity.get("device", "")),
            report_json=json.dumps(parity, sort_keys=True),
        ),
        model=name,
        version=version,
        languages=model_languages(tokenizer),
        generation_defaults=generation_defaults(recorded, defaults, tokenizer),
        kv_cache=describe.get("kv_cache", "") if generates else "",
        packed_weights=bool(describe.get("pack_weights", False)),
    )


def default_source_language(tokenizer: Tokenizer, model_source_language: str) -> str:
    """The source language a request without one gets: a multilingual model's default
    (its checkpoint tokenizer's, "" when requests must name one), else the model's own."""
    conventions = tokenizer.languages
    return conventions.default_source if conventions is not None else model_source_language


def generation_defaults(recorded: GenerationDefaults, applied: dict[str, Any],
                        tokenizer: Tokenizer) -> Message:
    """The GenerationDefaults message: the DecodingOptions fields the model's defaults give
    a request without target prefix (`applied`), its forced first token, what model.json
    records and what of it is not applied."""
    message = pb2.GenerationDefaults(
        recorded_json=json.dumps(recorded.to_dict(), sort_keys=True),
        unapplied=recorded.unapplied(pad_token_id=tokenizer.pad_id,
                                     eos_token_id=tokenizer.eos_id))
    for name, value in applied.items():
        if name == "early_stopping":  # true, false or transformers' "never"
            message.early_stopping = str(value).lower()
        elif name in message.DESCRIPTOR.fields_by_name:
            setattr(message, name, value)
    if recorded.forced_bos_token_id is not None:
        message.forced_bos_token_id = recorded.forced_bos_token_id
    return message
