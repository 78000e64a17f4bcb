"""How close a batch-1 decoder step comes to the machine's memory bandwidth.

    python -m tfserve.bench.roofline ARTIFACTS --tokens-per-second 31.5 [--threads 0]

At batch 1 a greedy step does little arithmetic per byte: it reads every decoder weight once
(the tied output projection included: 525 MB of NLLB's 256,206 x 1,024 table in fp32) and
the KV caches of its row. Such a step is bound by memory bandwidth, so a tokens/s figure is
best read against the bandwidth roofline:

    share = (bytes read per step / seconds per step) / measured read bandwidth

`bytes_per_step` counts the decoder graph's weights from the graph file (initializers, and
the weight inputs the runtime feeds, such as a shared table) plus the self- and
cross-attention K/V one row reads at the mean position of a decode; `read_bandwidth`
measures the rate at which this machine's cores sum a buffer far larger than its caches.
`python -m tfserve.bench.compare` reports the share for its greedy-b1 rows. Needs `onnx`
(the export extra).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tfserve.argparsing import OneLineParser
from tfserve.artifacts.manifest import decoder_io
from tfserve.bench.common import cpu_count

PROG = "python -m tfserve.bench.roofline"
# inputs of the decoder graph that are per-call values, not weights (docs/graph-interface.md)
CALL_INPUTS = decoder_io(0)[0]  # the decoder's inputs besides its layers' K/V caches
CACHE_PREFIXES = ("past_key_", "past_value_", "cross_key_", "cross_value_")


def read_bandwidth(threads: int = 0, megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes per second that `threads` threads (0: every usable core) read from memory, each
    summing its own part of one buffer of `megabytes` (numpy releases the GIL in the sum);
    the best of `repeats` passes."""
    threads = threads or cpu_count()
    buffer = np.ones(megabytes * (1 << 20) // 4, dtype=np.float32)
    parts = np.array_split(buffer, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, buffer.nbytes / (time.perf_counter() - start))
    return best


def bytes_per_step(artifacts: Path, source_tokens: int, mean_position: int) -> dict[str, int]:
    """What one batch-1 decoder step reads: `weights` (every decoder weight, a shared table
    once) and `cache` (its row's cross K/V over `source_tokens` and self K/V over
    `mean_position` steps), in bytes."""
    import onnx
    from onnx import helper

    graph = onnx.load(str(artifacts / "decoder.onnx"), load_external_data=False).graph

    def nbytes(elem_type: int, dims: list[int]) -> int:
        size = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize
        return int(np.prod(dims, dtype=np.int64)) * size

    weights = {tensor.name: nbytes(tensor.data_type, list(tensor.dims))
               for tensor in graph.initializer}
    cache = 0
    for value in graph.input:
        tensor_type = value.type.tensor_type
        # [batch, heads, length, head_dim]: the named dims are batch and length
        dims = [dim.dim_value for dim in tensor_type.shape.dim]
        if value.name.startswith(CACHE_PREFIXES):
            length = source_tokens if value.name.startswith("cross_") else mean_position
            cache += nbytes(tensor_type.elem_type, [1, dims[1], length, dims[3]])
        elif value.name not in CALL_INPUTS and value.name not in weights and all(dims):
            weights[value.name] = nbytes(tensor_type.elem_type, dims)  # a table fed at run time
    return {"weights": sum(weights.values()), "cache": cache}


def roofline_share(step_bytes: int, tokens_per_second: float, bandwidth: float) -> float:
    """The share of the bandwidth roofline a batch-1 decode at `tokens_per_second` reaches."""
    return step_bytes * tokens_per_second / bandwidth


def batch_one_shares(artifacts: Path, tokens_per_second: dict[str, float], source_tokens: int,
                     new_tokens: int, threads: int = 0) -> dict[str, object]:
    """The roofline of `artifacts`' batch-1 step and the share each engine's greedy batch-1
    rate (`tokens_per_second`, engine -> tokens/s, engines of the artifacts' precision)
    reaches."""
    step = bytes_per_step(artifacts, source_tokens, new_tokens // 2)
    total = step["weights"] + step["cache"]
    bandwidth = read_bandwidth(threads)
    return {"bytes_per_step": total, "weight_bytes": step["weights"],
            "read_bandwidth_gb_s": round(bandwidth / 1e9, 2),
            "roofline_tok_s": round(bandwidth / total, 1),
            "share": {engine: roofline_share(total, rate, bandwidth)
                      for engine, rate in tokens_per_second.items()}}


def format_shares(shares: dict[str, object]) -> str:
    """One line per engine under a header naming the step's bytes and the bandwidth."""
    lines = [f"batch-1 roofline: {shares['bytes_per_step'] / 1e6:.1f} MB read per step, "
             f"{shares['read_bandwidth_gb_s']} GB/s measured -> "
             f"{shares['roofline_tok_s']} tokens/s at most"]
    for engine, share in shares["share"].items():  # type: ignore[attr-defined]
        lines.append(f"  {engine:<14} {share:.0%} of the roofline")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", type=Path, help="an artifacts directory (python -m export)")
    parser.add_argument("--tokens-per-second", type=float, required=True,
                        help="a measured batch-1 greedy decode rate (tokens per second)")
    parser.add_argument("--source-tokens", type=int, default=25,
                        help="source tokens of the decoded sentence (default 25)")
    parser.add_argument("--new-tokens", type=int, default=32,
                        help="tokens decoded per sentence (default 32)")
    parser.add_argument("--threads", type=int, default=0,
                        help="threads reading memory (0: every usable core) (default 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.artifacts / "decoder.onnx").is_file():
        print(f"{PROG}: {args.artifacts}: no decoder.onnx", file=sys.stderr)
        return 2
    shares = batch_one_shares(args.artifacts, {"measured": args.tokens_per_second},
                              args.source_tokens, args.new_tokens, args.threads)
    print(format_shares(shares))
    return 0


if __name__ == "__main__":
    sys.exit(main())
