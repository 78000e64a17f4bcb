"""The fairseq-lineage checkpoints BART, mBART and M2M100 / NLLB share one layout; each
family module (bart.py, mbart.py, m2m_100.py) describes only what differs (`Family`).

Model: transformers' Bart / MBart / M2M100ForConditionalGeneration are the encoder-decoder
of "Attention Is All You Need" with the options of tfserve's one model:

- BART, distilbart: post-norm; learned positions at offset 2; a LayerNorm on the
  embeddings (layernorm_embedding); a final logits bias;
- mBART-50, mBART-cc25: pre-norm with a final LayerNorm per stack; learned positions at
  offset 2; layernorm_embedding; a final logits bias;
- M2M100, NLLB-200: pre-norm with a final LayerNorm per stack; fairseq's sinusoidal
  positions, counted from pad + 1 over the non-pad tokens (a pad takes none).

The embedding scale is sqrt(d_model) when config.json says `scale_embedding` (mBART, M2M100
and NLLB checkpoints do; bart-large does not). One token table is shared by both stacks and
the output projection (an untied lm_head becomes tfserve's own). `model_config` maps
config.json onto ModelConfig and refuses, naming the field, what tfserve cannot hold
(different encoder / decoder widths, flags of old fairseq configs that contradict the
family, as transformers ignores them); `key_map` is the explicit tensor-name map and every
tensor is shape-checked before it is loaded.

Tokenizer and languages come from the family module (`Family.tokenizer`); the generation
settings from config.json and generation_config.json (tfserve.artifacts.generation_defaults). A
checkpoint that ships only its tokenizer's SentencePiece or BPE files (no tokenizer.json) has
its tokenizer.json built by transformers' AutoTokenizer from them, the conversion
`AutoTokenizer.from_pretrained(DIR)` itself runs, and that file goes into the artifacts.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from export.importers.hf_files import (
    EMBEDDING_ALIASES,
    checkpoint_name,
    decoder_layers,
    float_tensor,
    load_weights,
    read_json,
    read_weights,
    refuse_missing,
    refuse_unexpected,
    shared_table,
    weight_files,
)
from export.sources import Source, SourceError
from tfserve.artifacts.generation_defaults import GenerationDefaults, from_hf_files
from tfserve.artifacts.model_config import ConfigError, ModelConfig
from tfserve.model import Seq2SeqTransformer
from tfserve.text.tokenizer import Tokenizer, TokenizerError, TokenizerSpec

CONFIG_FILE = "config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_JSON = "tokenizer.json"
# the files the families' tokenizers are built from when no tokenizer.json is there:
# NLLB's and mBART-50's SentencePiece BPE model, mBART-cc25's older name for it, BART's BPE
SLOW_TOKENIZER_FILES = ("sentencepiece.bpe.model", "sentence.bpe.model", "vocab.json",
                        "merges.txt")

# transformers' BartConfig / MBartConfig / M2M100Config defaults shared by all three; each
# family overrides what differs (Family.defaults)
COMMON_DEFAULTS: dict[str, Any] = {
    "max_position_embeddings": 1024,
    "encoder_layers": 12,
    "encoder_ffn_dim": 4096,
    "encoder_attention_heads": 16,
    "decoder_layers": 12,
    "decoder_ffn_dim": 4096,
    "decoder_attention_heads": 16,
    "d_model": 1024,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "tie_word_embeddings": True,
}

# HF activation names (ACT2FN) -> ModelConfig.activation ("gelu" is the exact erf GELU)
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu"}

POSITION_KEYS = ("encoder.embed_positions.weight", "decoder.embed_positions.weight")
# what transformers itself ignores when it loads these checkpoints: fairseq's version
# counters and M2M100's stored sinusoidal tables (recomputed, as tfserve recomputes them)
IGNORED = re.compile(r"^(encoder|decoder)\.(version|embed_positions\.(weights|_float_tensor))$")


@dataclass(frozen=True)
class TokenizerInfo:
    """What a family's tokenizer reader returns."""

    spec: TokenizerSpec
    source_language: str = ""  # the checkpoint tokenizer's src_lang / tgt_lang, if any
    target_language: str = ""
    built: BuiltTokenizer | None = None  # tokenizer.json built from the slow files


