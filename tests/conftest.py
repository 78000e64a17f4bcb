"""Test setup: make `tfserve` and `helpers` importable, keep torch small and deterministic."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
for entry in (ROOT, ROOT / "tests"):
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))
# the test folders too (after the rest): a test module imports another's helpers by name
# (test_scheduler's drive, test_marian's strings) when it runs on its own
for entry in sorted(folder for folder in (ROOT / "tests").iterdir() if folder.is_dir()):
    if any(entry.glob("test_*.py")) and str(entry) not in sys.path:
        sys.path.append(str(entry))

import torch  # noqa: E402

# the machine has 2 cores and may be training in the background: one thread is faster here
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_spm_bytes() -> bytes:
    """A small SentencePiece model trained on generated English/French number phrases."""
    import sentencepiece as spm

    from tfserve.demo.data import tokenizer_corpus

    lines = tokenizer_corpus(300, seed=0)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=80,
        model_type="unigram",
        character_coverage=1.0,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return model.getvalue()


@pytest.fixture
def tiny_spm_dir(tmp_path: Path, tiny_spm_bytes: bytes) -> Path:
    """A directory holding source.spm (the tiny model) for Tokenizer(directory, spec)."""
    (tmp_path / "source.spm").write_bytes(tiny_spm_bytes)
    return tmp_path


@pytest.fixture(scope="session")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random RoPE model with the demo's tokenizer, exported once per run (needs
    torch): random weights rarely emit eos, so request lengths are set by the request."""
    from server_helpers import export_random_model

    return export_random_model(tmp_path_factory.mktemp("random-model") / "artifacts")


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled demo, exported once a session into a cache of its own (tests/bulk has its
    own: the user's cache, where the CLI it runs finds the demo)."""
    from server_helpers import demo_trained

    if not demo_trained():
        pytest.skip("the demo checkpoint (tfserve/demo/checkpoint/model.safetensors) is not "
                    "trained yet")
    from tfserve.demo import default_artifacts

    saved = os.environ.get("TFSERVE_CACHE")
    os.environ["TFSERVE_CACHE"] = str(tmp_path_factory.mktemp("tfserve-cache"))
    try:
        return default_artifacts()
    finally:
        if saved is None:
            os.environ.pop("TFSERVE_CACHE", None)
        else:
            os.environ["TFSERVE_CACHE"] = saved
