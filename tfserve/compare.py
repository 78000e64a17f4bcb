"""Engines compared on one Marian model: tfserve (ONNX Runtime) vs CTranslate2 vs Hugging Face.

    python -m tfserve.compare                         # random opus-mt-base-sized model
    python -m tfserve.compare --hf-dir opus-mt-en-de  # a real (downloaded) opus-mt checkpoint
    python -m tfserve.compare --quick                 # tiny model, seconds (the smoke test)

One run builds (or, with --work DIR, reuses) a MarianMT checkpoint, imports it with
`python -m export --from-hf` (fp32, and int8 with --quantize int8), converts it with
CTranslate2's own converter (float32 and int8), and times five engines on the same token ids:
tfserve fp32 / int8 (`Runtime` + `generate`), CTranslate2 fp32 / int8 (`translate_batch`) and
Hugging Face eager `generate`. Every engine decodes exactly --new-tokens tokens per sentence
(min = max new tokens; the lengths are checked), so tokens/s compare like with like.

Each engine is loaded and timed in its own child process (`--engine NAME`), so its peak RSS
(`ru_maxrss` at the end of the child) is that engine's alone. Output: one JSON line per
(engine, case), a table of tokens/s, the ratios tfserve / CTranslate2, peak RSS; --json OUT
writes everything.

The random checkpoint: MarianMTModel(config) with transformers' own initialisation, d_model
512, 6+6 layers, 8 heads, FFN 2048, vocabulary 32,000 (the pieces of a SentencePiece model
trained on generated text, padded with synthetic pieces, "<pad>" last as in opus-mt), swish,
sinusoidal positions, scaled and tied embeddings, a small random final_logits_bias. Nothing
is downloaded. This module imports the standard library and numpy only; torch, transformers
and ctranslate2 are imported by the stages that need them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ENGINES = ("tfserve-fp32", "tfserve-int8", "ct2-fp32", "ct2-int8", "hf-eager")
RATIOS = (("tfserve-fp32", "ct2-fp32"), ("tfserve-int8", "ct2-int8"),
          ("tfserve-fp32", "hf-eager"))


@dataclass(frozen=True)
class Case:
    """`sentences` inputs decoded in batches of `batch` with `beams` beams (1: greedy)."""

    batch: int
    beams: int
    sentences: int


CASES = {
    "greedy-b1": Case(batch=1, beams=1, sentences=8),
    "greedy-b16": Case(batch=16, beams=1, sentences=16),
    "beam4-b32": Case(batch=32, beams=4, sentences=32),
}
QUICK_CASES = {
    "greedy-b1": Case(batch=1, beams=1, sentences=2),
    "greedy-b16": Case(batch=16, beams=1, sentences=16),
    "beam4-b32": Case(batch=32, beams=4, sentences=32),
}


@dataclass(frozen=True)
class ModelSpec:
    """The random Marian checkpoint to build."""

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
BUILD_STAMP = "compare-build.json"
INPUTS_FILE = "inputs.json"


# -- the random checkpoint ------------------------------------------------------------------


def pseudo_words(count: int, seed: int) -> list[str]:
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


def build_checkpoint(directory: Path, spec: ModelSpec, seed: int = 0) -> Path:
    """A MarianMT checkpoint with transformers' random init, its spm models and vocab.json."""
    import warnings

    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

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
    for name in ("source.spm", "target.spm"):
        (directory / name).write_bytes(spm_model)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=1),
                                          encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Recommended: pip install sacremoses"
        tokenizer = MarianTokenizer(source_spm=str(directory / "source.spm"),
                                    target_spm=str(directory / "target.spm"),
                                    vocab=str(directory / "vocab.json"),
                                    source_lang="en", target_lang="fr")
        tokenizer.save_pretrained(directory)
    return directory


# -- inputs ---------------------------------------------------------------------------------


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


