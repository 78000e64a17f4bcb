"""Sampling on the device: a step's draws made from its logits where the decoder left them.

A sampling search without top-k (temperature alone, top-p, or a top_k wider than the graph's
top candidates) may draw any token, so it needs whole rows of the [B,V] logits. On the device
placement (`tfserve.runtime.cache.DeviceCache`) those rows stay where the decoder made them
and the draws are made there, by the ONNX nodes built here. What crosses to the device is
per draw its row, its uniform and its options (about 40 bytes); what comes back is per draw
its token and log-probability (12 bytes): nothing of vocabulary size.

The nodes reproduce `SamplingSearch._draw` (tfserve.generation.sampling), which the host
runs on numpy rows, operation for operation, so that a seed gives the same tokens on either
path:

1. the row's logits (cast to float32, as the host casts them) and their logsumexp, taken
   before any ban: the drawn token's log-probability is its logit less that (what the
   search scores with);
2. the banned ids, and eos where the row blocks it (min_new_tokens not reached), to -inf;
3. divided by the temperature;
4. top-k (`filter_logits`): every logit below the row's k-th largest to -inf (ties kept);
5. top-p, in the nucleus variant: the row sorted (TopK over the whole row: ties in id order,
   as the host's stable argsort), log-softmax and float32 cumsum in that order, the tokens
   whose mass ahead reaches top_p (never the first) to -inf, scattered back to id order;
6. log-softmax, exp: the probabilities; their cumsum in float64 (the host's
   `np.cumsum(..., dtype=float64)`); the draw is the first id whose cumulative mass exceeds
   uniform x total (`np.searchsorted(..., side="right")`, clamped to the last id), moved
   back to the nearest id at or before it with a non-zero probability (never a filtered
   token).

Each option is per draw, so searches with different temperatures, top-k and top-p share one
run. Steps 4 and 5 are each under an `If` on a bool input (`DRAW_TOP_K`, `DRAW_TOP_P`, set
from the host when some draw asks for the filter): the full sort of step 5 is the costly
part, and a run whose draws all have top_p 1 skips it. Logsumexps are written as the host
writes them (peak + log of the sum of exp of the shifted row) rather than as ONNX's fused
ops, to keep their rounding close; sums still run in another order than numpy's, so
probabilities agree to float32 rounding and a draw could differ only where its uniform falls
within that rounding of a boundary.

The nodes are built once per graph by `_draw_nodes`, from which two graphs are made:

- `add_draw`: the decoder step graph's own draw (`tfserve.runtime.step_graph`), an `If` on
  the bool input `DRAW` at the end of the decoder graph whose then-branch is the draw over
  the step's logits (an outer-scope value) and whose else-branch gives empty outputs: a
  step's draws come out of the step's one ONNX Runtime run, and a step without draws runs
  the else-branch's two empty constants. Every run binds the draw inputs (empty ones, and
  the conditions off, when nothing is drawn: `draw_feeds`). The conditions are bound from
  host memory, where ONNX Runtime reads an `If`'s condition on every provider.
- `draw_graph`: the same nodes as a graph of their own, which `DeviceSampler` runs with IO
  binding on a step's logits OrtValue, a second run: the fallback for a decoder graph
  without the draw (the static cache's rewrite, an ONNX Runtime that cannot load a
  rewritten graph with its weights in files).

Built with `onnx.helper` (a graph per logits element type: float32, or float16 in fp16
exports), like the row operations of `tfserve.runtime.cache_graphs`.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import onnxruntime as ort

from tfserve.runtime.ort_runs import (
    HOST,
    RunCounters,
    bound_run,
    fetch,
    model_bytes,
    small_session,
)
from tfserve.step import SampleDraws

# the draw's small inputs, per draw, and their element types on the host
DRAW_INPUTS = {"draw_rows": np.int64, "draw_uniforms": np.float64,
               "draw_temperature": np.float32, "draw_top_k": np.int64,
               "draw_top_p": np.float32, "draw_blocked_ids": np.int64,
               "draw_blocked": np.bool_}
# bool [] conditions, bound from host memory: whether some draw filters by top-k, by top-p
DRAW_TOP_K = "draw_with_top_k"
DRAW_TOP_P = "draw_with_top_p"
# bool []: whether the step graph draws in this run (add_draw's If)
DRAW = "draw"
DRAW_OUTPUTS = ("drawn_token", "drawn_log_prob")
# what a decoder graph gains with add_draw
STEP_DRAW_INPUTS = (DRAW, DRAW_TOP_K, DRAW_TOP_P, *DRAW_INPUTS)
# the inputs of a run that draws nothing: no draws, the conditions off
_NO_DRAWS = {DRAW: np.array(False), DRAW_TOP_K: np.array(False),
             DRAW_TOP_P: np.array(False),
             **{name: np.zeros((0, 1) if name.startswith("draw_blocked") else 0, dtype)
                for name, dtype in DRAW_INPUTS.items()}}


class _GraphBuilder:
    """Nodes and constants of one graph, named in order under `prefix`; `branch` gives the
    builder of a subgraph, whose names continue the same count (unique across scopes)."""

    def __init__(self, prefix: str = "", counter: Any = None) -> None:
        self.nodes: list[Any] = []
        self.prefix = prefix
        self.counter = itertools.count(1) if counter is None else counter

    def branch(self) -> _GraphBuilder:
        return _GraphBuilder(self.prefix, self.counter)

    def _name(self, stem: str) -> str:
        return f"{self.prefix}{stem}_{next(self.counter)}"

    def __call__(self, op: str, *inputs: str, **attributes: Any) -> str:
        """One node with one output; its name."""
        from onnx import helper

        out = self._name(op.lower())
        self.nodes.append(helper.make_node(op, list(inputs), [out], **attributes))
        return out

    def outputs(self, op: str, inputs: list[str], count: int, **attributes: Any
                ) -> list[str]:
        """One node with `count` outputs; their names."""
        from onnx import helper

        stem = self._name(op.lower())
        outs = [f"{stem}_{i}" for i in range(count)]
        self.nodes.append(helper.make_node(op, inputs, outs, **attributes))
        return outs

    def const(self, value: Any, dtype: type) -> str:
        """A constant tensor (a 0-d one for a scalar)."""
        from onnx import helper, numpy_helper

        out = self._name("const")
        tensor = numpy_helper.from_array(np.array(value, dtype), out)
        self.nodes.append(helper.make_node("Constant", [], [out], value=tensor))
        return out

    def graph(self, name: str, outputs: list[Any], inputs: list[Any] | None = None) -> Any:
        """These nodes as a GraphProto (a subgraph: no inputs, outer-scope names read)."""
        from onnx import helper

        return helper.make_graph(self.nodes, name, inputs or [], outputs)

    def log_softmax(self, x: str, axes: str) -> str:
        """x - (peak + log(sum(exp(x - peak)))) over axis 1 of x [S,V] (kernels.log_softmax)."""
        return self("Sub", x, self.logsumexp(x, axes))

    def logsumexp(self, x: str, axes: str) -> str:
        """[S,1] of x [S,V], as kernels._logsumexp_rows computes it."""
        peak = self("ReduceMax", x, axes=[1], keepdims=1)  # [S,1]
        total = self("ReduceSum", self("Exp", self("Sub", x, peak)), axes, keepdims=1)
        return self("Add", peak, self("Log", total))


def _filter_branch(g: _GraphBuilder, condition: str, x: str, name: str,
                   stage: Any) -> str:
    """If(condition): stage(builder, x) [S,V] float32, else x as it is; the If's output."""
    from onnx import TensorProto, helper

    then = g.branch()
    filtered = stage(then)
    keep = g.branch()
    same = keep("Identity", x)

    def out(value: str) -> Any:
        return helper.make_tensor_value_info(value, TensorProto.FLOAT, ["draws", "vocab"])

    return g("If", condition, then_branch=then.graph(f"{name}_on", [out(filtered)]),
             else_branch=keep.graph(f"{name}_off", [out(same)]))


