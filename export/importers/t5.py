"""Hugging Face T5-family checkpoints (T5, mT5, Flan-T5, MADLAD-400) -> `Seq2SeqTransformer`.

A T5 directory holds config.json (`model_type` "t5" or "mt5"), model.safetensors (or
pytorch_model.bin, or shards with an index) and tokenizer.json and/or spiece.model with
tokenizer_config.json.

Model: T5 is the pre-norm Transformer with these options of tfserve's one model:
- positions "relative": no position embeddings; a learned bias per (distance bucket, head)
  stored in the first block of each stack (`relative_attention_bias`) and added to the
  self-attention scores of every block (`relative_attention_num_buckets`,
  `relative_attention_max_distance`);
- norm "pre" with norm_type "rmsnorm" (T5LayerNorm: no mean, no bias) and a final norm per
  stack; no bias in any projection;
- the FFN from `feed_forward_proj`: "relu" (T5 v1.0: wi, wo) or "gated-gelu" (T5 v1.1, mT5,
  Flan-T5, MADLAD: gelu_new(x wi_0) * (x wi_1), wo), or another "[gated-]act"; in float16
  exports wo stays float32 and so does the residual stream after it (transformers'
  `_keep_in_fp32_modules`; ModelConfig.extra "keep_in_fp32_modules");
- no 1/sqrt(d) scaling of the attention scores; head dim `d_kv` (num_heads * d_kv may differ
  from d_model);
- the output projection tied to the shared embedding and the decoder output scaled by
  d_model^-0.5 (v1.0), or an untied lm_head without scaling (v1.1, mT5).

Which of the last two a checkpoint is follows transformers 5: the decoder output is scaled
when config.json says `scale_decoder_outputs`, or, in configs written before it existed, when
`tie_word_embeddings` is not false (mT5: never); the lm_head is untied when the weights hold
an `lm_head.weight` that differs from the shared table.

An encoder-only checkpoint (T5EncoderModel / MT5EncoderModel in `architectures`, or
`is_encoder_decoder: false`, as transformers saves them: no `decoder.*` weights) becomes an
encoder-only model (decoder_layers 0), exported as the encoder graph alone and served for
Encode.

Decoding starts from `decoder_start_token_id` (the pad token, 0). Task prefixes
("translate English to German: ...", "summarize: ...") and MADLAD's target-language token
("<2fr> ...") are plain text, which the tokenizer splits as transformers does.

Tokenizer: tokenizer.json runs with the `tokenizers` library (TokenizerSpec kind "hf-json");
without it, spiece.model is mapped as transformers' T5Tokenizer maps it (kind "t5-spiece":
`extra_ids` sentinels <extra_id_N> on top of the vocabulary, </s> appended, no bos).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from export.importers.hf_files import (
    EMBEDDING_ALIASES,
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
from tfserve.model import Seq2SeqTransformer
from tfserve.model.transformer import KEEP_IN_FP32
from tfserve.text.tokenizer import Tokenizer, TokenizerError, TokenizerSpec
from tfserve.text.tokenizers.hf_json import HFJsonTokenizer

KIND = "hf-t5"
CONFIG_FILE = "config.json"
TOKENIZER_JSON = "tokenizer.json"
SPIECE_MODEL = "spiece.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
DEFAULT_EXTRA_IDS = 100  # T5Tokenizer's default number of sentinels
DEFAULT_POSITIONS = 512  # T5's n_positions: the tokenizer's model_max_length

# transformers' T5Config / MT5Config defaults for the fields a config.json leaves out
DEFAULTS: dict[str, dict[str, Any]] = {
    "t5": {"vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6,
           "num_heads": 8, "relative_attention_num_buckets": 32,
           "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6,
           "feed_forward_proj": "relu", "pad_token_id": 0, "eos_token_id": 1},
    "mt5": {"vocab_size": 250112, "d_model": 512, "d_kv": 64, "d_ff": 1024, "num_layers": 8,
            "num_heads": 6, "relative_attention_num_buckets": 32,
            "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6,
            "feed_forward_proj": "gated-gelu", "pad_token_id": 0, "eos_token_id": 1},
}

# HF activation names (ACT2FN) -> ModelConfig.activation; T5's "gated-gelu" is gelu_new
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu"}

# MADLAD-400's target-language tokens: "<2fr> text" translates into French
LANGUAGE_TOKEN = re.compile(r"^<2[^>]+>$")


# -- config ---------------------------------------------------------------------------------


def _field(config: dict[str, Any], model_type: str, name: str) -> Any:
    return config[name] if name in config else DEFAULTS[model_type].get(name)


def _int_field(config: dict[str, Any], model_type: str, name: str, where: Path) -> int:
    value = _field(config, model_type, name)
    if isinstance(value, list) and len(value) == 1:  # eos_token_id may be a one-element list
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int):
        raise SourceError(f"{where}: {name} must be an integer, got {value!r}")
    return value


def feed_forward(value: Any, where: Path) -> tuple[str, bool]:
    """`feed_forward_proj` ("relu", "gated-gelu", ...) -> (ModelConfig.activation, gated)."""
    parts = value.split("-") if isinstance(value, str) else []
    gated = len(parts) == 2 and parts[0] == "gated"
    name = parts[-1] if parts else None
    if gated and name == "gelu":
        name = "gelu_new"  # transformers: "gated-gelu" is gelu_new (the tanh approximation)
    if not parts or len(parts) > 2 or (len(parts) == 2 and not gated) \
            or name not in ACTIVATIONS:
        raise SourceError(f"{where}: feed_forward_proj {value!r} is not supported; supported: "
                          f"'ACT' or 'gated-ACT' with ACT one of {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name], gated


def scales_decoder_output(config: dict[str, Any], model_type: str) -> bool:
    """Whether transformers 5 multiplies the decoder output by d_model^-0.5 (T5 v1.0)."""
    if model_type == "mt5":
        return False
    if "scale_decoder_outputs" in config:
        return config["scale_decoder_outputs"] is True
    return config.get("tie_word_embeddings", True) is not False


def model_config(config: dict[str, Any], directory: Path, tied: bool, unk: int,
                 generation: dict[str, Any] | None = None,
                 encoder_only: bool = False) -> ModelConfig:
    """config.json (a dict) -> ModelConfig, or SourceError naming the field tfserve can't hold.

    tied: whether the output projection is the shared table (from the weights); unk: the
    tokenizer's unknown-token id; encoder_only: an encoder checkpoint (decoder_layers 0).
    """
    where = directory / CONFIG_FILE
    model_type = config.get("model_type", "t5")
    activation, gated = feed_forward(_field(config, model_type, "feed_forward_proj"), where)
    d_model = _int_field(config, model_type, "d_model", where)
    layers = _int_field(config, model_type, "num_layers", where)
    decoder_layers = config.get("num_decoder_layers")
    decoder_layers = layers if decoder_layers is None else _int_field(
        config, model_type, "num_decoder_layers", where)
    if encoder_only:
        decoder_layers = 0
    pad = _int_field(config, model_type, "pad_token_id", where)
    eos = _int_field(config, model_type, "eos_token_id", where)
    # T5 starts decoding with the pad token; transformers falls back to it when unset
    start = pad if config.get("decoder_start_token_id") is None \
        else _int_field(config, model_type, "decoder_start_token_id", where)
    positions = config.get("n_positions", DEFAULT_POSITIONS)
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise SourceError(f"{where}: n_positions must be a positive integer, got {positions!r}")
    eps = _field(config, model_type, "layer_norm_epsilon")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise SourceError(f"{where}: layer_norm_epsilon must be a number, got {eps!r}")
    # the FFN output projection (wo) stays float32 in float16 exports, as transformers keeps
    # it (`_keep_in_fp32_modules = ["wo"]`): T5 v1.1's FFN outputs exceed float16's range
    extra: dict[str, Any] = {"importer": KIND, "hf_model_type": model_type,
                             KEEP_IN_FP32: ["ffn.fc2"]}
    if generation:
        extra["hf_generation"] = generation
    try:
        return ModelConfig(
            vocab_size=_int_field(config, model_type, "vocab_size", where),
            d_model=d_model,
            num_heads=_int_field(config, model_type, "num_heads", where),
            attention_head_dim=_int_field(config, model_type, "d_kv", where),
            encoder_layers=layers,
            decoder_layers=decoder_layers,
            ffn_dim=_int_field(config, model_type, "d_ff", where),
            activation=activation,
            ffn_gated=gated,
            ffn_bias=False,
            norm="pre",
            norm_type="rmsnorm",
            positions="relative",
            relative_buckets=_int_field(config, model_type, "relative_attention_num_buckets",
                                        where),
            relative_max_distance=_int_field(config, model_type,
                                             "relative_attention_max_distance", where),
            attention_scale=False,
            attention_bias=False,
            max_source_positions=positions,
            max_target_positions=positions,
            scale_embedding=False,
            tie_word_embeddings=tied,
            final_logits_bias=False,
            output_scale=d_model ** -0.5 if scales_decoder_output(config, model_type) else 1.0,
            layer_norm_eps=float(eps),
            dropout=0.0,
            pad_token_id=pad,
            eos_token_id=eos,
            unk_token_id=unk,
            decoder_start_token_id=start,
            name=directory.resolve().name or model_type,
            extra=extra,
        )
    except ConfigError as exc:
        raise SourceError(f"{where}: {exc}") from exc


ENCODER_ARCHITECTURES = ("T5EncoderModel", "MT5EncoderModel")


def encoder_only_checkpoint(config: dict[str, Any]) -> str:
    """Why config.json says the checkpoint is an encoder alone ("" when it does not):
    transformers' T5EncoderModel saves its architecture and is_encoder_decoder false."""
    listed = [a for a in config.get("architectures") or [] if a in ENCODER_ARCHITECTURES]
    if listed:
        return f"architectures {listed}"
    if config.get("is_encoder_decoder", True) is False:
        return "is_encoder_decoder is False"
    return ""