def pad_batch(rows: Sequence[Sequence[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded int64 ids [B,S] and attention mask [B,S]."""
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad, np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


# -- engines (each runs in its own child process) ------------------------------------------


class Engine:
    """prepare() turns id rows into the engine's native batch (untimed); run() decodes it."""

    def prepare(self, rows: list[list[int]]) -> Any:
        raise NotImplementedError

    def run(self, batch: Any, beams: int, new_tokens: int) -> list[list[int]]:
        """Decode; returns the best hypothesis's token ids per row (no start, no eos)."""
        raise NotImplementedError


class TfserveEngine(Engine):
    def __init__(self, artifacts: Path, threads: int) -> None:
        from tfserve.batch import generate
        from tfserve.generation import DecodingOptions
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
    """translate_batch on token strings: the vocabulary pieces of the same ids."""

    def __init__(self, model_dir: Path, hf_dir: Path, compute_type: str, threads: int) -> None:
        import ctranslate2

        self.translator = ctranslate2.Translator(str(model_dir), device="cpu",
                                                 compute_type=compute_type,
                                                 intra_threads=threads, inter_threads=1)
        vocab, _, _, _ = read_vocab(hf_dir)
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
    def __init__(self, hf_dir: Path, threads: int) -> None:
        import torch
        from transformers import MarianMTModel

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = MarianMTModel.from_pretrained(str(hf_dir)).eval()
        self.pad = self.model.config.pad_token_id
        # opus-mt forces eos at max_length, so min = max new tokens would end with eos: turn
        # it off where generate() reads it (a None in a generation_config passed to generate()
        # falls back to the model's value); bad_words_ids [[pad]] stays, as tfserve bans pad
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


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


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

    outputs = once()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        once()
        times.append(time.perf_counter() - started)
    return times, outputs


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


# -- build (a child process too: the parent stays free of torch) ---------------------------


def build(work: Path, quick: bool, hf_dir: Path | None, sentences: int) -> dict[str, Any]:
    """Checkpoint, tfserve fp32/int8 artifacts, CTranslate2 float32/int8 models, inputs.

    Every step whose output is already in `work` (and was made for the same model) is skipped.
    """
    work.mkdir(parents=True, exist_ok=True)
    spec = QUICK_MODEL if quick else BASE_MODEL
    key = {"hf_dir": str(hf_dir.resolve()) if hf_dir else None,
           "model": None if hf_dir else asdict(spec)}
    stamp_path = work / BUILD_STAMP
    if stamp_path.is_file():
        old = json.loads(stamp_path.read_text(encoding="utf-8"))
        if old.get("key") != key:
            raise SystemExit(f"--work {work} holds a build of another model ({old.get('key')}); "
                             "use another --work directory")
    timings: dict[str, float] = {}

    def step(what: str, done: bool, fn: Callable[[], Any]) -> None:
        if done:
            return
        started = time.perf_counter()
        fn()
        timings[what] = round(time.perf_counter() - started, 1)
        print(f"compare: built {what} in {timings[what]}s", file=sys.stderr, flush=True)

    checkpoint = hf_dir.resolve() if hf_dir else work / spec.name
    step("checkpoint", (checkpoint / "config.json").is_file(),
         lambda: build_checkpoint(checkpoint, spec))
    stamp = {"key": key, "hf_dir": str(checkpoint)}
    stamp_path.write_text(json.dumps(stamp, indent=1), encoding="utf-8")

    from export.cli import main as export_main

    for name, extra in (("tfserve-fp32", []), ("tfserve-int8", ["--quantize", "int8"])):
        def export(out: Path = work / name, extra: list[str] = extra) -> None:
            code = export_main(["--from-hf", str(checkpoint), "--out", str(out), "--force",
                                "--quiet", "--parity-samples", "0", *extra])
            if code:
                raise SystemExit(f"python -m export --from-hf {checkpoint} failed ({code})")
        step(name, exported_by_this_revision(work / name), export)
    for name, quantization in (("ct2-fp32", None), ("ct2-int8", "int8")):
        def convert(out: Path = work / name, quantization: str | None = quantization) -> None:
            import ctranslate2

            ctranslate2.converters.TransformersConverter(str(checkpoint)).convert(
                str(out), quantization=quantization, force=True)
        step(name, (work / name / "model.bin").is_file(), convert)
    inputs = work / INPUTS_FILE

    def write_inputs() -> None:
        sources = make_inputs(checkpoint, sentences)
        inputs.write_text(json.dumps({"sources": sources}), encoding="utf-8")
    step("inputs", inputs.is_file() and len(json.loads(inputs.read_text())["sources"])
         >= sentences, write_inputs)
    return {"checkpoint": str(checkpoint), "build_s": timings}


# -- the parent -----------------------------------------------------------------------------


def exported_by_this_revision(artifacts: Path) -> bool:
    """An export in `artifacts` made by this tfserve's graph revision (older ones are redone:
    the comparison is about the graphs this version makes)."""
    from tfserve.manifest import GRAPH_REVISION

    path = artifacts / "model.json"
    if not path.is_file():
        return False
    provenance = json.loads(path.read_text(encoding="utf-8")).get("provenance", {})
    return provenance.get("graph_revision") == GRAPH_REVISION


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_child(argv: list[str], threads: int, timeout: float) -> tuple[int, list[dict[str, Any]],
                                                                      str]:
    """`python -m tfserve.compare ARGV` -> (exit code, its JSON rows, the tail of its stderr)."""
    command = [sys.executable, "-m", "tfserve.compare", *argv]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=child_env(threads))
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return 124, rows, f"timed out after {timeout:.0f}s"
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, rows, done.stderr[-2000:]


def cpu_count() -> int:
    """The cores this process may use (as tfserve.runtime.default_threads, without importing
    onnxruntime into every child)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = cpu_count()
    versions = {}
    for module in ("onnxruntime", "ctranslate2", "torch", "transformers", "numpy"):
        try:
            from importlib.metadata import version

            versions[module] = version(module)
        except Exception:  # noqa: BLE001 - a missing package is reported as such
            versions[module] = None
    return {"cpu": cpu, "cores": cores, "python": platform.python_version(),
            "loadavg": [round(x, 2) for x in os.getloadavg()], "versions": versions}


def agreement(outputs: dict[str, dict[str, list[list[int]]]], reference: str,
              case: str) -> dict[str, Any]:
    """Identical outputs and matching tokens (position by position) against `reference`."""
    result = {}
    ref = outputs.get(reference, {}).get(case)
    for name, cases in outputs.items():
        other = cases.get(case)
        if name == reference or ref is None or other is None:
            continue
        same = sum(a == b for a, b in zip(ref, other))
        tokens = sum(x == y for a, b in zip(ref, other) for x, y in zip(a, b))
        total = sum(len(a) for a in ref)
        result[name] = {"identical": f"{same}/{len(ref)}", "tokens": round(tokens / total, 3)}
    return result


def best_rows(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Each (engine, case)'s fastest row over the passes."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["engine"], row["case"])
        if key not in best or row["tok_s"] > best[key]["tok_s"]:
            best[key] = row
    return best


def format_table(rows: list[dict[str, Any]], summaries: dict[str, dict[str, Any]],
                 cases: list[str], engines: list[str]) -> str:
    by = best_rows(rows)
    lines = ["tokens/s (best of --repeat and --passes; output tokens = sentences x new tokens)",
             f"{'engine':<14}" + "".join(f"{c:>13}" for c in cases) + f"{'peak RSS MiB':>14}"]
    for engine in engines:
        cells = [f"{by[(engine, c)]['tok_s']:>13.1f}" if (engine, c) in by else f"{'-':>13}"
                 for c in cases]
        rss = summaries.get(engine, {}).get("peak_rss_mib")
        lines.append(f"{engine:<14}" + "".join(cells)
                     + (f"{rss:>14.0f}" if rss is not None else f"{'-':>14}"))
    lines.append("")
    lines.append(f"{'ratio':<28}" + "".join(f"{c:>13}" for c in cases))
    for a, b in RATIOS:
        if a not in engines or b not in engines:
            continue
        cells = []
        for c in cases:
            if (a, c) in by and (b, c) in by:
                cells.append(f"{by[(a, c)]['tok_s'] / by[(b, c)]['tok_s']:>12.2f}x")
            else:
                cells.append(f"{'-':>13}")
        lines.append(f"{a + ' / ' + b:<28}" + "".join(cells))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from tfserve.argparsing import OneLineParser

    parser = OneLineParser(prog="python -m tfserve.compare",
                           description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--work", type=Path, default=None,
                        help="build directory, reused when it holds a build of the same model "
                        "(default: a new temporary directory)")
    parser.add_argument("--hf-dir", type=Path, default=None,
                        help="a downloaded MarianMT / opus-mt checkpoint instead of the random one")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 1 repeat, 4 tokens (smoke test)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated engines")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="tokens decoded per sentence, min = max (default 32; --quick 4)")
    parser.add_argument("--threads", type=int, default=0, help="threads per engine (0: all cores)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="timed runs per case after one warm-up (default 3; --quick 1)")
    parser.add_argument("--passes", type=int, default=1,
                        help="run the engines in turn this many times and keep each engine's "
                             "best case times and highest peak RSS (a shared machine's speed "
                             "drifts between the engines' turns)")
    parser.add_argument("--timeout", type=float, default=1200.0,
                        help="seconds allowed to the build and to each engine's child process")
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)  # child: one engine
    parser.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)  # child
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cases_table = QUICK_CASES if args.quick else CASES
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for given, known, flag in ((cases, cases_table, "--cases"), (engines, ENGINES, "--engines")):
        unknown = [x for x in given if x not in known]
        if unknown or not given:
            parser.error(f"{flag}: unknown {unknown}; known: {', '.join(known)}")
    if args.hf_dir is not None and not (args.hf_dir / "config.json").is_file():
        parser.error(f"--hf-dir {args.hf_dir}: no config.json")
    new_tokens = args.new_tokens or (4 if args.quick else 32)
    repeat = args.repeat or (1 if args.quick else 3)
    if new_tokens < 1 or repeat < 1 or args.threads < 0 or args.passes < 1:
        parser.error("--new-tokens, --repeat and --passes must be >= 1, --threads >= 0")
    threads = args.threads or cpu_count()
    selected = {c: cases_table[c] for c in cases}
    sentences = max(c.sentences for c in cases_table.values())

    if args.engine is not None:  # child: one engine
        if args.work is None:
            parser.error("--engine needs --work")
        run_engine(args.engine, args.work, threads, repeat, new_tokens, selected,
                   lambda row: print(json.dumps(row), flush=True))
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="tfserve-compare-"))
    if args.build_only:
        print(json.dumps(build(work, args.quick, args.hf_dir, sentences)), flush=True)
        return 0

    common = ["--work", str(work), "--threads", str(threads)]
    if args.quick:
        common.append("--quick")
    if args.hf_dir is not None:
        common += ["--hf-dir", str(args.hf_dir)]
    code, built, err = run_child([*common, "--build-only"], threads, args.timeout)
    if code:
        print(f"python -m tfserve.compare: build failed ({code}): {err}", file=sys.stderr)
        return 1
    stamp = json.loads((work / BUILD_STAMP).read_text(encoding="utf-8"))
    header = {"work": str(work), "checkpoint": stamp["hf_dir"], "threads": threads,
              "new_tokens": new_tokens, "repeat": repeat, "passes": args.passes,
              "quick": args.quick,
              "machine": machine(), "build": built[-1] if built else {}}
    print(json.dumps(header), flush=True)

    rows: list[dict[str, Any]] = []
    summaries: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    for turn, engine in enumerate([e for _ in range(args.passes) for e in engines]):
        code, got, err = run_child(
            [*common, "--engine", engine, "--repeat", str(repeat), "--new-tokens",
             str(new_tokens), "--cases", ",".join(cases)], threads, args.timeout)
        for row in got:
            if row.get("summary"):
                before = summaries.get(engine)
                if before is None or row["peak_rss_mib"] > before["peak_rss_mib"]:
                    summaries[engine] = row
            else:
                row["pass"] = turn // len(engines) + 1
                rows.append(row)
                if not row["lengths_ok"]:
                    print(f"warning: {engine} {row['case']} decoded lengths {row['lengths']}, "
                          f"not {new_tokens}", file=sys.stderr)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
        if code:
            failures[engine] = f"exit {code}: {err.strip().splitlines()[-1] if err.strip() else ''}"
            print(f"warning: engine {engine} failed ({failures[engine]})", file=sys.stderr)

    outputs = {}
    for engine in engines:
        path = work / "outputs" / f"{engine}.json"
        if path.is_file() and engine in summaries:
            outputs[engine] = json.loads(path.read_text(encoding="utf-8"))
    agree = {case: agreement(outputs, "hf-eager", case) for case in cases
             if "hf-eager" in outputs}
    ratios = {}
    by = best_rows(rows)
    for a, b in RATIOS:
        for case in cases:
            if (a, case) in by and (b, case) in by:
                ratios[f"{a}/{b}/{case}"] = round(by[(a, case)]["tok_s"] / by[(b, case)]["tok_s"],
                                                  3)
    print("\n" + format_table(rows, summaries, cases, engines))
    if agree:
        print("\noutputs identical to hf-eager (sentences; tokens matching position by position):")
        for case, per_engine in agree.items():
            print(f"  {case}: " + ", ".join(f"{name} {v['identical']} ({v['tokens']:.0%})"
                                            for name, v in per_engine.items()))
    print(f"\nload average now {os.getloadavg()[0]:.2f} on {header['machine']['cores']} cores")
    if args.json is not None:
        args.json.write_text(json.dumps({**header, "rows": rows, "engines": summaries,
                                         "ratios": ratios, "agreement_with_hf": agree,
                                         "failures": failures}, indent=1), encoding="utf-8")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
