"""Hugging Face MarianMT (opus-mt) checkpoints -> `Seq2SeqTransformer` + vocab-mode tokenizer.

A MarianMT directory holds config.json, model.safetensors (or pytorch_model.bin, or sharded
variants with an index), source.spm, target.spm, vocab.json and tokenizer_config.json.

Model: MarianMTModel is the paper's post-norm Transformer with Marian's sinusoidal positions
([sin | cos] halves, not stored: derived from the config), an embedding scale of sqrt(d_model)
when `scale_embedding`, one embedding table shared by encoder and decoder, an output
projection tied to it (an untied lm_head becomes tfserve's own untied lm_head) and a final
logits bias [1, V] that is not a parameter in transformers. `model_config` maps config.json onto
`tfserve.artifacts.model_config.ModelConfig` and refuses, naming the field, what tfserve's model
cannot hold;
`marian_key_map` is the explicit tensor-name map onto our module names, and every tensor is
shape-checked before it is loaded.

Tokenizer: MarianTokenizer splits the source text with source.spm, maps the pieces through
vocab.json (pieces missing from it become <unk>) and appends </s>; decoding joins the pieces
with target.spm and turns every word-boundary mark left (pieces target.spm does not know are
copied verbatim) into a space (transformers 5 joins with source.spm when the vocabulary is
shared: the same text,
tests/export/test_marian.py::test_decoding_random_ids_matches_marian_tokenizer).
That is the "sentencepiece" tokenizer kind in vocab mode
(`tfserve.text.tokenizers.sentencepiece`), so the artifacts carry the three files and a
`TokenizerSpec` naming them. (What MarianTokenizer does beyond that, a leading `>>xx<<`
language code and special-token strings inside the text, is listed in tests/export/test_marian.py.)

Only JSON, safetensors and `torch.load(weights_only=True)` are used: nothing is unpickled
beyond plain tensors, and transformers is not needed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from export.importers.hf_files import (  # noqa: F401  (the file helpers, importable here too)
    EMBEDDING_ALIASES,
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    TORCH_FILE,
    TORCH_INDEX,
    decoder_layers,
    float_tensor,
    load_weights,
    read_json,
    read_weights,
    refuse_missing,
    refuse_unexpected,
    same_tensor,
    shared_table,
    weight_files,
)
from export.sources import Source, SourceError
from tfserve.artifacts.generation_defaults import from_hf_files
from tfserve.artifacts.model_config import ConfigError, ModelConfig
from tfserve.model import Seq2SeqTransformer, sinusoidal_table
from tfserve.text.tokenizer import Tokenizer, TokenizerError, TokenizerSpec

KIND = "hf-marian"
CONFIG_FILE = "config.json"
SOURCE_SPM = "source.spm"
TARGET_SPM = "target.spm"
VOCAB_FILE = "vocab.json"
TARGET_VOCAB_FILE = "target_vocab.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# transformers' MarianConfig defaults, used for fields a config.json leaves out (so the
# imported model is the one transformers would build from the same file)
MARIAN_DEFAULTS: dict[str, Any] = {
    "vocab_size": 58101,
    "decoder_vocab_size": None,
    "max_position_embeddings": 1024,
    "encoder_layers": 12,
    "encoder_ffn_dim": 4096,
    "encoder_attention_heads": 16,
    "decoder_layers": 12,
    "decoder_ffn_dim": 4096,
    "decoder_attention_heads": 16,
    "activation_function": "gelu",
    "d_model": 1024,
    "decoder_start_token_id": 58100,
    "scale_embedding": False,
    "pad_token_id": 58100,
    "eos_token_id": 0,
    "forced_eos_token_id": 0,
    "share_encoder_decoder_embeddings": True,
    "tie_word_embeddings": True,
}

# HF activation names -> ModelConfig.activation (ACT2FN: "gelu" is the exact erf GELU)
ACTIVATIONS = {"swish": "silu", "silu": "silu", "relu": "relu", "gelu": "gelu"}

# legacy BART-style fields that would change the architecture: (field, value that is refused,
# why). transformers' MarianMTModel ignores them, so a config setting them describes a model
# that neither transformers nor tfserve runs as intended.
REFUSED_FLAGS = (
    ("normalize_before", True, "pre-norm layers (Marian is post-norm)"),
    ("add_final_layer_norm", True, "a final LayerNorm after each stack"),
    ("layernorm_embedding", True, "a LayerNorm on the embeddings"),
    ("normalize_embedding", True, "a LayerNorm on the embeddings"),
    ("add_bias_logits", True, "an extra logits bias"),
    ("static_position_embeddings", False, "learned position embeddings"),
)

LANGUAGE_CODE = re.compile(r"^>>.+<<$")


# -- config ---------------------------------------------------------------------------------


def _field(config: dict[str, Any], name: str) -> Any:
    return config[name] if name in config else MARIAN_DEFAULTS.get(name)


def _int_field(config: dict[str, Any], name: str, where: Path) -> int:
    value = _field(config, name)
    if isinstance(value, list) and len(value) == 1:  # eos_token_id may be a one-element list
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int):
        raise SourceError(f"{where}: {name} must be an integer, got {value!r}")
    return value


def _bool_field(config: dict[str, Any], name: str, where: Path) -> bool:
    value = _field(config, name)
    if not isinstance(value, bool):
        raise SourceError(f"{where}: {name} must be true or false, got {value!r}")
    return value


def _same(config: dict[str, Any], first: str, second: str, where: Path, what: str) -> int:
    a, b = _int_field(config, first, where), _int_field(config, second, where)
    if a != b:
        raise SourceError(f"{where}: {first} ({a}) != {second} ({b}): tfserve's model has one "
                          f"{what} for encoder and decoder")
    return a


def _languages(directory: Path, tokenizer_config: dict[str, Any]) -> tuple[str, str]:
    source = tokenizer_config.get("source_lang")
    target = tokenizer_config.get("target_lang")
    if isinstance(source, str) and isinstance(target, str) and source and target:
        return source, target
    # opus-mt-en-de, opus-mt-tc-big-en-fr: the last two parts of the directory name
    match = re.search(r"opus-mt-(?:.+-)?([A-Za-z_]{2,})-([A-Za-z_]{2,})$",
                      directory.resolve().name)
    return (match.group(1), match.group(2)) if match else ("", "")


def model_config(config: dict[str, Any], directory: Path, special: dict[str, int],
                 tokenizer_config: dict[str, Any] | None = None,
                 generation: dict[str, Any] | None = None) -> ModelConfig:
    """config.json (a dict) -> ModelConfig, or SourceError naming the field tfserve can't hold.

    `special` holds the token ids read from vocab.json (at least "unk"); `generation` the
    checkpoint's generation defaults, kept in `extra["hf_generation"]` for the record.
    """
    where = directory / CONFIG_FILE
    tokenizer_config = tokenizer_config or {}
    for name, refused, meaning in REFUSED_FLAGS:
        if name in config and config[name] == refused:
            raise SourceError(f"{where}: {name}={json.dumps(refused)} ({meaning}) is not supported "
                              "for Marian checkpoints")
    activation = _field(config, "activation_function")
    if activation not in ACTIVATIONS:
        raise SourceError(f"{where}: activation_function {activation!r} is not supported; "
                          f"supported: {', '.join(sorted(ACTIVATIONS))}")
    vocab_size = _int_field(config, "vocab_size", where)
    decoder_vocab = config.get("decoder_vocab_size")
    if decoder_vocab is not None and decoder_vocab != vocab_size:
        raise SourceError(f"{where}: decoder_vocab_size ({decoder_vocab}) != vocab_size "
                          f"({vocab_size}): tfserve's model has one vocabulary for both sides")
    heads = _same(config, "encoder_attention_heads", "decoder_attention_heads", where,
                  "number of attention heads")
    ffn_dim = _same(config, "encoder_ffn_dim", "decoder_ffn_dim", where, "FFN width")
    positions = _int_field(config, "max_position_embeddings", where)
    pad = _int_field(config, "pad_token_id", where)
    eos = _int_field(config, "eos_token_id", where)
    # Marian starts decoding with the pad token; transformers falls back to it when unset
    start = pad if _field(config, "decoder_start_token_id") is None \
        else _int_field(config, "decoder_start_token_id", where)
    scale = _bool_field(config, "scale_embedding", where)
    tie = _bool_field(config, "tie_word_embeddings", where)
    source_language, target_language = _languages(directory, tokenizer_config)
    extra: dict[str, Any] = {"importer": KIND}
    if generation:
        extra["hf_generation"] = generation
    try:
        return ModelConfig(
            vocab_size=vocab_size,
            d_model=_int_field(config, "d_model", where),
            num_heads=heads,
            encoder_layers=_int_field(config, "encoder_layers", where),
            decoder_layers=decoder_layers(_int_field(config, "decoder_layers", where), where),
            ffn_dim=ffn_dim,
            activation=ACTIVATIONS[activation],
            norm="post",
            positions="sinusoidal",
            sinusoidal_layout="half",
            max_source_positions=positions,
            max_target_positions=positions,
            scale_embedding=scale,
            tie_word_embeddings=tie,
            final_logits_bias=True,
            layer_norm_eps=1e-5,
            dropout=0.0,
            attention_bias=True,
            pad_token_id=pad,
            eos_token_id=eos,
            unk_token_id=special["unk"],
            decoder_start_token_id=start,
            name=directory.resolve().name or "marian",
            source_language=source_language,
            target_language=target_language,
            extra=extra,
        )
    except ConfigError as exc:
        raise SourceError(f"{where}: {exc}") from exc


def generation_defaults(directory: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The search settings the checkpoint asks for (config.json, then generation_config.json).

    opus-mt checkpoints ban the pad token (bad_words_ids [[pad]]; tfserve.generation always
    does), force eos as the last token at max_length (forced_eos_token_id: DecodingOptions'
    forced_eos) and ask for num_beams 4..6. They are recorded in the manifest so that every
    front end defaults to them (tfserve.artifacts.generation_defaults). The fields read are
    hf_fields(): the decoding options tfserve.option_table marks `checkpoint`, and the fields
    with rules of their own.
    """
    data: dict[str, Any] = {}
    path = directory / GENERATION_CONFIG_FILE
    if path.is_file():
        data = read_json(path, "generation config")
        if not isinstance(data, dict):
            raise SourceError(f"{path} must hold a JSON object")
    return from_hf_files(config, data)


