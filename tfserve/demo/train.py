"""Train the bundled demo checkpoint: `python -m tfserve.demo.train [--out DIR]`.

Trains a small RoPE Transformer on generated English -> French number phrases (the English
varied as people type it, and half the pairs written as sentences: "Seven?" -> "Sept ?";
see data.py) with the bundled 111-piece SentencePiece vocabulary (sentence_vocabulary),
then writes a native checkpoint (config.json, model.safetensors, tokenizer.json, source.spm,
samples.txt). Seeded (--seed; torch and the data stream), so a run with the same arguments
and thread count writes the same checkpoint.

The bundled checkpoint is the lower-case one of commit 27fa71c (800 steps from random
weights, no sentences) fine-tuned on the mixed stream:

    git show 27fa71c:tfserve/demo/checkpoint/model.safetensors > /tmp/lower-case.safetensors
    python -m tfserve.demo.train --init /tmp/lower-case.safetensors --steps 400 \\
        --warmup 40 --lr 5e-4 --batch-size 64 --threads 1

(about 4 minutes on one busy core; 100% held-out exact match in every form of
data.SOURCE_FORMS and data.SENTENCE_FORMS).

Progress is judged by teacher-forced exact match on the held-out numbers: when the argmax at
every target position equals the reference, greedy decoding produces exactly the reference,
so this is the greedy exact-match accuracy computed in one batched forward pass.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import time
from pathlib import Path

import sentencepiece as spm
import torch
import torch.nn.functional as F

from tfserve.artifacts.model_config import ModelConfig
from tfserve.demo import CHECKPOINT_DIR
from tfserve.demo.data import (
    FORMS,
    SENTENCE_RATE,
    form_pair,
    held_out_numbers,
    tokenizer_corpus,
    training_pairs,
)
from tfserve.model import Seq2SeqTransformer, load_state, save_checkpoint
from tfserve.text.tokenizer import Tokenizer, TokenizerSpec

SPM_FILE = "source.spm"

# Capitals reach the model as a mark before the lower-case word: SentencePiece's normalizer
# writes "Seven" as "⇧ seven" (pieces '▁', '⇧', '▁seven': every word keeps its piece), and its
# denormalizer turns the decoded "⇧ sept" back into "Sept". The mark and the sentence ends
# take the ids of four letters that no number phrase uses (each is covered by a longer
# piece), so the vocabulary keeps its 111 ids and every lower-case phrase its pieces. A
# capital inside a word gets a mark too, which splits it: ALL-CAPS is not a demo form.
CASE_MARK = "\u21e7"  # ⇧
REPLACED_PIECES = {"z": CASE_MARK, "q": ".", "v": "!", "x": "?"}
CAPITALS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _normalization_rules() -> str:
    """The rules TSV of the encoding side: SentencePiece's nmt_nfkc, one character at a time
    (its few multi-character rules are not carried), then each capital as CASE_MARK, a space
    and its lower case."""

    def mark_capitals(text: str) -> str:
        return "".join(f"{CASE_MARK} {c.lower()}" if c in CAPITALS else c for c in text)

    nfkc = spm.SentencePieceNormalizer(rule_name="nmt_nfkc", add_dummy_prefix=False,
                                       remove_extra_whitespaces=False,
                                       escape_whitespaces=False)
    lines = []
    for code in range(0x110000):
        if 0xD800 <= code <= 0xDFFF:  # surrogates are no characters
            continue
        char = chr(code)
        normalized = mark_capitals(nfkc.normalize(char))
        if normalized != char:
            lines.append(f"{code:X}\t{' '.join(f'{ord(c):X}' for c in normalized)}")
    return "\n".join(lines) + "\n"


def _denormalization_rules() -> str:
    """The rules TSV of the decoding side: CASE_MARK, a space and a letter -> its capital; a
    mark before anything else (or nothing yet, mid-stream) -> nothing."""
    lines = [f"{ord(CASE_MARK):X} 20 {ord(c.lower()):X}\t{ord(c):X}" for c in CAPITALS]
    return "\n".join([*lines, f"{ord(CASE_MARK):X}\t"]) + "\n"


def sentence_vocabulary(bundled: bytes) -> bytes:
    """The bundled 111-piece SentencePiece model with the sentence pieces (REPLACED_PIECES)
    and the case mark's normalization rules; the same model again when it has them already.

    The vocabulary is kept, not retrained: its ids are the demo's (tests build random models
    on them), and SentencePiece 0.2.2 trains 132 pieces from data.tokenizer_corpus, not the
    bundled 111. The rules are compiled by SentencePiece's trainer on a throwaway corpus.
    """
    import tempfile

    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(bundled)
    for piece in model.pieces:
        piece.piece = REPLACED_PIECES.get(piece.piece, piece.piece)
    with tempfile.TemporaryDirectory() as tmp:
        rules, inverse = Path(tmp) / "rules.tsv", Path(tmp) / "inverse.tsv"
        rules.write_text(_normalization_rules())
        inverse.write_text(_denormalization_rules())
        compiled = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(tokenizer_corpus(0, seed=0)), model_writer=compiled,
            vocab_size=60, hard_vocab_limit=False, normalization_rule_tsv=str(rules),
            denormalization_rule_tsv=str(inverse), minloglevel=2)
    rules_model = sentencepiece_model_pb2.ModelProto()
    rules_model.ParseFromString(compiled.getvalue())
    model.normalizer_spec.CopyFrom(rules_model.normalizer_spec)
    model.denormalizer_spec.CopyFrom(rules_model.denormalizer_spec)
    for spec in (model.normalizer_spec, model.denormalizer_spec):
        spec.ClearField("normalization_rule_tsv")  # the throwaway file's path
    return model.SerializeToString()


def write_vocabulary(directory: Path) -> TokenizerSpec:
    """source.spm (sentence_vocabulary of the bundled one) and tokenizer.json in `directory`."""
    (directory / SPM_FILE).write_bytes(
        sentence_vocabulary((CHECKPOINT_DIR / SPM_FILE).read_bytes()))
    spec = TokenizerSpec(source=SPM_FILE, pad_token_id=0, eos_token_id=1, unk_token_id=2,
                         decoder_start_token_id=0)
    (directory / "tokenizer.json").write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
    return spec


def make_batch(
    tokenizer: Tokenizer, pairs: list[tuple[str, str]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Source ids/mask [B,S]; decoder inputs (start + target) and labels (target + eos) [B,T]."""
    src_ids, src_mask = tokenizer.pad_batch([tokenizer.encode(en) for en, _ in pairs])
    targets = [tokenizer.encode_target(fr) for _, fr in pairs]
    dec_in, _ = tokenizer.pad_batch([[tokenizer.decoder_start_id] + t[:-1] for t in targets])
    labels, label_mask = tokenizer.pad_batch(targets)
    labels[label_mask == 0] = -100  # ignored by the loss
    return (torch.from_numpy(src_ids), torch.from_numpy(src_mask), torch.from_numpy(dec_in),
            torch.from_numpy(labels))


