"""Bulk translation benchmark: the streamed file job against today's in-memory path,
CTranslate2's translate_file and the same job through a server; and the job's peak RSS
against the size of its file; and the job on Ray, 1 actor against several.

    python -m tfserve.bench.bulk --work /tmp/bulk-bench             # throughput (opus-mt-base)
    python -m tfserve.bench.bulk --work /tmp/bulk-bench --rss       # peak RSS, 10k vs 1M lines
    python -m tfserve.bench.bulk --work /tmp/bulk-bench --ray-scaling --lines 600   # Ray
    python -m tfserve.bench.bulk --quick                            # tiny everything (smoke)

Throughput: one random opus-mt-base-sized MarianMT checkpoint (tfserve.bench.compare's build:
exported by `python -m export --from-hf`, converted by CTranslate2's converter; reused with
--work), a file of --lines generated sentences of mixed lengths (3 to 60 words), and four
engines, each in a child process of its own with the same threads, beam and batch size, every
sentence decoding exactly --new-tokens tokens (min = max), so that tokens/s compare like with
like:

    memory   today's `tfserve translate` path: every line in memory, sorted globally, batches
             of --batch-size rows (Translator.translate_hypotheses)
    file     the streamed job (tfserve.bulk: read buffers of --read-buffer lines sorted by
             length, token-budget batches, output fsynced and journaled per buffer)
    ct2      CTranslate2's Translator.translate_file (max_batch_size --batch-size,
             read_batch_size --read-buffer, the SentencePiece model as its tokenize_fn)
    server   the streamed job with --server against `tfserve serve` on this machine, whose
             --max-batch-size (rows: one per beam) holds a batch of --batch-size lines

It prints one JSON line per engine and the ratios the issue asks for: file / memory (>= 0.95),
file / ct2 (>= 1.1), server / file (>= 0.9).

--rss: the bundled demo model (tiny, so a big file is fast) translating files of short lines
(--rss-lines, default 10,000 and 1,000,000) with `tfserve translate --input --output` in a
child process each; its peak RSS (wait4's ru_maxrss) per size and the ratio of the largest to
the smallest (<= 1.2: memory does not grow with the file).

--ray-scaling: the same corpus and model through the CLI, wall time of the whole command
(Ray's start, the actors' model loads and the job): the one-machine job with 1 thread and with
--threads, and `translate --ray local` with 1 actor and with --ray-actors actors of one CPU
each; the ratios are the Ray job's scaling from 1 actor to N and its N actors against the
one-machine job on the same cores.

In the throughput runs model loading is not timed; each child times its job only. This
module imports the standard library only at import time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROG = "python -m tfserve.bench.bulk"
ENGINES = ("memory", "file", "ct2", "server")


def corpus(path: Path, lines: int, seed: int = 5, most_words: int = 60) -> None:
    """`lines` generated sentences of 3 to `most_words` words (mixed lengths), with a blank
    line now and then, as a corpus has."""
    from tfserve.bench.models import pseudo_sentences, pseudo_words

    words = pseudo_words(3000, seed=0)
    rng = random.Random(seed)
    texts = pseudo_sentences(words, lines, seed, low=3, high=most_words)
    with open(path, "w", encoding="utf-8") as stream:
        for text in texts:
            stream.write(("" if rng.random() < 0.02 else text) + "\n")


def short_corpus(path: Path, lines: int, seed: int = 6) -> None:
    """`lines` demo phrases (English numbers), for the RSS runs."""
    from tfserve.demo.data import english

    rng = random.Random(seed)
    phrases = [english(rng.randrange(10**6)) for _ in range(1000)]
    with open(path, "w", encoding="utf-8") as stream:
        for _ in range(lines):
            stream.write(phrases[rng.randrange(len(phrases))] + "\n")


# -- the children: one engine each ------------------------------------------------------------


def decoding(args: argparse.Namespace) -> dict[str, Any]:
    return {"num_beams": args.beams, "min_new_tokens": args.new_tokens,
            "max_new_tokens": args.new_tokens}


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Load the engine (untimed), time its job over the corpus, return its row."""
    work = args.work
    source, out = work / "corpus.txt", work / f"out-{args.engine}.txt"
    lines = sum(1 for line in open(source, encoding="utf-8") if line.strip())
    threads = args.threads
    if args.engine == "ct2":
        import ctranslate2
        import sentencepiece as spm

        stamp = json.loads((work / "compare-build.json").read_text())
        processor = spm.SentencePieceProcessor()
        processor.Load(str(Path(stamp["hf_dir"]) / "source.spm"))
        translator = ctranslate2.Translator(str(work / "ct2-fp32"), device="cpu",
                                            intra_threads=threads, inter_threads=1)
        started = time.perf_counter()
        # ct2 4.x: a step producing </s> counts towards max_decoding_length and </s> is banned
        # for min_decoding_length steps: min = max = N decodes N tokens, as tfserve's min = max
        translator.translate_file(
            str(source), str(out), max_batch_size=args.batch_size,
            read_batch_size=args.read_buffer, batch_type="examples", beam_size=args.beams,
            min_decoding_length=args.new_tokens, max_decoding_length=args.new_tokens,
            source_tokenize_fn=lambda text: processor.encode(text, out_type=str),
            target_detokenize_fn=lambda tokens: " ".join(tokens))
        seconds = time.perf_counter() - started
    elif args.engine == "memory":
        from tfserve.cli import run_non_blank
        from tfserve.translator import Translator

        translator = Translator(work / "tfserve-fp32", intra_op_threads=threads,
                                max_batch_size=args.batch_size)
        started = time.perf_counter()
        texts = [line.rstrip("\n") for line in open(source, encoding="utf-8")]
        results = run_non_blank(texts, lambda batch: translator.translate_hypotheses(
            batch, **decoding(args)))
        with open(out, "w", encoding="utf-8") as stream:
            for hyps in results:
                stream.write(("" if hyps is None else hyps[0].text) + "\n")
        seconds = time.perf_counter() - started
    else:
        from tfserve.bulk.engines import LocalEngine, ServerEngine
        from tfserve.bulk.job import JobOptions, run_job
        from tfserve.bulk.journal import Journal
        from tfserve.bulk.progress import Progress
        from tfserve.bulk.records import Writer, read_lines

        if args.engine == "server":
            engine: Any = ServerEngine([args.server], in_flight=args.in_flight,
                                       **decoding(args))
        else:
            from tfserve.translator import Translator

            translator = Translator(work / "tfserve-fp32", intra_op_threads=threads,
                                    max_batch_size=args.batch_size)
            engine = LocalEngine(translator, "bench", **decoding(args))
        journal_path = Path(str(out) + ".tfserve-job.json")
        journal_path.unlink(missing_ok=True)
        journal = Journal(out)
        started = time.perf_counter()
        state = journal.start({"bench": args.engine})
        with open(source, "rb") as stream, open(out, "r+b") as sink:
            run_job(read_lines(stream), Writer(), sink, engine,
                    JobOptions(max_batch_size=args.batch_size, read_buffer=args.read_buffer),
                    Progress(sys.stderr, enabled=False), journal, state)
        seconds = time.perf_counter() - started
    return {"engine": args.engine, "lines": lines, "seconds": round(seconds, 3),
            "lines_s": lines / seconds, "tok_s": lines * args.new_tokens / seconds,
            "threads": threads, "beams": args.beams, "batch_size": args.batch_size}


