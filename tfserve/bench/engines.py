"""The engines `python -m tfserve.bench.compare` times, and the child process's job.

Each engine is loaded and timed in a child process of its own (`run_engine`), so that its peak
RSS is its alone: the tfserve engines never import torch, and each engine imports its library
(onnxruntime, ctranslate2, transformers) only when it is opened.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tfserve.bench.common import Case, peak_rss_mib, timed_runs
from tfserve.bench.models import read_vocab

ENGINES = ("tfserve-fp32", "tfserve-int8", "ct2-fp32", "ct2-int8", "hf-eager")
# the build's files in the work directory, read by every engine's child
BUILD_STAMP = "compare-build.json"
INPUTS_FILE = "inputs.json"


def pad_batch(rows: Sequence[Sequence[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded int64 ids [B,S] and attention mask [B,S]."""
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad, np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


class Engine:
    """prepare() turns id rows into the engine's native batch (untimed); run() decodes it."""

    def prepare(self, rows: list[list[int]]) -> Any:
        raise NotImplementedError

    def run(self, batch: Any, beams: int, new_tokens: int) -> list[list[int]]:
        """Decode; returns the best hypothesis's token ids per row (no start, no eos)."""
        raise NotImplementedError


class TfserveEngine(Engine):
    """tfserve's `Runtime` on an export, decoded by `batch.generate`."""

    def __init__(self, artifacts: Path, threads: int) -> None:
        from tfserve.generation import DecodingOptions
        from tfserve.generation.batch import generate
        from tfserve.runtime import Runtime

        self.runtime = Runtime(artifacts, intra_op_threads=threads)
        self._options, self._generate = DecodingOptions, generate

    def prepare(self, rows: list[list[int]]) -> Any:
        return pad_batch(rows, self.runtime.pad_token_id)

    def run(self, batch: Any, beams: int, new_tokens: int) -> list[list[int]]:
        options = self._options(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                num_beams=beams)
        results = self._generate(self.runtime, batch[0], batch[1], options)
        return [hypotheses[0].token_ids for hypotheses in results]


class CTranslate2Engine(Engine):
    """translate_batch on token strings: the vocabulary pieces of the same ids (Marian:
    vocab.json; otherwise the vocabulary the converter wrote, in id order)."""

    def __init__(self, model_dir: Path, hf_dir: Path, compute_type: str, threads: int) -> None:
        import ctranslate2

        self.translator = ctranslate2.Translator(str(model_dir), device="cpu",
                                                 compute_type=compute_type,
                                                 intra_threads=threads, inter_threads=1)
        if (hf_dir / "vocab.json").is_file():
            vocab, _, _, _ = read_vocab(hf_dir)
        else:
            # T5: the tokenizer's pieces, then "<extra_id_N>" names for the model's ids
            # beyond them (which repeat sentinel names: the first id of a name is kept);
            # NLLB: the tokenizer's pieces, then "madeupwordN" up to the model's vocabulary
            pieces = json.loads((model_dir / "shared_vocabulary.json").read_text(
                encoding="utf-8"))
            vocab = {}
            for index, piece in enumerate(pieces):
                vocab.setdefault(piece, index)
        self.ids = vocab
        self.pieces = {i: piece for piece, i in vocab.items()}

    def prepare(self, rows: list[list[int]]) -> Any:
        return [[self.pieces[i] for i in row] for row in rows]

    def run(self, batch: Any, beams: int, new_tokens: int) -> list[list[int]]:
        # ct2 4.8: a decoding step that produces </s> counts towards max_decoding_length, and
        # </s> is banned for the first min_decoding_length steps; min = max = N is N steps
        # and N tokens without </s> (return_end_token is then moot; the lengths are checked)
        results = self.translator.translate_batch(
            batch, beam_size=beams, num_hypotheses=1, min_decoding_length=new_tokens,
            max_decoding_length=new_tokens, return_end_token=False, max_batch_size=0)
        return [[self.ids[t] for t in result.hypotheses[0]] for result in results]


