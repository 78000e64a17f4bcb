"""tfserve on a CUDA GPU: fp32 and fp16 parity against the eager model, and tokens/s against
Hugging Face transformers (and CTranslate2 where its CUDA build loads) on the same GPU.

    python -m tfserve.bench.gpu --work DIR          # needs onnxruntime-gpu, torch with CUDA

Two models, both built here (nothing is downloaded):
- parity on the bundled demo (a trained model, so greedy agreement is about real sentences):
  its fp32 and fp16 exports run on CUDA with IO binding (the KV cache stays on the device),
  compared step by step with the eager fp32 model (max |logit difference|, relative to the
  largest logit) and by greedy decoding of the demo's sample sentences;
- speed on the random opus-mt-base-sized Marian checkpoint of `python -m tfserve.bench.compare`
  with the same cases (greedy batch 1 and 16, beam 4 batch 32; min = max new tokens): tfserve
  CUDA fp32 / fp16 against transformers' `generate` on CUDA in fp32 / fp16, and CTranslate2
  float16 when it is installed with a CUDA build that loads.

Output: one JSON line per measurement, then a table and the ratios; --json OUT keeps them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tfserve.bench.common import CASES, Case, export_quietly, json_line
from tfserve.bench.engines import (
    CTranslate2Engine,
    Engine,
    HuggingFaceEngine,
    TfserveEngine,
    pad_batch,
    time_case,
)
from tfserve.bench.models import BASE_MODEL, build_checkpoint, make_inputs, read_vocab
from tfserve.bench.report import machine

PROG = "python -m tfserve.bench.gpu"
ENGINES = ("tfserve-fp32", "tfserve-fp16", "hf-fp32", "hf-fp16", "ct2-fp16")


class CudaTfserveEngine(TfserveEngine):
    """tfserve's Runtime on CUDA: IO binding, the KV cache kept as device OrtValues."""

    def __init__(self, artifacts: Path) -> None:
        super().__init__(artifacts, threads=1)
        from tfserve.runtime import Runtime

        self.runtime = Runtime(artifacts, device="cuda")


class CudaHuggingFaceEngine(HuggingFaceEngine):
    """transformers' generate on CUDA, in float32 or float16."""

    def __init__(self, hf_dir: Path, half: bool) -> None:
        super().__init__(hf_dir, threads=1)
        dtype = self.torch.float16 if half else self.torch.float32
        self.model = self.model.to(device="cuda", dtype=dtype)

    def prepare(self, rows: list[list[int]]) -> Any:
        ids, mask = pad_batch(rows, self.pad)
        return self.torch.from_numpy(ids).cuda(), self.torch.from_numpy(mask).cuda()

    def run(self, batch: Any, beams: int, new_tokens: int) -> list[list[int]]:
        out = super().run(batch, beams, new_tokens)
        self.torch.cuda.synchronize()
        return out


class CudaCTranslate2Engine(CTranslate2Engine):
    """CTranslate2 float16 on CUDA, converted here from the same checkpoint."""

    def __init__(self, work: Path, hf_dir: Path) -> None:
        import ctranslate2

        model_dir = work / "ct2-fp16"
        if not (model_dir / "model.bin").is_file():
            ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(
                str(model_dir), quantization="float16", force=True)
        self.translator = ctranslate2.Translator(str(model_dir), device="cuda",
                                                 compute_type="float16")
        vocab, _, _, _ = read_vocab(hf_dir)
        self.ids = vocab
        self.pieces = {i: piece for piece, i in vocab.items()}


def open_engine(name: str, work: Path, hf_dir: Path) -> Engine:
    if name in ("tfserve-fp32", "tfserve-fp16"):
        return CudaTfserveEngine(work / name)
    if name in ("hf-fp32", "hf-fp16"):
        return CudaHuggingFaceEngine(hf_dir, half=name == "hf-fp16")
    if name == "ct2-fp16":
        return CudaCTranslate2Engine(work, hf_dir)
    raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")


def export(source: list[str], out: Path, dtype: str) -> None:
    """`python -m export SOURCE --dtype DTYPE` into out, unless it is there already."""
    if (out / "model.json").is_file():
        return
    code = export_quietly(source, out, "--dtype", dtype, "--parity-samples", "0")
    if code:
        raise SystemExit(f"{PROG}: export {' '.join(source)} --dtype {dtype} failed ({code})")


def demo_parity(work: Path, emit: Any) -> None:
    """Step parity and greedy agreement of the demo's fp32 / fp16 exports on CUDA."""
    from export.sources import load_source
    from export.verify import greedy_agreement, step_parity
    from tfserve.demo import CHECKPOINT_DIR
    from tfserve.runtime import Runtime

    source = load_source(CHECKPOINT_DIR)
    model = source.model.eval()
    for dtype in ("fp32", "fp16"):
        out = work / f"demo-{dtype}"
        export(["--checkpoint", str(CHECKPOINT_DIR)], out, dtype)
        runtime = Runtime(out, device="cuda")
        steps = step_parity(model, runtime)
        samples = [runtime.tokenizer.encode(t) for t in source.sample_texts]
        greedy = greedy_agreement(model, runtime, samples, 32)
        emit({"parity": "demo", "precision": dtype, "device": "cuda",
              "io_binding": runtime.device_cache,
              "max_abs_logits_diff": steps["max_abs_diff"]["max_logits"],
              "max_rel_logits_diff": steps["max_rel_diff"]["max_logits"],
              "max_abs_logits": steps["max_abs_logits"],
              "greedy_identical": greedy["identical"], "greedy_sentences": greedy["sentences"],
              "greedy_agreement": greedy["agreement"]})


