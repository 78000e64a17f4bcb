"""Shared helpers for the tests: tiny models, padded batches, an incremental decoder driver.

Everything here is deliberately small (d_model 32, 2 heads, 2 layers, vocab 50) so the whole
suite runs in seconds on a 2-core CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from tfserve.artifacts.model_config import ModelConfig
from tfserve.model import Seq2SeqTransformer

POSITIONS = ("sinusoidal", "rope", "learned")
NORMS = ("post", "pre")
FIRST_REGULAR_ID = 3  # 0 pad, 1 eos, 2 unk in every tiny config


def tiny_config(positions: str = "sinusoidal", norm: str = "post", **overrides) -> ModelConfig:
    values = dict(
        vocab_size=50,
        d_model=32,
        num_heads=2,
        encoder_layers=2,
        decoder_layers=2,
        ffn_dim=64,
        activation="gelu",
        positions=positions,
        norm=norm,
        max_source_positions=32,
        max_target_positions=32,
    )
    values.update(overrides)
    return ModelConfig(**values)


def describe(cfg: ModelConfig) -> str:
    """A short config summary for failure messages."""
    return (
        f"positions={cfg.positions} norm={cfg.norm} layout={cfg.sinusoidal_layout} "
        f"tie={cfg.tie_word_embeddings} final_logits_bias={cfg.final_logits_bias} "
        f"d_model={cfg.d_model} heads={cfg.num_heads} layers={cfg.encoder_layers}/"
        f"{cfg.decoder_layers} vocab={cfg.vocab_size}"
    )


def tiny_model(positions: str = "sinusoidal", norm: str = "post", seed: int = 0,
               **overrides) -> Seq2SeqTransformer:
    """A random tiny model in eval mode.

    LayerNorm affine parameters, biases and the final logits bias are randomised too (they
    start at 1 / 0), so a test also notices when one of them is skipped or applied twice.
    """
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(tiny_config(positions, norm, **overrides))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.normal_(1.0, 0.1)
                module.bias.normal_(0.0, 0.1)
            elif isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.1)
            elif isinstance(module, nn.Embedding) and module is not model.shared:
                module.weight.normal_(0.0, 0.2)  # learned positions
        if model.final_logits_bias is not None:
            model.final_logits_bias.normal_(0.0, 0.5)
    return model.eval()


def padded_batch(lengths: list[int], vocab_size: int = 50, seed: int = 0,
                 pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random ids [B,max(lengths)] (no special tokens) and their 0/1 mask."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(lengths), width), dtype=torch.int64)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(FIRST_REGULAR_ID, vocab_size, (length,), generator=gen)
        mask[row, :length] = 1
    return ids, mask


def decoder_inputs(lengths: list[int], vocab_size: int = 50, seed: int = 1,
                   start_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded decoder inputs that begin with the start token, and their mask."""
    ids, mask = padded_batch(lengths, vocab_size, seed)
    ids[:, 0] = start_id
    return ids, mask


@torch.no_grad()
def incremental_logits(model: Seq2SeqTransformer, src: torch.Tensor, src_mask: torch.Tensor,
                       tgt: torch.Tensor, tgt_mask: torch.Tensor | None = None,
                       chunk: int = 1) -> torch.Tensor:
    """Logits [B,T,V] from decode_step fed `chunk` tokens per call, starting from an empty cache.

    position_ids are the step indices; the self-attention mask grows by the new tokens' mask
    columns (all ones for unpadded targets).
    """
    batch, length = tgt.shape
    if tgt_mask is None:
        tgt_mask = torch.ones_like(tgt)
    cross = model.cross_kv(model.encode(src, src_mask))
    past = model.empty_cache(batch)
    pieces = []
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        position_ids = torch.arange(start, stop).expand(batch, -1)
        logits, past = model.decode_step(tgt[:, start:stop], position_ids, tgt_mask[:, :stop],
                                         src_mask, past, cross)
        pieces.append(logits)
    return torch.cat(pieces, dim=1)


def max_masked_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest |a - b| over the positions where mask [B,T] is 1 (a, b [B,T,...])."""
    keep = mask.bool()
    return float((a[keep] - b[keep]).abs().max())