@torch.no_grad()
def exact_match(model: Seq2SeqTransformer, tokenizer: Tokenizer, numbers: list[int],
                form: str = "canonical") -> float:
    """Fraction of numbers whose every target token is the argmax under teacher forcing,
    written in one of data.SOURCE_FORMS or data.SENTENCE_FORMS."""
    model.eval()
    correct = 0
    for start in range(0, len(numbers), 250):
        chunk = numbers[start : start + 250]
        src, mask, dec_in, labels = make_batch(tokenizer, [form_pair(n, form) for n in chunk])
        predicted = model(src, mask, dec_in).argmax(-1)  # [B,T]
        ok = (predicted == labels) | (labels == -100)
        correct += int(ok.all(dim=1).sum())
    model.train()
    return correct / len(numbers)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=CHECKPOINT_DIR, help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--init", type=Path, default=None,
                        help="start from these weights (a model.safetensors of the same "
                             "config) instead of random ones")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    spec = write_vocabulary(args.out)
    tokenizer = Tokenizer(args.out, spec)
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=128,
        num_heads=4,
        encoder_layers=3,
        decoder_layers=3,
        ffn_dim=512,
        activation="gelu",
        norm="pre",
        positions="rope",
        max_source_positions=64,
        max_target_positions=64,
        scale_embedding=True,
        tie_word_embeddings=True,
        dropout=0.0,
        pad_token_id=spec.pad_token_id,
        eos_token_id=spec.eos_token_id,
        unk_token_id=spec.unk_token_id,
        decoder_start_token_id=spec.decoder_start_token_id,
        name="tfserve-demo-en-fr-numbers",
        source_language="en",
        target_language="fr",
    )
    model = Seq2SeqTransformer(config)
    if args.init is not None:
        load_state(model, args.init)
    print(f"vocab {tokenizer.vocab_size}, parameters {model.num_parameters():,}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98),
                                  weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    dev = held_out_numbers()
    # sentences the export decodes with both backends for its greedy parity check: held-out
    # numbers in each form in turn, so the check covers the forms people type
    samples = [form_pair(n, FORMS[i % len(FORMS)])[0] for i, n in enumerate(dev[:200])]
    (args.out / "samples.txt").write_text("\n".join(samples) + "\n")
    pairs = training_pairs(args.seed, sentence_rate=SENTENCE_RATE)
    model.train()
    started = time.time()
    for step in range(1, args.steps + 1):
        batch = [next(pairs) for _ in range(args.batch_size)]
        src, mask, dec_in, labels = make_batch(tokenizer, batch)
        logits = model(src, mask, dec_in)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                               label_smoothing=0.05)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                  f"{time.time() - started:.0f}s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            scores = ", ".join(f"{form} {exact_match(model, tokenizer, dev, form):.2%}"
                               for form in FORMS)
            print(f"step {step} held-out exact match: {scores}", flush=True)
            save_checkpoint(model.eval(), args.out)
            model.train()
    print(f"saved {args.out}", flush=True)


if __name__ == "__main__":
    main()
