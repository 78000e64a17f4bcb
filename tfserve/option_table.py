"""The decoding options a request can set, declared once: `OPTIONS`, one `Option` each.

Everything else is derived from this table:

- `tfserve.generation.DecodingOptions`: a field per option (its type and default, before the
  controls the server sets itself), and validate()'s check of each one's limits;
- the proto mapping (`tfserve.frontends.messages`): each option is the field of the same name
  of `tfserve.v1.DecodingOptions` (proto/tfserve/v1/translator.proto, the wire contract,
  written by hand), checked against it when the mapping is imported;
- the HTTP/JSON mapping's schema (`/openapi.json`): each option's limits, label, help,
  default and searches; the playground builds its controls from that schema;
- the Python client's keyword arguments (`tfserve.client`) and the CLI's decoding flags
  (`tfserve.cli`);
- a checkpoint's generation defaults (`tfserve.artifacts.generation_defaults`): the
  generation_config.json fields copied as they are, and the beam-only ones; the importers
  (`export/importers/`) read those fields from a checkpoint through it.

Adding an option: declare it here, add its field to the proto (and regenerate the stubs),
and make the searches read it. Imports nothing of tfserve, so every layer, down to the
artifacts, reads it; read it as `option_table.OPTIONS` when it is used (not at import), as
the derivations do, so that a test can declare an option by replacing the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_NEW_TOKENS = 256
MAX_BEAMS = 16
# beyond these the scores over- or underflow (length ** length_penalty) or the tempered
# distribution is all one token or all noise; common settings sit well inside
MAX_ABS_LENGTH_PENALTY = 10.0
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 100.0
# a penalty of 10 already makes any repeat all but impossible (or, near 0, certain);
# n-grams longer than 64 tokens do not repeat in a translation, and the size bounds the
# work of every step
MAX_REPETITION_PENALTY = 10.0
# symmetric: below 1/10 a repeat is all but certain, and a penalty near 0 (5e-324)
# divides a logit past float32's range, which makes the step's scores NaN
MIN_REPETITION_PENALTY = 1 / MAX_REPETITION_PENALTY
MAX_NO_REPEAT_NGRAM_SIZE = 64
MAX_SEED = 2**63 - 1  # an int64 proto field

SEARCHES = ("beam", "sample")  # the searches an option can be limited to (greedy: neither)


@dataclass(frozen=True)
class Option:
    """One decoding option. `name` is its name everywhere: the DecodingOptions field, the
    proto DecodingOptions field (lowerCamelCase in its JSON mapping), the client's keyword
    argument; the CLI flag is `--name-with-dashes` unless `flag` says otherwise."""

    name: str
    type: type  # of the value: int, float or bool
    default: Any  # DecodingOptions' (None: decided per request, `unset` says how)
    label: str  # a short title (the playground's label)
    help: str  # what it does (CLI help, the schema's description); limits and default follow
    # the range (a float option has both bounds): low inclusive unless low_open, high
    # inclusive; None: no bound, or for high one that depends on the request
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # (low, high]: low itself is refused
    off: bool = False  # the default turns the option off
    unset: str | None = None  # what a None default stands for
    searches: tuple[str, ...] = ()  # the searches that read it (SEARCHES); (): every one
    flag: str = ""  # the CLI flag without "--", when it is not the name with dashes
    checkpoint: bool = False  # generation_config.json's field of this name is its model default
    extra_values: tuple[str, ...] = ()  # values beside the type's (Python API and checkpoints)
    batch_rows: bool = False  # a count of decoder batch rows: --max-batch-size bounds it too
    example: Any = None  # a typical value, where the default is not one (the playground's start)

    @property
    def cli_flag(self) -> str:
        return "--" + (self.flag or self.name.replace("_", "-"))

    @property
    def annotation(self) -> Any:
        """The DecodingOptions field's type."""
        kind: Any = self.type
        for value in self.extra_values:
            kind = kind | type(value)
        return kind if self.default is not None else kind | None

    @property
    def limits_text(self) -> str:
        """The range as errors and help texts say it ("in [1, 16]", "in (0, 1]", ">= 0");
        "" without a lower bound."""
        if self.low is None:
            return ""
        if self.high is None:
            return f">= {self.low}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}]"

    @property
    def default_text(self) -> str:
        """The default as help texts say it."""
        if self.default is None:
            return self.unset or "none"
        if self.type is bool:
            return "on" if self.default else "off"
        return f"{self.default}, off" if self.off else str(self.default)

    @property
    def off_note(self) -> str:
        """What the range error adds: the value that turns the option off, where it lies
        inside the range rather than at a bound (there the range alone does not show it)."""
        if self.off and self.low is not None and self.high is not None \
                and self.low < self.default < self.high:
            return f" ({self.default}: off)"
        return ""

    @property
    def description(self) -> str:
        """The help with its range and default: the CLI's help, the schema's description."""
        limits = f"{self.limits_text}; " if self.high is not None else ""
        return f"{self.help} ({limits}default: {self.default_text})"


