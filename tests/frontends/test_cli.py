"""The command line: help texts, --version, program name, exit codes, stdin line alignment and
a closed standard output.

Commands run in-process through `tfserve.cli.main` (stdin, stdout and argv replaced by the
test) except where the process itself is the subject (a closed pipe, the console script's
import of settings). The model is a small random export (outputs are compared with the
Translator's own, not with expected words); a server, where needed, is a real one on a loopback
ephemeral port.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from server_helpers import ROOT, ServerThread, free_port, server_args

from tfserve import cli
from tfserve.argparsing import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILURE,
    EXIT_USAGE,
    OneLineParser,
    program_name,
)
from tfserve.client import ServerError
from tfserve.version import __version__

DECODE = ["--max-new-tokens", "3", "--threads", "1"]


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def translator(random_model: Path) -> Any:
    from tfserve.translator import Translator

    return Translator(random_model, intra_op_threads=1)


@pytest.fixture(scope="module")
def server(random_model: Path) -> Iterator[ServerThread]:
    with ServerThread(server_args(random_model)) as running:
        yield running


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Help wrapped at a fixed width, no TFSERVE_* settings from the caller's shell, and the
    program started as `python -m tfserve` unless a test says otherwise."""
    monkeypatch.setenv("COLUMNS", "100")
    for name in list(os.environ):
        if name.startswith("TFSERVE_") and name != "TFSERVE_CACHE":
            monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "tfserve" / "__main__.py")])


def run_cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
            argv: list[str], stdin: str | None = None) -> tuple[int, str, str]:
    """tfserve.cli.main(argv) with `stdin` as standard input: (exit code, stdout, stderr)."""
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as exited:  # argparse: --help, --version, usage errors
        code = exited.code if isinstance(exited.code, int) else EXIT_FAILURE
    out, err = capsys.readouterr()
    return code, out, err


# -- help -----------------------------------------------------------------------------------------


HELPS = {
    "tfserve": ["--help"],
    "translate": ["translate", "--help"],
    "encode": ["encode", "--help"],
    "serve": ["serve", "--help"],
    "bench": ["bench", "--help"],
    "export": None,  # python -m export --help
}


def render_help(name: str, capsys: pytest.CaptureFixture[str],
                monkeypatch: pytest.MonkeyPatch) -> str:
    argv = HELPS[name]
    if argv is None:
        from export.cli import main as export_main

        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            export_main(["--help"])
        assert exited.value.code == 0
        return capsys.readouterr().out
    code, out, err = run_cli(capsys, monkeypatch, argv)
    assert code == 0, err
    return out


def option_entries(text: str) -> dict[str, str]:
    """Each option of a rendered help -> its help text (empty when it has none).

    An entry starts with a line indented two spaces and beginning with "-"; its help follows
    on that line after a gap of two or more spaces, or on the deeper-indented lines below.
    """
    entries: dict[str, str] = {}
    current: str | None = None
    for line in text.splitlines():
        if re.match(r"^  -", line):
            invocation, _, rest = line.strip().partition("  ")
            current = invocation.split(",")[-1].split()[0]
            entries[current] = rest.strip()
        elif current is not None and re.match(r"^ {4,}\S", line):
            entries[current] = f"{entries[current]} {line.strip()}".strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("name", list(HELPS))