# -- tokenizer ------------------------------------------------------------------------------


def _token_string(value: Any, default: str) -> str:
    """A special token in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else default


def read_tokenizer(directory: Path) -> tuple[dict[str, int], dict[str, Any], dict[str, int]]:
    """(vocab.json, tokenizer_config.json or {}, special ids {"unk","eos","pad"} from the vocab)."""
    for name in (SOURCE_SPM, TARGET_SPM):
        if not (directory / name).is_file():
            raise SourceError(f"Marian tokenizer file not found: {directory / name}")
    tokenizer_config: dict[str, Any] = {}
    if (directory / TOKENIZER_CONFIG_FILE).is_file():
        tokenizer_config = read_json(directory / TOKENIZER_CONFIG_FILE, "tokenizer config")
        if not isinstance(tokenizer_config, dict):
            raise SourceError(f"{directory / TOKENIZER_CONFIG_FILE} must hold a JSON object")
    if tokenizer_config.get("separate_vocabs") or (directory / TARGET_VOCAB_FILE).is_file():
        raise SourceError(f"{directory}: separate source/target vocabularies (separate_vocabs, "
                          f"{TARGET_VOCAB_FILE}) are not supported: tfserve's model has one "
                          "shared vocabulary")
    vocab_path = directory / VOCAB_FILE
    vocab = read_json(vocab_path, "Marian vocabulary")
    if (not isinstance(vocab, dict) or not vocab
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                       for v in vocab.values())):
        raise SourceError(f"{vocab_path} must map pieces to integer ids >= 0")
    special = {}
    for key, default in (("unk", "<unk>"), ("eos", "</s>"), ("pad", "<pad>")):
        token = _token_string(tokenizer_config.get(f"{key}_token"), default)
        if token not in vocab:
            raise SourceError(f"{vocab_path} has no {key} token {token!r}")
        special[key] = vocab[token]
    return vocab, tokenizer_config, special


def tokenizer_spec(cfg: ModelConfig) -> TokenizerSpec:
    return TokenizerSpec(
        source=SOURCE_SPM,
        target=TARGET_SPM,
        vocab=VOCAB_FILE,
        pad_token_id=cfg.pad_token_id,
        eos_token_id=cfg.eos_token_id,
        unk_token_id=cfg.unk_token_id,
        decoder_start_token_id=cfg.decoder_start_token_id,
    )


# -- weights --------------------------------------------------------------------------------


def marian_key_map(encoder_layers: int, decoder_layers: int, tied: bool = True) -> dict[str, str]:
    """HF tensor name (without the leading "model.") -> our module's parameter name."""
    key_map = {"shared.weight": "shared.weight", "final_logits_bias": "final_logits_bias"}
    if not tied:
        key_map["lm_head.weight"] = "lm_head.weight"
    common = {
        "self_attn": "self_attn",
        "self_attn_layer_norm": "self_attn_res.norm",
        "fc1": "ffn.fc1",
        "fc2": "ffn.fc2",
        "final_layer_norm": "ffn_res.norm",
    }
    cross = {"encoder_attn": "cross_attn", "encoder_attn_layer_norm": "cross_attn_res.norm"}
    for side, count, ours, blocks in (("encoder", encoder_layers, "encoder_layers", common),
                                      ("decoder", decoder_layers, "decoder_layers",
                                       {**common, **cross})):
        for layer in range(count):
            for hf_block, our_block in blocks.items():
                projections = ("q_proj.", "k_proj.", "v_proj.", "out_proj.") \
                    if hf_block in ("self_attn", "encoder_attn") else ("",)
                for projection in projections:
                    for param in ("weight", "bias"):
                        hf_name = f"{side}.layers.{layer}.{hf_block}.{projection}{param}"
                        key_map[hf_name] = f"{ours}.{layer}.{our_block}.{projection}{param}"
    return key_map