def generation_defaults(directory: Path) -> dict[str, Any]:
    """The search settings generation_config.json asks for, recorded in the manifest: its
    fields of hf_fields() (the decoding options tfserve.option_table marks `checkpoint`, and
    the fields with rules of their own)."""
    path = directory / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    data = read_json(path, "generation config")
    if not isinstance(data, dict):
        raise SourceError(f"{path} must hold a JSON object")
    return from_hf_files({}, data)


# -- tokenizer ------------------------------------------------------------------------------


def _extra_ids(tokenizer_config: dict[str, Any]) -> int:
    """The number of <extra_id_N> sentinels T5Tokenizer adds to spiece.model's pieces."""
    value = tokenizer_config.get("extra_ids")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    listed = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = tokenizer_config.get(key)
        listed += value if isinstance(value, list) else []
    sentinels = {t for t in listed if isinstance(t, str) and t.startswith("<extra_id_")}
    return len(sentinels) or DEFAULT_EXTRA_IDS


def tokenizer_spec(directory: Path, config: dict[str, Any], model_type: str) -> TokenizerSpec:
    """tokenizer.json (hf-json) if the checkpoint has one, else spiece.model (t5-spiece);
    the special ids from config.json, checked against the tokenizer's own pieces."""
    where = directory / CONFIG_FILE
    tokenizer_config: dict[str, Any] = {}
    if (directory / TOKENIZER_CONFIG_FILE).is_file():
        tokenizer_config = read_json(directory / TOKENIZER_CONFIG_FILE, "tokenizer config")
        if not isinstance(tokenizer_config, dict):
            raise SourceError(f"{directory / TOKENIZER_CONFIG_FILE} must hold a JSON object")
    pad = _int_field(config, model_type, "pad_token_id", where)
    eos = _int_field(config, model_type, "eos_token_id", where)
    start = config.get("decoder_start_token_id")
    spec = TokenizerSpec(pad_token_id=pad, eos_token_id=eos, unk_token_id=2,
                         decoder_start_token_id=pad if start is None else start)
    if (directory / TOKENIZER_JSON).is_file():
        spec.kind, spec.source = "hf-json", TOKENIZER_JSON
    elif (directory / SPIECE_MODEL).is_file():
        spec.kind, spec.source = "t5-spiece", SPIECE_MODEL
        spec.extra_ids = _extra_ids(tokenizer_config)
    else:
        raise SourceError(f"T5 tokenizer not found in {directory}: expected {TOKENIZER_JSON} "
                          f"or {SPIECE_MODEL}")
    # the unknown token is the tokenizer's own; pad and eos must be where config.json says
    try:
        probe = Tokenizer(directory, TokenizerSpec(kind=spec.kind, source=spec.source,
                                                   extra_ids=spec.extra_ids, pad_token_id=0,
                                                   eos_token_id=0, unk_token_id=0,
                                                   decoder_start_token_id=0))
    except TokenizerError as exc:
        raise SourceError(str(exc)) from exc
    assert isinstance(probe, HFJsonTokenizer)
    pieces = {}
    for key, default in (("unk", "<unk>"), ("eos", "</s>"), ("pad", "<pad>")):
        token = tokenizer_config.get(f"{key}_token", default)
        token = token.get("content", default) if isinstance(token, dict) else token
        token_id = probe.hf_tokenizer.token_to_id(token) if isinstance(token, str) else None
        if token_id is None:
            raise SourceError(f"{directory / spec.source} has no {key} token {token!r}")
        pieces[key] = token_id
    for key, value in (("pad", pad), ("eos", eos)):
        if pieces[key] != value:
            raise SourceError(f"{where}: {key}_token_id is {value} but {spec.source} maps the "
                              f"{key} token to {pieces[key]}")
    spec.unk_token_id = pieces["unk"]
    return spec