@dataclass(frozen=True)
class BuiltTokenizer:
    """A tokenizer.json transformers built for a checkpoint that ships none."""

    text: str  # the tokenizer.json
    note: str  # how it was built, for the manifest's provenance


@dataclass(frozen=True)
class HfJson:
    """What hf_json_spec reads: the spec (special ids checked), the loaded
    `tokenizers.Tokenizer` and, when the checkpoint has no tokenizer.json, the built one."""

    spec: TokenizerSpec
    loaded: Any
    built: BuiltTokenizer | None


@dataclass(frozen=True)
class Family:
    """What one fairseq-lineage family is, beside the shared layout."""

    kind: str  # provenance source_format, "hf-bart" ...
    defaults: dict[str, Any]  # config.json defaults beyond COMMON_DEFAULTS
    pre_norm: bool  # pre-norm layers with a final LayerNorm per stack
    positions: str  # "learned" (offset 2) or "sinusoidal" (fairseq's, from pad + 1)
    embedding_norm: bool  # layernorm_embedding
    final_logits_bias: bool  # a final_logits_bias buffer (loaded as zeros when absent)
    # (directory, config.json, tokenizer_config.json) -> tokenizer spec and languages
    tokenizer: Callable[[Path, dict[str, Any], dict[str, Any]], TokenizerInfo]
    # old fairseq config flags that contradict the family: (field, refused value, meaning)
    refused: tuple[tuple[str, Any, str], ...] = field(default_factory=tuple)

    def value(self, config: dict[str, Any], name: str) -> Any:
        """config.json's value of `name`, or the family's default for it."""
        if name in config:
            return config[name]
        return self.defaults.get(name, COMMON_DEFAULTS.get(name))


# -- config ---------------------------------------------------------------------------------


def _int_field(family: Family, config: dict[str, Any], name: str, where: Path) -> int:
    value = family.value(config, name)
    if isinstance(value, list) and len(value) == 1:  # eos_token_id may be a one-element list
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int):
        raise SourceError(f"{where}: {name} must be an integer, got {value!r}")
    return value


def _same(family: Family, config: dict[str, Any], first: str, second: str, where: Path,
          what: str) -> int:
    a, b = (_int_field(family, config, first, where), _int_field(family, config, second, where))
    if a != b:
        raise SourceError(f"{where}: {first} ({a}) != {second} ({b}): tfserve's model has one "
                          f"{what} for encoder and decoder")
    return a


def decoder_start(family: Family, config: dict[str, Any], generation: dict[str, Any],
                  where: Path) -> int:
    """The decoder start token as transformers' generate picks it: generation_config's
    decoder_start_token_id, else config.json's, else bos."""
    start = generation.get("decoder_start_token_id")
    if start is None:
        start = family.value(config, "decoder_start_token_id")
    if start is None:
        start = family.value(config, "bos_token_id")
    if isinstance(start, bool) or not isinstance(start, int):
        raise SourceError(f"{where}: decoder_start_token_id must be an integer, got {start!r}")
    return start


