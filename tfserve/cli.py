"""`tfserve {translate,encode,serve,bench}` (also `python -m tfserve ...`).

    tfserve translate "three hundred and forty-two" "seven"        # the bundled demo
    tfserve translate --model artifacts/opus-mt-en-de --beams 4 "Hello."
    tfserve translate --server localhost:50051 "twelve"            # a running server
    tfserve translate --server localhost:50051 --model-name en-fr "twelve"   # one of its models
    tfserve translate --model artifacts/nllb --source-lang eng_Latn --target-lang fra_Latn "Hi."
    tfserve translate --document page.html --format html --source-lang auto --target-lang fra_Latn
    tfserve models --server localhost:50051                         # the models it serves
    tfserve encode --pooling mean "twelve"
    tfserve serve --model DIR --port 50051                          # see serve --help
    tfserve bench                                                   # offline benchmark

Texts come from the arguments, or from standard input one per line when there are none.
Output keeps to the input, line for line: each input gives --n-best lines (one JSON object
with --json, and for encode); a blank input gives blank lines (translate), an object with no
hypotheses (translate --json) or a null embedding (encode), and is not sent to the model.

Exit codes: 0 success; 1 runtime failure (server unreachable, model failure, any server error
but INVALID_ARGUMENT); 2 bad flag or bad input (one line on stderr); 141 when the reader of
standard output went away (`| head -1`), quietly, as `cat` does; 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tfserve import option_table
from tfserve.argparsing import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILURE,
    EXIT_USAGE,
    OneLineParser,
    add_version,
    program_name,
)
from tfserve.serving.settings import MODEL_SETTINGS, add_arguments
from tfserve.version import __version__

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--model, --device and --threads as `serve` declares them (tfserve.serving.settings), and
    --truncate."""
    add_arguments(parser, MODEL_SETTINGS)
    parser.add_argument("--truncate", action="store_true",
                        help="cut texts longer than the model's source limit instead of failing")


def add_decoding_args(parser: argparse.ArgumentParser) -> None:
    """A flag per decoding option (tfserve.option_table: its flag, type and help; a boolean
    option is a --flag / --no-flag pair). A flag left out takes the model's generation
    default (its checkpoint's generation_config.json: opus-mt asks for --beams 4), else the
    default its help names."""
    group = parser.add_argument_group(
        "decoding", "a flag left out takes the model's own generation default (its "
        "checkpoint's generation_config.json), else the default named here")
    for declared in option_table.OPTIONS:
        flag = declared.cli_flag
        if declared.type is bool:
            group.add_argument(flag, dest=declared.name, default=None,
                               action=argparse.BooleanOptionalAction,
                               help=declared.description)
        else:
            group.add_argument(flag, dest=declared.name, default=None, type=declared.type,
                               metavar=flag[2:].upper().replace("-", "_"),
                               help=declared.description)
    languages = parser.add_argument_group(
        "languages", "a multilingual model's language codes (NLLB-200 eng_Latn, M2M100 en, "
        "mBART-50 en_XX; the model's info lists them)")
    languages.add_argument("--source-lang", default=None, metavar="CODE",
                           help="the language of the texts (default: the model's own, where "
                           "it has one)")
    languages.add_argument("--target-lang", default=None, metavar="CODE",
                           help="the language to translate into (required by a multilingual "
                           "model)")
    languages.add_argument("--prefix", default=None, metavar="TEXT",
                           help="text every translation must start with")