# -- the parent -------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_engine(args: argparse.Namespace, engine: str, extra: list[str]) -> dict[str, Any]:
    command = [sys.executable, "-m", "tfserve.bench.bulk", "--child", engine, "--work",
               str(args.work), "--threads", str(args.threads), "--beams", str(args.beams),
               "--new-tokens", str(args.new_tokens), "--batch-size", str(args.batch_size),
               "--read-buffer", str(args.read_buffer), *extra]
    done = subprocess.run(command, capture_output=True, text=True, env=child_env())
    if done.returncode != 0:
        raise SystemExit(f"{PROG}: {engine} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    """`tfserve serve` on the fp32 export, with the engines' threads and batch; waits until
    SERVING."""
    import socket

    from tfserve.client import Client

    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    process = subprocess.Popen(
        [sys.executable, "-m", "tfserve", "serve", "--model", str(args.work / "tfserve-fp32"),
         "--host", "127.0.0.1", "--port", str(port), "--threads", str(args.threads),
         # the job's batch: --max-batch-size counts rows, one per beam of each line
         "--max-batch-size", str(args.batch_size * args.beams),
         "--metrics-port", "0", "--log-level", "warning"], env=child_env())
    target = f"127.0.0.1:{port}"
    with Client(target) as client:
        deadline = time.monotonic() + 600
        while True:
            try:
                if client.health(timeout=5) == "SERVING":
                    return process, target
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{PROG}: the server did not start")
            time.sleep(0.5)


def build_throughput_inputs(args: argparse.Namespace) -> Path:
    """The model (tfserve.bench.compare's build, reused from --work) and the corpus."""
    build = [sys.executable, "-m", "tfserve.bench.compare", "--work", str(args.work),
             "--build-only", *(["--quick"] if args.quick else [])]
    done = subprocess.run(build, env=child_env())
    if done.returncode != 0:
        raise SystemExit(f"{PROG}: building the model failed ({done.returncode})")
    source = args.work / "corpus.txt"
    corpus(source, args.lines, most_words=12 if args.quick else 60)  # --quick: 64 positions
    return source


def throughput(args: argparse.Namespace, engines: list[str]) -> dict[str, Any]:
    from tfserve.bench.common import stop_process

    build_throughput_inputs(args)
    rows: dict[str, dict[str, Any]] = {}
    # the engines take turns, --passes times, and each keeps its best run: a shared
    # machine's speed drifts between one engine's turn and the next
    for _ in range(args.passes):
        for engine in engines:
            if engine == "server":
                process, target = start_server(args)
                try:
                    row = run_engine(args, engine, ["--server", target])
                finally:
                    stop_process(process)
            else:
                row = run_engine(args, engine, [])
            print(json.dumps(row), flush=True)
            if engine not in rows or row["tok_s"] > rows[engine]["tok_s"]:
                rows[engine] = row
    ratios = {}
    for name, (top, bottom, floor) in {"file_over_memory": ("file", "memory", 0.95),
                                       "file_over_ct2": ("file", "ct2", 1.1),
                                       "server_over_file": ("server", "file", 0.9)}.items():
        if top in rows and bottom in rows:
            ratio = rows[top]["tok_s"] / rows[bottom]["tok_s"]
            ratios[name] = {"ratio": round(ratio, 3), "target": floor, "met": ratio >= floor}
    # the same translations: the share of lines each tfserve engine writes as the in-memory
    # path does (CTranslate2 writes pieces, not text)
    agreement = {}
    if "memory" in rows:
        reference = (args.work / "out-memory.txt").read_text(encoding="utf-8").splitlines()
        for engine in ("file", "server"):
            if engine in rows:
                lines = (args.work / f"out-{engine}.txt").read_text(
                    encoding="utf-8").splitlines()
                agreement[engine] = round(sum(a == b for a, b in zip(lines, reference))
                                          / max(len(reference), len(lines), 1), 4)
    print(json.dumps({"ratios": ratios, "lines_as_memory": agreement}), flush=True)
    return {"engines": rows, "ratios": ratios, "lines_as_memory": agreement}


def peak_rss(args: argparse.Namespace) -> dict[str, Any]:
    from tfserve.demo import default_artifacts

    model = default_artifacts()
    sizes = [int(size) for size in args.rss_lines.split(",")]
    rows = []
    for size in sizes:
        source, out = args.work / f"short-{size}.txt", args.work / f"short-{size}.out"
        if not source.is_file():
            short_corpus(source, size)
        Path(str(out) + ".tfserve-job.json").unlink(missing_ok=True)
        started = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-m", "tfserve", "translate", "--model", str(model), "--input",
             str(source), "--output", str(out), "--threads", str(args.threads), "--progress",
             "none"], env=child_env())
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            raise SystemExit(f"{PROG}: the {size}-line job failed ({process.returncode})")
        row = {"lines": size, "seconds": round(time.perf_counter() - started, 1),
               "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}  # Linux: KiB
        rows.append(row)
        print(json.dumps(row), flush=True)
    ratio = rows[-1]["peak_rss_mib"] / rows[0]["peak_rss_mib"]
    result = {"rss_ratio": round(ratio, 3), "target": 1.2, "met": ratio <= 1.2}
    print(json.dumps(result), flush=True)
    return {"rss": rows, **result}


def ray_scaling(args: argparse.Namespace) -> dict[str, Any]:
    source = build_throughput_inputs(args)
    runs = {"file-1": ["--threads", "1"], f"file-{args.threads}": ["--threads",
                                                                  str(args.threads)],
            "ray-1": ["--ray", "local", "--ray-actors", "1", "--ray-cpus", "1"],
            f"ray-{args.ray_actors}": ["--ray", "local", "--ray-actors", str(args.ray_actors),
                                       "--ray-cpus", "1"]}
    lines = sum(1 for line in open(source, encoding="utf-8") if line.strip())
    rows: dict[str, dict[str, Any]] = {}
    for name, extra in runs.items():
        out = args.work / f"out-{name}.txt"
        out.unlink(missing_ok=True)
        Path(str(out) + ".tfserve-job.json").unlink(missing_ok=True)
        command = [sys.executable, "-m", "tfserve", "translate", "--model",
                   str(args.work / "tfserve-fp32"), "--input", str(source), "--output",
                   str(out), "--beams", str(args.beams), "--min-new-tokens",
                   str(args.new_tokens), "--max-new-tokens", str(args.new_tokens),
                   "--max-batch-size", str(args.batch_size), "--read-buffer",
                   str(args.read_buffer), "--progress", "none", *extra]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True,
                              env={**child_env(), "RAY_USAGE_STATS_ENABLED": "0"})
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"{PROG}: {name} failed ({done.returncode}): "
                             f"{done.stderr[-2000:]}")
        rows[name] = {"run": name, "lines": lines, "seconds": round(seconds, 1),
                      "lines_s": lines / seconds, "tok_s": lines * args.new_tokens / seconds}
        print(json.dumps(rows[name]), flush=True)
    reference = (args.work / f"out-file-{args.threads}.txt").read_text(encoding="utf-8")
    same = all((args.work / f"out-{name}.txt").read_text(encoding="utf-8") == reference
               for name in runs)
    many, one = rows[f"ray-{args.ray_actors}"], rows["ray-1"]
    result = {"ray_scaling": round(many["tok_s"] / one["tok_s"], 3),
              "ray_over_file": round(many["tok_s"] / rows[f"file-{args.threads}"]["tok_s"], 3),
              "outputs_equal": same}
    print(json.dumps(result), flush=True)
    return {"runs": rows, **result}