def _draw_nodes(g: _GraphBuilder, logits: str, logits_type: int,
                outputs: tuple[str, str]) -> None:
    """The draw (module docstring) from logits [B,T,V] of element type `logits_type`, reading
    DRAW_INPUTS and the conditions DRAW_TOP_K / DRAW_TOP_P, into g: token [S] int64 and
    log_prob [S] float32 written to `outputs`."""
    from onnx import TensorProto, helper

    rows, uniforms, temperature, top_k, top_p, blocked_ids, blocked = DRAW_INPUTS
    axis1 = g.const([1], np.int64)
    ninf = g.const(-np.inf, np.float32)
    # 1. the drawn rows' last position, float32 [S,V]; their logsumexp before any ban
    picked = g("Gather", logits, rows, axis=0)  # [S,T,V]
    last = g("Gather", picked, g.const(-1, np.int64), axis=1)  # [S,V]
    x = g("Cast", last, to=TensorProto.FLOAT) if logits_type != TensorProto.FLOAT else last
    lse = g.logsumexp(x, axis1)  # [S,1]
    vocab = g("Gather", g("Shape", x), g.const(1, np.int64), axis=0)  # scalar V
    # 2. bans: blocked_ids [S,m] each row's banned ids and eos, blocked [S,m] which of them
    # go to -inf; the others are written back as they are (a row that lets eos through)
    held = g("GatherElements", x, blocked_ids, axis=1)  # [S,m]
    allowed = g("ScatterElements", x, blocked_ids, g("Where", blocked, ninf, held),
                axis=1)  # [S,V]
    # 3. temperature
    scaled = g("Div", allowed, g("Unsqueeze", temperature, axis1))  # [S,V]

    def top_k_filter(b: _GraphBuilder) -> str:
        # 4. top-k: below the k-th largest (k of the rows with 0 < top_k < V; K the largest)
        k_on = b("And", b("Greater", top_k, b.const(0, np.int64)),
                 b("Less", top_k, vocab))  # [S]
        k = b("Where", k_on, top_k, b.const(0, np.int64))  # [S]
        widest = b("Max", b("ReduceMax", k, axes=[0], keepdims=1),
                   b.const([1], np.int64))  # [1]
        best, _ = b.outputs("TopK", [scaled, widest], 2, axis=1)  # [S,K], largest first
        kth_index = b("Unsqueeze", b("Max", b("Sub", k, b.const(1, np.int64)),
                                     b.const(0, np.int64)), axis1)  # [S,1]
        kth = b("Where", b("Unsqueeze", k_on, axis1),
                b("GatherElements", best, kth_index, axis=1), ninf)  # [S,1]
        return b("Where", b("Less", scaled, kth), ninf, scaled)  # [S,V]

    top_ked = _filter_branch(g, DRAW_TOP_K, scaled, "draw_top_k", top_k_filter)

    def top_p_filter(b: _GraphBuilder) -> str:
        # 5. top-p over the row sorted by logit (ties: lower id first)
        ordered, order = b.outputs("TopK", [top_ked, b("Reshape", vocab, axis1)], 2,
                                   axis=1, largest=1, sorted=1)  # [S,V] each
        sorted_probs = b("Exp", b.log_softmax(ordered, axis1))  # [S,V]
        before = b("Sub", b("CumSum", sorted_probs, b.const(1, np.int64)), sorted_probs)
        first = b("Unsqueeze", b("Equal", b("Range", b.const(0, np.int64), vocab,
                                            b.const(1, np.int64)), b.const(0, np.int64)),
                  b.const([0], np.int64))  # [1,V]: the most likely token always stays
        remove = b("And", b("GreaterOrEqual", before, b("Unsqueeze", top_p, axis1)),
                   b("Not", first))  # [S,V]
        remove = b("And", remove, b("Unsqueeze", b("Less", top_p, b.const(1.0, np.float32)),
                                    axis1))  # top_p 1: no filter
        kept_sorted = b("Where", remove, ninf, ordered)  # [S,V]
        return b("ScatterElements", top_ked, order, kept_sorted, axis=1)  # id order

    filtered = _filter_branch(g, DRAW_TOP_P, top_ked, "draw_top_p", top_p_filter)
    # 6. the inverse-CDF draw in id order
    probs = g("Exp", g.log_softmax(filtered, axis1))  # [S,V] float32
    cdf = g("CumSum", g("Cast", probs, to=TensorProto.DOUBLE), g.const(1, np.int64))
    total = g("Gather", cdf, g.const(-1, np.int64), axis=1)  # [S]
    threshold = g("Unsqueeze", g("Mul", uniforms, total), axis1)  # [S,1]
    count = g("ReduceSum", g("Cast", g("LessOrEqual", cdf, threshold), to=TensorProto.INT64),
              axis1, keepdims=0)  # [S]: searchsorted side="right"
    column = g("Unsqueeze", g("Min", count, g("Sub", vocab, g.const(1, np.int64))),
               axis1)  # [S,1]
    # the column's probability is non-zero unless it was clamped (uniform x total rounded
    # to the total): then the host walks back to the last id with a non-zero probability
    # (ids + 1 as float32: exact below 2^24, and a product with the 0/1 sign of the
    # probability where a Where over int64 costs several times more on CPU)
    positions = g("Unsqueeze", g("Range", g.const(1.0, np.float32),
                                 g("Cast", g("Add", vocab, g.const(1, np.int64)),
                                   to=TensorProto.FLOAT), g.const(1.0, np.float32)),
                  g.const([0], np.int64))  # [1,V]: id + 1
    drawable = g("Mul", g("Sign", probs), positions)  # [S,V]: id + 1 where drawable, else 0
    last_drawable = g("Sub", g("Cast", g("ReduceMax", drawable, axes=[1], keepdims=1),
                               to=TensorProto.INT64), g.const(1, np.int64))  # [S,1]
    landed = g("Greater", g("GatherElements", probs, column, axis=1),
               g.const(0.0, np.float32))  # [S,1]
    token = g("Where", landed, column, last_drawable)  # [S,1]
    logit = g("GatherElements", x, token, axis=1)  # [S,1]
    g.nodes.append(helper.make_node("Squeeze", [token, axis1], [outputs[0]]))  # [S]
    g.nodes.append(helper.make_node("Squeeze", [g("Sub", logit, lse), axis1],
                                    [outputs[1]]))  # [S]