def model_config(family: Family, config: dict[str, Any], directory: Path, unk_token_id: int,
                 generation: dict[str, Any], languages: TokenizerInfo) -> ModelConfig:
    """config.json (a dict) -> ModelConfig, or SourceError naming the field."""
    where = directory / CONFIG_FILE
    for name, refused, meaning in family.refused:
        if config.get(name) == refused:
            raise SourceError(f"{where}: {name}={json.dumps(refused)} ({meaning}) is not how "
                              f"transformers runs model_type {config.get('model_type')!r}, "
                              "which ignores the flag: the weights would not fit it")
    activation = family.value(config, "activation_function")
    if activation not in ACTIVATIONS:
        raise SourceError(f"{where}: activation_function {activation!r} is not supported; "
                          f"supported: {', '.join(sorted(ACTIVATIONS))}")
    if config.get("is_encoder_decoder") is False:
        raise SourceError(f"{where}: is_encoder_decoder is false: tfserve runs "
                          "encoder-decoder checkpoints")
    scale = family.value(config, "scale_embedding")
    tie = family.value(config, "tie_word_embeddings")
    for name, value in (("scale_embedding", scale), ("tie_word_embeddings", tie)):
        if not isinstance(value, bool):
            raise SourceError(f"{where}: {name} must be true or false, got {value!r}")
    pad = _int_field(family, config, "pad_token_id", where)
    positions = _int_field(family, config, "max_position_embeddings", where)
    sinusoidal = family.positions == "sinusoidal"
    extra: dict[str, Any] = {"importer": family.kind,
                             "hf_model_type": config.get("model_type", "")}
    try:
        return ModelConfig(
            vocab_size=_int_field(family, config, "vocab_size", where),
            d_model=_int_field(family, config, "d_model", where),
            num_heads=_same(family, config, "encoder_attention_heads",
                            "decoder_attention_heads", where, "number of attention heads"),
            encoder_layers=_int_field(family, config, "encoder_layers", where),
            decoder_layers=decoder_layers(_int_field(family, config, "decoder_layers", where),
                                          where),
            ffn_dim=_same(family, config, "encoder_ffn_dim", "decoder_ffn_dim", where,
                          "FFN width"),
            activation=ACTIVATIONS[activation],
            norm="pre" if family.pre_norm else "post",
            positions=family.positions,
            sinusoidal_layout="fairseq" if sinusoidal else "interleaved",
            # fairseq's sinusoidal positions start after the pad row; learned tables keep
            # two rows in front (fairseq's offset, kept by transformers)
            position_offset=pad + 1 if sinusoidal else 2,
            position_padding=sinusoidal,
            embedding_norm=family.embedding_norm,
            max_source_positions=positions,
            max_target_positions=positions,
            scale_embedding=scale,
            tie_word_embeddings=tie,
            final_logits_bias=family.final_logits_bias,
            layer_norm_eps=1e-5,
            dropout=0.0,
            attention_bias=True,
            pad_token_id=pad,
            eos_token_id=_int_field(family, config, "eos_token_id", where),
            unk_token_id=unk_token_id,
            decoder_start_token_id=decoder_start(family, config, generation, where),
            name=checkpoint_name(directory) or str(config.get("model_type", "model")),
            source_language=languages.source_language,
            target_language=languages.target_language,
            extra=extra,
        )
    except ConfigError as exc:
        raise SourceError(f"{where}: {exc}") from exc


def generation_settings(directory: Path, config: dict[str, Any]) -> dict[str, Any]:
    """config.json's generation fields overlaid by generation_config.json's, checked."""
    generation_config: dict[str, Any] = {}
    path = directory / GENERATION_CONFIG_FILE
    if path.is_file():
        generation_config = read_json(path, "generation config")
        if not isinstance(generation_config, dict):
            raise SourceError(f"{path} must hold a JSON object")
    settings = from_hf_files(config, generation_config)
    try:
        GenerationDefaults(settings)
    except ValueError as exc:
        raise SourceError(f"{directory}: {exc}") from exc
    return settings


# -- weights --------------------------------------------------------------------------------


def key_map(family: Family, cfg: ModelConfig) -> dict[str, str]:
    """HF tensor name (without the leading "model.") -> our parameter name."""
    mapped = {"shared.weight": "shared.weight"}
    if family.final_logits_bias:
        mapped["final_logits_bias"] = "final_logits_bias"
    if not cfg.tie_word_embeddings:
        mapped["lm_head.weight"] = "lm_head.weight"
    common = {"self_attn": "self_attn", "self_attn_layer_norm": "self_attn_res.norm",
              "fc1": "ffn.fc1", "fc2": "ffn.fc2", "final_layer_norm": "ffn_res.norm"}
    cross = {"encoder_attn": "cross_attn", "encoder_attn_layer_norm": "cross_attn_res.norm"}
    for side, count, ours, blocks in (("encoder", cfg.encoder_layers, "encoder_layers", common),
                                      ("decoder", cfg.decoder_layers, "decoder_layers",
                                       {**common, **cross})):
        embed = f"{side}_embed"
        stack_parts = []
        if family.positions == "learned":
            stack_parts.append((f"{side}.embed_positions", f"{embed}.position_embedding"))
        if family.embedding_norm:
            stack_parts.append((f"{side}.layernorm_embedding", f"{embed}.norm"))
        for hf, our in stack_parts:
            for param in (("weight",) if "positions" in hf else ("weight", "bias")):
                mapped[f"{hf}.{param}"] = f"{our}.{param}"
        if family.pre_norm:
            for param in ("weight", "bias"):
                mapped[f"{side}.layer_norm.{param}"] = f"{side}_norm.{param}"
        for layer in range(count):
            for hf_block, our_block in blocks.items():
                projections = ("q_proj.", "k_proj.", "v_proj.", "out_proj.") \
                    if hf_block in ("self_attn", "encoder_attn") else ("",)
                for projection in projections:
                    for param in ("weight", "bias"):
                        mapped[f"{side}.layers.{layer}.{hf_block}.{projection}{param}"] = \
                            f"{ours}.{layer}.{our_block}.{projection}{param}"
    return mapped


def _strip(key: str) -> str:
    return key[len("model."):] if key.startswith("model.") else key


def map_weights(family: Family, state: dict[str, torch.Tensor], cfg: ModelConfig,
                where: str) -> dict[str, torch.Tensor]:
    """HF state dict -> our parameter names, float32, with every name and shape checked."""
    state = {_strip(k): v for k, v in state.items()}
    state["shared.weight"] = shared_table(state, where, cfg.tie_word_embeddings)
    mapped_names = key_map(family, cfg)
    skipped = set(EMBEDDING_ALIASES)
    if cfg.tie_word_embeddings:
        skipped.add("lm_head.weight")
    refuse_unexpected([k for k in state if k not in mapped_names and k not in skipped
                       and not IGNORED.match(k)], where)
    if family.final_logits_bias and "final_logits_bias" not in state:
        state["final_logits_bias"] = torch.zeros(1, cfg.vocab_size)  # as transformers does
    refuse_missing(state, list(mapped_names), where,
                   f"{cfg.encoder_layers} encoder / {cfg.decoder_layers} decoder layers")
    return {our_name: float_tensor(state, hf_name, where)
            for hf_name, our_name in mapped_names.items()}


# -- tokenizer helpers for the family modules ---------------------------------------------------


def read_tokenizer_config(directory: Path) -> dict[str, Any]:
    path = directory / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return {}
    data = read_json(path, "tokenizer config")
    if not isinstance(data, dict):
        raise SourceError(f"{path} must hold a JSON object")
    return data


def tokenizer_class(tokenizer_config: dict[str, Any]) -> str:
    """tokenizer_config.json's tokenizer_class without "Fast" ("" when it names none)."""
    value = tokenizer_config.get("tokenizer_class")
    if not isinstance(value, str):
        return ""
    return value[:-4] if value.endswith("Fast") else value


