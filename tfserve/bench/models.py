"""The random models the benchmarks build, and the inputs they decode. Nothing is downloaded.

- `make_random_base`: a native tfserve checkpoint of opus-mt-base size (the offline benchmark);
- `build_checkpoint`: a MarianMT checkpoint with transformers' own random initialisation, real
  Marian tokenizer files (a SentencePiece model trained on generated pseudo-words, vocab.json
  padded with synthetic pieces, "<pad>" last as in opus-mt), for the engines comparison; or,
  for a T5 spec, a T5ForConditionalGeneration of Flan-T5's layout (gated-gelu, untied
  lm_head) with T5's tokenizer files (spiece.model padded to 32,000 pieces, 100 sentinels,
  tokenizer.json);
- `make_inputs`: source id sequences of generated text, split by a checkpoint's tokenizer.

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
    family: str = "marian"  # "marian" or "t5"


# Helsinki-NLP/opus-mt-* (transformer-base) sizes
BASE_MODEL = ModelSpec("random-opus-mt-base", d_model=512, layers=6, heads=8, ffn=2048,
                       vocab=32000, positions=512)
QUICK_MODEL = ModelSpec("random-opus-mt-tiny", d_model=32, layers=2, heads=4, ffn=64,
                        vocab=2500, positions=64)
# google/flan-t5-base sizes: 12 heads of 64, 12+12 layers, gated-gelu FFN 2048, 32,128 ids
FLAN_T5_BASE = ModelSpec("random-flan-t5-base", d_model=768, layers=12, heads=12, ffn=2048,
                         vocab=32128, positions=512, family="t5")
QUICK_T5 = ModelSpec("random-flan-t5-tiny", d_model=32, layers=2, heads=4, ffn=64, vocab=2600,
                     positions=64, family="t5")
# facebook/nllb-200-distilled-600M sizes: 16 heads, 12+12 layers, FFN 4096, 256,206 ids (the
# output projection alone is 1024 x 256,206: 262M of the model's 615M parameters)
NLLB_600M = ModelSpec("random-nllb-200-distilled-600m", d_model=1024, layers=12, heads=16,
                      ffn=4096, vocab=256206, positions=1024, family="nllb")
QUICK_NLLB = ModelSpec("random-nllb-tiny", d_model=32, layers=2, heads=4, ffn=64, vocab=2600,
                       positions=64, family="nllb")
# opus-mt-base's body (d_model 512, 6+6 layers, FFN 2048) with NLLB-200's 256,206 ids: the
# shared embedding (525 MB in fp32) outweighs the rest of the model (~180 MB)
NLLB_VOCAB_BASE = ModelSpec("random-nllb-vocab-base", d_model=512, layers=6, heads=8, ffn=2048,
                            vocab=256206, positions=1024, family="nllb")
# the models `python -m tfserve.bench.compare --model NAME` builds: (full size, --quick)
MODELS = {"opus-mt-base": (BASE_MODEL, QUICK_MODEL), "flan-t5-base": (FLAN_T5_BASE, QUICK_T5),
          "nllb-600m": (NLLB_600M, QUICK_NLLB), "nllb-vocab-base": (NLLB_VOCAB_BASE, QUICK_NLLB)}


def model_spec(name: str, quick: bool = False) -> ModelSpec:
    """The spec `--model NAME` (and `--quick`) stands for."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name][1 if quick else 0]

SOURCE_LENGTHS = (20, 25)  # source tokens per sentence, </s> included
SYLLABLES = ("ka lo mi tre sen vor pa qui dun el ra bo ste nu fi gar osh li ten wa zu xen po "
             "dri mal an is der ung ver ch sch au ei ou ment tion ble").split()