def _output_infos(names: tuple[str, str]) -> list[Any]:
    """The token [S] int64 and log-probability [S] float32 outputs, named `names`."""
    from onnx import TensorProto, helper

    return [helper.make_tensor_value_info(names[0], TensorProto.INT64, ["draws"]),
            helper.make_tensor_value_info(names[1], TensorProto.FLOAT, ["draws"])]


def _input_infos(names: Any) -> list[Any]:
    """Value infos of the draw inputs and conditions among `names`."""
    from onnx import TensorProto, helper

    types = {np.int64: TensorProto.INT64, np.float64: TensorProto.DOUBLE,
             np.float32: TensorProto.FLOAT, np.bool_: TensorProto.BOOL}
    infos = []
    for name in names:
        if name in (DRAW, DRAW_TOP_K, DRAW_TOP_P):
            infos.append(helper.make_tensor_value_info(name, TensorProto.BOOL, []))
        else:
            shape = ["draws", "blocked"] if name.startswith("draw_blocked") else ["draws"]
            infos.append(helper.make_tensor_value_info(name, types[DRAW_INPUTS[name]], shape))
    return infos


def draw_graph(logits_type: int) -> bytes:
    """The draw as a graph of its own (DeviceSampler's): logits [B,T,V] of element type
    `logits_type`, DRAW_INPUTS and the conditions in, DRAW_OUTPUTS out."""
    from onnx import helper

    g = _GraphBuilder()
    _draw_nodes(g, "logits", logits_type, DRAW_OUTPUTS)
    inputs = [helper.make_tensor_value_info("logits", logits_type, ["batch", "time", "vocab"]),
              *_input_infos((DRAW_TOP_K, DRAW_TOP_P, *DRAW_INPUTS))]
    return model_bytes(g.graph("sample_draws", _output_infos(DRAW_OUTPUTS), inputs))