def decoding_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The decoding options and languages the flags set (those left out are not passed:
    the model's generation defaults fill them)."""
    given = {name: getattr(args, name) for name in option_table.names()}
    given.update(source_language=args.source_lang, target_language=args.target_lang,
                 target_prefix=args.prefix)
    return {name: value for name, value in given.items() if value is not None}


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of `tfserve` (serve and bench only show here: they parse their own flags)."""
    prog = prog or program_name()
    parser = OneLineParser(prog=prog, description="Translate, embed, serve and benchmark "
                           "encoder-decoder Transformers exported to ONNX.")
    add_version(parser, __version__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=OneLineParser)

    tr = sub.add_parser("translate", help="translate texts, one result line per text",
                        description="Translate texts with the model (or a running server): "
                        "--n-best lines per input line, in input order.")
    add_version(tr, __version__)
    tr.add_argument("texts", nargs="*",
                    help="texts to translate (default: the lines of standard input)")
    add_model_args(tr)
    add_decoding_args(tr)
    tr.add_argument("--server", default=None, metavar="HOST:PORT",
                    help="send the texts to a running tfserve server instead of loading "
                    "--model")
    add_model_name_arg(tr)
    tr.add_argument("--eager", action="store_true",
                    help="run the PyTorch checkpoint (--checkpoint) instead of ONNX Runtime")
    tr.add_argument("--checkpoint", type=Path, default=None,
                    help="native checkpoint for --eager (default: the bundled demo)")
    tr.add_argument("--scores", action="store_true", help="print 'score<TAB>text'")
    tr.add_argument("--json", action="store_true", help="print one JSON object per text")
    # a document (docs/documents.md): one file, split into sentences, its layout kept
    tr.add_argument("--document", type=Path, default=None, metavar="FILE",
                    help="translate FILE as one document ('-': standard input): split into "
                    "sentences, each translated, written to standard output in FILE's layout")
    tr.add_argument("--format", default="text", metavar="FORMAT",
                    help="what --document holds: text (default) or html (markup kept, its "
                    "text translated)")
    from tfserve.bulk.command import add_arguments as add_corpus_arguments

    add_corpus_arguments(tr)  # --input/--output/--ray: a corpus job (docs/bulk.md)

    enc = sub.add_parser("encode", help="sentence embeddings (JSON lines)",
                         description="Encoder embeddings: one JSON object per input line, in "
                         "input order.")
    add_version(enc, __version__)
    enc.add_argument("texts", nargs="*",
                     help="texts to encode (default: the lines of standard input)")
    add_model_args(enc)
    enc.add_argument("--pooling", default="mean", choices=["mean", "max", "first"],
                     help="how the encoder's hidden states become one vector: mean or max over "
                     "the tokens, or the first token's")
    enc.add_argument("--per-token", action="store_true", help="include per-token hidden states")
    enc.add_argument("--server", default=None, metavar="HOST:PORT",
                     help="send the texts to a running tfserve server instead of loading "
                     "--model")
    add_model_name_arg(enc)

    models = sub.add_parser("models", help="the models a running server serves (JSON lines)",
                            description="List the models of a running server's repository: "
                            "one JSON object per model (name, state, version, languages, ...).")
    add_version(models, __version__)
    models.add_argument("--server", required=True, metavar="HOST:PORT",
                        help="the tfserve server to ask")

    sub.add_parser("serve", help=f"run the server, gRPC and HTTP (see `{prog} serve --help`)",
                   add_help=False)
    sub.add_parser("bench", help=f"offline benchmark, or with --server a load test of a "
                   f"running server (see `{prog} bench --help`)", add_help=False)
    return parser


def add_model_name_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-name", default="", metavar="NAME",
                        help="with --server: the server's model to use, one of those `models` "
                        "lists (default: the server's default model)")


def check_model_name(args: argparse.Namespace) -> None:
    if args.model_name and not args.server:
        raise ValueError("--model-name needs --server: it names one of a server's models "
                         "(without a server, --model is the artifacts directory)")


def read_texts(args: argparse.Namespace) -> list[str]:
    """The arguments, or every line of standard input (blank ones included, so that output
    lines can follow input lines)."""
    if args.texts:
        return list(args.texts)
    if sys.stdin is None or sys.stdin.isatty():
        raise ValueError("no texts given: pass them as arguments or on standard input")
    return [line.rstrip("\r\n") for line in sys.stdin]


def run_non_blank(texts: Sequence[str], run: Callable[[list[str]], list[Any]]) -> list[Any]:
    """`run` on the texts that are not blank; None in the places of the blank ones, which the
    model never sees (an empty text is not a translation request, and the output must still
    have a line for it)."""
    keep = [i for i, text in enumerate(texts) if text.strip()]
    results: list[Any] = [None] * len(texts)
    if keep:
        for index, result in zip(keep, run([texts[i] for i in keep])):
            results[index] = result
    return results


def print_translations(args: argparse.Namespace, texts: Sequence[str],
                       results: Sequence[list[Any] | None]) -> None:
    for text, hyps in zip(texts, results):
        if args.json:
            print(json.dumps({"source": text, "hypotheses": [
                {"text": h.text, "token_ids": list(h.token_ids), "score": h.score}
                for h in hyps or []]}, ensure_ascii=False))
        elif hyps is None:  # a blank input: as many blank lines as a real one would print
            print("\n" * ((args.num_return_sequences or 1) - 1))
        else:
            for h in hyps:
                print(f"{h.score:.4f}\t{h.text}" if args.scores else h.text)


def cmd_translate(args: argparse.Namespace) -> None:
    check_model_name(args)
    if args.input or args.output or args.ray:  # a corpus job, streamed (docs/bulk.md)
        from tfserve.bulk.command import run as run_corpus

        run_corpus(args, decoding_kwargs(args), program_name())
        return
    if args.document is not None:
        translate_document_file(args)
        return
    texts = read_texts(args)
    kwargs = decoding_kwargs(args)
    if args.server:
        from tfserve.client import Client

        with Client(args.server) as client:
            # each line one sequence, as the local Translator's (--document: a document)
            results = run_non_blank(texts, lambda batch: client.translate_hypotheses(
                batch, truncate=args.truncate, model=args.model_name, split_sentences=False,
                **kwargs))
        print_translations(args, texts, results)
        return
    from tfserve.translator import Translator

    if args.eager:
        from tfserve.demo import CHECKPOINT_DIR
        from tfserve.model import load_checkpoint
        from tfserve.model.eager import EagerBackend
        from tfserve.text.tokenizer import Tokenizer, TokenizerSpec

        directory = args.checkpoint or CHECKPOINT_DIR
        spec = TokenizerSpec.from_dict(json.loads((directory / "tokenizer.json").read_text()))
        translator = Translator.from_backend(EagerBackend(load_checkpoint(directory)),
                                             Tokenizer(directory, spec))
    else:
        translator = Translator(args.model, device=args.device, intra_op_threads=args.threads)
    print_translations(args, texts, run_non_blank(texts, lambda batch: (
        translator.translate_hypotheses(batch, truncate=args.truncate, **kwargs))))


def translate_document_file(args: argparse.Namespace) -> None:
    """--document FILE: the file translated as one document (Translator.translate_document,
    or a server's Translate with the file as one text and its format), written to standard
    output in its layout."""
    if args.texts:
        raise ValueError("--document translates one file: give no texts beside it")
    text = sys.stdin.read() if str(args.document) == "-" else \
        args.document.read_text(encoding="utf-8")
    kwargs = decoding_kwargs(args)
    if kwargs.pop("target_prefix", None) is not None:
        raise ValueError("--prefix starts a translation: not for --document")
    if args.server:
        from tfserve.client import Client

        with Client(args.server) as client:
            translated = client.translate([text], truncate=args.truncate, format=args.format,
                                          model=args.model_name, **kwargs)[0]
    else:
        from tfserve.translator import Translator

        translator = Translator(args.model, device=args.device, intra_op_threads=args.threads)
        translated = translator.translate_document(text, format=args.format,
                                                   truncate=args.truncate, **kwargs).text
    sys.stdout.write(translated)


def cmd_encode(args: argparse.Namespace) -> None:
    check_model_name(args)
    texts = read_texts(args)
    if args.server:
        from tfserve.client import Client

        with Client(args.server) as client:
            encodings = run_non_blank(texts, lambda batch: client.encode(
                batch, pooling=args.pooling, per_token=args.per_token, truncate=args.truncate,
                model=args.model_name))
    else:
        from tfserve.translator import Translator

        translator = Translator(args.model, device=args.device, intra_op_threads=args.threads)
        encodings = run_non_blank(texts, lambda batch: translator.encode(
            batch, pooling=args.pooling, truncate=args.truncate))
    for text, e in zip(texts, encodings):
        record: dict[str, Any] = {"text": text, "embedding": None if e is None else [
            round(float(x), 6) for x in e.embedding]}
        if args.per_token:
            record["hidden_states"] = None if e is None else [
                [round(float(x), 6) for x in row] for row in e.hidden_states]
        print(json.dumps(record, ensure_ascii=False))


def cmd_models(args: argparse.Namespace) -> None:
    from dataclasses import asdict

    from tfserve.client import Client

    with Client(args.server) as client:
        entries = client.list_models()
    for entry in entries:
        print(json.dumps(asdict(entry), ensure_ascii=False))


def failure_exit_code(exc: BaseException) -> int:
    """EXIT_USAGE for bad input (a ValueError, or a server answering INVALID_ARGUMENT),
    EXIT_FAILURE for everything else (unreachable server, model failure, I/O)."""
    if isinstance(exc, ValueError):
        return EXIT_USAGE
    code = getattr(exc, "code", None)
    if callable(code):  # a gRPC error (tfserve.client.ServerError)
        return EXIT_USAGE if getattr(code(), "name", "") == "INVALID_ARGUMENT" else EXIT_FAILURE
    return EXIT_FAILURE


def _quiet_stdout() -> None:
    """Point standard output at /dev/null: the interpreter flushes it once more at exit,
    which would raise BrokenPipeError again and print 'Exception ignored'."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor behind sys.stdout (embedded, tests)
        pass


def main(argv: list[str] | None = None) -> int:
    """The `tfserve` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # serve and bench own their whole argument lists (and their --help)
    if argv and argv[0] == "serve":
        from tfserve.server.main import main as serve_main

        return serve_main(argv[1:])
    if argv and argv[0] == "bench":
        from tfserve.bench.offline import main as bench_main

        return bench_main(argv[1:])
    prog = program_name()
    parser = build_parser(prog)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse would blame the top parser: name the subcommand, as its errors do
        parser.exit(EXIT_USAGE, f"{prog} {args.command}: error: unrecognized arguments: "
                    f"{' '.join(unknown)} (see {prog} {args.command} --help)\n")
    try:
        {"translate": cmd_translate, "encode": cmd_encode,
         "models": cmd_models}[args.command](args)
        sys.stdout.flush()  # a closed pipe must fail here, inside the try, not at exit
    except BrokenPipeError:  # the reader went away (`| head -1`): stop quietly, as cat does
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except (ValueError, RuntimeError, OSError) as exc:
        # input, config and artifacts errors are ValueErrors naming the field; failed gRPC
        # calls are tfserve.client.ServerError (a RuntimeError) carrying the status code
        print(f"{prog} {args.command}: error: {exc}", file=sys.stderr)
        return failure_exit_code(exc)
    return 0