POSITION_KEYS = ("encoder.embed_positions.weight", "decoder.embed_positions.weight")


def _strip(key: str) -> str:
    return key[len("model."):] if key.startswith("model.") else key


def map_weights(state: dict[str, torch.Tensor], cfg: ModelConfig, hf_config: dict[str, Any],
                where: str) -> dict[str, torch.Tensor]:
    """HF state dict -> our parameter names, float32, with every name and shape checked.

    Tied aliases (encoder/decoder embed_tokens, a tied lm_head) must equal the shared table;
    stored sinusoidal position tables must equal the ones tfserve derives; anything else
    that has no place in tfserve's model is refused by name.
    """
    state = {_strip(k): v for k, v in state.items()}
    shared_flag = hf_config.get("share_encoder_decoder_embeddings",
                                MARIAN_DEFAULTS["share_encoder_decoder_embeddings"])
    # the one token table: HF's `shared`, or what the stacks hold when it is not stored
    tables = {name: state[name] for name in ("shared.weight", *EMBEDDING_ALIASES) if name in state}
    if not shared_flag and len(tables) > 1:
        first, *rest = tables.items()
        for name, table in rest:
            if not same_tensor(table, first[1]):
                raise SourceError(
                    f"{where}: share_encoder_decoder_embeddings is false and {name} differs from "
                    f"{first[0]}: tfserve's model has one embedding table shared by encoder, "
                    "decoder and output projection")
    state["shared.weight"] = shared_table(state, where, cfg.tie_word_embeddings)

    for key in POSITION_KEYS:
        if key in state:
            stored = state[key].float()
            if stored.dim() != 2 or stored.shape[1] != cfg.d_model:
                raise SourceError(f"{where}: {key} has shape {tuple(stored.shape)}, expected "
                                  f"[positions, {cfg.d_model}]")
            derived = sinusoidal_table(stored.shape[0], cfg.d_model, "half")
            if not torch.allclose(stored, derived, atol=1e-4, rtol=0):
                raise SourceError(f"{where}: {key} is not Marian's sinusoidal table "
                                  "(learned position embeddings are not supported)")

    key_map = marian_key_map(cfg.encoder_layers, cfg.decoder_layers, cfg.tie_word_embeddings)
    skipped = set(POSITION_KEYS) | set(EMBEDDING_ALIASES)
    if cfg.tie_word_embeddings:
        skipped.add("lm_head.weight")
    refuse_unexpected([k for k in state if k not in key_map and k not in skipped], where)
    if "final_logits_bias" not in state:  # transformers loads it as zeros when absent
        state["final_logits_bias"] = torch.zeros(1, cfg.vocab_size)
    refuse_missing(state, list(key_map), where,
                   f"{cfg.encoder_layers} encoder / {cfg.decoder_layers} decoder layers")
    return {our_name: float_tensor(state, hf_name, where)
            for hf_name, our_name in key_map.items()}