def test_help_renders_every_option_once_without_leaks(
        name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    text = render_help(name, capsys, monkeypatch)
    # an unescaped "%" in a help makes argparse print its internal dict of the action
    assert "%(" not in text and "{'" not in text, text
    assert "(default: None)" not in text
    flat = " ".join(text.split())
    assert not re.search(r"\(default:[^)]*\)\s*\(default:", flat), text
    entries = option_entries(text)
    assert "--help" in entries
    if name != "tfserve":
        assert len(entries) > 3
    for option, help_text in entries.items():
        assert help_text, f"{name}: {option} has no help text"
        assert help_text.count("(default:") <= 1, f"{name}: {option}: {help_text}"
    assert "--version" in entries


def test_serve_help_prints_a_percent_as_written(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A "%" in a serve help text (e.g. "1% slower") is printed as "%", not as argparse's
    internal dict of the action."""
    from tfserve.serving import settings

    monkeypatch.setitem(settings._HELP, "encode_ahead", "about 1% slower where cores are few")
    text = render_help("serve", capsys, monkeypatch)
    assert "about 1% slower where cores are few" in " ".join(text.split())
    assert "{'" not in text


def test_help_formatter_escapes_stray_percents_and_keeps_placeholders(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = OneLineParser(prog="demo")
    parser.add_argument("--a", default=3, help="1% of it, 100%% sure")
    parser.add_argument("--b", default=4, help="starts at %(default)s")
    parser.add_argument("--c", default=5, help="five")
    parser.add_argument("--d", default=None, help="unset: nothing")
    parser.add_argument("--e", action="store_true", help="switch")
    entries = option_entries(parser.format_help())
    assert entries["--a"] == "1% of it, 100% sure (default: 3)"
    assert entries["--b"] == "starts at 4"
    assert entries["--c"] == "five (default: 5)"
    assert entries["--d"] == "unset: nothing"
    assert entries["--e"] == "switch"


def test_bench_help_says_server_runs_a_load_test(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    text = " ".join(render_help("bench", capsys, monkeypatch).split())
    assert "--server HOST:PORT" in text
    assert "load test" in text and "load-test this running server" in text


# -- --version and the program's name -------------------------------------------------------------


@pytest.mark.parametrize("argv, prog", [
    (["--version"], "python -m tfserve"),
    (["translate", "--version"], "python -m tfserve translate"),
    (["encode", "--version"], "python -m tfserve encode"),
    (["serve", "--version"], "python -m tfserve serve"),
    (["bench", "--version"], "python -m tfserve bench"),
])
def test_version(argv: list[str], prog: str, capsys: pytest.CaptureFixture[str],
                 monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, _ = run_cli(capsys, monkeypatch, argv)
    assert code == 0
    assert out.strip() == f"{prog} {__version__}"


def test_export_version(capsys: pytest.CaptureFixture[str]) -> None:
    from export.cli import main as export_main

    with pytest.raises(SystemExit) as exited:
        export_main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"python -m export {__version__}"


@pytest.mark.parametrize("argv0, name", [
    ("/venv/bin/tfserve", "tfserve"),
    ("C:\\venv\\Scripts\\tfserve.exe".replace("\\", os.sep), "tfserve"),
    ("/src/tfserve/__main__.py", "python -m tfserve"),
    ("", "python -m tfserve"),
])
def test_program_name(argv0: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [argv0])
    assert program_name() == name


def test_the_console_script_names_itself_in_errors_and_usage(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/venv/bin/tfserve"])
    code, _, err = run_cli(capsys, monkeypatch, ["translate", "--beams", "many"])
    assert code == EXIT_USAGE
    assert err.startswith("tfserve translate: error: argument --beams")
    assert err.count("\n") == 1
    code, out, _ = run_cli(capsys, monkeypatch, ["serve", "--help"])
    assert code == 0 and out.startswith("usage: tfserve serve ")
    code, out, _ = run_cli(capsys, monkeypatch, ["--help"])
    assert code == 0 and out.startswith("usage: tfserve ")
    assert "`tfserve serve --help`" in out


# -- exit codes -----------------------------------------------------------------------------------


def test_a_bad_flag_exits_2(capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = run_cli(capsys, monkeypatch, ["translate", "--no-such-flag", "seven"])
    assert code == EXIT_USAGE
    assert err.startswith("python -m tfserve translate: error: unrecognized arguments")


def test_a_missing_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = run_cli(capsys, monkeypatch,
                             ["translate", "--model", str(tmp_path / "absent"), "seven"])
    assert (code, out) == (EXIT_USAGE, "")
    assert err.startswith("python -m tfserve translate: error: ") and err.count("\n") == 1
    assert str(tmp_path / "absent") in err


def test_bad_decoding_options_exit_2(random_model: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = run_cli(capsys, monkeypatch, ["translate", "--model", str(random_model),
                                                   "--beams", "99", "seven"])
    assert (code, out) == (EXIT_USAGE, "")
    assert "num_beams must be in [1, 16], got 99" in err and err.count("\n") == 1


def test_a_model_failure_exits_1(random_model: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from tfserve.translator import Translator

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the decoder run failed")

    monkeypatch.setattr(Translator, "translate_hypotheses", fail)
    code, out, err = run_cli(capsys, monkeypatch,
                             ["translate", "--model", str(random_model), "seven"])
    assert (code, out) == (EXIT_FAILURE, "")
    assert err == "python -m tfserve translate: error: the decoder run failed\n"


@pytest.mark.parametrize("command", ["translate", "encode"])
def test_an_unreachable_server_exits_1(command: str, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = run_cli(capsys, monkeypatch,
                             [command, "--server", f"127.0.0.1:{free_port()}", "seven"])
    assert (code, out) == (EXIT_FAILURE, "")
    assert err.startswith(f"python -m tfserve {command}: error: UNAVAILABLE: ")
    assert err.count("\n") == 1


def test_invalid_argument_from_the_server_exits_2(server: ServerThread,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = run_cli(capsys, monkeypatch, ["translate", "--server", server.target,
                                                   "--beams", "99", "seven"])
    assert (code, out) == (EXIT_USAGE, "")
    assert err.startswith("python -m tfserve translate: error: INVALID_ARGUMENT: ")
    assert err.count("\n") == 1


@pytest.mark.parametrize("error, expected", [
    (ValueError("texts must not be empty"), EXIT_USAGE),
    (ServerError(grpc.StatusCode.INVALID_ARGUMENT, "num_beams"), EXIT_USAGE),
    (ServerError(grpc.StatusCode.UNAVAILABLE, "connection refused"), EXIT_FAILURE),
    (ServerError(grpc.StatusCode.INTERNAL, "model failure"), EXIT_FAILURE),
    (ServerError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"), EXIT_FAILURE),
    (ServerError(grpc.StatusCode.DEADLINE_EXCEEDED, "slow"), EXIT_FAILURE),
    (RuntimeError("onnxruntime failed"), EXIT_FAILURE),
    (OSError("disk"), EXIT_FAILURE),
])
def test_failure_exit_codes(error: BaseException, expected: int) -> None:
    assert cli.failure_exit_code(error) == expected


def test_a_closed_stdout_exits_quietly(random_model: Path) -> None:
    """`tfserve translate ... | head -1`: the reader goes away; the command stops without a
    message or a traceback and exits 141, as `cat` does (128 + SIGPIPE)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to the pipe now fails with EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tfserve", "translate", "--model", str(random_model), *DECODE,
             "seven", "eight"], cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    finally:
        os.close(write_end)
    assert proc.returncode == EXIT_BROKEN_PIPE
    assert proc.stderr == ""


# -- one output line per input line ---------------------------------------------------------------


STDIN = "seven\n\n   \neight\r\n"


def spy_on(monkeypatch: pytest.MonkeyPatch, cls: type, method: str) -> list[list[str]]:
    """Record the texts every call of cls.method receives."""
    seen: list[list[str]] = []
    original = getattr(cls, method)

    def spy(self: Any, texts: list[str], *args: Any, **kwargs: Any) -> Any:
        seen.append(list(texts))
        return original(self, texts, *args, **kwargs)

    monkeypatch.setattr(cls, method, spy)
    return seen


def test_blank_stdin_lines_give_blank_output_lines(random_model: Path, translator: Any,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from tfserve.translator import Translator

    expected = translator.translate(["seven", "eight"], max_new_tokens=3)
    seen = spy_on(monkeypatch, Translator, "translate_hypotheses")
    code, out, err = run_cli(capsys, monkeypatch,
                             ["translate", "--model", str(random_model), *DECODE], STDIN)
    assert code == 0, err
    assert out.split("\n") == [expected[0], "", "", expected[1], ""]
    assert seen == [["seven", "eight"]]  # the model never saw the blank lines


def test_blank_lines_with_n_best_keep_n_lines_per_input(random_model: Path,
                                                        capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = run_cli(capsys, monkeypatch, [
        "translate", "--model", str(random_model), *DECODE, "--beams", "2", "--n-best", "2",
        "--scores"], STDIN)
    assert code == 0, err
    lines = out.split("\n")[:-1]
    assert len(lines) == 8
    assert lines[2:6] == ["", "", "", ""]
    assert all("\t" in line for line in lines[:2] + lines[6:])


def test_blank_lines_in_json_output(random_model: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = run_cli(capsys, monkeypatch,
                             ["translate", "--model", str(random_model), *DECODE, "--json"],
                             STDIN)
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["source"] for r in records] == ["seven", "", "   ", "eight"]
    assert [len(r["hypotheses"]) for r in records] == [1, 0, 0, 1]


def test_only_blank_lines_never_reach_the_model(random_model: Path,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from tfserve.translator import Translator

    seen = spy_on(monkeypatch, Translator, "translate_hypotheses")
    code, out, err = run_cli(capsys, monkeypatch,
                             ["translate", "--model", str(random_model), *DECODE], "\n\n")
    assert (code, out, seen) == (0, "\n\n", []), err


def test_encode_keeps_blank_lines_as_null_embeddings(random_model: Path, translator: Any,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = run_cli(capsys, monkeypatch, [
        "encode", "--model", str(random_model), "--threads", "1", "--per-token"], STDIN)
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["text"] for r in records] == ["seven", "", "   ", "eight"]
    assert records[1]["embedding"] is None and records[2]["hidden_states"] is None
    d_model = len(translator.encode(["seven"])[0].embedding)
    assert len(records[0]["embedding"]) == len(records[3]["embedding"]) == d_model


def test_blank_lines_through_a_server(server: ServerThread, translator: Any,
                                      capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    expected = translator.translate(["seven", "eight"], max_new_tokens=3)
    code, out, err = run_cli(capsys, monkeypatch, [
        "translate", "--server", server.target, "--max-new-tokens", "3"], STDIN)
    assert code == 0, err
    assert out.split("\n") == [expected[0], "", "", expected[1], ""]


# -- module layout --------------------------------------------------------------------------------


def test_argparsing_imports_nothing_of_tfserve() -> None:
    tree = ast.parse((ROOT / "tfserve" / "argparsing.py").read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if name.split(".")[0] in ("tfserve", "export")]


def test_settings_do_not_import_the_cli() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, tfserve.serving.settings; print('tfserve.cli' in "
         "sys.modules)"], cwd=ROOT, capture_output=True, text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr
