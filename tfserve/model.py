"""The encoder-decoder Transformer in PyTorch: the eager reference every other backend matches.

Read top to bottom: positions, attention, feed-forward, layers, stacks, the model, checkpoints.

Shapes use B batch rows, S source length, T new target tokens, P past (cached) length,
H heads, Dh head dim, D model dim, V vocab, L layers.

The decoder is driven one way only, `decode_step`, which is exactly the exported decoder
graph's interface (see docs/graph-interface.md): new tokens, their per-row `position_ids`, a
`self_attention_mask` over past + new keys (0 = a hole), the encoder mask, the self-attention
cache and the cross-attention K/V. The full-sequence forward is the same call with an empty
past, so training, incremental decoding and export share one code path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tfserve.config import ModelConfig
from tfserve.manifest import TOP_CANDIDATES

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (key, value), each [B,H,len,Dh]


class CheckpointError(ValueError):
    """A missing, corrupt or mismatching checkpoint file; the message names the file."""


# -- positions ------------------------------------------------------------------------------


def sinusoidal_table(num_positions: int, dim: int, layout: str = "interleaved") -> torch.Tensor:
    """The paper's table: PE[pos, 2i] = sin(pos / 10000^(2i/dim)), PE[pos, 2i+1] = cos(same).

    `layout="half"` is Marian's variant: [sin of every frequency | cos of every frequency].
    Computed in float64 so both layouts are exact to fp32 rounding at long positions.
    """
    positions = torch.arange(num_positions, dtype=torch.float64)[:, None]  # [N,1]
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [dim/2]
    angles = positions * inv_freq[None, :]  # [N, dim/2]
    table = torch.empty(num_positions, dim, dtype=torch.float64)
    if layout == "interleaved":
        table[:, 0::2] = torch.sin(angles)
        table[:, 1::2] = torch.cos(angles)
    elif layout == "half":
        table[:, : dim // 2] = torch.sin(angles)
        table[:, dim // 2 :] = torch.cos(angles)
    else:
        raise ValueError(f"sinusoidal layout must be 'interleaved' or 'half', got {layout!r}")
    return table.float()


def rotate_half(x: torch.Tensor, half: int) -> torch.Tensor:
    """[x1 | x2] -> [-x2 | x1] on the last dim (the half-split RoPE layout).

    half is a Python int: traced, the two slices have constant bounds (x.chunk(2) read the
    size off x at run time, six shape ops per rotation).
    """
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rope(NamedTuple):
    """One call's rotation, for the eager maths and for the fused op.

    cos, sin [B,1,T,Dh]: the angles of each row and position, shared by every head.
    position_ids [B,T] and the tables cos_table, sin_table [N,Dh/2] (angle of position n):
    what com.microsoft.RotaryEmbedding takes. half = Dh/2.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    position_ids: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    half: int


