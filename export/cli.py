"""`python -m export`: a checkpoint -> a verified ONNX artifacts directory.

    python -m export                                  # the bundled demo -> artifacts/<name>
    python -m export --checkpoint DIR --out OUT       # a native checkpoint
    python -m export --from-hf DIR --out OUT          # a Hugging Face checkpoint directory
    python -m export --quantize int8 --out OUT-int8   # dynamic int8 for CPU

Template: load -> trace -> check -> (quantize) -> verify parity -> publish. Everything is
written into a temporary directory beside --out and renamed into place at the end, so a
failed or interrupted export never leaves a half-written artifacts directory.

fp16 graphs are checked on CUDA when a device is there, else on the CPU where its provider
runs their fused attention in fp16; where neither does, the export refuses (exit code 2)
unless --allow-unverified publishes them unchecked (docs/graph-interface.md, "fp16 graphs").

Exit codes: 0 success, 1 parity check failed (nothing written), 2 bad input (a module of the
`export` extra missing included: one line naming what to install).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tfserve.argparsing import OneLineParser, add_version
from tfserve.version import __version__

if TYPE_CHECKING:  # imported where used: it loads torch
    from export.sources import Source

EXIT_PARITY = 1
EXIT_USAGE = 2


class ExportError(Exception):
    """Bad input to the export; printed as one line, exit code 2."""


# The modules of the `export` extra (pyproject.toml), each named as its distribution. The base
# wheel (the serving path) has none of them; the export imports them after parsing its
# arguments, so --help and --version work without them.
EXPORT_EXTRA_MODULES = ("torch", "onnx", "onnxscript", "safetensors", "num2words")
DEMO_ONLY_MODULES = ("num2words",)  # the bundled demo's sentences
# torch installed first, as README says: pip takes its CPU build for this pin, while a bare
# `torch` requirement (the extra's) pulls several GB of CUDA packages
TORCH_REQUIREMENT = "torch==2.13.0"


def missing_extra(module: str) -> str:
    """The one line for a module of the export extra that is not installed."""
    return (f"the export needs the 'export' extra (no module {module}): "
            f"pip install {TORCH_REQUIREMENT} (the CPU build), then pip install "
            "'tfserve[export]'")


def missing_export_module(demo: bool) -> str | None:
    """The first module of the export extra that cannot be found here (the demo's too when
    `demo`), or None; checked before any work, so a missing one costs no checkpoint load."""
    for name in EXPORT_EXTRA_MODULES:
        if name in DEMO_ONLY_MODULES and not demo:
            continue
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a finder that refuses it; a module without spec
            found = False
        if not found:
            return name
    return None


def missing_module_exit(exc: ModuleNotFoundError) -> int:
    """Exit code 2 and the one line for a module of the export extra found missing while
    exporting (one the check before did not see: an import inside it); others re-raised."""
    module = (exc.name or "").partition(".")[0]
    if module not in EXPORT_EXTRA_MODULES:
        raise exc
    print(f"python -m export: error: {missing_extra(module)}", file=sys.stderr)
    return EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m export",
        description="Export an encoder-decoder Transformer to ONNX (encoder.onnx + KV-cached "
        "decoder.onnx), verify numerical parity against the eager model, and write an "
        "artifacts directory (model.json, graphs, tokenizer) for tfserve.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", type=Path, default=None,
                        help="native checkpoint directory (config.json, model.safetensors, "
                        "tokenizer.json + SentencePiece files); default: the bundled demo")
    source.add_argument("--from-hf", type=Path, default=None, metavar="DIR",
                        help="local Hugging Face checkpoint directory, or a cache snapshot "
                        "(models--ORG--NAME/snapshots/HASH, named ORG/NAME): MarianMT / opus-mt, "
                        "T5 / mT5 / Flan-T5 / MADLAD, BART / distilbart, mBART-50 / mBART-cc25, "
                        "M2M100 / NLLB-200")
    parser.add_argument("--out", type=Path, default=None,
                        help="artifacts directory to create (default: artifacts/<model name>)")
    parser.add_argument("--opset", type=int, default=17, help="ONNX opset version (14..20)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16"],
                        help="float precision of the graphs; fp16 is for CUDA (its parity "
                        "check runs on CUDA when a device is there, else on the CPU where "
                        "this onnxruntime's CPU provider runs fp16 MultiHeadAttention)")
    parser.add_argument("--allow-unverified", action="store_true",
                        help="--dtype fp16 where no device here runs the fp16 graphs: "
                        "publish them without the parity check (model.json: provenance "
                        "verified false) instead of refusing")
    parser.add_argument("--quantize", default=None, choices=["int8"],
                        help="dynamic int8 quantization of the MatMul weights (CPU)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite an existing --out, and publish even if parity fails")
    parser.add_argument("--parity-samples", type=int, default=200,
                        help="sample sentences decoded greedily by both backends (demo model)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    add_version(parser, __version__)
    return parser


class Progress:
    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.quiet, self.index = total, quiet, 0

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        self.index += 1
        started = time.perf_counter()
        if not self.quiet:
            print(f"[{self.index}/{self.total}] {what} ...", flush=True)
        yield
        if not self.quiet:
            print(f"      done in {time.perf_counter() - started:.1f}s",
                  flush=True)


def sha256_of(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def check_out(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise ExportError(f"--out {out} already exists (use --force to overwrite)")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory")
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"--out {out}: cannot create {parent}: {exc.strerror}") from exc
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"--out {out}: directory {parent} is not writable")


def publish(staging: Path, out: Path) -> None:
    """Move the finished staging directory to `out`, replacing an old one last."""
    backup = None
    if out.exists():
        backup = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(backup)
    staging.rename(out)
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    # heavy imports after argument parsing, so --help and usage errors are instant
    import onnx
    import torch

    from export.graphs import (
        FP16_MIN_OPSET,
        FP16_PARITY_NEEDS,
        SUPPORTED_OPSETS,
        attention_nodes,
        expected_attention_nodes,
        export_graphs,
        fp16_parity_device,
        quantize_int8,
        store_weights_externally,
    )
    from export.sources import load_source
    from export.verify import verify
    from tfserve.artifacts.manifest import GRAPH_REVISION, Manifest
    from tfserve.version import __version__

    if args.opset not in SUPPORTED_OPSETS:
        raise ExportError(f"--opset must be in {SUPPORTED_OPSETS.start}.."
                          f"{SUPPORTED_OPSETS.stop - 1}, got {args.opset}")
    if args.quantize and args.dtype != "fp32":
        raise ExportError("--quantize int8 needs --dtype fp32")
    if args.parity_samples < 0:
        raise ExportError(f"--parity-samples must be >= 0, got {args.parity_samples}")
    if args.dtype == "fp16" and args.opset < FP16_MIN_OPSET:
        # earlier opsets have no LayerNormalization: torch writes the mean in float16 ops
        raise ExportError(f"--dtype fp16 needs --opset {FP16_MIN_OPSET} or later (its "
                          "LayerNormalization keeps the statistics in float32), got "
                          f"{args.opset}")
    # fp32 and int8 graphs are checked on the CPU, which runs them everywhere; fp16 graphs
    # where a device here runs their fused attention in fp16, or nowhere (never silently)
    parity_device = fp16_parity_device() if args.dtype == "fp16" else "cpu"
    if parity_device is None and not args.allow_unverified:
        raise ExportError("--dtype fp16: no device here runs the fused fp16 attention "
                          "(com.microsoft.MultiHeadAttention) for the parity check; it needs "
                          f"{FP16_PARITY_NEEDS} (--allow-unverified publishes the graphs "
                          "unchecked)")
    progress = Progress((7 if args.quantize else 6) - (parity_device is None), args.quiet)

    with progress.step("loading checkpoint"):
        source = load_source(checkpoint=args.checkpoint, hf_dir=args.from_hf)
    model = source.model
    out = args.out or Path("artifacts") / model.config.name
    check_out(out, args.force)

    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.resolve().parent))
    # mkdtemp makes the directory private (0700); a published model is readable like any
    # directory the user creates (a container's non-root server must be able to read it)
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    try:
        float_dtype = torch.float16 if args.dtype == "fp16" else torch.float32
        graphs_traced = "the encoder" if model.config.encoder_only else "encoder and decoder"
        with progress.step(f"tracing {graphs_traced} (opset {args.opset}, {args.dtype})"):
            # an encoder-only model (T5EncoderModel) has the encoder graph alone; in fp16 the
            # modules the config keeps in float32 stay so (T5's FFN output projection)
            graphs = [path.name for path in export_graphs(model.to_precision(float_dtype),
                                                          staging, args.opset, float_dtype)]
            model = model.float()
        for name in graphs:  # every attention is one fused node, in every precision
            found, expected = attention_nodes(staging / name), \
                expected_attention_nodes(model, name)
            if found != expected:  # a fault of the tracing, not of the input
                raise RuntimeError(f"{name} has {found} com.microsoft.MultiHeadAttention "
                                   f"nodes where the model has {expected} attentions")
        with progress.step("onnx.checker"):
            for name in graphs:
                onnx.checker.check_model(str(staging / name), full_check=True)
        if args.quantize:
            with progress.step("int8 dynamic quantization"):
                quantize_int8(staging, graphs)
        with progress.step("weights into " + " / ".join(f"{name}.data" for name in graphs)):
            store_weights_externally(staging, graphs)
        for name in source.tokenizer_files:
            if name in source.built_files:
                (staging / name).write_text(source.built_files[name], encoding="utf-8")
            else:
                shutil.copy2(source.directory / name, staging / name)
        generation = source.generation or recorded_generation(model.config.extra)
        manifest = Manifest(
            config=model.config,
            generation=generation,
            banned_token_ids=banned_token_ids(source, generation),
            tokenizer=source.tokenizer_spec,
            dtype=args.dtype,
            quantization=args.quantize,
            opset=args.opset,
            provenance={
                "source": str(source.directory),
                "source_format": source.kind,
                "source_sha256": sha256_of(source.weight_files),
                "tfserve": __version__,
                "graph_revision": GRAPH_REVISION,
                "attention": "fused",
                # where the parity check ran ("none": published unchecked, verified false)
                "parity_device": parity_device or "none",
                "verified": parity_device is not None,
                **({"tokenizer": source.built_note} if source.built_note else {}),
                "torch": torch.__version__,
                "onnx": onnx.__version__,
                "onnxruntime": __import__("onnxruntime").__version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
        )
        manifest.save(staging)
        if parity_device is None:
            report = unverified_report(args.dtype)
        else:
            with progress.step(f"parity against the eager model (ONNX Runtime "
                               f"{parity_device.upper()})"):
                report = verify(model, staging, args.dtype, args.quantize,
                                source.sample_texts[: args.parity_samples],
                                device=parity_device)
        manifest.parity = report
        manifest.save(staging)
        if parity_device is not None and not report["passed"] and not args.force:
            raise ParityFailure("; ".join(report["failures"]))
        with progress.step(f"writing {out}"):
            publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"out": str(out), "parity": report}


def unverified_report(dtype: str) -> dict[str, Any]:
    """model.json's parity for graphs published unchecked (--allow-unverified)."""
    from export.graphs import FP16_PARITY_NEEDS

    return {"precision": dtype, "device": "none", "verified": False, "passed": False,
            "failures": [],
            "note": f"not checked (--allow-unverified): no device here runs the fused {dtype} "
                    f"attention; checking needs {FP16_PARITY_NEEDS}"}


