"""CUDA checks shared by the model-family tests (gpu-marked; skipped without onnxruntime-gpu
and a CUDA device): the same artifacts translated on CUDA, with IO binding, and on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest

from tfserve.translator import Translator

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu and a CUDA device")
# ONNX Runtime's CUDA provider runs fp32 MatMuls in TF32 (its use_tf32 default): logits move
# by ~1e-3 of their scale, which flips the near-ties of random models (measured on an H100:
# 46 to 50 of 50 outputs identical per family and search); a wrong mask, position or cache
# row changes nearly all of them
MIN_IDENTICAL = 0.9


def cuda_agreement(artifacts: Path, texts: list[str], **kwargs: Any) -> dict[str, int]:
    """Per search (greedy, beam 4): how many of the texts' best outputs on CUDA equal the
    CPU's (kwargs: Translator.translate_hypotheses')."""
    cpu = Translator(artifacts, intra_op_threads=1)
    cuda = Translator(artifacts, device="cuda")
    assert cuda.runtime is not None and cuda.runtime.device_cache  # IO binding
    identical = {}
    for label, extra in (("greedy", {}), ("beam4", {"num_beams": 4})):
        ref = [h[0].token_ids for h in cpu.translate_hypotheses(texts, **kwargs, **extra)]
        got = [h[0].token_ids for h in cuda.translate_hypotheses(texts, **kwargs, **extra)]
        identical[label] = sum(a == b for a, b in zip(got, ref))
    return identical
