"""Multi-head attention (W_Q/W_K/W_V/W_O), with its fused ONNX form and the KV cache."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tfserve.model.heads import merge_heads, split_heads
from tfserve.model.positions import FusedRotary, Rope, apply_rope

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (key, value), each [B,H,len,Dh]


def scaled_dot_product(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor, scale: float,
    position_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(Dh) (+ position bias), masked) v.

    q [B,H,Tq,Dh], k/v [B,H,Tk,Dh], scale = Dh ** -0.5 or 1.0 (a Python float, so it is a
    constant in the graphs), blocked bool broadcastable to [B,H,Tq,Tk] (True: the
    query may not see that key). It is computed once per call of the stack, not per layer, so
    the graphs carry one Where per attention and no per-layer mask arithmetic.
    Masked scores are set to the dtype's minimum rather than -inf: a query whose keys are all
    masked (a padding row) then gets a uniform distribution instead of NaN (masked_fill
    replaces the score, so nothing is added to the minimum and nothing overflows).
    position_bias: T5's relative position bias, broadcastable to [B,H,Tq,Tk], added to the
    scores before the mask.
    Half-precision scores are normalised in float32 (the softmax's max and sum), as the fused
    op's kernels do.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B,H,Tq,Tk]
    if position_bias is not None:
        scores = scores + position_bias
    scores = scores.masked_fill(blocked, torch.finfo(scores.dtype).min)
    return torch.matmul(softmax_fp32(scores), v)  # [B,H,Tq,Dh]


def softmax_fp32(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim, its max and sum in float32 for half-precision scores; the
    probabilities in the scores' dtype. float32 scores are not cast (traced, a same-type
    Cast is still a node)."""
    if scores.dtype == torch.float32:
        return scores.softmax(dim=-1)
    return scores.float().softmax(dim=-1).to(scores.dtype)


# The additive mask of float16 graphs. The dtype's minimum (-65504) plus a score of -16 or
# less rounds to -inf in float16 arithmetic, and a row whose keys are all masked then
# normalises to NaN. With -1e4 (ONNX Runtime's own mask_filter_value) any score above -55504
# stays finite, a fully masked row stays finite, and a masked key still gets zero weight
# (exp(-1e4) underflows) unless the row's scores differ by thousands.
FP16_MASK_BIAS = -1.0e4


def mask_bias(dtype: torch.dtype) -> float:
    """The additive score bias of a blocked key in the fused graphs of `dtype`: float32's
    minimum (|score| is far below the spacing of floats there, so score + min == min, the
    same scores as scaled_dot_product's masked_fill, padding rows included), FP16_MASK_BIAS
    for half precision."""
    return torch.finfo(dtype).min if dtype == torch.float32 else FP16_MASK_BIAS


def blocked_to_bias(blocked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True: blocked) -> additive bias, mask_bias(dtype) where blocked."""
    return blocked.to(dtype) * mask_bias(dtype)


class FusedAttention(torch.autograd.Function):
    """Exported as ONNX Runtime's com.microsoft.MultiHeadAttention: one node instead of ~12.

    Head split, past concat, q k^T * scale + bias, softmax, @ v and head merge in one kernel
    (fp32 and fp16 on CUDA and, in recent ONNX Runtimes, on CPU; the kernels normalise in
    float32). Used while exporting fp32 and fp16 graphs
    (`Seq2SeqTransformer.use_fused_attention`); `forward` is the reference computation the
    tracer runs, the same maths as the unfused path (`bias` holds mask_bias where a key is
    blocked).

    q [B,T,D]; k/v either new projections [B,T,D] (self-attention; with past [B,H,P,Dh] they
    are appended) or cached cross K/V [B,H,S,Dh]; bias [B,1,T,P+T] (or [B,1,T,S]) additive,
    or [B,H,T,P+T] with a relative position bias per head (T5).
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
        return merge_heads(torch.matmul(softmax_fp32(scores), v)), k, v

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

    def __init__(self, d_model: int, num_heads: int, bias: bool, head_dim: int | None = None,
                 scaled: bool = True) -> None:
        """head_dim: per head (default d_model / num_heads; T5's d_kv may make num_heads *
        head_dim differ from d_model). scaled: scores q.k / sqrt(head_dim), else q.k (T5)."""
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim or d_model // num_heads
        inner = num_heads * self.head_dim
        self.scale = self.head_dim ** -0.5 if scaled else 1.0
        self.q_proj = nn.Linear(d_model, inner, bias=bias)
        self.k_proj = nn.Linear(d_model, inner, bias=bias)
        self.v_proj = nn.Linear(d_model, inner, bias=bias)
        self.out_proj = nn.Linear(inner, d_model, bias=bias)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of x [B,S,D], each [B,H,S,Dh]."""
        return (split_heads(self.k_proj(x), self.num_heads, self.head_dim),
                split_heads(self.v_proj(x), self.num_heads, self.head_dim))

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor,
               rope: Rope | None = None, position_bias: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Queries from x [B,T,D] against given keys/values; returns [B,T,D]."""
        q = split_heads(self.q_proj(x), self.num_heads, self.head_dim)  # [B,H,T,Dh]
        if rope is not None:
            q = apply_rope(q, rope)
        out = scaled_dot_product(q, k, v, blocked, self.scale, position_bias)
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
                                         self.scale)
        if cached is not None and self.q_proj.out_features == self.q_proj.in_features:
            out = out.reshape_as(x)  # [Bc,G*T,D] -> [B,T,D]: one Shape op, no Gathers
        elif cached is not None:
            out = out.reshape(x.shape[0], x.shape[1], -1)  # [Bc,G*T,H*Dh] -> [B,T,H*Dh]
        return self.out_proj(out), k, v