def speed(work: Path, engines: list[str], cases: dict[str, Case], new_tokens: int,
          repeat: int, emit: Any) -> list[dict[str, Any]]:
    """Tokens/s of every engine on every case, the base model built in `work` if missing."""
    checkpoint = work / BASE_MODEL.name
    if not (checkpoint / "config.json").is_file():
        build_checkpoint(checkpoint, BASE_MODEL)
    for dtype in ("fp32", "fp16"):
        if f"tfserve-{dtype}" in engines:
            export(["--from-hf", str(checkpoint)], work / f"tfserve-{dtype}", dtype)
    sources = make_inputs(checkpoint, max(c.sentences for c in cases.values()))
    rows = []
    outputs: dict[str, dict[str, list[list[int]]]] = {}
    for name in engines:
        try:
            engine = open_engine(name, work, checkpoint)
        except Exception as exc:  # an engine whose library or CUDA build is missing here
            emit({"engine": name, "skipped": f"{type(exc).__name__}: {str(exc)[:300]}"})
            continue
        outputs[name] = {}
        for case_name, case in cases.items():
            times, out = time_case(engine, sources, case, new_tokens, repeat)
            produced = case.sentences * new_tokens
            outputs[name][case_name] = out
            row = {"engine": name, "case": case_name, "batch": case.batch,
                   "beams": case.beams, "new_tokens": new_tokens,
                   "lengths_ok": sorted({len(o) for o in out}) == [new_tokens],
                   "tok_s": produced / min(times),
                   "tok_s_median": produced / statistics.median(times)}
            rows.append(row)
            emit(row)
        del engine
    for name, by_case in outputs.items():
        if name != "hf-fp32" and "hf-fp32" in outputs:
            for case_name, out in by_case.items():
                ref = outputs["hf-fp32"][case_name]
                emit({"agreement": name, "with": "hf-fp32", "case": case_name,
                      "identical": sum(a == b for a, b in zip(out, ref)),
                      "sentences": len(ref)})
    return rows


def table(rows: list[dict[str, Any]], cases: list[str], engines: list[str]) -> str:
    """Tokens/s per engine and case, and tfserve / the others in the same precision."""
    best = {(r["engine"], r["case"]): r["tok_s"] for r in rows}
    lines = ["engine".ljust(14) + "".join(c.rjust(14) for c in cases)]
    for engine in engines:
        if any((engine, c) in best for c in cases):
            lines.append(engine.ljust(14) + "".join(
                f"{best.get((engine, c), float('nan')):14.1f}" for c in cases))
    for ours, theirs in (("tfserve-fp32", "hf-fp32"), ("tfserve-fp16", "hf-fp16"),
                         ("tfserve-fp16", "ct2-fp16")):
        if all((e, c) in best for e in (ours, theirs) for c in cases):
            lines.append(f"{ours} / {theirs}: " + ", ".join(
                f"{c} {best[(ours, c)] / best[(theirs, c)]:.2f}x" for c in cases))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tfserve.argparsing import OneLineParser

    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--work", type=Path, default=None,
                        help="build directory, reused (default: a new temporary directory)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated engines")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--new-tokens", type=int, default=32,
                        help="tokens decoded per sentence, min = max")
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed runs per case after one warm-up")
    parser.add_argument("--skip-parity", action="store_true", help="only the speed table")
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    args = parser.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for given, known, flag in ((engines, ENGINES, "--engines"), (cases, CASES, "--cases")):
        unknown = [x for x in given if x not in known]
        if unknown or not given:
            parser.error(f"{flag}: unknown {unknown}; known: {', '.join(known)}")
    if args.new_tokens < 1 or args.repeat < 1:
        parser.error("--new-tokens and --repeat must be >= 1")
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        parser.error("needs onnxruntime-gpu with a CUDA device (CUDAExecutionProvider is not "
                     f"available: {onnxruntime.get_available_providers()})")
    work = args.work or Path(tempfile.mkdtemp(prefix="tfserve-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        results.append(row)
        print(json_line(row, 4), flush=True)

    emit({"machine": machine(), "onnxruntime": onnxruntime.__version__, "gpu": gpu_name(),
          "new_tokens": args.new_tokens, "repeat": args.repeat})
    if not args.skip_parity:
        demo_parity(work, emit)
    rows = speed(work, engines, {c: CASES[c] for c in cases}, args.new_tokens, args.repeat,
                 emit)
    print("\n" + table(rows, cases, engines))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


def gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception as exc:  # no torch, or no CUDA build of it
        return f"unknown ({type(exc).__name__})"


if __name__ == "__main__":
    sys.exit(main())