def recorded_generation(extra: dict[str, Any]) -> dict[str, Any]:
    """The generation settings an importer kept in ModelConfig.extra (Marian, T5)."""
    from tfserve.artifacts.generation_defaults import hf_fields

    recorded = extra.get("hf_generation")
    if not isinstance(recorded, dict):
        return {}
    known = hf_fields()
    return {key: value for key, value in recorded.items()
            if key in known and value is not None}


def banned_token_ids(source: Source, generation: dict[str, Any]) -> list[int]:
    """The tokens the searches will never produce (model.json's banned_token_ids): what the
    checkpoint's bad_words_ids bans (tfserve.artifacts.generation_defaults); for a native
    checkpoint,
    its pad token unless it is eos (tfserve's own models train with pad as padding only, and
    have always been decoded with it banned)."""
    from tfserve.artifacts.generation_defaults import GenerationDefaults, pad_ban

    cfg = source.model.config
    if source.kind == "native":
        return list(pad_ban(cfg.pad_token_id, cfg.eos_token_id))
    return GenerationDefaults(generation).banned_token_ids(cfg.eos_token_id)


class ParityFailure(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    missing = missing_export_module(demo=args.checkpoint is None and args.from_hf is None)
    if missing is not None:
        print(f"python -m export: error: {missing_extra(missing)}", file=sys.stderr)
        return EXIT_USAGE
    try:  # these load torch
        from export.sources import SourceError
        from tfserve.artifacts.model_config import ConfigError
        from tfserve.model import CheckpointError
        from tfserve.text.tokenizer import TokenizerError
    except ModuleNotFoundError as exc:
        return missing_module_exit(exc)

    try:
        result = run(args)
    except ModuleNotFoundError as exc:
        return missing_module_exit(exc)
    except (ExportError, SourceError, ConfigError, CheckpointError, TokenizerError) as exc:
        print(f"python -m export: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ParityFailure as exc:
        print(f"python -m export: parity check failed, nothing written: {exc} "
              "(--force publishes anyway)", file=sys.stderr)
        return EXIT_PARITY
    except KeyboardInterrupt:
        print("python -m export: interrupted, nothing written", file=sys.stderr)
        return 130
    if args.quiet:
        return 0
    parity = result["parity"]
    if parity.get("verified") is False:
        status = "NOT CHECKED (published with --allow-unverified)"
    else:
        status = "passed" if parity["passed"] else "FAILED (published with --force)"
    print(f"exported {result['out']}: parity {status}: {parity_summary(parity)}")
    return 0


def parity_summary(parity: dict[str, Any]) -> str:
    """One line of the parity report: the logits' (an encoder-only model: the hidden
    states' and embeddings') differences and the greedy agreement."""
    figures = parity.get("max_abs_diff", {})
    key = "max_logits" if "max_logits" in figures else "encoder_hidden_states"
    if key not in figures:
        return str(parity.get("note", ""))
    shown = "logits" if key == "max_logits" else "hidden states"
    summary = f"max |{shown} diff| {figures[key]:.2e}"
    if "max_rel_diff" in parity:
        summary += f" (relative {parity['max_rel_diff'][key]:.2e}"
        if "tolerance_ratio" in parity:
            summary += f", {parity['tolerance_ratio']:.2g} of the tolerance"
        summary += ")"
    embeddings = parity.get("embeddings", {})
    if embeddings.get("sources"):
        summary += (f", embedding cosine >= {embeddings['min_cosine']:.8f} over "
                    f"{embeddings['sources']} sources")
    greedy = parity.get("greedy") or parity.get("greedy_random_sources") or {}
    if greedy.get("sentences"):
        summary += f", greedy identical {greedy['identical']}/{greedy['sentences']}"
    return summary
