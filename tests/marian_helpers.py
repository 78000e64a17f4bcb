"""Tiny random MarianMT checkpoints for tests/export/test_marian.py (needs transformers).

Everything is built here, nothing is downloaded: two SentencePiece models trained on
generated sentences (source.spm, target.spm), a Marian-style vocab.json ("</s>" 0, "<unk>" 1,
the pieces of both models, "<pad>" last), tokenizer_config.json written by MarianTokenizer
itself, and a MarianMTModel with random weights saved by transformers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch

from tfserve.bench.models import train_spm  # noqa: F401  (the one SentencePiece recipe)

SOURCE_WORDS = (
    "the cat dog house tree river city road small big green red blue old new one two three "
    "four five six seven eight nine ten hundred thousand is are was were have has with "
    "without for from into under over near far very quite really good bad quick slow "
    "café naïve résumé coöperate façade jalapeño über straße smörgåsbord"
).split()
TARGET_WORDS = (
    "le la les un une des chat chien maison arbre rivière ville route petit grand vert rouge "
    "bleu vieux nouveau deux trois quatre cinq six sept huit neuf dix cent mille est sont "
    "était avec sans pour dans sous sur près loin très bien mal vite lent où déjà être "
    "garçon français noël cœur œuvre"
).split()
PUNCTUATION = (".", ",", "!", "?", ";", ":", "'", '"', "(", ")", "-")


def corpus(words: tuple[str, ...] | list[str], count: int, seed: int) -> list[str]:
    """`count` sentences of 1..12 words with digits and punctuation sprinkled in."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 12)):
            roll = rng.random()
            if roll < 0.08:
                parts.append(str(rng.randint(0, 2024)))
            elif roll < 0.15:
                parts.append(rng.choice(words).capitalize())
            else:
                parts.append(rng.choice(words))
            if rng.random() < 0.1:
                parts[-1] += rng.choice(PUNCTUATION)
        lines.append(" ".join(parts))
    return lines


def spm_pieces(model: bytes) -> list[str]:
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(model)
    return [processor.IdToPiece(i) for i in range(processor.GetPieceSize())
            if not (processor.IsControl(i) or processor.IsUnknown(i))]


def build_vocab(source: bytes, target: bytes, drop: int = 3,
                language_codes: tuple[str, ...] = ()) -> dict[str, int]:
    """Marian's vocab.json: "</s>", "<unk>", source then target pieces, codes, "<pad>" last.

    Every 17th source piece (the first `drop` of them) is left out, so some pieces that
    source.spm produces are not in the vocabulary and must become <unk>.
    """
    pieces = ["</s>", "<unk>"]
    dropped = 0
    for index, piece in enumerate(spm_pieces(source)):
        if index % 17 == 5 and dropped < drop:
            dropped += 1
            continue
        pieces.append(piece)
    seen = set(pieces)
    pieces += [p for p in spm_pieces(target) if p not in seen]
    pieces += list(language_codes)
    pieces.append("<pad>")
    return {piece: index for index, piece in enumerate(pieces)}


def marian_config(vocab_size: int, **overrides: Any):
    """A tiny MarianConfig: opus-mt's conventions (eos 0, pad = decoder start = last id)."""
    from transformers import MarianConfig

    values: dict[str, Any] = dict(
        vocab_size=vocab_size,
        decoder_vocab_size=vocab_size,
        d_model=24,
        encoder_attention_heads=3,
        decoder_attention_heads=3,
        encoder_layers=2,
        decoder_layers=1,
        encoder_ffn_dim=40,
        decoder_ffn_dim=40,
        max_position_embeddings=64,
        activation_function="swish",
        scale_embedding=True,
        pad_token_id=vocab_size - 1,
        decoder_start_token_id=vocab_size - 1,
        eos_token_id=0,
        forced_eos_token_id=0,
        dropout=0.1,
    )
    values.update(overrides)
    return MarianConfig(**values)


@torch.no_grad()
def randomize(model, seed: int, eos_boost: float = 1.5, gain: float = 2.0) -> None:
    """Random weights everywhere (LayerNorms, biases and final_logits_bias too).

    The scales were picked so that a random model is not degenerate: with `gain` times the
    1/sqrt(fan_in) std on every projection, outputs depend on the input (about 30 distinct
    greedy outputs for 50 inputs), beam search often differs from greedy, and the logits
    are peaked enough that near-ties between the two best tokens (which would make token
    comparisons flaky) are rare. `eos_boost` raises eos so that about half of the outputs
    end before max_new_tokens=20.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "layer_norm" in name:
            base = 1.0 if name.endswith("weight") else 0.0
            param.copy_(base + 0.1 * torch.randn(param.shape, generator=gen))
        elif name.endswith("bias"):
            param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        elif "embed_tokens" in name or "shared" in name or "lm_head" in name:
            param.copy_(0.25 * torch.randn(param.shape, generator=gen))
        elif "embed_positions" in name:
            continue
        else:
            param.copy_(gain * torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
    bias = 0.5 * torch.randn(model.final_logits_bias.shape, generator=gen)
    bias[..., model.config.eos_token_id] += eos_boost
    model.final_logits_bias.copy_(bias)


def write_checkpoint(directory: Path, source_spm: bytes, target_spm: bytes,
                     vocab: dict[str, int], weights: str = "safetensors", seed: int = 0,
                     eos_boost: float = 1.5, init_std: float | None = None,
                     **config_overrides: Any):
    """A MarianMT checkpoint directory; returns the transformers model (eval mode).

    weights: "safetensors" (save_pretrained), "sharded" (save_pretrained in small shards) or
    "bin" (pytorch_model.bin holding the full state dict with its tied aliases and position
    tables, the layout of older checkpoints; transformers 5 always writes safetensors).
    init_std: keep transformers' own initialization, normal(0, init_std) for every projection
    and embedding (LayerNorms at 1 and 0, no logits bias), instead of `randomize`; with
    init_std 0.5 and d_model 128 the logits reach |20| (large-logit parity tests).
    """
    from transformers import MarianMTModel, MarianTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if init_std is not None:
        config_overrides["init_std"] = init_std
    model = MarianMTModel(marian_config(len(vocab), **config_overrides))
    if init_std is None:
        randomize(model, seed, eos_boost)
    if not model.config.tie_word_embeddings:
        # transformers 5 ties nothing when tie_word_embeddings is false, not even the encoder
        # and decoder tables to `shared`: keep one token table (tfserve's model has one) and
        # let only lm_head differ
        with torch.no_grad():
            for stack in (model.model.encoder, model.model.decoder):
                stack.embed_tokens.weight.copy_(model.model.shared.weight)
    model.eval()
    # as in opus-mt's generation_config.json: generate() never produces the pad token
    model.generation_config.bad_words_ids = [[model.config.pad_token_id]]
    if weights == "bin":
        model.save_pretrained(directory)
        (directory / "model.safetensors").unlink()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save(state, directory / "pytorch_model.bin")
    elif weights == "sharded":
        model.save_pretrained(directory, max_shard_size="20KB")
    else:
        model.save_pretrained(directory)
    (directory / "source.spm").write_bytes(source_spm)
    (directory / "target.spm").write_bytes(target_spm)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=1),
                                          encoding="utf-8")
    tokenizer = MarianTokenizer(source_spm=str(directory / "source.spm"),
                                target_spm=str(directory / "target.spm"),
                                vocab=str(directory / "vocab.json"),
                                source_lang="en", target_lang="fr")
    tokenizer.save_pretrained(directory)
    return model
