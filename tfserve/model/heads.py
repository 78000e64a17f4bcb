"""Splitting the model dimension into heads and back."""

from __future__ import annotations

import torch


def split_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    x = x.reshape(x.shape[0], x.shape[1], num_heads, head_dim)  # [B,T,D] -> [B,T,H,Dh]
    return x.transpose(1, 2)  # [B,H,T,Dh]


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    x = x.transpose(1, 2)  # [B,H,T,Dh] -> [B,T,H,Dh]
    return x.reshape(x.shape[0], x.shape[1], -1)  # [B,T,D]
