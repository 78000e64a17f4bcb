"""Tiny random BART-family checkpoints for tests/export/test_families.py (needs transformers).

Everything is built here, nothing is downloaded. Per family, a tokenizer trained on generated
sentences and wrapped by the family's own transformers tokenizer class (which writes what
the hub's checkpoints ship), and a model of that family with random weights at odd sizes
(d_model 36, 3 heads, FFN 52, 2 encoder + 3 decoder layers), saved by transformers:

- "nllb": NllbTokenizer (SentencePiece BPE -> tokenizer.json) with four language codes,
  M2M100ForConditionalGeneration; the model's vocabulary has two ids beyond the tokenizer's;
- "m2m100": M2M100Tokenizer (sentencepiece.bpe.model + vocab.json, some pieces left out of
  vocab.json; the 8 "wmt21" languages listed as special tokens, as the hub's checkpoints
  list theirs), M2M100ForConditionalGeneration;
- "mbart50": MBart50Tokenizer (SentencePiece unigram -> tokenizer.json, 52 languages),
  MBartForConditionalGeneration with decoder_start_token_id = eos;
- "cc25": MBartTokenizer (25 languages, `text </s> [src]`), MBartForConditionalGeneration
  whose decoder starts from fr_XX (an mBART-cc25 fine-tune into French);
- "bart": byte-level BPE (RobertaTokenizer, as BartTokenizer is in transformers 5),
  BartForConditionalGeneration (post-norm), generation settings of bart-large
  (forced_bos_token_id 0).
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import marian_helpers as mh
import sentencepiece as spm
import torch

FAMILIES = ("nllb", "m2m100", "mbart50", "cc25", "bart")
NLLB_CODES = ("eng_Latn", "fra_Latn", "deu_Latn", "spa_Latn")
M2M100_CODES = ("en", "ha", "is", "ja", "cs", "ru", "zh", "de")  # transformers' "wmt21"
SIZES = dict(d_model=36, encoder_attention_heads=3, decoder_attention_heads=3,
             encoder_ffn_dim=52, decoder_ffn_dim=52, encoder_layers=2, decoder_layers=3,
             max_position_embeddings=160, dropout=0.1)
# eos_boost and init_std per family: some greedy outputs of the test inputs end before 20
# new tokens and some do not (measured: 13 to 34 of 50 end), and 13 to 46 of them differ,
# with sharpness 1.5 (sharper attention makes the graphs' fp32 rounding exceed 1e-5 of the
# logits' scale: 1.8e-5 at sharpness 2)
EOS_BOOST = {"nllb": 1.5, "m2m100": 2.5, "mbart50": 1.0, "cc25": 1.5, "bart": 0.7}
INIT_STD = {"nllb": 0.2, "m2m100": 0.2, "mbart50": 0.2, "cc25": 0.2, "bart": 0.15}
# (source, targets) language codes the tests translate with, per family
LANGUAGES = {
    "nllb": ("eng_Latn", ("fra_Latn", "deu_Latn", "spa_Latn")),
    "m2m100": ("en", ("de", "ru", "ja")),
    "mbart50": ("en_XX", ("fr_XX", "de_DE", "ro_RO")),
    "cc25": ("en_XX", ("fr_XX",)),
    "bart": ("", ("",)),
}


def lines(count: int = 400) -> list[str]:
    return mh.corpus(mh.SOURCE_WORDS, count, seed=0) + mh.corpus(mh.TARGET_WORDS, count, seed=1)


def train_spm(model_type: str, vocab_size: int = 220) -> bytes:
    """A SentencePiece model (SentencePiece's own ids: unk 0, bos 1, eos 2)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines()), model_writer=model, vocab_size=vocab_size,
        model_type=model_type, character_coverage=1.0, hard_vocab_limit=False, minloglevel=2)
    return model.getvalue()


