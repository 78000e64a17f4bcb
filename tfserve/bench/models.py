"""The random models the benchmarks build, and the inputs they decode. Nothing is downloaded.

- `make_random_base`: a native tfserve checkpoint of opus-mt-base size (the offline benchmark);
- `build_checkpoint`: a MarianMT checkpoint with transformers' own random initialisation, real
  Marian tokenizer files (a SentencePiece model trained on generated pseudo-words, vocab.json
  padded with synthetic pieces, "<pad>" last as in opus-mt), for the engines comparison;
- `make_inputs`: source id sequences of generated text, split by a checkpoint's source.spm.

torch, transformers and sentencepiece are imported by the functions that need them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    """The size of a random encoder-decoder model (as many decoder as encoder layers)."""

    name: str
    d_model: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    positions: int


# Helsinki-NLP/opus-mt-* (transformer-base) sizes
BASE_MODEL = ModelSpec("random-opus-mt-base", d_model=512, layers=6, heads=8, ffn=2048,
                       vocab=32000, positions=512)
QUICK_MODEL = ModelSpec("random-opus-mt-tiny", d_model=32, layers=2, heads=4, ffn=64,
                        vocab=2500, positions=64)

SOURCE_LENGTHS = (20, 25)  # source tokens per sentence, </s> included
SYLLABLES = ("ka lo mi tre sen vor pa qui dun el ra bo ste nu fi gar osh li ten wa zu xen po "
             "dri mal an is der ung ver ch sch au ei ou ment tion ble").split()


def make_random_base(directory: Path, seed: int = 0, spec: ModelSpec = BASE_MODEL) -> Path:
    """A random native checkpoint of `spec`'s size with opus-mt's layout (swish, post-norm,
    sinusoidal [sin | cos] positions, final logits bias) and the demo tokenizer files."""
    import shutil

    import torch

    from tfserve.config import ModelConfig
    from tfserve.demo import CHECKPOINT_DIR
    from tfserve.model import Seq2SeqTransformer, save_checkpoint

    config = ModelConfig(
        vocab_size=spec.vocab, d_model=spec.d_model, num_heads=spec.heads,
        encoder_layers=spec.layers, decoder_layers=spec.layers, ffn_dim=spec.ffn,
        activation="silu", norm="post", positions="sinusoidal", sinusoidal_layout="half",
        final_logits_bias=True, max_source_positions=spec.positions,
        max_target_positions=spec.positions, name=spec.name)
    torch.manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("source.spm", "tokenizer.json"):
        shutil.copy2(CHECKPOINT_DIR / name, directory / name)
    save_checkpoint(Seq2SeqTransformer(config), directory)
    return directory


# -- generated text and Marian's tokenizer files ----------------------------------------------


def pseudo_words(count: int, seed: int) -> list[str]:
    """`count` words of 1 to 4 syllables."""
    rng = random.Random(seed)
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
            for _ in range(count)]


def pseudo_sentences(words: Sequence[str], count: int, seed: int, low: int = 5,
                     high: int = 20) -> list[str]:
    """Sentences of `low`..`high` words, some capitalised, some with punctuation or digits."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(low, high)):
            word = rng.choice(words)
            roll = rng.random()
            if roll < 0.05:
                word = str(rng.randint(0, 2024))
            elif roll < 0.15:
                word = word.capitalize()
            if rng.random() < 0.08:
                word += rng.choice(".,;:!?")
            parts.append(word)
        lines.append(" ".join(parts))
    return lines


def train_spm(lines: list[str], vocab_size: int) -> bytes:
    """A unigram SentencePiece model (Marian's layout: <unk> 0, <s> 1, </s> 2) as bytes."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
        model_type="unigram", character_coverage=1.0, hard_vocab_limit=False, minloglevel=2)
    return model.getvalue()


def marian_vocab(spm_model: bytes, size: int) -> dict[str, int]:
    """Marian's vocab.json: "</s>" 0, "<unk>" 1, the spm pieces, synthetic pieces, "<pad>" last."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(spm_model)
    pieces = ["</s>", "<unk>"]
    pieces += [processor.IdToPiece(i) for i in range(processor.GetPieceSize())
               if not (processor.IsControl(i) or processor.IsUnknown(i))][: size - 3]
    seen = set(pieces)
    index = 0
    while len(pieces) < size - 1:  # pieces the spm model never produces (digits after zz)
        piece = f"\u2581zz{index:05d}"
        index += 1
        if piece not in seen:
            pieces.append(piece)
    pieces.append("<pad>")
    return {piece: i for i, piece in enumerate(pieces)}


