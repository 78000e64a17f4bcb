"""Small random checkpoints exported once per test session, shared by the parity tests.

Each (positions, norm, ...) variant is built, saved as a native checkpoint with the demo
tokenizer files and exported with `python -m export` once; later requests reuse it.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch
from helpers import tiny_config

from export.cli import main as export_main
from tfserve.artifacts.model_config import ModelConfig
from tfserve.demo import CHECKPOINT_DIR
from tfserve.model import Seq2SeqTransformer, load_checkpoint, save_checkpoint

WORK = Path(tempfile.mkdtemp(prefix="tfserve-tests-"))
atexit.register(shutil.rmtree, WORK, True)

DEMO_VOCAB_FILES = ("source.spm", "tokenizer.json")


def demo_vocab_config(positions: str = "rope", norm: str = "pre",
                      **overrides: object) -> ModelConfig:
    """`helpers.tiny_config` for the demo tokenizer (vocab 111) and its sentences: 4 heads,
    300 source and 128 target positions, named after its variant; sinusoidal positions in
    the half layout, with a final logits bias."""
    values: dict = dict(vocab_size=111, num_heads=4, max_source_positions=300,
                        max_target_positions=128, name=f"tiny-{positions}-{norm}")
    if positions == "sinusoidal":
        values["sinusoidal_layout"] = "half"
        values["final_logits_bias"] = True
    return tiny_config(positions, norm, **{**values, **overrides})


@functools.cache
def checkpoint(positions: str = "rope", norm: str = "pre", seed: int = 0,
               favour_specials: bool = False) -> Path:
    """A random native checkpoint using the demo's tokenizer (vocab 111).

    favour_specials (sinusoidal only, the config with a final logits bias): pad and eos get
    a large logits bias, so the searches' bans (pad always, eos before min_new_tokens) decide
    many of the outputs.
    """
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(demo_vocab_config(positions, norm))
    if model.final_logits_bias is not None:
        with torch.no_grad():
            model.final_logits_bias.normal_(std=0.5)
            if favour_specials:
                model.final_logits_bias[model.config.pad_token_id] += 8.0
                model.final_logits_bias[model.config.eos_token_id] += 6.0
    special = "-specials" if favour_specials else ""
    directory = WORK / f"ckpt-{positions}-{norm}-{seed}{special}"
    save_checkpoint(model, directory)
    for name in DEMO_VOCAB_FILES:
        shutil.copy2(CHECKPOINT_DIR / name, directory / name)
    return directory


def artifacts(positions: str = "rope", norm: str = "pre", seed: int = 0,
              quantize: str | None = None, favour_specials: bool = False) -> Path:
    """`checkpoint(...)` exported (fp32, or int8 when quantize='int8'), once per session."""
    # one cache key per export however the arguments were spelled
    return _artifacts(positions, norm, seed, quantize, favour_specials)


@functools.cache
def _artifacts(positions: str, norm: str, seed: int, quantize: str | None,
               favour_specials: bool) -> Path:
    special = "-specials" if favour_specials else ""
    out = WORK / f"art-{positions}-{norm}-{seed}-{quantize or 'fp32'}{special}"
    source = checkpoint(positions, norm, seed, favour_specials)
    args = ["--checkpoint", str(source), "--out", str(out),
            "--quiet", "--parity-samples", "0"]
    if quantize:
        args += ["--quantize", quantize]
    code = export_main(args)
    assert code == 0, f"export of {positions}/{norm} failed with exit code {code}"
    return out


def eager_model(positions: str = "rope", norm: str = "pre", seed: int = 0) -> Seq2SeqTransformer:
    return load_checkpoint(checkpoint(positions, norm, seed))


@functools.cache
def demo_artifacts(quantize: str | None = None) -> Path:
    """The bundled demo exported once per session (int8 too when asked)."""
    out = WORK / f"demo-{quantize or 'fp32'}"
    args = ["--checkpoint", str(CHECKPOINT_DIR), "--out", str(out), "--quiet",
            "--parity-samples", "0"]
    if quantize:
        args += ["--quantize", quantize]
    assert export_main(args) == 0
    return out


def demo_trained() -> bool:
    return (CHECKPOINT_DIR / "model.safetensors").is_file()