class RotaryEmbedding(nn.Module):
    """RoPE: rotates each (i, i + Dh/2) pair of q and k by angle pos * base^(-2i/Dh).

    Eager, the rotation is computed from `position_ids` on the fly and has no length limit.
    Exported fp32 graphs apply it with ONNX Runtime's RotaryEmbedding op (`FusedRotary`),
    which looks the angles up in tables of `max_positions` rows, so there positions must be
    below max(max_source_positions, max_target_positions): the limits the runtime enforces.
    """

    inv_freq: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(self, head_dim: int, base: float, max_positions: int) -> None:
        super().__init__()
        self.half = head_dim // 2
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [Dh/2]
        # the same product and cos/sin as forward's, so table lookups equal it bit for bit
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq  # [N,Dh/2]
        self.register_buffer("cos_table", angles.cos(), persistent=False)
        self.register_buffer("sin_table", angles.sin(), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> Rope:
        angles = position_ids[..., None].float() * self.inv_freq  # [B,T,Dh/2]
        angles = torch.cat((angles, angles), dim=-1)  # [B,T,Dh]
        # [B,1,T,Dh]: one rotation per row and position, shared by every head
        return Rope(angles.cos()[:, None], angles.sin()[:, None], position_ids,
                    self.cos_table, self.sin_table, self.half)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    """x [B,H,T,Dh] rotated by the angles whose cos/sin [B,1,T,Dh] are given (half = Dh/2):
    the one formula of the eager rotation and of FusedRotary's reference."""
    return x * cos.to(x.dtype) + rotate_half(x, half) * sin.to(x.dtype)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x [B,H,T,Dh] rotated by the angles in rope.cos/sin [B,1,T,Dh]."""
    return rotate(x, rope.cos, rope.sin, rope.half)


class FusedRotary(torch.autograd.Function):
    """Exported as ONNX Runtime's com.microsoft.RotaryEmbedding: one node instead of ~14.

    x [B,T,D] (heads side by side) rotated per head; `forward` is the reference maths the
    tracer runs (the same as apply_rope). Used with the fused attention (fp32 graphs only).
    The demo decoder, optimized by ONNX Runtime: 215 -> 121 nodes (encoder 185 -> 89).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, position_ids: torch.Tensor, cos_table: torch.Tensor,
                sin_table: torch.Tensor, num_heads: int) -> torch.Tensor:
        half = cos_table.shape[-1]
        cos = torch.cat((cos_table[position_ids],) * 2, dim=-1)[:, None]  # [B,1,T,Dh]
        sin = torch.cat((sin_table[position_ids],) * 2, dim=-1)[:, None]
        heads = split_heads(x, num_heads, 2 * half)  # [B,H,T,Dh]
        return merge_heads(rotate(heads, cos, sin, half))  # [B,T,D]

    @staticmethod
    def symbolic(g: Any, x: Any, position_ids: Any, cos_table: Any, sin_table: Any,
                 num_heads: int) -> Any:
        out = g.op("com.microsoft::RotaryEmbedding", x, position_ids, cos_table, sin_table,
                   interleaved_i=0, num_heads_i=num_heads)
        out.setType(x.type())
        return out


# -- attention ------------------------------------------------------------------------------


# Both reshapes name the leading dims as x.shape[i] of the reshaped tensor itself and the head
# sizes as Python ints: traced, that is Shape -> Gather -> Unsqueeze -> Concat, which ONNX
# Runtime's reshape fusion turns into one Reshape with a constant [0, 0, H, Dh]. unflatten and
# flatten traced into ~10 shape ops per call, run at every decoder step (a fifth of the
# optimized decoder graph's nodes).


def split_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    x = x.reshape(x.shape[0], x.shape[1], num_heads, head_dim)  # [B,T,D] -> [B,T,H,Dh]
    return x.transpose(1, 2)  # [B,H,T,Dh]


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    x = x.transpose(1, 2)  # [B,H,T,Dh] -> [B,T,H,Dh]
    return x.reshape(x.shape[0], x.shape[1], -1)  # [B,T,D]


def scaled_dot_product(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T / sqrt(Dh), masked) v.

    q [B,H,Tq,Dh], k/v [B,H,Tk,Dh], scale = Dh ** -0.5 (a Python float, so it is a constant
    in the graphs), blocked bool broadcastable to [B,H,Tq,Tk] (True: the
    query may not see that key). It is computed once per call of the stack, not per layer, so
    the graphs carry one Where per attention and no per-layer mask arithmetic.
    Masked scores are set to the dtype's minimum rather than -inf: a query whose keys are all
    masked (a padding row) then gets a uniform distribution instead of NaN.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B,H,Tq,Tk]
    scores = scores.masked_fill(blocked, torch.finfo(scores.dtype).min)
    return torch.matmul(scores.softmax(dim=-1), v)  # [B,H,Tq,Dh]


