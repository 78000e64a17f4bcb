"""Offline benchmark: ONNX Runtime backend vs the eager PyTorch backend, one run, same inputs.

    python -m tfserve bench                       # the bundled demo
    python -m tfserve bench --random-base         # random opus-mt-base-sized model
    python -m tfserve bench --server HOST:PORT    # load test of a running server (loadgen)

Cases (fixed output length: min_new_tokens = max_new_tokens, so every engine decodes the
same number of tokens): greedy batch 1, greedy batch 16, beam 4 batch 32. Prints tokens/s
per backend and the ratio ONNX Runtime / eager. Needs torch (the eager side).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tfserve.argparsing import OneLineParser, add_version, program_name
from tfserve.bench.common import CASES, export_quietly, json_line, timed_runs
from tfserve.version import __version__


def source_batch(vocab: int, eos: int, batch: int, length: int, seed: int) -> tuple[np.ndarray,
                                                                                  np.ndarray]:
    """`batch` random source rows of `length` ids ending with eos, and their (all-ones) mask."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(batch, length), dtype=np.int64)
    ids[:, -1] = eos
    return ids, np.ones_like(ids)


def run_cases(backends: dict[str, Any], vocab: int, eos: int, new_tokens: int, source_len: int,
              cases: list[str], repeat: int) -> list[dict[str, Any]]:
    """Tokens/s of every backend on every case (best of `repeat` after a warm-up), printed
    as a JSON line per case as it finishes; with two backends, also their ratio."""
    from tfserve.generation import DecodingOptions
    from tfserve.generation.batch import generate

    rows = []
    for case in cases:
        spec = CASES[case]
        ids, mask = source_batch(vocab, eos, spec.batch, source_len, seed=len(rows))
        options = DecodingOptions(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  num_beams=spec.beams)
        row: dict[str, Any] = {"case": case, "batch": spec.batch, "new_tokens": new_tokens}
        for name, backend in backends.items():
            times, _ = timed_runs(
                lambda b=backend, i=ids, m=mask, o=options: generate(b, i, m, o), repeat)
            row[f"{name}_tok_s"] = spec.batch * new_tokens / min(times, default=float("inf"))
        names = list(backends)
        if len(names) == 2:
            row["ratio"] = row[f"{names[0]}_tok_s"] / row[f"{names[1]}_tok_s"]
        rows.append(row)
        print(json_line(row, 2), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """`tfserve bench`: the offline benchmark, or with --server the load generator."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg == "--server" or arg.startswith("--server=") for arg in argv):
        from tfserve.bench.loadgen import main as loadgen_main

        return loadgen_main(argv)
    parser = OneLineParser(prog=f"{program_name()} bench", description=__doc__.split("\n\n")[0],
                           epilog="With --server HOST:PORT this runs a load test against that "
                           "running server instead (tfserve.bench.loadgen: closed-loop clients "
                           "at several concurrencies, throughput and latency); `--server "
                           "HOST:PORT --help` lists its flags.")
    add_version(parser, __version__)
    parser.add_argument("--server", metavar="HOST:PORT", help="load-test this running server "
                        "instead of the offline benchmark (see below)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="native checkpoint (default: the bundled demo)")
    parser.add_argument("--random-base", action="store_true",
                        help="benchmark a random opus-mt-base-sized model instead")
    parser.add_argument("--model", type=Path, default=None,
                        help="reuse an exported artifacts dir of the same checkpoint")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per row")
    parser.add_argument("--source-len", type=int, default=24,
                        help="source tokens per input row")
    parser.add_argument("--threads", type=int, default=0, help="threads for both backends "
                        "(0: all cores)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed runs per case after one warm-up; the best is reported")
    parser.add_argument("--quantize", action="store_true",
                        help="also time an int8-quantized export")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")

    import torch

    from tfserve.bench.models import make_random_base
    from tfserve.model import load_checkpoint
    from tfserve.model.eager import EagerBackend
    from tfserve.runtime import Runtime, default_threads

    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    work = Path(tempfile.mkdtemp(prefix="tfserve-bench-"))
    checkpoint = args.checkpoint
    if args.random_base:
        checkpoint = make_random_base(work / "checkpoint")
    if checkpoint is None:
        from tfserve.demo import CHECKPOINT_DIR

        checkpoint = CHECKPOINT_DIR
    source = ["--checkpoint", str(checkpoint)]
    artifacts = args.model
    if artifacts is None:
        artifacts = work / "artifacts"
        code = export_quietly(source, artifacts)
        if code:
            return code
    model = load_checkpoint(checkpoint)
    backends: dict[str, Any] = {"onnxruntime": Runtime(artifacts, intra_op_threads=threads),
                                "eager": EagerBackend(model)}
    if args.quantize:
        quantized = work / "artifacts-int8"
        code = export_quietly(source, quantized, "--quantize", "int8")
        if code:
            return code
        backends = {"onnxruntime": backends["onnxruntime"],
                    "onnxruntime_int8": Runtime(quantized, intra_op_threads=threads),
                    "eager": backends["eager"]}
    cfg = model.config
    print(json.dumps({"model": cfg.name, "d_model": cfg.d_model, "layers": [
        cfg.encoder_layers, cfg.decoder_layers], "vocab": cfg.vocab_size, "threads": threads}),
        flush=True)
    new_tokens = min(args.new_tokens, cfg.max_target_positions - 1)
    source_len = min(args.source_len, cfg.max_source_positions)
    rows = run_cases(backends, cfg.vocab_size, cfg.eos_token_id, new_tokens, source_len, cases,
                     args.repeat)
    print("\ncase          " + "".join(f"{name + ' tok/s':>22}" for name in backends)
          + "   ratio onnxruntime/eager")
    for row in rows:
        ratio = row["onnxruntime_tok_s"] / row["eager_tok_s"]
        print(f"{row['case']:<14}" + "".join(f"{row[f'{n}_tok_s']:>22.1f}" for n in backends)
              + f"   {ratio:.2f}x")
    return 0