def make_random_base(directory: Path, seed: int = 0, spec: ModelSpec = BASE_MODEL) -> Path:
    """A random native checkpoint of `spec`'s size with opus-mt's layout (swish, post-norm,
    sinusoidal [sin | cos] positions, final logits bias) and the demo tokenizer files."""
    import shutil

    import torch

    from tfserve.artifacts.model_config import ModelConfig
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
    """A MarianMT checkpoint with transformers' random init, its spm models and vocab.json
    (a T5 one for a T5 spec: `build_t5_checkpoint`)."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    if spec.family == "t5":
        return build_t5_checkpoint(directory, spec, seed)
    if spec.family == "nllb":
        return build_nllb_checkpoint(directory, spec, seed)
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


# -- the random T5 checkpoint -----------------------------------------------------------------

T5_EXTRA_IDS = 100  # T5's sentinels <extra_id_0..99>
T5_PIECES = 32000  # spiece.model's pieces in T5 and Flan-T5: 32,100 ids with the sentinels


def t5_spiece(lines: list[str], pieces: int) -> bytes:
    """A unigram SentencePiece model in T5's layout (<pad> 0, </s> 1, <unk> 2, no bos) trained
    on `lines`, padded to `pieces` pieces with synthetic ones that text never produces
    ("▁zz00000"..., the lowest scores), as bytes."""
    import io

    import sentencepiece as spm

    from tfserve.text.tokenizers.spiece_model import parse_model

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=min(pieces, 4000),
        model_type="unigram", character_coverage=1.0, hard_vocab_limit=False, minloglevel=2,
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>",
        unk_piece="<unk>")
    proto = parse_model(model.getvalue())
    lowest = min(piece.score for piece in proto.pieces)
    known = {piece.piece for piece in proto.pieces}
    index = 0
    while len(proto.pieces) < pieces:
        piece = f"\u2581zz{index:05d}"
        index += 1
        if piece not in known:
            proto.pieces.add(piece=piece, score=lowest - 1.0 - index)
    return proto.SerializeToString()


def build_t5_checkpoint(directory: Path, spec: ModelSpec, seed: int = 0) -> Path:
    """A T5ForConditionalGeneration of Flan-T5's layout (gated-gelu FFN, untied lm_head, head
    dim d_model / heads) with transformers' random init, and T5's tokenizer files:
    spiece.model (a trained model padded to 32,000 pieces, fewer for a small vocabulary),
    tokenizer_config.json and tokenizer.json written by T5Tokenizer with 100 sentinels."""
    import warnings

    import torch
    from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    words = pseudo_words(3000, seed)
    pieces = min(T5_PIECES, spec.vocab - T5_EXTRA_IDS)
    (directory / "spiece.model").write_bytes(
        t5_spiece(pseudo_sentences(words, 5000, seed), pieces))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = T5Tokenizer.from_pretrained(str(directory), extra_ids=T5_EXTRA_IDS)
        tokenizer.save_pretrained(directory)
    config = T5Config(
        vocab_size=spec.vocab, d_model=spec.d_model, d_kv=spec.d_model // spec.heads,
        d_ff=spec.ffn, num_layers=spec.layers, num_decoder_layers=spec.layers,
        num_heads=spec.heads, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
        n_positions=spec.positions, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        dropout_rate=0.1)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # an lm_head of its own, as Flan-T5 (transformers 5 ties it otherwise)
        model.lm_head.weight = torch.nn.Parameter(
            torch.randn_like(model.shared.weight) * spec.d_model ** -0.5)
    model.generation_config.max_length = spec.positions
    model.save_pretrained(directory)
    return directory


NLLB_PIECES = 8000  # SentencePiece pieces of the random NLLB tokenizer (the real one: 256,000)
NLLB_LANGUAGES = ("eng_Latn", "fra_Latn", "deu_Latn", "spa_Latn")


def build_nllb_checkpoint(directory: Path, spec: ModelSpec, seed: int = 0) -> Path:
    """An M2M100ForConditionalGeneration of NLLB-200's layout (pre-norm, fairseq sinusoidal
    positions, scaled and tied embeddings, relu) with transformers' random init, and
    NLLB's tokenizer files: a SentencePiece BPE model trained on generated text, written by
    NllbTokenizer (tokenizer.json) with four language codes. The model's vocabulary has the
    real model's 256,206 ids whatever the tokenizer holds: the output projection's cost is
    the point of this model."""
    import warnings

    import sentencepiece as spm
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration, NllbTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    words = pseudo_words(3000, seed)
    pieces = min(NLLB_PIECES, spec.vocab // 2)
    model_file = directory / "sentencepiece.bpe.model"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(pseudo_sentences(words, 5000, seed)),
        model_prefix=str(model_file.with_suffix("")), model_type="bpe", vocab_size=pieces,
        character_coverage=1.0, hard_vocab_limit=False, minloglevel=2)
    model_file.with_suffix(".vocab").unlink(missing_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = NllbTokenizer.from_pretrained(
            str(directory), additional_special_tokens=list(NLLB_LANGUAGES))
        tokenizer.save_pretrained(directory)
    config = M2M100Config(
        vocab_size=spec.vocab, d_model=spec.d_model, encoder_layers=spec.layers,
        decoder_layers=spec.layers, encoder_attention_heads=spec.heads,
        decoder_attention_heads=spec.heads, encoder_ffn_dim=spec.ffn, decoder_ffn_dim=spec.ffn,
        max_position_embeddings=spec.positions, activation_function="relu",
        scale_embedding=True, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, dropout=0.1)
    torch.manual_seed(seed)
    model = M2M100ForConditionalGeneration(config).eval()
    model.generation_config.max_length = 200  # as NLLB-200's generation_config.json
    model.save_pretrained(directory)
    return directory


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
    (pieces missing from it become <unk>), as MarianTokenizer does, then cut to length; a T5
    checkpoint's text is split by its tokenizer.json.
    """
    import sentencepiece as spm

    if not (hf_dir / "vocab.json").is_file() and (hf_dir / "tokenizer.json").is_file():
        return make_t5_inputs(hf_dir, count, seed, lengths)
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


def make_t5_inputs(hf_dir: Path, count: int, seed: int = 1,
                   lengths: tuple[int, int] = SOURCE_LENGTHS) -> list[list[int]]:
    """make_inputs for a T5 checkpoint: generated text split by its tokenizer.json (as
    transformers' T5Tokenizer splits it), cut to length, ending with </s>."""
    from tfserve.text.tokenizer import Tokenizer, TokenizerSpec

    config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    eos = int(config.get("eos_token_id", 1))
    tokenizer = Tokenizer(hf_dir, TokenizerSpec(kind="hf-json", source="tokenizer.json",
                                                pad_token_id=0, eos_token_id=eos,
                                                unk_token_id=2))
    rng = random.Random(seed)
    words = pseudo_words(3000, seed=0)
    sources = []
    for text in pseudo_sentences(words, count, seed, low=40, high=50):
        length = rng.randint(*lengths)
        ids = [i for i in tokenizer.encode(text) if i != eos]
        sources.append(ids[: length - 1] + [eos])
    return sources
