"""Tiny random T5-family checkpoints for tests/export/test_t5.py (needs transformers).

Everything is built here, nothing is downloaded: a SentencePiece model in T5's layout
(<pad> 0, </s> 1, <unk> 2, no bos) trained on generated sentences, with MADLAD-style
target-language pieces (<2fr>, <2de>) as user-defined symbols, wrapped by transformers'
T5Tokenizer with a few <extra_id_N> sentinels; and a T5ForConditionalGeneration or
MT5ForConditionalGeneration with random weights saved by transformers.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import marian_helpers as mh
import sentencepiece as spm
import torch

EXTRA_IDS = 8
LANGUAGE_TOKENS = ("<2fr>", "<2de>")


def train_t5_spm(vocab_size: int = 220) -> bytes:
    """A unigram SentencePiece model with T5's special ids, trained on English and French."""
    lines = mh.corpus(mh.SOURCE_WORDS, 400, seed=0) + mh.corpus(mh.TARGET_WORDS, 400, seed=1)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
        model_type="unigram", character_coverage=1.0, hard_vocab_limit=False, minloglevel=2,
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>",
        unk_piece="<unk>", user_defined_symbols=list(LANGUAGE_TOKENS))
    return model.getvalue()


def write_tokenizer(directory: Path, spiece: bytes, tokenizer_json: bool = True) -> None:
    """spiece.model and tokenizer_config.json, plus tokenizer.json when asked (what
    T5Tokenizer.save_pretrained writes); without it, only the SentencePiece model, as older
    T5 checkpoints ship."""
    from transformers import T5Tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "spiece.model").write_bytes(spiece)
    tokenizer = T5Tokenizer.from_pretrained(str(directory), extra_ids=EXTRA_IDS)
    tokenizer.save_pretrained(directory)
    if not tokenizer_json:
        (directory / "tokenizer.json").unlink()
    (directory / "spiece.model").write_bytes(spiece)


@torch.no_grad()
def randomize(model, seed: int, eos_boost: float, logit_gain: float = 3.0,
              cross_gain: float = 3.0) -> None:
    """Random weights everywhere, picked so that a random model is not degenerate.

    transformers' own initialisation for the projections, and: every norm weight near 1
    (the decoder's final one `logit_gain` times larger, so the logits are peaked enough that
    near-ties between the two best tokens are rare); relative position biases at std 1, so
    that distant buckets differ; the cross-attention outputs `cross_gain` times larger, so
    that the outputs depend on the source (about 20 to 50 distinct greedy outputs for 50
    inputs); and the last decoder FFN writing a positive amount into dimension 0 (its relu
    or gelu outputs times a positive row of wo), which eos's output row reads `eos_boost`
    more of, so that some outputs end before max_new_tokens and some do not.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "layer_norm" in name:
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
        elif "relative_attention_bias" in name:
            param.copy_(torch.randn(param.shape, generator=gen))
        elif "EncDecAttention.o" in name:
            param.mul_(cross_gain)
    model.decoder.final_layer_norm.weight.mul_(logit_gain)
    last = model.decoder.block[-1].layer[-1].DenseReluDense.wo.weight  # [D,F]
    last[0] = last[0].abs() * 3.0
    model.lm_head.weight[model.config.eos_token_id, 0] += eos_boost


def write_checkpoint(directory: Path, spiece: bytes, model_type: str = "t5",
                     tokenizer_json: bool = True, seed: int = 0, untied: bool = False,
                     old_style_config: bool = False, eos_boost: float = 1.0,
                     **config: Any):
    """A T5 (or mT5) checkpoint directory; returns the transformers model loaded from it.

    untied: an lm_head of its own (T5 v1.1, mT5), which transformers 5 keeps when the saved
    weights differ from the shared table. old_style_config: config.json as Flan-T5 ships it
    (tie_word_embeddings false, no scale_decoder_outputs), which transformers 5 reads as an
    unscaled decoder output.
    """
    from transformers import (
        MT5Config,
        MT5ForConditionalGeneration,
        T5Config,
        T5ForConditionalGeneration,
    )

    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory, spiece, tokenizer_json)
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(spiece)
    values = dict(vocab_size=processor.GetPieceSize() + EXTRA_IDS, decoder_start_token_id=0,
                  dropout_rate=0.1, **config)
    if untied and model_type == "t5":
        values["tie_word_embeddings"] = False  # transformers 5: no decoder output scaling
    torch.manual_seed(seed)
    if model_type == "mt5":
        model = MT5ForConditionalGeneration(MT5Config(**values))
    else:
        model = T5ForConditionalGeneration(T5Config(**values))
    if untied:
        model.lm_head.weight = torch.nn.Parameter(0.2 * torch.randn_like(model.shared.weight))
    randomize(model, seed, eos_boost=eos_boost)
    model.eval()
    model.save_pretrained(directory)
    if old_style_config:
        path = directory / "config.json"
        saved = json.loads(path.read_text(encoding="utf-8"))
        saved.pop("scale_decoder_outputs", None)
        saved["tie_word_embeddings"] = False
        path.write_text(json.dumps(saved, indent=1), encoding="utf-8")
    # the reference is the model transformers reads from the files
    return type(model).from_pretrained(str(directory)).eval()


def write_encoder_checkpoint(directory: Path, spiece: bytes, model_type: str = "t5",
                             seed: int = 0, **config: Any):
    """A T5EncoderModel (or MT5EncoderModel) checkpoint, as sentence-embedding models ship
    one: the encoder's weights alone, config.json with that architecture; returns the
    transformers model loaded from it. Norm weights near 1 and relative position biases at
    std 1, as in `randomize`, so that the hidden states depend on positions."""
    from transformers import MT5Config, MT5EncoderModel, T5Config, T5EncoderModel

    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory, spiece)
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(spiece)
    values = dict(vocab_size=processor.GetPieceSize() + EXTRA_IDS, dropout_rate=0.1, **config)
    torch.manual_seed(seed)
    model = (MT5EncoderModel(MT5Config(**values)) if model_type == "mt5"
             else T5EncoderModel(T5Config(**values)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif "relative_attention_bias" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
    model.eval()
    model.save_pretrained(directory)
    return type(model).from_pretrained(str(directory)).eval()


def sentences(count: int, seed: int, low: int = 1, high: int = 12) -> list[str]:
    """English-ish sentences; with high > 12, longer ones (several corpus lines joined)."""
    lines = mh.corpus(mh.SOURCE_WORDS, count * 3, seed=seed)
    if high <= 12:
        return lines[:count]
    return [" ".join(lines[3 * i: 3 * i + 3]) for i in range(count)]