def blocked_to_bias(blocked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True: blocked) -> additive bias with the dtype's minimum where blocked.

    |score| is far below the spacing of floats near the minimum, so score + min == min: the
    same scores as scaled_dot_product's masked_fill, padding rows included.
    """
    return blocked.to(dtype) * torch.finfo(dtype).min


class FusedAttention(torch.autograd.Function):
    """Exported as ONNX Runtime's com.microsoft.MultiHeadAttention: one node instead of ~12.

    Head split, past concat, q k^T * scale + bias, softmax, @ v and head merge in one kernel
    (fp32 on CPU; fp32/fp16 on CUDA). Used only while exporting fp32 graphs
    (`Seq2SeqTransformer.use_fused_attention`); `forward` is the reference computation the
    tracer runs, the same maths as the unfused path.

    q [B,T,D]; k/v either new projections [B,T,D] (self-attention; with past [B,H,P,Dh] they
    are appended) or cached cross K/V [B,H,S,Dh]; bias [B,1,T,P+T] (or [B,1,T,S]) additive.
    Returns the output [B,T,D] and the keys/values attended over [B,H,P+T,Dh].
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                past_k: torch.Tensor | None, past_v: torch.Tensor | None, num_heads: int,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        head_dim = q.shape[-1] // num_heads
        if k.dim() == 3:
            k, v = split_heads(k, num_heads, head_dim), split_heads(v, num_heads, head_dim)
            if past_k is not None and past_v is not None:
                k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
        qh = split_heads(q, num_heads, head_dim)  # [B,H,T,Dh]
        scores = torch.matmul(qh, k.transpose(-1, -2)) * scale + bias  # [B,H,T,Tk]
        return merge_heads(torch.matmul(scores.softmax(dim=-1), v)), k, v

    @staticmethod
    def symbolic(g: Any, q: Any, k: Any, v: Any, bias: Any, past_k: Any, past_v: Any,
                 num_heads: int, scale: float) -> Any:
        none = g.op("prim::Constant")  # an omitted optional input ("" in the ONNX node)
        none.setType(torch._C.OptionalType.ofTensor())
        if past_k is None:  # cross-attention over cached K/V: no present outputs
            out = g.op("com.microsoft::MultiHeadAttention", q, k, v, none, none, bias,
                       num_heads_i=num_heads, scale_f=scale)
            out.setType(q.type())
            return out, k, v
        out, key, value = g.op("com.microsoft::MultiHeadAttention", q, k, v, none, none, bias,
                               past_k, past_v, num_heads_i=num_heads, scale_f=scale, outputs=3)
        out.setType(q.type())
        key.setType(past_k.type())
        value.setType(past_v.type())
        return out, key, value


