"""Engines compared on one Marian model: tfserve (ONNX Runtime) vs CTranslate2 vs Hugging Face.

    python -m tfserve.bench.compare                         # random opus-mt-base-sized model
    python -m tfserve.bench.compare --hf-dir opus-mt-en-de  # a real (downloaded) checkpoint
    python -m tfserve.bench.compare --quick                 # tiny model, seconds (smoke test)
    python -m tfserve.bench.compare --model flan-t5-base    # a random Flan-T5-base-sized T5
    python -m tfserve.bench.compare --model nllb-600m       # a random NLLB-200-600M-sized model

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
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tfserve.bench.common import CASES, Case, cpu_count, export_quietly, json_line
from tfserve.bench.engines import BUILD_STAMP, ENGINES, INPUTS_FILE, run_engine
from tfserve.bench.models import (
    MODELS,
    SOURCE_LENGTHS,
    build_checkpoint,
    make_inputs,
    model_spec,
)
from tfserve.bench.report import (
    agreement,
    best_rows,
    format_agreement,
    format_table,
    machine,
    ratios,
)
from tfserve.bench.roofline import batch_one_shares, format_shares

PROG = "python -m tfserve.bench.compare"
QUICK_CASES = {
    "greedy-b1": Case(batch=1, beams=1, sentences=2),
    "greedy-b16": Case(batch=16, beams=1, sentences=16),
    "beam4-b32": Case(batch=32, beams=4, sentences=32),
}


# -- build (a child process too: the parent stays free of torch) ------------------------------


def build(work: Path, quick: bool, hf_dir: Path | None, sentences: int,
          model: str = "opus-mt-base") -> dict[str, Any]:
    """Checkpoint, tfserve fp32/int8 artifacts, CTranslate2 float32/int8 models, inputs.

    Every step whose output is already in `work` (and was made for the same model) is skipped.
    """
    work.mkdir(parents=True, exist_ok=True)
    spec = model_spec(model, quick)
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

    for name, extra in (("tfserve-fp32", []), ("tfserve-int8", ["--quantize", "int8"])):
        def export(out: Path = work / name, extra: list[str] = extra) -> None:
            code = export_quietly(["--from-hf", str(checkpoint)], out, *extra)
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


def exported_by_this_revision(artifacts: Path) -> bool:
    """An export in `artifacts` made by this tfserve's graph revision (older ones are redone:
    the comparison is about the graphs this version makes)."""
    from tfserve.artifacts.manifest import GRAPH_REVISION

    path = artifacts / "model.json"
    if not path.is_file():
        return False
    provenance = json.loads(path.read_text(encoding="utf-8")).get("provenance", {})
    return provenance.get("graph_revision") == GRAPH_REVISION


# -- the parent -------------------------------------------------------------------------------


def child_env(threads: int) -> dict[str, str]:
    """The children's environment: this checkout importable, Hugging Face offline."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # tfserve/bench/compare.py -> the root
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_child(argv: list[str], threads: int, timeout: float) -> tuple[int, list[dict[str, Any]],
                                                                      str]:
    """`python -m tfserve.bench.compare ARGV` -> (exit code, its JSON rows, its stderr's tail)."""
    command = [sys.executable, "-m", "tfserve.bench.compare", *argv]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=child_env(threads))
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return 124, rows, f"timed out after {timeout:.0f}s"
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, rows, done.stderr[-2000:]


def batch_one_roofline(work: Path, rows: list[dict[str, Any]], cases: list[str],
                       new_tokens: int, threads: int) -> dict[str, Any]:
    """The fp32 engines' greedy batch-1 rates as shares of the bandwidth roofline of the fp32
    export's step (tfserve.bench.roofline); empty without that case, export or `onnx`."""
    artifacts = work / "tfserve-fp32"
    by = best_rows(rows)
    rates = {engine: by[(engine, "greedy-b1")]["tok_s"] for engine in ("tfserve-fp32", "ct2-fp32")
             if (engine, "greedy-b1") in by}
    if "greedy-b1" not in cases or not rates or not (artifacts / "decoder.onnx").is_file():
        return {}
    try:
        return batch_one_shares(artifacts, rates, max(SOURCE_LENGTHS), new_tokens, threads)
    except ImportError:  # onnx (the export extra) reads the graph's weights
        return {}


def build_parser() -> argparse.ArgumentParser:
    """The parser of the parent and of its children (--engine, --build-only)."""
    from tfserve.argparsing import OneLineParser

    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--work", type=Path, default=None,
                        help="build directory, reused when it holds a build of the same model "
                        "(default: a new temporary directory)")
    parser.add_argument("--hf-dir", type=Path, default=None,
                        help="a downloaded checkpoint (MarianMT, T5, NLLB, ...) instead of the "
                        "random one")
    parser.add_argument("--model", default="opus-mt-base", choices=list(MODELS),
                        help="the random model to build (without --hf-dir)")
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
    """The command line: the parent, or one of its children; returns the exit code."""
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
        print(json.dumps(build(work, args.quick, args.hf_dir, sentences, args.model)),
              flush=True)
        return 0

    common = ["--work", str(work), "--threads", str(threads), "--model", args.model]
    if args.quick:
        common.append("--quick")
    if args.hf_dir is not None:
        common += ["--hf-dir", str(args.hf_dir)]
    code, built, err = run_child([*common, "--build-only"], threads, args.timeout)
    if code:
        print(f"{PROG}: build failed ({code}): {err}", file=sys.stderr)
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
            print(json_line(row, 3), flush=True)
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
    print("\n" + format_table(rows, summaries, cases, engines))
    if agree:
        print("\n" + format_agreement(agree, "hf-eager"))
    roofline = batch_one_roofline(work, rows, cases, new_tokens, threads)
    if roofline:
        print("\n" + format_shares(roofline))
    print(f"\nload average now {os.getloadavg()[0]:.2f} on {header['machine']['cores']} cores")
    if args.json is not None:
        args.json.write_text(json.dumps({**header, "rows": rows, "engines": summaries,
                                         "ratios": ratios(rows, cases),
                                         "agreement_with_hf": agree,
                                         "roofline": roofline,
                                         "failures": failures}, indent=1), encoding="utf-8")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