# -- the importer ---------------------------------------------------------------------------


def load(directory: Path, config: dict[str, Any]) -> Source:
    """export.importers entry point: a MarianMT directory -> Source."""
    directory = Path(directory)
    files = weight_files(directory)
    vocab, tokenizer_config, special = read_tokenizer(directory)
    cfg = model_config(config, directory, special, tokenizer_config,
                       generation_defaults(directory, config))
    where = str(directory / CONFIG_FILE)
    for key in ("eos", "pad"):
        config_id = getattr(cfg, f"{key}_token_id")
        if special[key] != config_id:
            raise SourceError(f"{where}: {key}_token_id is {config_id} but {VOCAB_FILE} maps the "
                              f"{key} token to {special[key]}")
    if max(vocab.values()) >= cfg.vocab_size:
        raise SourceError(f"{directory / VOCAB_FILE} has ids up to {max(vocab.values())}, "
                          f"outside the model's vocab_size {cfg.vocab_size}")
    codes = sorted(piece for piece in vocab if LANGUAGE_CODE.match(piece))
    if codes:
        cfg.extra["language_codes"] = codes
    weights_where = ", ".join(str(p) for p in files)
    mapped = map_weights(read_weights(files), cfg, config, weights_where)
    model = Seq2SeqTransformer(cfg)
    load_weights(model, mapped, weights_where)
    spec = tokenizer_spec(cfg)
    try:
        Tokenizer(directory, spec)
    except TokenizerError as exc:
        raise SourceError(str(exc)) from exc
    return Source(model.eval(), directory, spec, [directory / CONFIG_FILE, *files], KIND, [])
