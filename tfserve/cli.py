"""`python -m tfserve {translate,encode,serve,bench}`.

    python -m tfserve translate "three hundred and forty-two" "seven"   # the bundled demo
    python -m tfserve translate --model artifacts/opus-mt-en-de --beams 4 "Hello."
    python -m tfserve translate --server localhost:50051 "twelve"       # a running server
    python -m tfserve encode --pooling mean "twelve"
    python -m tfserve serve --model DIR --port 50051                     # see --help
    python -m tfserve bench                                              # offline benchmark

Texts come from the arguments, or from standard input one per line when there are none.
Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None,
                        help="artifacts directory from `python -m export` (default: the bundled "
                        "demo, exported on first use)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=0,
                        help="ONNX Runtime intra-op threads (0: one per core)")
    parser.add_argument("--truncate", action="store_true",
                        help="cut texts longer than the model's source limit instead of failing")


def add_decoding_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("decoding")
    group.add_argument("--max-new-tokens", type=int, default=None,
                       help="default: 256 or the model's limit, whichever is smaller")
    group.add_argument("--min-new-tokens", type=int, default=0)
    group.add_argument("--beams", type=int, default=1, help="beam size (1: greedy)")
    group.add_argument("--length-penalty", type=float, default=1.0)
    group.add_argument("--early-stopping", action="store_true")
    group.add_argument("--n-best", type=int, default=1,
                       help="hypotheses printed per text (num_return_sequences)")
    group.add_argument("--sample", action="store_true", help="sample instead of searching")
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--seed", type=int, default=None)


def decoding_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
                num_beams=args.beams, length_penalty=args.length_penalty,
                early_stopping=args.early_stopping, num_return_sequences=args.n_best,
                do_sample=args.sample, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m tfserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    tr = sub.add_parser("translate", help="translate texts, one result line per text",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    tr.add_argument("texts", nargs="*", help="texts (default: lines of standard input)")
    add_model_args(tr)
    add_decoding_args(tr)
    tr.add_argument("--server", default=None, metavar="HOST:PORT",
                    help="send the texts to a running tfserve server instead")
    tr.add_argument("--eager", action="store_true",
                    help="run the PyTorch checkpoint (--checkpoint) instead of ONNX Runtime")
    tr.add_argument("--checkpoint", type=Path, default=None,
                    help="native checkpoint for --eager (default: the bundled demo)")
    tr.add_argument("--scores", action="store_true", help="print 'score<TAB>text'")
    tr.add_argument("--json", action="store_true", help="print one JSON object per text")

    enc = sub.add_parser("encode", help="sentence embeddings (JSON lines)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    enc.add_argument("texts", nargs="*")
    add_model_args(enc)
    enc.add_argument("--pooling", default="mean", choices=["mean", "max", "first"])
    enc.add_argument("--per-token", action="store_true", help="include per-token hidden states")
    enc.add_argument("--server", default=None, metavar="HOST:PORT")

    serve = sub.add_parser("serve", help="run the gRPC server (see `serve --help`)",
                           add_help=False)
    serve.add_argument("rest", nargs=argparse.REMAINDER)
    bench = sub.add_parser("bench", help="benchmarks (see `bench --help`)", add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def read_texts(args: argparse.Namespace) -> list[str]:
    if args.texts:
        return list(args.texts)
    if sys.stdin is None or sys.stdin.isatty():
        raise ValueError("no texts given: pass them as arguments or on standard input")
    return [line.rstrip("\n") for line in sys.stdin if line.strip()]


def print_translations(args: argparse.Namespace, texts: list[str],
                       results: list[list[Any]]) -> None:
    for text, hyps in zip(texts, results):
        if args.json:
            print(json.dumps({"source": text, "hypotheses": [
                {"text": h.text, "token_ids": list(h.token_ids), "score": h.score}
                for h in hyps]}, ensure_ascii=False))
            continue
        for h in hyps:
            print(f"{h.score:.4f}\t{h.text}" if args.scores else h.text)


def cmd_translate(args: argparse.Namespace) -> None:
    texts = read_texts(args)
    kwargs = decoding_kwargs(args)
    if args.server:
        from tfserve.client import Client

        with Client(args.server) as client:
            results = client.translate_hypotheses(texts, truncate=args.truncate, **kwargs)
        print_translations(args, texts, results)
        return
    from tfserve.translator import Translator

    if args.eager:
        from tfserve.demo import CHECKPOINT_DIR
        from tfserve.eager import EagerBackend
        from tfserve.model import load_checkpoint
        from tfserve.tokenizer import Tokenizer, TokenizerSpec

        directory = args.checkpoint or CHECKPOINT_DIR
        spec = TokenizerSpec.from_dict(json.loads((directory / "tokenizer.json").read_text()))
        translator = Translator.from_backend(EagerBackend(load_checkpoint(directory)),
                                             Tokenizer(directory, spec))
    else:
        translator = Translator(args.model, device=args.device, intra_op_threads=args.threads)
    print_translations(args, texts, translator.translate_hypotheses(
        texts, truncate=args.truncate, **kwargs))


def cmd_encode(args: argparse.Namespace) -> None:
    texts = read_texts(args)
    if args.server:
        from tfserve.client import Client

        with Client(args.server) as client:
            encodings = client.encode(texts, pooling=args.pooling, per_token=args.per_token,
                                      truncate=args.truncate)
    else:
        from tfserve.translator import Translator

        translator = Translator(args.model, device=args.device, intra_op_threads=args.threads)
        encodings = translator.encode(texts, pooling=args.pooling, truncate=args.truncate)
    for text, e in zip(texts, encodings):
        record: dict[str, Any] = {"text": text, "embedding": [round(float(x), 6)
                                                             for x in e.embedding]}
        if args.per_token:
            record["hidden_states"] = [[round(float(x), 6) for x in row]
                                       for row in e.hidden_states]
        print(json.dumps(record, ensure_ascii=False))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # serve and bench own their whole argument lists (and their --help)
    if argv and argv[0] == "serve":
        from tfserve.server import main as serve_main

        return serve_main(argv[1:])
    if argv and argv[0] == "bench":
        from tfserve.bench import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        {"translate": cmd_translate, "encode": cmd_encode}[args.command](args)
    except (ValueError, RuntimeError, OSError) as exc:
        # every input / config / artifacts error in tfserve is a ValueError naming the field
        print(f"python -m tfserve {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `| head` closed the pipe: not an error
        return 0
    return 0
