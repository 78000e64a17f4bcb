"""Where one decoder step's time goes: ONNX Runtime's per-node profile of an export's decoder,
or (--search) what a search's steps cost in runs and host <-> device traffic.

    python -m tfserve.bench.step_profile ARTIFACTS [--batch 16] [--threads 2] [--past 16]
    python -m tfserve.bench.step_profile ARTIFACTS --search [--batch 32] [--beams 4]
    python -m tfserve.bench.step_profile ARTIFACTS --search --sample [--top-p 0.9]

Runs the decoder graph of an artifacts directory on random inputs (`--batch` rows, one new
token after `--past` cached ones, a source of `--source` tokens), a few warm-up steps and
`--steps` timed ones, with ONNX Runtime's profiler on, and prints the step time, the step time
without fetching the [B,1,V] logits (what a search that reads only the graph's top
candidates would pay), and the nodes that take the most kernel time. With a large
vocabulary (NLLB-200's 256,206 ids) the output projection (`/lm_head/MatMul`, or its
`_quant` form in int8 exports) and the LogSoftmax / TopK over its output lead the list.

--search decodes `--batch` random sources of `--source` tokens with `--beams` beams (1:
greedy) for `--steps` new tokens through the serving path (`Runtime` and `DecodeBatch`), with
the KV cache kept as the device placement keeps it (`--placement device`, the path CUDA takes,
here in CPU memory), as the CPU keeps it (`--placement host`) or in the static buffers of
`Runtime(kv_cache="static")` (`--placement static`: the device placement with buffers per
bucket written in place, tfserve.runtime.static_cache), and prints the ONNX Runtime
runs and the bytes copied between host and device memory per decoder step (the runtime's
`RunCounters`; the encoder run and the rows' joining are not counted). `--sample` samples
instead (`--samples` per text, `--temperature`, `--top-k`, `--top-p`, seeded): without a
top-k the graph's candidates can serve, the device placement draws where the logits are
(tfserve.runtime.sampling_graph: inside the decoder step's run; the static placement, a
second run) and the host placement takes whole rows.

Imports numpy and onnxruntime only.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from tfserve.artifacts.manifest import Manifest


def profile(artifacts: Path, batch: int, threads: int, past: int, source: int, steps: int,
            top: int) -> list[str]:
    """The report's lines (module docstring)."""
    manifest = Manifest.load(artifacts)
    cfg = manifest.config
    if cfg.encoder_only:
        raise ValueError(f"{artifacts} is an encoder-only model (model.decoder_layers 0): it "
                         "has no decoder step to profile")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # errors only: not the shared table's input warning
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "step")
    session = ort.InferenceSession(str(artifacts / manifest.decoder_file), options,
                                   providers=["CPUExecutionProvider"])
    dtype = np.float16 if manifest.dtype == "fp16" else np.float32
    rng = np.random.default_rng(0)
    feeds = {"input_ids": np.full((batch, 1), cfg.eos_token_id, np.int64),  # [B,1]
             "position_ids": np.full((batch, 1), past, np.int64),
             "self_attention_mask": np.ones((batch, past + 1), np.int64),
             "encoder_attention_mask": np.ones((batch, source), np.int64)}
    for layer in range(cfg.decoder_layers):
        for kind, length in (("past", past), ("cross", source)):
            for part in ("key", "value"):
                feeds[f"{kind}_{part}_{layer}"] = rng.standard_normal(
                    (batch, cfg.num_heads, length, cfg.head_dim)).astype(dtype)
    fetch = [output.name for output in session.get_outputs()]
    without_logits = [name for name in fetch if name != "logits"]
    warmup = 3
    for _ in range(warmup):
        session.run(fetch, feeds)
    timings = {}
    for name, names in (("all", fetch), ("no-logits", without_logits)):
        started = time.perf_counter()
        for _ in range(steps):
            session.run(names, feeds)
        timings[name] = (time.perf_counter() - started) / steps
    events = json.loads(Path(session.end_profiling()).read_text(encoding="utf-8"))
    per_node: collections.Counter[str] = collections.Counter()
    op_of = {}
    for event in events:
        name = event.get("name", "")
        if event.get("cat") == "Node" and name.endswith("_kernel_time"):
            node = name[: -len("_kernel_time")]
            per_node[node] += event["dur"]
            op_of[node] = event.get("args", {}).get("op_name", "")
    runs = warmup + 2 * steps
    kernels = sum(per_node.values()) / runs  # microseconds per step
    lines = [f"{artifacts.name}: {manifest.dtype}{' int8' if manifest.quantization else ''}, "
             f"vocabulary {cfg.vocab_size}, {cfg.decoder_layers} decoder layers, batch "
             f"{batch}, {threads} threads: step {timings['all'] * 1e3:.2f} ms, without "
             f"fetching the logits {timings['no-logits'] * 1e3:.2f} ms, kernels "
             f"{kernels / 1e3:.2f} ms"]
    for node, total in per_node.most_common(top):
        lines.append(f"  {op_of[node]:24s} {total / runs / 1e3:8.2f} ms "
                     f"{100 * total / runs / kernels:5.1f}%  {node}")
    return lines


