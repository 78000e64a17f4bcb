"""The argument parser every tfserve command line uses, and the exit codes they share.

Imports nothing of tfserve, so any module (settings, export, benchmarks) can use it without
pulling in the CLI or the model code.

Exit codes: 0 success, EXIT_FAILURE (1) for a runtime failure (server unreachable, model
failure), EXIT_USAGE (2) for a bad flag or bad input, EXIT_BROKEN_PIPE (141, what a shell
reports for `cat` when the reader of its output goes away) when standard output was closed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, NoReturn

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 128 + 13  # 128 + SIGPIPE

# a "%" that is not the start of a "%(name)s" placeholder, or an already escaped "%%"
_STRAY_PERCENT = re.compile(r"%%|%(?!\()")


def program_name() -> str:
    """`tfserve` when run as the console script, else `python -m tfserve`: the name usage
    lines and error messages show, so that they can be pasted back into the shell."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if name.lower().endswith(".exe"):  # the console script on Windows
        name = name[:-4]
    return name if name == "tfserve" else "python -m tfserve"


class HelpFormatter(argparse.HelpFormatter):
    """Help texts rendered as written, each default shown once.

    - a literal "%" in a help text is printed as is: argparse formats help with the
      %-operator, and "1% slower" would otherwise read "% s" and print argparse's internal
      dict of the action;
    - "(default: X)" is appended only when it tells something: not when the help already
      states its default, nor for None, False or empty defaults, nor for on/off switches.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = _STRAY_PERCENT.sub("%%", action.help or "")
        if _shows_default(action, text):
            text += " (default: %(default)s)"
        return text


def _shows_default(action: argparse.Action, text: str) -> bool:
    if "default" in text.lower():
        return False
    if action.default is None or action.default is False or action.default in ("",
                                                                               argparse.SUPPRESS):
        return False
    if action.nargs == 0:  # store_true, store_const, --help, --version
        return False
    return bool(action.option_strings) or action.nargs in (argparse.OPTIONAL,
                                                            argparse.ZERO_OR_MORE)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit code EXIT_USAGE, with help
    rendered by HelpFormatter (argparse's stock formatters are replaced by it: their
    "(default: None)" after a help that states its default is what this avoids)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = kwargs.get("formatter_class")
        if given in (None, argparse.HelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
            kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def add_version(parser: argparse.ArgumentParser, version: str) -> None:
    """`--version`: print the program name and version, exit 0."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {version}",
                        help="print the version and exit")
