"""Positions: sinusoidal tables, rotary embeddings (RoPE) and their fused ONNX form, and
T5's relative position bias."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from tfserve.model.heads import merge_heads, split_heads


def sinusoidal_table(num_positions: int, dim: int, layout: str = "interleaved") -> torch.Tensor:
    """The paper's table: PE[pos, 2i] = sin(pos / 10000^(2i/dim)), PE[pos, 2i+1] = cos(same).

    `layout="half"` is Marian's variant: [sin of every frequency | cos of every frequency].
    Computed in float64 so both layouts are exact to fp32 rounding at long positions.
    `layout="fairseq"` (M2M100, NLLB) is fairseq_table's.
    """
    if layout == "fairseq":
        return fairseq_table(num_positions, dim)
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


def fairseq_table(num_positions: int, dim: int, padding_row: int | None = None
                  ) -> torch.Tensor:
    """fairseq's sinusoidal table (M2M100, NLLB): [sin | cos] halves at the frequencies
    10000^(-i / (dim/2 - 1)), i = 0..dim/2-1 [num_positions, dim]; an odd dim has a last
    column of zeros (half = dim // 2, as fairseq and transformers zero-pad it).

    Computed in float32 with the very ops of fairseq and transformers
    (M2M100SinusoidalPositionalEmbedding.get_embedding), so the table equals theirs bit for
    bit: in float32 the angle pos * frequency is rounded, and a float64 table would differ
    from the checkpoint's by up to ~1e-4 at position 1,000. padding_row: a row of zeros
    (the pad tokens' position).
    """
    half = dim // 2
    step = math.log(10000) / (half - 1)
    frequencies = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)  # [dim/2]
    angles = (torch.arange(num_positions, dtype=torch.int64).float().unsqueeze(1)
              * frequencies.unsqueeze(0))  # [N, dim/2]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)  # [N, 2 * (dim // 2)]
    if dim % 2:
        table = torch.cat([table, torch.zeros(num_positions, 1)], dim=1)  # [N, dim]
    if padding_row is not None:
        table[padding_row, :] = 0
    return table


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
    Exported graphs (fp32, fp16) apply it with ONNX Runtime's RotaryEmbedding op (`FusedRotary`),
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
    tracer runs (the same as apply_rope). Used with the fused attention (fp32 and fp16 graphs).
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


# -- relative position bias (T5) ------------------------------------------------------------


def bucket_of_distance(num_buckets: int, max_distance: int) -> torch.Tensor:
    """bucket[n] for distances n = 0..max_distance [max_distance + 1] (int64), T5's mapping
    of one direction's distances onto its `num_buckets` buckets.

    The first half of the buckets hold the distances 0..max_exact-1 one each; the others
    cover max_exact..max_distance logarithmically, and every distance >= max_distance falls
    in the last bucket, so a lookup at min(n, max_distance) is the mapping for any distance.
    Evaluated here with transformers' own float32 ops (T5Attention._relative_position_bucket),
    once: the graphs then look the buckets up instead of computing a log, whose last bit may
    differ between ONNX Runtime's kernels and PyTorch's and would move a distance that lands
    on a bucket boundary (16, 32, 64 with the default 32 buckets and 128) into its neighbour.
    """
    max_exact = num_buckets // 2
    n = torch.arange(max_distance + 1)
    large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.clamp(large, max=num_buckets - 1)
    return torch.where(n < max_exact, n, large)


class RelativePositionBias(nn.Module):
    """T5's relative position bias: a learned scalar per (distance bucket, head), added to the
    self-attention scores of every layer of one stack (computed once per stack call).

    Bidirectional (encoder): half of the buckets for keys after the query, half for keys at
    or before it. Causal (decoder): all buckets for keys at or before the query; keys after
    it get bucket 0, which the look-ahead mask hides anyway.
    """

    bucket_table: torch.Tensor

    def __init__(self, num_buckets: int, max_distance: int, num_heads: int,
                 bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.max_distance = max_distance
        self.direction_buckets = num_buckets // 2 if bidirectional else num_buckets
        self.bias = nn.Embedding(num_buckets, num_heads)  # [buckets,H]
        # derived from the config, so not stored in checkpoints
        self.register_buffer("bucket_table",
                             bucket_of_distance(self.direction_buckets, max_distance),
                             persistent=False)  # [max_distance+1]

    def forward(self, query_positions: torch.Tensor, key_positions: torch.Tensor
                ) -> torch.Tensor:
        """query_positions [B,T], key_positions [B,K] (B may be 1) -> bias [B,H,T,K]."""
        relative = key_positions[:, None, :] - query_positions[:, :, None]  # [B,T,K]
        if self.bidirectional:
            offset = (relative > 0).to(torch.long) * self.direction_buckets
            distance = relative.abs()
        else:
            offset = None
            distance = (-relative).clamp(min=0)
        bucket = self.bucket_table[distance.clamp(max=self.max_distance)]  # [B,T,K]
        if offset is not None:
            bucket = bucket + offset
        return self.bias(bucket).permute(0, 3, 1, 2)  # [B,T,K,H] -> [B,H,T,K]