def language_tokens(tokenizer: Tokenizer) -> list[str]:
    """MADLAD-400's target-language tokens (<2xx>) among the tokenizer's pieces."""
    assert isinstance(tokenizer, HFJsonTokenizer)
    vocab = tokenizer.hf_tokenizer.get_vocab(with_added_tokens=True)
    return sorted(piece for piece in vocab if LANGUAGE_TOKEN.match(piece))


# -- weights --------------------------------------------------------------------------------

ATTENTION = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}
# transformers ignores it too (T5ForConditionalGeneration._keys_to_ignore_on_load_unexpected)
IGNORED = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)


def t5_key_map(encoder_layers: int, decoder_layers: int, gated: bool,
               tied: bool = True) -> dict[str, str | tuple[str, int]]:
    """HF tensor name -> our parameter name; for a gated FFN, wi_0 / wi_1 -> ("...fc1.weight",
    0 or 1): the two halves of fc1 (the gate's rows first)."""
    key_map: dict[str, str | tuple[str, int]] = {
        "shared.weight": "shared.weight",
        "encoder.final_layer_norm.weight": "encoder_norm.weight",
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight":
            "encoder_positions.bias.weight",
    }
    if decoder_layers:  # an encoder-only model has no decoder parts and no output projection
        key_map["decoder.final_layer_norm.weight"] = "decoder_norm.weight"
        key_map["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = \
            "decoder_positions.bias.weight"
        if not tied:
            key_map["lm_head.weight"] = "lm_head.weight"
    for side, count, ours in (("encoder", encoder_layers, "encoder_layers"),
                              ("decoder", decoder_layers, "decoder_layers")):
        # (HF sub-layer index, HF module, our attention, our residual)
        blocks = [(0, "SelfAttention", "self_attn", "self_attn_res")]
        if side == "decoder":
            blocks.append((1, "EncDecAttention", "cross_attn", "cross_attn_res"))
        ffn_index = len(blocks)
        for layer in range(count):
            hf, our = f"{side}.block.{layer}.layer", f"{ours}.{layer}"
            for index, module, attention, res in blocks:
                for hf_proj, our_proj in ATTENTION.items():
                    key_map[f"{hf}.{index}.{module}.{hf_proj}.weight"] = \
                        f"{our}.{attention}.{our_proj}.weight"
                key_map[f"{hf}.{index}.layer_norm.weight"] = f"{our}.{res}.norm.weight"
            dense = f"{hf}.{ffn_index}.DenseReluDense"
            if gated:
                key_map[f"{dense}.wi_0.weight"] = (f"{our}.ffn.fc1.weight", 0)
                key_map[f"{dense}.wi_1.weight"] = (f"{our}.ffn.fc1.weight", 1)
            else:
                key_map[f"{dense}.wi.weight"] = f"{our}.ffn.fc1.weight"
            key_map[f"{dense}.wo.weight"] = f"{our}.ffn.fc2.weight"
            key_map[f"{hf}.{ffn_index}.layer_norm.weight"] = f"{our}.ffn_res.norm.weight"
    return key_map


def _strip(key: str) -> str:
    return key[len("transformer."):] if key.startswith("transformer.") else key


def lm_head_tied(state: dict[str, torch.Tensor]) -> bool:
    """The output projection is the shared table unless the weights hold another one."""
    state = {_strip(k): v for k, v in state.items()}
    head = state.get("lm_head.weight")
    if head is None:
        return True
    table = state.get("shared.weight", state.get(EMBEDDING_ALIASES[0]))
    return table is not None and same_tensor(head, table)


def map_weights(state: dict[str, torch.Tensor], cfg: ModelConfig,
                where: str) -> dict[str, torch.Tensor]:
    """HF state dict -> our parameter names, float32, every name and shape checked."""
    state = {_strip(k): v for k, v in state.items()}
    state["shared.weight"] = shared_table(state, where, shown_name="shared.weight")
    key_map = t5_key_map(cfg.encoder_layers, cfg.decoder_layers, cfg.ffn_gated,
                         cfg.tie_word_embeddings)
    skipped = set(EMBEDDING_ALIASES) | set(IGNORED)
    if cfg.tie_word_embeddings or cfg.encoder_only:
        skipped.add("lm_head.weight")
    refuse_unexpected([k for k in state if k not in key_map and k not in skipped], where)
    stacks = (f"{cfg.encoder_layers} encoder layers (an encoder-only checkpoint)"
              if cfg.encoder_only else
              f"{cfg.encoder_layers} encoder / {cfg.decoder_layers} decoder layers")
    refuse_missing(state, list(key_map), where,
                   f"{stacks}, feed_forward_proj {'gated' if cfg.ffn_gated else 'not gated'}")
    mapped: dict[str, torch.Tensor] = {}
    halves: dict[str, list[torch.Tensor]] = {}
    for hf_name, ours in key_map.items():
        tensor = float_tensor(state, hf_name, where)
        if isinstance(ours, tuple):
            halves.setdefault(ours[0], [torch.empty(0), torch.empty(0)])[ours[1]] = tensor
        else:
            mapped[ours] = tensor
    for name, (gate, up) in halves.items():
        if gate.shape != up.shape:
            raise SourceError(f"{where}: {name}: wi_0 {tuple(gate.shape)} and wi_1 "
                              f"{tuple(up.shape)} differ in shape")
        mapped[name] = torch.cat((gate, up))  # [2F,D]: the gate's rows first
    return mapped


# -- the importer ---------------------------------------------------------------------------


def load(directory: Path, config: dict[str, Any]) -> Source:
    """export.importers entry point: a T5 / mT5 directory -> Source."""
    directory = Path(directory)
    model_type = config.get("model_type", "t5")
    files = weight_files(directory)
    spec = tokenizer_spec(directory, config, model_type)
    weights_where = ", ".join(str(p) for p in files)
    state = read_weights(files)
    # T5EncoderModel / MT5EncoderModel checkpoints hold the encoder alone
    encoder_only = encoder_only_checkpoint(config)
    stray = sorted(key for key in state if _strip(key).startswith("decoder.")) \
        if encoder_only else []
    if stray:
        raise SourceError(f"{directory / CONFIG_FILE}: {encoder_only} (an encoder-only "
                          f"checkpoint), but the weights hold decoder tensors ({stray[0]}, "
                          f"... {len(stray)} in all)")
    cfg = model_config(config, directory, lm_head_tied(state), spec.unk_token_id,
                       generation_defaults(directory), bool(encoder_only))
    spec.decoder_start_token_id = cfg.decoder_start_token_id
    try:
        tokenizer = Tokenizer(directory, spec)
    except TokenizerError as exc:
        raise SourceError(str(exc)) from exc
    if tokenizer.vocab_size > cfg.vocab_size:
        raise SourceError(f"{directory / spec.source} has {tokenizer.vocab_size} ids, more than "
                          f"the model's vocab_size {cfg.vocab_size} ({directory / CONFIG_FILE})")
    codes = language_tokens(tokenizer)
    if codes:
        cfg.extra["language_codes"] = codes
    model = Seq2SeqTransformer(cfg)
    load_weights(model, map_weights(state, cfg, weights_where), weights_where)
    return Source(model.eval(), directory, spec, [directory / CONFIG_FILE, *files], KIND, [])

