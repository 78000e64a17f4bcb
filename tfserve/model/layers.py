"""Feed-forward, residual blocks, encoder and decoder layers, embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tfserve.artifacts.model_config import ModelConfig
from tfserve.model.attention import MultiHeadAttention
from tfserve.model.positions import Rope, apply_rope, sinusoidal_table


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation: transformers' "gelu_new", T5 v1.1's gated activation."""
    return F.gelu(x, approximate="tanh")


ACTIVATION_FUNCTIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": gelu_tanh, "silu": F.silu,
                        "swish": F.silu}


class FeedForward(nn.Module):
    """act(x W1 + b1) W2 + b2, applied to every position independently.

    Gated (T5 v1.1, mT5, Flan-T5): act(x W_gate) * (x W_up), then W2. W_gate and W_up are
    stacked in fc1 ([2F,D]: the gate's F rows first), so the two run as one GEMM.
    fc2 may be kept in float32 in a half-precision model (T5: `Seq2SeqTransformer.
    to_precision`); its input is then cast to float32 and the output is float32, as in
    transformers' T5DenseGatedActDense with `_keep_in_fp32_modules = ["wo"]`.
    """

    def __init__(self, d_model: int, ffn_dim: int, activation: str, gated: bool = False,
                 bias: bool = True) -> None:
        super().__init__()
        self.ffn_dim = ffn_dim
        self.gated = gated
        self.fc1 = nn.Linear(d_model, 2 * ffn_dim if gated else ffn_dim, bias=bias)
        self.fc2 = nn.Linear(ffn_dim, d_model, bias=bias)
        self.act = ACTIVATION_FUNCTIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            # [B,T,2F] -> 2 x [B,T,F]; ffn_dim a Python int: constant split sizes in the graph
            gate, up = self.fc1(x).split(self.ffn_dim, dim=-1)
            hidden = self.act(gate) * up
        else:
            hidden = self.act(self.fc1(x))
        if hidden.dtype != self.fc2.weight.dtype:  # a float32 fc2 in a float16 model
            hidden = hidden.to(self.fc2.weight.dtype)
        return self.fc2(hidden)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight: T5's layer norm (no mean subtracted, no bias).

    Written as transformers' T5LayerNorm computes it, in float32 for half inputs.
    """

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # casts only for half inputs: traced, a same-type cast is still a node
        squared = (x if x.dtype == torch.float32 else x.float()).pow(2)
        normed = x * torch.rsqrt(squared.mean(-1, keepdim=True) + self.eps)  # [...,D]
        if normed.dtype != self.weight.dtype:
            normed = normed.to(self.weight.dtype)
        return self.weight * normed


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The config's normalisation over d_model: LayerNorm or RMSNorm (norm_type)."""
    if cfg.norm_type == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)


class Residual(nn.Module):
    """Sub-layer with residual connection and a norm, post-norm (paper) or pre-norm."""

    def __init__(self, d_model: int, eps: float, pre_norm: bool, dropout: float,
                 norm: nn.Module | None = None) -> None:
        """norm: the normalisation to use (default a LayerNorm over d_model with eps)."""
        super().__init__()
        self.norm = norm if norm is not None else nn.LayerNorm(d_model, eps=eps)
        self.pre_norm = pre_norm
        self.dropout = nn.Dropout(dropout)

    def normed_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) if self.pre_norm else x

    def combine(self, x: torch.Tensor, sublayer_out: torch.Tensor) -> torch.Tensor:
        if sublayer_out.dtype != x.dtype:
            # a float32 sublayer (T5's FFN output kept in float32) in a float16 model: the
            # residual stream goes on in float32 from there, as in transformers, where
            # float16 + float32 promotes; explicit casts, so the traced Add has one type
            dtype = torch.promote_types(x.dtype, sublayer_out.dtype)
            x, sublayer_out = x.to(dtype), sublayer_out.to(dtype)
        out = x + self.dropout(sublayer_out)
        return out if self.pre_norm else self.norm(out)


# -- layers ---------------------------------------------------------------------------------