def add_draw(graph: Any, logits: str) -> None:
    """Add the draw to a decoder graph (onnx GraphProto, edited in place) that gives
    `logits` [B,T,V] as an output: the inputs STEP_DRAW_INPUTS, the outputs DRAW_OUTPUTS,
    and at the end an If on DRAW whose then-branch draws from those logits and whose
    else-branch gives empty outputs. A ValueError where the graph has no such output or
    already has one of those names."""
    from onnx import helper

    given = {value.name: value for value in graph.output}
    if logits not in given:
        raise ValueError(f"the decoder graph has no output {logits!r} to draw from")
    names = {value.name for value in (*graph.input, *graph.output)}
    clash = [name for name in (*STEP_DRAW_INPUTS, *DRAW_OUTPUTS) if name in names]
    if clash:
        raise ValueError(f"the decoder graph already has a {clash[0]!r}")
    logits_type = given[logits].type.tensor_type.elem_type
    then = _GraphBuilder("draw/")
    inner = (f"draw/{DRAW_OUTPUTS[0]}", f"draw/{DRAW_OUTPUTS[1]}")
    _draw_nodes(then, logits, logits_type, inner)
    none = _GraphBuilder("draw/", then.counter)
    empty = (none.const(np.zeros(0, np.int64), np.int64),
             none.const(np.zeros(0, np.float32), np.float32))
    none.nodes.extend(helper.make_node("Identity", [value], [name])
                      for value, name in zip(empty, (f"{name}/none" for name in inner)))
    graph.node.append(helper.make_node(
        "If", [DRAW], list(DRAW_OUTPUTS), name="draw",
        then_branch=then.graph("draw", _output_infos(inner)),
        else_branch=none.graph("draw_none", _output_infos(
            tuple(f"{name}/none" for name in inner)))))  # type: ignore[arg-type]
    graph.input.extend(_input_infos(STEP_DRAW_INPUTS))
    graph.output.extend(_output_infos(DRAW_OUTPUTS))