# -- the random MarianMT checkpoint -----------------------------------------------------------


def build_checkpoint(directory: Path, spec: ModelSpec, seed: int = 0) -> Path:
    """A MarianMT checkpoint with transformers' random init, its spm models and vocab.json."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    directory.mkdir(parents=True, exist_ok=True)
    words = pseudo_words(3000, seed)
    spm_model = train_spm(pseudo_sentences(words, 5000, seed), vocab_size=4000)
    vocab = marian_vocab(spm_model, spec.vocab)
    pad = spec.vocab - 1
    config = MarianConfig(
        vocab_size=spec.vocab, decoder_vocab_size=spec.vocab, d_model=spec.d_model,
        encoder_layers=spec.layers, decoder_layers=spec.layers,
        encoder_attention_heads=spec.heads, decoder_attention_heads=spec.heads,
        encoder_ffn_dim=spec.ffn, decoder_ffn_dim=spec.ffn,
        max_position_embeddings=spec.positions, activation_function="swish",
        scale_embedding=True, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
        pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0, bos_token_id=0,
        forced_eos_token_id=0, dropout=0.1)
    torch.manual_seed(seed)
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        model.final_logits_bias.copy_(0.02 * torch.randn(model.final_logits_bias.shape,
                                                         generator=gen))
    # opus-mt's generation_config.json: the pad token is never generated, beam 4, 512 tokens
    model.generation_config.bad_words_ids = [[pad]]
    model.generation_config.num_beams = 4
    model.generation_config.max_length = spec.positions
    model.save_pretrained(directory)
    write_marian_tokenizer(directory, spm_model, spm_model, vocab)
    return directory


def write_marian_tokenizer(directory: Path, source_spm: bytes, target_spm: bytes,
                           vocab: dict[str, int]) -> None:
    """Marian's tokenizer files in `directory`: source.spm, target.spm, vocab.json, and the
    tokenizer_config.json that MarianTokenizer itself writes from them."""
    import warnings

    from transformers import MarianTokenizer

    (directory / "source.spm").write_bytes(source_spm)
    (directory / "target.spm").write_bytes(target_spm)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=1),
                                          encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Recommended: pip install sacremoses"
        tokenizer = MarianTokenizer(source_spm=str(directory / "source.spm"),
                                    target_spm=str(directory / "target.spm"),
                                    vocab=str(directory / "vocab.json"),
                                    source_lang="en", target_lang="fr")
        tokenizer.save_pretrained(directory)


# -- inputs -----------------------------------------------------------------------------------


def read_vocab(hf_dir: Path) -> tuple[dict[str, int], int, int, int]:
    """(vocab.json, eos, unk, pad) of a Marian checkpoint."""
    vocab = json.loads((hf_dir / "vocab.json").read_text(encoding="utf-8"))
    config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    pad = config.get("pad_token_id", vocab.get("<pad>"))
    return vocab, vocab["</s>"], vocab["<unk>"], int(pad)


def make_inputs(hf_dir: Path, count: int, seed: int = 1,
                lengths: tuple[int, int] = SOURCE_LENGTHS) -> list[list[int]]:
    """`count` source id sequences of lengths[0]..lengths[1] tokens, each ending with </s>.

    Generated text is split by the checkpoint's source.spm and mapped through vocab.json
    (pieces missing from it become <unk>), as MarianTokenizer does, then cut to length.
    """
    import sentencepiece as spm

    vocab, eos, unk, _ = read_vocab(hf_dir)
    processor = spm.SentencePieceProcessor()
    processor.Load(str(hf_dir / "source.spm"))
    rng = random.Random(seed)
    words = pseudo_words(3000, seed=0)
    sources = []
    for text in pseudo_sentences(words, count, seed, low=40, high=50):
        length = rng.randint(*lengths)
        pieces = processor.encode(text, out_type=str)[: length - 1]
        sources.append([vocab.get(piece, unk) for piece in pieces] + [eos])
    return sources