class MultiHeadAttention(nn.Module):
    """Separate W_Q, W_K, W_V projections per head group and the output projection W_O.

    W_O mixes the heads' outputs back into one D-dim vector; without it each head would only
    ever write to its own Dh slice of the residual stream.
    """

    def __init__(self, d_model: int, num_heads: int, bias: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of x [B,S,D], each [B,H,S,Dh]."""
        return (split_heads(self.k_proj(x), self.num_heads, self.head_dim),
                split_heads(self.v_proj(x), self.num_heads, self.head_dim))

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor,
               rope: Rope | None = None) -> torch.Tensor:
        """Queries from x [B,T,D] against given keys/values; returns [B,T,D]."""
        q = split_heads(self.q_proj(x), self.num_heads, self.head_dim)  # [B,H,T,Dh]
        if rope is not None:
            q = apply_rope(q, rope)
        out = scaled_dot_product(q, k, v, blocked, self.head_dim ** -0.5)
        return self.out_proj(merge_heads(out))

    def _rotate_fused(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """x [B,T,D] with RoPE applied per head, as one RotaryEmbedding node when traced."""
        return FusedRotary.apply(x, rope.position_ids, rope.cos_table.to(x.dtype),
                                 rope.sin_table.to(x.dtype), self.num_heads)

    def attend_fused(self, x: torch.Tensor, bias: torch.Tensor,
                     past: tuple[torch.Tensor, torch.Tensor] | None = None,
                     rope: Rope | None = None,
                     cached: tuple[torch.Tensor, torch.Tensor] | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention of x [B,T,D] through FusedAttention (export only).

        Self-attention (cached None): keys and values from x, appended to `past` when given;
        W_Q, W_K and W_V run as one [D, 3D] GEMM (one kernel and one activation quantization
        instead of three). Cross-attention: `cached` K/V [B,H,S,Dh] from the encoder.
        Returns the output [B,T,D] and the keys/values attended over, each [B,H,len,Dh].
        """
        if cached is None:
            weight = torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
            biases = (self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)
            joint = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
            # [B,T,3D] -> 3 x [B,T,D]
            q, k, v = F.linear(x, weight, joint).split(self.q_proj.out_features, dim=-1)
            if rope is not None:  # keys are cached already rotated
                k = self._rotate_fused(k, rope)
        else:
            q, (k, v) = self.q_proj(x), cached
            # a group's G rows become G*T query positions of its one K/V row. Bc is read off
            # the bias, which every layer shares, and D is a Python int: traced, the shape
            # ops are the same in every layer and ONNX Runtime computes them once per step
            # (reading Bc off each layer's K and D off q cost ~13 shape nodes per layer)
            q = q.reshape(bias.shape[0], -1, self.q_proj.out_features)  # [B,T,D] -> [Bc,G*T,D]
        if rope is not None:
            q = self._rotate_fused(q, rope)
        past_k, past_v = past if past is not None else (None, None)
        out, k, v = FusedAttention.apply(q, k, v, bias, past_k, past_v, self.num_heads,
                                         self.head_dim ** -0.5)
        if cached is not None and self.q_proj.out_features == self.q_proj.in_features:
            out = out.reshape_as(x)  # [Bc,G*T,D] -> [B,T,D]: one Shape op, no Gathers
        elif cached is not None:
            out = out.reshape(x.shape[0], x.shape[1], -1)  # [Bc,G*T,H*Dh] -> [B,T,H*Dh]
        return self.out_proj(out), k, v


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


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder Transformer with an incremental (KV-cached) decoder."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        shared = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_token_id)
        self.shared = shared
        self.encoder_embed = Embeddings(cfg, shared, cfg.max_source_positions)
        self.decoder_embed = Embeddings(cfg, shared, cfg.max_target_positions)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        pre = cfg.norm == "pre"
        # pre-norm stacks leave the residual stream unnormalised, so each ends with a LayerNorm
        self.encoder_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if pre else None
        self.decoder_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if pre else None
        rope = cfg.positions == "rope"
        max_positions = max(cfg.max_source_positions, cfg.max_target_positions)
        self.rope = (RotaryEmbedding(cfg.head_dim, cfg.rope_base, max_positions) if rope
                     else None)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = shared.weight
        if cfg.final_logits_bias:
            self.final_logits_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        else:
            self.final_logits_bias = None
        # export-time switch (export.graphs): trace attention as ONNX Runtime's fused
        # MultiHeadAttention op; the eager maths are the same either way
        self.use_fused_attention = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.d_model**-0.5
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.shared.weight, std=std)
        if not self.config.tie_word_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)
        with torch.no_grad():
            self.shared.weight[self.config.pad_token_id].zero_()

    # -- input checks (eager only: they would be data-dependent branches in a traced graph) --

    def _check_ids(self, name: str, ids: torch.Tensor, limit: int) -> None:
        if torch.jit.is_tracing() or torch.compiler.is_compiling():
            return
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must be an integer tensor, got {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
            raise ValueError(
                f"{name} holds ids outside [0, {limit}): min {int(ids.min())}, max {int(ids.max())}"
            )

    # -- encoder ------------------------------------------------------------------------------

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask [B,S] (1 token, 0 pad) -> encoder hidden states [B,S,D]."""
        self._check_ids("input_ids", input_ids, self.config.vocab_size)
        if not (torch.jit.is_tracing() or torch.compiler.is_compiling()):
            if input_ids.shape[1] > self.config.max_source_positions:
                raise ValueError(
                    f"input_ids length {input_ids.shape[1]} exceeds max_source_positions "
                    f"{self.config.max_source_positions}"
                )
        seq_len = input_ids.shape[1]
        position_ids = torch.arange(seq_len, device=input_ids.device)[None, :]  # [1,S]
        position_ids = position_ids.expand_as(input_ids)  # [B,S]
        x = self.encoder_embed(input_ids, position_ids)
        mask = attention_mask[:, None, None, :] == 0  # [B,1,1,S] keys that are padding
        if self.use_fused_attention:
            # the fused kernel wants the bias at its full [B,1,S,S] shape
            mask = blocked_to_bias(mask.expand(-1, -1, seq_len, -1), x.dtype)
        rope = self.rope(position_ids) if self.rope is not None else None
        for layer in self.encoder_layers:
            x = layer(x, mask, rope)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return x

    def cross_kv(self, encoder_hidden_states: torch.Tensor) -> KVCache:
        """Every decoder layer's cross-attention K/V, computed once per source: [B,H,S,Dh]."""
        return [layer.cross_attn.project_kv(encoder_hidden_states) for layer in self.decoder_layers]

    # -- decoder ------------------------------------------------------------------------------

    def empty_cache(self, batch: int, device: torch.device | None = None,
                    dtype: torch.dtype | None = None) -> KVCache:
        """A P = 0 self-attention cache for the first step."""
        dtype = dtype or self.shared.weight.dtype
        shape = (batch, self.config.num_heads, 0, self.config.head_dim)  # [B,H,0,Dh]
        return [
            (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device,
                                                                         dtype=dtype))
            for _ in self.decoder_layers
        ]

    def decode_step(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        self_attention_mask: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        past: KVCache,
        cross: KVCache,
    ) -> tuple[torch.Tensor, KVCache]:
        """One decoder call over T new tokens; returns logits [B,T,V] and the grown cache.

        input_ids, position_ids [B,T]; self_attention_mask [B,P+T] (0 = a hole: a cache slot
        this row never filled); encoder_attention_mask [B,S]; past [B,H,P,Dh] per layer;
        cross [B,H,S,Dh] per layer. New token t sits at key index P + t and may see the keys
        j <= P + t that its row's mask marks valid (look-ahead + padding masks).
        """
        self._check_ids("decoder input_ids", input_ids, self.config.vocab_size)
        if (self.config.positions != "rope" and not torch.jit.is_tracing()
                and not torch.compiler.is_compiling() and position_ids.numel()):
            limit = self.config.max_target_positions
            if int(position_ids.max()) >= limit or int(position_ids.min()) < 0:
                raise ValueError(f"position_ids must be in [0, max_target_positions={limit})")
        new_len = input_ids.shape[1]
        total_len = self_attention_mask.shape[1]
        query_pos = torch.arange(new_len, device=input_ids.device) + (total_len - new_len)  # [T]
        key_pos = torch.arange(total_len, device=input_ids.device)  # [P+T]
        future = key_pos[None, :] > query_pos[:, None]  # [T,P+T] look-ahead
        self_blocked = (self_attention_mask[:, None, None, :] == 0) | future  # [B,1,T,P+T]
        # the cross K/V and encoder mask may have one row per group of G consecutive rows
        # (a beam search's rows share their sentence's): Bc = B / G rows
        cross_blocked = encoder_attention_mask[:, None, None, :] == 0  # [Bc,1,1,S]
        if self.use_fused_attention:
            # additive biases at the full shapes the fused kernel takes: [B,1,T,P+T] and,
            # with a group's queries side by side, [Bc,1,G*T,S]
            dtype = self.shared.weight.dtype
            self_blocked = blocked_to_bias(self_blocked, dtype)  # type: ignore[assignment]
            group_queries = input_ids.shape[0] * new_len // encoder_attention_mask.shape[0]
            cross_blocked = blocked_to_bias(
                cross_blocked.expand(-1, -1, group_queries, -1), dtype)

        x = self.decoder_embed(input_ids, position_ids)
        rope = self.rope(position_ids) if self.rope is not None else None
        present: KVCache = []
        for layer, layer_past, layer_cross in zip(self.decoder_layers, past, cross):
            x, kv = layer(x, self_blocked, cross_blocked, layer_past, layer_cross, rope)
            present.append(kv)
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        logits = self.lm_head(x)  # [B,T,V]
        if self.final_logits_bias is not None:
            logits = logits + self.final_logits_bias
        return logits, present

    def top_candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each position's best K = min(TOP_CANDIDATES, V) log-probabilities [B,T,K] (float32
        even for fp16 logits: the search's scores accumulate them; best first) and their token
        ids [B,T,K]: the decoder graph's top outputs, and the eager backend's."""
        k = min(TOP_CANDIDATES, self.config.vocab_size)
        # no cast of fp32 logits: traced, .float() is a Cast that copies [B,T,V] every step
        # (ONNX Runtime keeps it, its output being a graph output)
        scores = logits if logits.dtype == torch.float32 else logits.float()
        return scores.log_softmax(dim=-1).topk(k, dim=-1)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        decoder_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher-forced logits [B,T,V] for right-padded decoder inputs [B,T]."""
        hidden = self.encode(input_ids, attention_mask)
        batch, tgt_len = decoder_input_ids.shape
        if decoder_attention_mask is None:
            decoder_attention_mask = torch.ones_like(decoder_input_ids)
        position_ids = torch.arange(tgt_len, device=decoder_input_ids.device).expand(batch, -1)
        logits, _ = self.decode_step(
            decoder_input_ids,
            position_ids,
            decoder_attention_mask,
            attention_mask,
            self.empty_cache(batch, decoder_input_ids.device, hidden.dtype),
            self.cross_kv(hidden),
        )
        return logits

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


# -- checkpoints ----------------------------------------------------------------------------

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