def blocked_tokens(draws: SampleDraws) -> tuple[np.ndarray, np.ndarray]:
    """Each draw's banned ids and eos [S,m], and which of them are blocked [S,m]: the bans
    always, eos where the draw blocks it (or it is banned)."""
    banned = (np.zeros(0, np.int64) if draws.banned is None
              else np.asarray(draws.banned, np.int64))
    count = len(draws.rows)
    ids = np.empty((count, len(banned) + 1), np.int64)  # [S,m]
    ids[:, :-1] = banned
    ids[:, -1] = draws.eos_token_id
    blocked = np.ones(ids.shape, np.bool_)  # [S,m]
    # eos written back as it is unless blocked: one value per id, so never where banned
    blocked[:, -1] = np.asarray(draws.block_eos, np.bool_) | (draws.eos_token_id in banned)
    return ids, blocked


def draw_feeds(draws: SampleDraws | None, vocab: int) -> dict[str, np.ndarray]:
    """The host values of a run's draw inputs and conditions (STEP_DRAW_INPUTS, DRAW
    included): `draws` for logits of `vocab` ids (0: not known; a top_k of V or more then
    runs the top-k pass, which keeps every id), or, where it is None, none (empty inputs,
    every condition off)."""
    if draws is None:
        return _NO_DRAWS
    top_k = np.asarray(draws.top_k)
    blocked_ids, blocked = blocked_tokens(draws)
    given = {"draw_rows": draws.rows, "draw_uniforms": draws.uniforms,
             "draw_temperature": draws.temperature, "draw_top_k": draws.top_k,
             "draw_top_p": draws.top_p, "draw_blocked_ids": blocked_ids,
             "draw_blocked": blocked}
    feeds = {DRAW: np.array(True),
             DRAW_TOP_K: np.array(bool(((top_k > 0) & ((top_k < vocab) | (vocab <= 0))).any())),
             DRAW_TOP_P: np.array(bool((np.asarray(draws.top_p) < 1.0).any()))}
    feeds.update((name, np.ascontiguousarray(given[name], dtype=dtype))
                 for name, dtype in DRAW_INPUTS.items())
    # top_k and top_p are read by their filter's branch alone: empty where it is off
    for condition, name in ((DRAW_TOP_K, "draw_top_k"), (DRAW_TOP_P, "draw_top_p")):
        if not feeds[condition]:
            feeds[name] = _NO_DRAWS[name]
    return feeds


