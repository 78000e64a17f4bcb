"""Model configuration: one dataclass that describes every checkpoint tfserve can hold.

`ModelConfig` round-trips through JSON (it is stored in checkpoints and in the exported
manifest) and validates itself at construction, so an impossible model is refused with a
message naming the field instead of failing later inside a matmul.

This module imports nothing heavy: the serving path reads configs without torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# "gelu" is the exact (erf) GELU; "gelu_tanh" its tanh approximation (T5 v1.1's "gelu_new")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "swish")
NORMS = ("post", "pre")
# "layernorm": (x - mean) / std * weight + bias; "rmsnorm": x / rms * weight (T5's, no bias)
NORM_TYPES = ("layernorm", "rmsnorm")
# "relative": no absolute positions; a learned bias per (distance bucket, head) is added to the
# self-attention scores (T5), bidirectional in the encoder and causal in the decoder
POSITIONS = ("sinusoidal", "rope", "learned", "relative")
# "interleaved" is the paper's PE[pos, 2i] = sin, PE[pos, 2i+1] = cos;
# "half" is Marian's [sin(all frequencies) | cos(all frequencies)];
# "fairseq" is fairseq's (M2M100, NLLB): [sin | cos] halves with the frequencies
# 10000^(-i / (D/2 - 1)), computed in float32 as fairseq and transformers compute them.
SINUSOIDAL_LAYOUTS = ("interleaved", "half", "fairseq")


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and the limit."""