def rows_of_groups(rows: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Tensors with one row per group of G = rows / Bc consecutive rows, repeated to `rows`.

    [Bc,...] -> [B,...]: the unfused path's form of grouped cross-attention (the fused op
    instead lays a group's queries side by side and reads each K/V row once).
    """
    out = []
    for t in tensors:
        groups = t.shape[0]
        t = t[:, None].expand(groups, rows // groups, *t.shape[1:])  # [Bc,G,...]
        out.append(t.reshape(rows, *t.shape[2:]))  # [B,...]
    return tuple(out)


def attention(cfg: ModelConfig) -> MultiHeadAttention:
    """The config's attention: its heads, head dim, projection biases and score scaling."""
    return MultiHeadAttention(cfg.d_model, cfg.num_heads, cfg.attention_bias, cfg.head_dim,
                              cfg.attention_scale)


def residual(cfg: ModelConfig) -> Residual:
    """A residual block with the config's norm (LayerNorm or RMSNorm), before or after."""
    return Residual(cfg.d_model, cfg.layer_norm_eps, cfg.norm == "pre", cfg.dropout,
                    make_norm(cfg))


def feed_forward(cfg: ModelConfig) -> FeedForward:
    """The config's FFN: its width, activation, gating and biases."""
    return FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.ffn_gated, cfg.ffn_bias)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = attention(cfg)
        self.self_attn_res = residual(cfg)
        self.ffn = feed_forward(cfg)
        self.ffn_res = residual(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope: Rope | None,
                position_bias: torch.Tensor | None = None) -> torch.Tensor:
        """mask: bool `blocked` [B,1,1,S], or the additive float bias for the fused path
        (which then holds the position bias too); position_bias [1,H,S,S] (relative
        positions) for the unfused path."""
        h = self.self_attn_res.normed_input(x)
        if mask.dtype != torch.bool:
            attended = self.self_attn.attend_fused(h, mask, rope=rope)[0]
        else:
            k, v = self.self_attn.project_kv(h)
            if rope is not None:
                k = apply_rope(k, rope)
            attended = self.self_attn.attend(h, k, v, mask, rope, position_bias)
        x = self.self_attn_res.combine(x, attended)
        return self.ffn_res.combine(x, self.ffn(self.ffn_res.normed_input(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = attention(cfg)
        self.self_attn_res = residual(cfg)
        self.cross_attn = attention(cfg)
        self.cross_attn_res = residual(cfg)
        self.ffn = feed_forward(cfg)
        self.ffn_res = residual(cfg)

    def forward(
        self,
        x: torch.Tensor,
        self_blocked: torch.Tensor,
        cross_blocked: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor],
        cross: tuple[torch.Tensor, torch.Tensor],
        rope: Rope | None,
        position_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Masks: bool `blocked` ones, or their additive float biases for the fused path
        (the self-attention one then holds the position bias too); position_bias
        [B,H,T,P+T] (relative positions) for the unfused self-attention."""
        h = self.self_attn_res.normed_input(x)
        if self_blocked.dtype != torch.bool:
            attended, k, v = self.self_attn.attend_fused(h, self_blocked, past, rope)
            x = self.self_attn_res.combine(x, attended)
            h = self.cross_attn_res.normed_input(x)
            attended = self.cross_attn.attend_fused(h, cross_blocked, cached=cross)[0]
        else:
            k_new, v_new = self.self_attn.project_kv(h)  # [B,H,T,Dh]
            if rope is not None:
                k_new = apply_rope(k_new, rope)  # cached keys are stored already rotated
            k = torch.cat((past[0], k_new), dim=2)  # [B,H,P+T,Dh]
            v = torch.cat((past[1], v_new), dim=2)
            x = self.self_attn_res.combine(
                x, self.self_attn.attend(h, k, v, self_blocked, rope, position_bias))
            h = self.cross_attn_res.normed_input(x)
            cross_k, cross_v, blocked = rows_of_groups(h.shape[0], cross[0], cross[1],
                                                       cross_blocked)
            attended = self.cross_attn.attend(h, cross_k, cross_v, blocked)
        x = self.cross_attn_res.combine(x, attended)
        x = self.ffn_res.combine(x, self.ffn(self.ffn_res.normed_input(x)))
        return x, (k, v)


# -- stacks ---------------------------------------------------------------------------------


class Embeddings(nn.Module):
    """Token embedding * scale + absolute positions (for sinusoidal / learned positions),
    then the embedding LayerNorm where the config has one (BART, mBART).

    Position p reads row p + position_offset of the table. With position_padding (M2M100,
    NLLB) a pad token reads row pad_token_id instead, which is all zeros.
    """

    def __init__(self, cfg: ModelConfig, tokens: nn.Embedding, max_positions: int) -> None:
        super().__init__()
        self.tokens = tokens
        self.scale = cfg.embed_scale
        self.kind = cfg.positions
        self.offset = cfg.position_offset
        self.pad_token_id = cfg.pad_token_id if cfg.position_padding else None
        rows = max_positions + cfg.position_offset
        if cfg.positions == "sinusoidal":
            table = sinusoidal_table(rows, cfg.d_model, cfg.sinusoidal_layout)
            if self.pad_token_id is not None:
                table[self.pad_token_id] = 0.0
            # derived from the config, so not stored in checkpoints
            self.register_buffer("position_table", table, persistent=False)  # [N,D]
        elif cfg.positions == "learned":
            self.position_embedding = nn.Embedding(rows, cfg.d_model)
        self.norm = make_norm(cfg) if cfg.embedding_norm else None
        self.dropout = nn.Dropout(cfg.dropout)

    def table_rows(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The table row of each token [B,T]: its position + offset, the pad row for pads."""
        rows = position_ids + self.offset if self.offset else position_ids
        if self.pad_token_id is not None:
            rows = torch.where(input_ids == self.pad_token_id, self.pad_token_id, rows)
        return rows

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(input_ids) * self.scale  # [B,T,D]
        if self.kind == "sinusoidal":
            rows = self.table_rows(input_ids, position_ids)
            x = x + F.embedding(rows, self.position_table).to(x.dtype)
        elif self.kind == "learned":
            x = x + self.position_embedding(self.table_rows(input_ids, position_ids))
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)
