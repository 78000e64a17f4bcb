"""Fixtures of the bulk tests: the bundled demo (exported once into the user's cache, as the
CLI finds it), a Translator on it, and corpora of demo phrases."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from server_helpers import demo_trained

# over the demo's 64 source positions: a line the length policy must handle
LONG_LINE = " ".join(["seven hundred and seventy-seven"] * 40)


@pytest.fixture(scope="session")
def demo_model() -> Path:
    if not demo_trained():
        pytest.skip("the demo checkpoint is not trained yet")
    from tfserve.demo import default_artifacts

    return default_artifacts()


@pytest.fixture(scope="session")
def demo_translator(demo_model: Path) -> Any:
    from tfserve.translator import Translator

    return Translator(demo_model, intra_op_threads=1)


def number_phrases(count: int, seed: int = 0, blanks: bool = True) -> list[str]:
    """Demo inputs of mixed lengths, with a blank line now and then."""
    from tfserve.demo.data import english

    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        if blanks and rng.random() < 0.08:
            lines.append("")
        else:
            lines.append(english(rng.choice([rng.randrange(10), rng.randrange(1000),
                                                     rng.randrange(10**6)])))
    return lines


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(number_phrases(60)) + "\n")
    return path