@dataclass
class ModelConfig:
    """Hyper-parameters of an encoder-decoder Transformer.

    Token ids of the special tokens live here too, because the model needs them (padding,
    the decoder start token) and so does every consumer of the exported graphs.
    """

    vocab_size: int
    d_model: int = 512
    num_heads: int = 8
    encoder_layers: int = 6
    decoder_layers: int = 6
    ffn_dim: int = 2048
    activation: str = "relu"
    # gated FFN: act(x W_gate) * (x W_up), then W2 (T5 v1.1 / mT5 / Flan-T5 "gated-gelu")
    ffn_gated: bool = False
    ffn_bias: bool = True
    norm: str = "post"
    norm_type: str = "layernorm"
    positions: str = "sinusoidal"
    sinusoidal_layout: str = "interleaved"
    rope_base: float = 10000.0
    # positions="relative": distances map to buckets, half of them exact, the others
    # logarithmic up to max_distance (farther ones share the last bucket)
    relative_buckets: int = 32
    relative_max_distance: int = 128
    # 0: d_model / num_heads; T5 sets it (d_kv), and num_heads * head dim may differ from d_model
    attention_head_dim: int = 0
    # attention scores q.k / sqrt(head dim) when true; T5 does not scale them
    attention_scale: bool = True
    max_source_positions: int = 512
    max_target_positions: int = 512
    # absolute positions (sinusoidal, learned): position p reads row p + position_offset of
    # the table (BART and mBART's learned tables: 2; M2M100 / NLLB: pad_token_id + 1)
    position_offset: int = 0
    # M2M100 / NLLB (fairseq's make_positions): a pad token gets no position (table row
    # pad_token_id, all zeros) and is not counted: an encoder token's position is the number
    # of non-pad tokens before it
    position_padding: bool = False
    # a LayerNorm on the embeddings (tokens + positions) of both stacks (BART, mBART:
    # transformers' layernorm_embedding)
    embedding_norm: bool = False
    scale_embedding: bool = True
    tie_word_embeddings: bool = True
    final_logits_bias: bool = False
    # the decoder's final hidden states are multiplied by it before the output projection
    # (T5 v1.0 with its tied embedding: d_model ** -0.5)
    output_scale: float = 1.0
    layer_norm_eps: float = 1e-5
    dropout: float = 0.0
    attention_bias: bool = True
    pad_token_id: int = 0
    eos_token_id: int = 1
    unk_token_id: int = 2
    decoder_start_token_id: int = 0
    name: str = "model"
    source_language: str = ""
    target_language: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.d_model // self.num_heads

    @property
    def inner_dim(self) -> int:
        """Width of the attention projections' outputs: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def encoder_only(self) -> bool:
        """No decoder (decoder_layers 0): a T5EncoderModel's encoder, for Encode only."""
        return self.decoder_layers == 0

    @property
    def embed_scale(self) -> float:
        return self.d_model**0.5 if self.scale_embedding else 1.0

    def validate(self) -> None:
        """Raise ConfigError naming the first impossible value."""

        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

        for name in (
            "vocab_size",
            "d_model",
            "num_heads",
            "encoder_layers",
            "ffn_dim",
            "max_source_positions",
            "max_target_positions",
        ):
            positive(name)
        value = self.decoder_layers
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"decoder_layers must be an integer >= 0 (0: an encoder-only "
                              f"model, which serves Encode), got {value!r}")
        value = self.attention_head_dim
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"attention_head_dim must be an integer >= 0 (0: d_model / "
                              f"num_heads), got {value!r}")
        if not self.attention_head_dim and self.d_model % self.num_heads:
            raise ConfigError(
                f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads}) "
                "unless attention_head_dim is set"
            )
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.norm not in NORMS:
            raise ConfigError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.norm_type not in NORM_TYPES:
            raise ConfigError(f"norm_type must be one of {NORM_TYPES}, got {self.norm_type!r}")
        if self.positions not in POSITIONS:
            raise ConfigError(f"positions must be one of {POSITIONS}, got {self.positions!r}")
        if self.sinusoidal_layout not in SINUSOIDAL_LAYOUTS:
            raise ConfigError(
                f"sinusoidal_layout must be one of {SINUSOIDAL_LAYOUTS}, "
                f"got {self.sinusoidal_layout!r}"
            )
        if self.positions == "rope" and self.head_dim % 2:
            raise ConfigError(
                f"positions='rope' needs an even head dim, got d_model/num_heads = {self.head_dim}"
            )
        # fairseq's table (M2M100, NLLB) zero-pads an odd d_model's last column; the
        # interleaved and Marian layouts have no such rule
        if self.positions == "sinusoidal" and self.sinusoidal_layout != "fairseq" and \
                self.d_model % 2:
            raise ConfigError(f"positions='sinusoidal' needs an even d_model (except with "
                              f"sinusoidal_layout='fairseq'), got {self.d_model}")
        if self.positions == "sinusoidal" and self.sinusoidal_layout == "fairseq" and \
                self.d_model < 4:
            raise ConfigError(f"sinusoidal_layout='fairseq' needs d_model >= 4, "
                              f"got {self.d_model}")
        for name in ("relative_buckets", "relative_max_distance"):
            positive(name)
        if self.positions == "relative":
            # every half of the buckets needs an exact part (half of it) and a log part
            if self.relative_buckets < 4:
                raise ConfigError(f"relative_buckets must be >= 4 with positions='relative', "
                                  f"got {self.relative_buckets}")
            if self.relative_max_distance <= self.relative_buckets // 2:
                raise ConfigError(
                    f"relative_max_distance must be > relative_buckets / 2 = "
                    f"{self.relative_buckets // 2}, got {self.relative_max_distance}")
        value = self.position_offset
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"position_offset must be an integer >= 0, got {value!r}")
        for name in ("scale_embedding", "tie_word_embeddings", "final_logits_bias",
                     "attention_bias", "attention_scale", "ffn_gated", "ffn_bias",
                     "position_padding", "embedding_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("rope_base", "layer_norm_eps", "dropout", "output_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{name} must be a number, got {value!r}")
        if not self.rope_base > 0:
            raise ConfigError(f"rope_base must be > 0, got {self.rope_base!r}")
        if not self.output_scale > 0:
            raise ConfigError(f"output_scale must be > 0, got {self.output_scale!r}")
        if not self.layer_norm_eps > 0:
            raise ConfigError(f"layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout!r}")
        for name in ("pad_token_id", "eos_token_id", "unk_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not (
                    0 <= value < self.vocab_size):
                raise ConfigError(
                    f"{name} must be an integer in [0, vocab_size={self.vocab_size}), got {value!r}"
                )
        if self.position_offset and self.positions not in ("sinusoidal", "learned"):
            raise ConfigError(f"position_offset needs absolute positions (sinusoidal or "
                              f"learned), got positions={self.positions!r}")
        if self.position_padding and self.positions not in ("sinusoidal", "learned"):
            raise ConfigError(f"position_padding needs absolute positions (sinusoidal or "
                              f"learned), got positions={self.positions!r}")
        if self.position_padding and self.position_offset <= self.pad_token_id:
            raise ConfigError(
                f"position_padding needs position_offset > pad_token_id ({self.pad_token_id}): "
                f"table row {self.pad_token_id} is the pad tokens' zero row, got "
                f"position_offset={self.position_offset}")

    # -- JSON -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"model config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        if "vocab_size" not in data:
            raise ConfigError("model config is missing the required field vocab_size")
        try:
            return cls(**data)
        except TypeError as exc:  # a wrongly typed value that broke arithmetic in validate()
            raise ConfigError(f"invalid model config: {exc}") from exc

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model config is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read model config {path}: {exc.strerror}") from exc
        try:
            return cls.from_json(text)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
