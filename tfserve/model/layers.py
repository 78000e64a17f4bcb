"""Feed-forward, residual blocks, encoder and decoder layers, embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tfserve.config import ModelConfig
from tfserve.model.attention import MultiHeadAttention
from tfserve.model.positions import Rope, apply_rope, sinusoidal_table


class FeedForward(nn.Module):
    """act(x W1 + b1) W2 + b2, applied to every position independently."""

    def __init__(self, d_model: int, ffn_dim: int, activation: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.act = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "swish": F.silu}[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Residual(nn.Module):
    """Sub-layer with residual connection and LayerNorm, post-norm (paper) or pre-norm."""

    def __init__(self, d_model: int, eps: float, pre_norm: bool, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.pre_norm = pre_norm
        self.dropout = nn.Dropout(dropout)

    def normed_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) if self.pre_norm else x

    def combine(self, x: torch.Tensor, sublayer_out: torch.Tensor) -> torch.Tensor:
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


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.num_heads, cfg.attention_bias)
        self.self_attn_res = Residual(cfg.d_model, cfg.layer_norm_eps, pre, cfg.dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation)
        self.ffn_res = Residual(cfg.d_model, cfg.layer_norm_eps, pre, cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor,
                rope: Rope | None) -> torch.Tensor:
        """mask: bool `blocked` [B,1,1,S], or its additive float bias for the fused path."""
        h = self.self_attn_res.normed_input(x)
        if mask.dtype != torch.bool:
            attended = self.self_attn.attend_fused(h, mask, rope=rope)[0]
        else:
            k, v = self.self_attn.project_kv(h)
            if rope is not None:
                k = apply_rope(k, rope)
            attended = self.self_attn.attend(h, k, v, mask, rope)
        x = self.self_attn_res.combine(x, attended)
        return self.ffn_res.combine(x, self.ffn(self.ffn_res.normed_input(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.num_heads, cfg.attention_bias)
        self.self_attn_res = Residual(cfg.d_model, cfg.layer_norm_eps, pre, cfg.dropout)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.num_heads, cfg.attention_bias)
        self.cross_attn_res = Residual(cfg.d_model, cfg.layer_norm_eps, pre, cfg.dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation)
        self.ffn_res = Residual(cfg.d_model, cfg.layer_norm_eps, pre, cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        self_blocked: torch.Tensor,
        cross_blocked: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor],
        cross: tuple[torch.Tensor, torch.Tensor],
        rope: Rope | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Masks: bool `blocked` ones, or their additive float biases for the fused path."""
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
            x = self.self_attn_res.combine(x, self.self_attn.attend(h, k, v, self_blocked, rope))
            h = self.cross_attn_res.normed_input(x)
            cross_k, cross_v, blocked = rows_of_groups(h.shape[0], cross[0], cross[1],
                                                       cross_blocked)
            attended = self.cross_attn.attend(h, cross_k, cross_v, blocked)
        x = self.cross_attn_res.combine(x, attended)
        x = self.ffn_res.combine(x, self.ffn(self.ffn_res.normed_input(x)))
        return x, (k, v)


# -- stacks ---------------------------------------------------------------------------------


class Embeddings(nn.Module):
    """Token embedding * scale + absolute positions (for sinusoidal / learned positions)."""

    def __init__(self, cfg: ModelConfig, tokens: nn.Embedding, max_positions: int) -> None:
        super().__init__()
        self.tokens = tokens
        self.scale = cfg.embed_scale
        self.kind = cfg.positions
        if cfg.positions == "sinusoidal":
            table = sinusoidal_table(max_positions, cfg.d_model, cfg.sinusoidal_layout)
            # derived from the config, so not stored in checkpoints
            self.register_buffer("position_table", table, persistent=False)  # [N,D]
        elif cfg.positions == "learned":
            self.position_embedding = nn.Embedding(max_positions, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(input_ids) * self.scale  # [B,T,D]
        if self.kind == "sinusoidal":
            x = x + F.embedding(position_ids, self.position_table).to(x.dtype)
        elif self.kind == "learned":
            x = x + self.position_embedding(position_ids)
        return self.dropout(x)