def search_profile(artifacts: Path, batch: int, beams: int, source: int, steps: int,
                   threads: int, placement: str, sampling: dict[str, float | int] | None = None
                   ) -> dict[str, float | int | str]:
    """Runs and host <-> device bytes per decoder step of one search (module docstring);
    sampling: DecodingOptions' sampling fields (do_sample implied), None: beams."""
    from tfserve.generation import DecodingOptions, make_search
    from tfserve.generation.batch import DecodeBatch
    from tfserve.runtime import Runtime

    runtime = Runtime(artifacts, intra_op_threads=threads,
                      device_cache=placement in ("device", "static"),
                      kv_cache="static" if placement == "static" else "dynamic")
    if runtime.decoder is None:
        raise ValueError(f"{artifacts} is an encoder-only model (model.decoder_layers 0): it "
                         "has no decoder step to profile")
    rng = np.random.default_rng(0)
    # ids above the special ones; eos last, as a tokenizer ends a source
    ids = rng.integers(4, runtime.vocab_size - 1, (batch, source), dtype=np.int64)  # [N,S]
    ids[:, -1] = runtime.eos_token_id
    mask = np.ones_like(ids)
    # every row runs all `steps` steps: eos is blocked until the last one
    search = ({"num_beams": beams} if sampling is None
              else {"do_sample": True, "seed": 0, **sampling})
    options = DecodingOptions(max_new_tokens=steps, min_new_tokens=steps, **search)
    searches = [make_search(options, runtime.eos_token_id, runtime.decoder_start_token_id)
                for _ in range(batch)]
    decode = DecodeBatch(runtime)
    decode.add(searches, list(range(batch)), runtime.encode(ids, mask)[1], mask)
    before, done = runtime.counters.snapshot(), 0
    started = time.perf_counter()
    while len(decode):
        decode.step()
        done += 1
    seconds = time.perf_counter() - started
    moved = runtime.counters.since(before)
    return {"model": artifacts.name, "placement": placement, "texts": batch,
            **({"beams": beams} if sampling is None else {"sampling": sampling}),
            "steps": done, "runs_per_step": round(moved.runs / done, 2),
            "to_device_bytes_per_step": round(moved.to_device / done),
            "to_host_bytes_per_step": round(moved.to_host / done),
            "ms_per_step": round(seconds / done * 1e3, 2)}


def main(argv: list[str] | None = None) -> int:
    from tfserve.argparsing import OneLineParser

    parser = OneLineParser(prog="python -m tfserve.bench.step_profile",
                           description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("artifacts", type=Path, help="an artifacts directory (python -m export)")
    parser.add_argument("--batch", type=int, default=1, help="decoder rows")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: all)")
    parser.add_argument("--past", type=int, default=16, help="cached tokens per row")
    parser.add_argument("--source", type=int, default=25, help="source tokens per row")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--top", type=int, default=8, help="nodes listed")
    parser.add_argument("--search", action="store_true",
                        help="decode with a search and report runs and host <-> device bytes "
                             "per step instead of the node profile")
    parser.add_argument("--beams", type=int, default=1, help="--search: beams (1: greedy)")
    parser.add_argument("--sample", action="store_true",
                        help="--search: sample instead of beams (--samples, --temperature, "
                             "--top-k, --top-p)")
    parser.add_argument("--samples", type=int, default=1,
                        help="--sample: samples per text (num_return_sequences)")
    parser.add_argument("--temperature", type=float, default=1.0, help="--sample: temperature")
    parser.add_argument("--top-k", type=int, default=0, help="--sample: top_k (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="--sample: top_p")
    parser.add_argument("--placement", choices=("device", "host", "static"), default="device",
                        help="--search: where the KV cache lives between steps (static: "
                             "the device placement's static buffers)")
    args = parser.parse_args(argv)
    for name in ("batch", "past", "source", "steps", "top", "beams", "samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    if args.sample and args.beams != 1:
        parser.error("--sample draws --samples per text: --beams must be 1")
    if args.search:
        sampling = None if not args.sample else {
            "num_return_sequences": args.samples, "temperature": args.temperature,
            "top_k": args.top_k, "top_p": args.top_p}
        try:
            row = search_profile(args.artifacts, args.batch, args.beams, args.source,
                                 args.steps, args.threads, args.placement, sampling)
        except (ValueError, OSError) as exc:
            parser.error(str(exc))
        print(json.dumps(row))
        return 0
    try:
        lines = profile(args.artifacts, args.batch, args.threads, args.past, args.source,
                        args.steps, args.top)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