def moved_bytes(feeds: dict[str, np.ndarray]) -> int:
    """What of `draw_feeds` crosses to the device: the draw inputs. The conditions stay in
    host memory, where ONNX Runtime reads an If's condition."""
    return sum(feeds[name].nbytes for name in DRAW_INPUTS)


class DeviceSampler:
    """The standalone draw graph on one device, and its runs on a step's logits OrtValue
    (the fallback where the decoder graph has no draw of its own: module docstring)."""

    def __init__(self, device_kind: str, device_index: int, providers: list[Any],
                 counters: RunCounters | None = None) -> None:
        """counters: the `RunCounters` that the runs and the bytes they move are added to
        (a fresh one where None). A graph per logits element type is built on its first
        use; the drawn tokens come to the host, so the device names only the providers'."""
        self.device_kind, self.device_index = device_kind, device_index
        self.providers = providers
        self.counters = counters if counters is not None else RunCounters()
        self.sessions: dict[str, ort.InferenceSession] = {}

    def _session(self, element: str) -> ort.InferenceSession:
        """The graph for logits of ONNX Runtime type `element` ('tensor(float)', ...)."""
        session = self.sessions.get(element)
        if session is None:
            from onnx import TensorProto

            types = {"tensor(float)": TensorProto.FLOAT, "tensor(float16)": TensorProto.FLOAT16}
            if element not in types:
                raise TypeError(f"sampling on the device takes float or float16 logits, not "
                                f"{element}")
            session = self.sessions[element] = small_session(draw_graph(types[element]),
                                                             self.providers)
        return session

    def draw(self, logits: ort.OrtValue, draws: SampleDraws) -> tuple[np.ndarray, np.ndarray]:
        """One token per draw from the rows of logits [B,T,V] (their last position): the
        drawn ids [S] int64 and their log-probabilities [S] float32 (logit - logsumexp of
        the unscaled row)."""
        feeds = draw_feeds(draws, logits.shape()[-1])
        # the step graph's condition DRAW is not an input here: this graph always draws
        token, log_prob = bound_run(
            self._session(logits.data_type()), self.counters,
            host_inputs={name: feeds[name] for name in DRAW_INPUTS},
            conditions={name: feeds[name] for name in (DRAW_TOP_K, DRAW_TOP_P)},
            inputs={"logits": logits},
            outputs=[(name, HOST) for name in DRAW_OUTPUTS])
        return fetch(token, self.counters), fetch(log_prob, self.counters)