def build_parser() -> argparse.ArgumentParser:
    from tfserve.argparsing import OneLineParser

    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--work", type=Path, default=None,
                        help="build directory, reused (default: a new temporary directory)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, few lines, small RSS files (smoke test)")
    parser.add_argument("--rss", action="store_true",
                        help="measure peak RSS against the file's size instead of throughput")
    parser.add_argument("--ray-scaling", action="store_true",
                        help="time the Ray job (1 actor, --ray-actors actors) against the "
                        "one-machine job instead (the ray extra)")
    parser.add_argument("--ray-actors", type=int, default=2,
                        help="actors of one CPU each in the --ray-scaling run")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated engines")
    parser.add_argument("--lines", type=int, default=None,
                        help="lines of the throughput corpus (default 20000; --quick 200)")
    parser.add_argument("--rss-lines", default=None,
                        help="comma-separated file sizes in lines, smallest first (default "
                        "10000,1000000; --quick 500,5000)")
    parser.add_argument("--threads", type=int, default=0, help="threads per engine (0: all cores)")
    parser.add_argument("--beams", type=int, default=4, help="beam size of every engine")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="tokens decoded per sentence, min = max (default 32; --quick 4)")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per batch")
    parser.add_argument("--read-buffer", type=int, default=4096,
                        help="lines read and sorted together (the job's and ct2's)")
    parser.add_argument("--in-flight", type=int, default=4, help="the server job's calls")
    parser.add_argument("--passes", type=int, default=1,
                        help="the engines take turns this many times; each keeps its best run")
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--server", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from tfserve.bench.common import cpu_count

    args = build_parser().parse_args(argv)
    args.threads = args.threads or cpu_count()
    args.new_tokens = args.new_tokens or (4 if args.quick else 32)
    if args.child is not None:
        args.engine = args.child
        print(json.dumps(child(args)), flush=True)
        return 0
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"{PROG}: --engines: unknown {unknown}; known: {', '.join(ENGINES)}")
    args.lines = args.lines or (200 if args.quick else 20000)
    args.rss_lines = args.rss_lines or ("500,5000" if args.quick else "10000,1000000")
    with tempfile.TemporaryDirectory(prefix="tfserve-bulk-bench-") as temporary:
        args.work = (args.work or Path(temporary)).resolve()
        args.work.mkdir(parents=True, exist_ok=True)
        if args.rss:
            result = peak_rss(args)
        elif args.ray_scaling:
            result = ray_scaling(args)
        else:
            result = throughput(args, engines)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