# In the order the CLI lists them; every option the searches read is here. prefix_token_ids,
# prefix_counts_as_new, forced_eos and decoder_start_token_id are DecodingOptions fields too,
# set by the server from a request's languages and target prefix and the model's defaults:
# no request names them.
OPTIONS: tuple[Option, ...] = (
    Option("max_new_tokens", int, None, "Max new tokens", "most tokens generated per text",
           low=1, unset=f"{DEFAULT_MAX_NEW_TOKENS} or the model's limit, whichever is smaller"),
    Option("min_new_tokens", int, 0, "Min new tokens",
           "tokens generated before end-of-sentence is allowed", low=0),
    Option("num_beams", int, 1, "Beams", "beam size, 1 for greedy search", low=1,
           high=MAX_BEAMS, searches=("beam",), flag="beams", checkpoint=True, batch_rows=True,
           example=4),
    Option("length_penalty", float, 1.0, "Length penalty",
           "beam search ranks hypotheses by log-probability / length ** this: above 1 "
           "favours longer ones, below 1 shorter ones", low=-MAX_ABS_LENGTH_PENALTY,
           high=MAX_ABS_LENGTH_PENALTY, searches=("beam",), checkpoint=True),
    Option("early_stopping", bool, False, "Early stopping",
           "beam search stops as soon as there are as many finished hypotheses as beams, "
           "instead of when no running beam can beat them", searches=("beam",), checkpoint=True,
           extra_values=("never",)),
    Option("num_return_sequences", int, 1, "Hypotheses per text",
           "hypotheses returned per text: at most the beam size, or with sampling that "
           "many independent samples", low=1, high=MAX_BEAMS, searches=("beam", "sample"),
           flag="n-best", batch_rows=True),
    Option("do_sample", bool, False, "Sampling", "sample instead of searching",
           searches=("sample",), flag="sample"),
    Option("temperature", float, 1.0, "Temperature",
           "sampling divides the logits by this: below 1 sharper, above 1 flatter",
           low=MIN_TEMPERATURE, high=MAX_TEMPERATURE, searches=("sample",)),
    Option("top_k", int, 0, "Top-k", "sampling draws from the k most likely tokens only",
           low=0, off=True, searches=("sample",)),
    Option("top_p", float, 1.0, "Top-p", "nucleus sampling: draw from the smallest set of "
           "tokens whose probability reaches p", low=0, high=1, low_open=True,
           off=True, searches=("sample",)),
    Option("seed", int, None, "Seed", "sampling's random seed: the same seed gives the same "
           "samples", low=0, high=MAX_SEED, unset="a fresh one per request",
           searches=("sample",)),
    Option("repetition_penalty", float, 1.0, "Repetition penalty",
           "divide the score of every token already in the output by this (where positive; "
           "multiply where negative): above 1 discourages repeats, below 1 encourages them",
           low=MIN_REPETITION_PENALTY, high=MAX_REPETITION_PENALTY, off=True, checkpoint=True),
    Option("no_repeat_ngram_size", int, 0, "No repeat n-gram size",
           "no n-gram of this many tokens occurs twice in the output", low=0,
           high=MAX_NO_REPEAT_NGRAM_SIZE, off=True, checkpoint=True),
)


def option(name: str) -> Option:
    """The declared option `name`, or KeyError naming it."""
    for declared in OPTIONS:
        if declared.name == name:
            return declared
    raise KeyError(f"{name!r} is not a declared decoding option")


def names() -> tuple[str, ...]:
    """The declared options' names, in order."""
    return tuple(declared.name for declared in OPTIONS)