def token_string(value: Any, default: str) -> str:
    """A special token in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else default


def check_special_ids(directory: Path, config: dict[str, Any], family: Family,
                      source: str, token_to_id: Callable[[str], int | None],
                      tokenizer_config: dict[str, Any]) -> dict[str, int]:
    """The tokenizer's unk, pad and eos ids; pad and eos must be config.json's."""
    where = directory / CONFIG_FILE
    ids = {}
    for key, default in (("unk", "<unk>"), ("eos", "</s>"), ("pad", "<pad>")):
        token = token_string(tokenizer_config.get(f"{key}_token"), default)
        token_id = token_to_id(token)
        if token_id is None:
            raise SourceError(f"{directory / source} has no {key} token {token!r}")
        ids[key] = token_id
    for key in ("pad", "eos"):
        value = _int_field(family, config, f"{key}_token_id", where)
        if ids[key] != value:
            raise SourceError(f"{where}: {key}_token_id is {value} but {source} maps the "
                              f"{key} token to {ids[key]}")
    return ids


def hf_json_spec(directory: Path, config: dict[str, Any], family: Family,
                 tokenizer_config: dict[str, Any], what: str) -> HfJson:
    """The checkpoint's tokenizer.json (or one built from its slow files) as a spec with
    the special ids checked, and the loaded `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer as HFTokenizer

    from tfserve.text.tokenizers.hf_json import load_hf_json

    built = None
    try:
        if (directory / TOKENIZER_JSON).is_file():
            loaded = load_hf_json(directory / TOKENIZER_JSON)
        else:
            built = build_tokenizer_json(directory, what, family.value(config, "vocab_size"))
            loaded = HFTokenizer.from_str(built.text)
    except TokenizerError as exc:
        raise SourceError(str(exc)) from exc
    ids = check_special_ids(directory, config, family, TOKENIZER_JSON, loaded.token_to_id,
                            tokenizer_config)
    spec = TokenizerSpec(kind="hf-json", source=TOKENIZER_JSON, pad_token_id=ids["pad"],
                         eos_token_id=ids["eos"], unk_token_id=ids["unk"])
    return HfJson(spec, loaded, built)


def build_tokenizer_json(directory: Path, what: str, vocab_size: Any) -> BuiltTokenizer:
    """tokenizer.json for a checkpoint that ships only its slow tokenizer's files, built as
    `transformers.AutoTokenizer.from_pretrained(directory)` builds it (the reference the
    ids are checked against), offline. mBART-cc25's older file name, sentence.bpe.model, is
    shown to transformers under the name its tokenizers read; a tokenizer built without its
    vocabulary (transformers builds one from the special tokens alone when it finds no
    file it reads) is refused against the model's vocab_size."""
    present = [name for name in SLOW_TOKENIZER_FILES if (directory / name).is_file()]
    if not present:
        raise SourceError(f"{what} tokenizer not found in {directory}: expected "
                          f"{TOKENIZER_JSON}, or {' / '.join(SLOW_TOKENIZER_FILES[:2])} "
                          "(or vocab.json + merges.txt) to build it from")
    try:
        import transformers
    except ImportError as exc:
        raise SourceError(f"{directory} has no {TOKENIZER_JSON}: building it from "
                          f"{', '.join(present)} needs transformers (pip install "
                          "transformers), or save the tokenizer with transformers' "
                          "save_pretrained, which writes tokenizer.json") from exc
    with tempfile.TemporaryDirectory(prefix="tfserve-slow-tokenizer-") as temporary:
        view = Path(temporary)
        try:
            tokenizer_view(directory, view)
        except (OSError, RuntimeError) as exc:  # RuntimeError: a symbolic link loop
            raise SourceError(f"{directory} has no {TOKENIZER_JSON} and its tokenizer files "
                              f"cannot be read to build one: {exc}") from exc
        try:
            loaded = transformers.AutoTokenizer.from_pretrained(str(view),
                                                                local_files_only=True)
        except Exception as exc:  # transformers raises what its converters raise
            first = str(exc).splitlines()[0] if str(exc) else repr(exc)
            raise SourceError(f"{directory} has no {TOKENIZER_JSON} and transformers could "
                              f"not build one from {', '.join(present)}: {first}") from exc
    backend = getattr(loaded, "backend_tokenizer", None)
    if backend is None:
        raise SourceError(f"{directory} has no {TOKENIZER_JSON} and transformers' "
                          f"{type(loaded).__name__} has no tokenizers backend to write one")
    size = backend.get_vocab_size(with_added_tokens=True)
    if isinstance(vocab_size, int) and size * 2 < vocab_size:
        raise SourceError(f"{directory} has no {TOKENIZER_JSON} and transformers' "
                          f"{type(loaded).__name__} built one of {size} ids from "
                          f"{', '.join(present)}, against the model's vocab_size "
                          f"{vocab_size}: it did not read the vocabulary (save the tokenizer "
                          "with transformers' save_pretrained, which writes tokenizer.json)")
    return BuiltTokenizer(backend.to_str(), f"built by transformers {transformers.__version__}"
                          f" ({type(loaded).__name__}) from {', '.join(present)}")


# what transformers' AutoTokenizer reads from a checkpoint directory besides the slow files
TOKENIZER_SETTINGS = ("config.json", TOKENIZER_CONFIG_FILE, "special_tokens_map.json",
                      "added_tokens.json")


def tokenizer_view(directory: Path, view: Path) -> None:
    """Links in `view` to the files AutoTokenizer reads from `directory`, the SentencePiece
    model under the name the families' tokenizers read (mBART-cc25's checkpoints call it
    sentence.bpe.model)."""
    for name in (*TOKENIZER_SETTINGS, *SLOW_TOKENIZER_FILES):
        if (directory / name).is_file():
            (view / name).symlink_to((directory / name).absolute())
    read, older = SLOW_TOKENIZER_FILES[0], SLOW_TOKENIZER_FILES[1]
    if not (view / read).is_file() and (view / older).is_file():
        (view / read).unlink(missing_ok=True)
        (view / read).symlink_to((directory / older).absolute())


@contextmanager
def tokenizer_directory(directory: Path, built: BuiltTokenizer | None) -> Iterator[Path]:
    """Where the tokenizer's files are: the checkpoint's directory, or a temporary one
    holding the built tokenizer.json while the block runs."""
    if built is None:
        yield directory
        return
    with tempfile.TemporaryDirectory(prefix="tfserve-tokenizer-") as temporary:
        (Path(temporary) / TOKENIZER_JSON).write_text(built.text, encoding="utf-8")
        yield Path(temporary)


def special_added_tokens(loaded: Any) -> dict[str, int]:
    """A tokenizer.json's added tokens marked special, content -> id, in id order."""
    decoder = loaded.get_added_tokens_decoder()
    return {decoder[i].content: int(i) for i in sorted(decoder) if decoder[i].special}


def checkpoint_language(value: Any, codes: dict[str, int]) -> str:
    """A tokenizer_config.json src_lang / tgt_lang that is one of the codes, else ""."""
    return value if isinstance(value, str) and value in codes else ""


# -- the importer ---------------------------------------------------------------------------


def load(family: Family, directory: Path, config: dict[str, Any]) -> Source:
    """A checkpoint directory of `family` -> Source."""
    directory = Path(directory)
    files = weight_files(directory)
    tokenizer_config = read_tokenizer_config(directory)
    info = family.tokenizer(directory, config, tokenizer_config)
    generation = generation_settings(directory, config)
    cfg = model_config(family, config, directory, info.spec.unk_token_id, generation, info)
    spec = info.spec
    spec.decoder_start_token_id = cfg.decoder_start_token_id
    try:
        with tokenizer_directory(directory, info.built) as where:
            tokenizer = Tokenizer(where, spec)
    except TokenizerError as exc:
        raise SourceError(str(exc)) from exc
    if tokenizer.vocab_size > cfg.vocab_size:
        raise SourceError(f"{directory / spec.source} has {tokenizer.vocab_size} ids, more than "
                          f"the model's vocab_size {cfg.vocab_size} ({directory / CONFIG_FILE})")
    languages = tokenizer.languages
    if languages is not None:
        cfg.extra["language_codes"] = languages.names
        if languages.target_mode == "start":
            # mBART-cc25: the decoder start token is the one target language
            own = [c for c, i in languages.codes.items() if i == cfg.decoder_start_token_id]
            cfg.target_language = own[0] if own else ""
    weights_where = ", ".join(str(p) for p in files)
    model = Seq2SeqTransformer(cfg)
    load_weights(model, map_weights(family, read_weights(files), cfg, weights_where),
                 weights_where)
    built = info.built
    return Source(model.eval(), directory, spec, [directory / CONFIG_FILE, *files], family.kind,
                  [], generation,
                  built_files={TOKENIZER_JSON: built.text} if built is not None else {},
                  built_note=built.note if built is not None else "")