class HuggingFaceEngine(Engine):
    """transformers' `generate` (MarianMTModel or T5ForConditionalGeneration; PyTorch eager,
    fp32)."""

    def __init__(self, hf_dir: Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForSeq2SeqLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForSeq2SeqLM.from_pretrained(str(hf_dir)).eval()
        self.pad = self.model.config.pad_token_id
        # opus-mt forces eos at max_length, so min = max new tokens would end with eos: turn
        # it off where generate() reads it (a None in a generation_config passed to generate()
        # falls back to the model's value); bad_words_ids stays: tfserve applies it too
        self.model.generation_config.forced_eos_token_id = None
        self.model.config.forced_eos_token_id = None

    def prepare(self, rows: list[list[int]]) -> Any:
        ids, mask = pad_batch(rows, self.pad)
        return self.torch.from_numpy(ids), self.torch.from_numpy(mask)

    def run(self, batch: Any, beams: int, new_tokens: int) -> list[list[int]]:
        with self.torch.inference_mode():
            out = self.model.generate(
                input_ids=batch[0], attention_mask=batch[1], num_beams=beams, do_sample=False,
                num_return_sequences=1, min_new_tokens=new_tokens, max_new_tokens=new_tokens)
        return out[:, 1:].tolist()  # drop the decoder start token


def open_engine(name: str, work: Path, hf_dir: Path, threads: int) -> Engine:
    """Load engine `name` from the build in `work` (the checkpoint itself for hf-eager)."""
    if name == "tfserve-fp32":
        return TfserveEngine(work / "tfserve-fp32", threads)
    if name == "tfserve-int8":
        return TfserveEngine(work / "tfserve-int8", threads)
    if name == "ct2-fp32":
        return CTranslate2Engine(work / "ct2-fp32", hf_dir, "float32", threads)
    if name == "ct2-int8":
        return CTranslate2Engine(work / "ct2-int8", hf_dir, "int8", threads)
    if name == "hf-eager":
        return HuggingFaceEngine(hf_dir, threads)
    raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")


def time_case(engine: Engine, sources: list[list[int]], case: Case, new_tokens: int,
              repeat: int) -> tuple[list[float], list[list[int]]]:
    """Wall times of `repeat` runs (after one warm-up run) and the warm-up's outputs."""
    batches = [engine.prepare(sources[i: i + case.batch])
               for i in range(0, case.sentences, case.batch)]

    def once() -> list[list[int]]:
        outputs: list[list[int]] = []
        for batch in batches:
            outputs += engine.run(batch, case.beams, new_tokens)
        return outputs

    return timed_runs(once, repeat)


def run_engine(name: str, work: Path, threads: int, repeat: int, new_tokens: int,
               cases: dict[str, Case], emit: Callable[[dict[str, Any]], None]) -> None:
    """The child's job: load one engine, time every case, emit JSON rows, then its RSS."""
    stamp = json.loads((work / BUILD_STAMP).read_text(encoding="utf-8"))
    hf_dir = Path(stamp["hf_dir"])
    sources = json.loads((work / INPUTS_FILE).read_text(encoding="utf-8"))["sources"]
    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    engine = open_engine(name, work, hf_dir, threads)
    load_s = time.perf_counter() - started
    rss_loaded = peak_rss_mib()
    outputs = {}
    for case_name, case in cases.items():
        times, out = time_case(engine, sources, case, new_tokens, repeat)
        lengths = sorted({len(o) for o in out})
        produced = case.sentences * new_tokens
        outputs[case_name] = out
        emit({"engine": name, "case": case_name, "batch": case.batch, "beams": case.beams,
              "sentences": case.sentences, "new_tokens": new_tokens,
              "output_tokens": produced, "lengths": lengths,
              "lengths_ok": lengths == [new_tokens],
              "best_s": min(times), "median_s": statistics.median(times),
              "tok_s": produced / min(times), "tok_s_median": produced / statistics.median(times),
              "threads": threads, "loadavg_1m": os.getloadavg()[0]})
    (work / "outputs").mkdir(exist_ok=True)
    (work / "outputs" / f"{name}.json").write_text(json.dumps(outputs), encoding="utf-8")
    emit({"engine": name, "summary": True, "load_s": load_s, "peak_rss_mib": peak_rss_mib(),
          "peak_rss_after_load_mib": rss_loaded, "threads": threads,
          "torch_imported": "torch" in sys.modules,
          "loadavg_1m_start": load_start, "loadavg_1m_end": os.getloadavg()[0]})