def write_tokenizer(name: str, directory: Path) -> Any:
    """The family's tokenizer files in `directory`; returns the transformers tokenizer."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    if name == "bart":
        from tokenizers import ByteLevelBPETokenizer

        trainer = ByteLevelBPETokenizer()
        trainer.train_from_iterator(lines(), vocab_size=300, min_frequency=2, show_progress=False,
                                    special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
        trainer.save_model(str(directory))
        tokenizer = transformers.BartTokenizer.from_pretrained(str(directory))
    elif name == "m2m100":
        model = train_spm("bpe")
        (directory / "sentencepiece.bpe.model").write_bytes(model)
        processor = spm.SentencePieceProcessor()
        processor.LoadFromSerializedProto(model)
        vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
        for index in range(processor.GetPieceSize()):
            piece = processor.IdToPiece(index)
            # every 23rd piece is left out: SentencePiece produces it, vocab.json maps it to unk
            if piece in vocab or processor.IsControl(index) or processor.IsUnknown(index) or \
                    index % 23 == 7:
                continue
            vocab[piece] = len(vocab)
        (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
        tokenizer = transformers.M2M100Tokenizer(
            str(directory / "vocab.json"), str(directory / "sentencepiece.bpe.model"),
            language_codes="wmt21", src_lang="en",
            additional_special_tokens=[f"__{code}__" for code in M2M100_CODES])
    else:
        model = train_spm("bpe" if name == "nllb" else "unigram")
        (directory / "sentencepiece.bpe.model").write_bytes(model)
        if name == "nllb":
            tokenizer = transformers.NllbTokenizer.from_pretrained(
                str(directory), additional_special_tokens=list(NLLB_CODES))
        elif name == "mbart50":
            tokenizer = transformers.MBart50Tokenizer.from_pretrained(str(directory))
        else:
            tokenizer = transformers.MBartTokenizer.from_pretrained(str(directory))
    tokenizer.save_pretrained(directory)
    return tokenizer


@torch.no_grad()
def randomize(model: Any, seed: int, eos_boost: float, sharpness: float) -> None:
    """Random weights picked so that a random model is not degenerate (as t5_helpers does):
    every LayerNorm weight near 1 and bias near 0, the decoder's last norm larger (peaked
    logits, few near-ties), learned positions and the final logits bias at std 1 (so they
    matter), cross-attention outputs larger and every attention's q and k `sharpness` times
    larger (outputs depend on the source), and eos's
    output row reading a dimension the last FFN writes into, so that some outputs end
    before max_new_tokens and some do not."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "layer_norm" in name or "layernorm" in name:
            if name.endswith("weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        elif "embed_positions" in name:
            param.copy_(torch.randn(param.shape, generator=gen))
        elif "encoder_attn.out_proj.weight" in name:
            param.mul_(3.0)
        elif "q_proj.weight" in name or "k_proj.weight" in name:
            param.mul_(sharpness)
    decoder = model.model.decoder
    last_norm = decoder.layer_norm if getattr(decoder, "layer_norm", None) is not None \
        else decoder.layers[-1].final_layer_norm
    last_norm.weight.mul_(3.0)
    if hasattr(model, "final_logits_bias"):
        model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=gen))
    fc2 = decoder.layers[-1].fc2.weight  # [D,F]
    fc2[0] = fc2[0].abs() * 3.0
    model.model.shared.weight[model.config.eos_token_id, 0] += eos_boost


def write_checkpoint(name: str, directory: Path, seed: int = 0, eos_boost: float | None = None,
                     sharpness: float = 1.5, init_std: float | None = None, **config: Any
                     ) -> tuple[Any, Any]:
    """A checkpoint directory of family `name`; returns (the transformers model as it loads
    from the directory, the tokenizer). init_std: transformers' initialisation of the
    projections and embeddings (its default 0.02 makes a random model's output ignore its
    source); sharpness: the factor of the attention's q and k projections (sharper
    attention, so that outputs depend on which tokens the source holds)."""
    import transformers

    tokenizer = write_tokenizer(name, directory)
    values: dict[str, Any] = {**SIZES, "vocab_size": len(tokenizer) + (2 if name == "nllb" else 0),
                              "pad_token_id": tokenizer.pad_token_id,
                              "eos_token_id": tokenizer.eos_token_id,
                              "bos_token_id": tokenizer.convert_tokens_to_ids("<s>")}
    if name in ("nllb", "m2m100"):
        values.update(scale_embedding=True, decoder_start_token_id=2)
        model_class, config_class = (transformers.M2M100ForConditionalGeneration,
                                     transformers.M2M100Config)
    elif name in ("mbart50", "cc25"):
        start = tokenizer.eos_token_id if name == "mbart50" else \
            tokenizer.convert_tokens_to_ids("fr_XX")
        values.update(scale_embedding=True, decoder_start_token_id=start,
                      activation_function="gelu")
        model_class, config_class = (transformers.MBartForConditionalGeneration,
                                     transformers.MBartConfig)
    else:
        values.update(scale_embedding=False, decoder_start_token_id=2, forced_bos_token_id=0)
        model_class, config_class = (transformers.BartForConditionalGeneration,
                                     transformers.BartConfig)
    values.update(init_std=INIT_STD[name] if init_std is None else init_std, **config)
    torch.manual_seed(seed)
    model = model_class(config_class(**values))
    randomize(model, seed, EOS_BOOST[name] if eos_boost is None else eos_boost, sharpness)
    model.eval()
    model.save_pretrained(directory)
    # the reference: transformers' plain attention maths. Its default (PyTorch's fused SDPA
    # kernel) rounds otherwise: on these models the two differ by up to 2e-5 of the logits'
    # scale, while tfserve's eager model equals the plain maths to the last bit
    reference = model_class.from_pretrained(str(directory), attn_implementation="eager")
    return reference.eval(), tokenizer


def sentences(count: int, seed: int) -> list[str]:
    """English-ish sentences of 1 to ~30 words (one to three corpus lines)."""
    rng = random.Random(seed)
    pool = mh.corpus(mh.SOURCE_WORDS, 3 * count, seed=seed)
    return [" ".join(pool[3 * i: 3 * i + rng.randint(1, 3)]) for i in range(count)]
