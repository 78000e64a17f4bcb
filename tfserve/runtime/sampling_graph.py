"""Sampling on the device: a step's draws made from its logits where the decoder left them.

A sampling search without top-k (temperature alone, top-p, or a top_k wider than the graph's
top candidates) may draw any token, so it needs whole rows of the [B,V] logits. On the device
placement (`tfserve.runtime.cache.DeviceCache`) those rows stay where the decoder made them:
the step binds its logits to the device, and this small ONNX graph, run on that OrtValue,
makes the draws there. What crosses to the device is per draw its row, its uniform and its
options (about 40 bytes); what comes back is per draw its token and log-probability (12
bytes): nothing of vocabulary size.

The graph reproduces `SamplingSearch._draw` (tfserve.generation.sampling), which the host
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
run. The full sort of step 5 is the graph's costly part: a run whose draws all have top_p 1
takes the variant without it. Logsumexps are written as the host writes them (peak + log of
the sum of exp of the shifted row) rather than as ONNX's fused ops, to keep their rounding
close; sums still run in another order than numpy's, so probabilities agree to float32
rounding and a draw could differ only where its uniform falls within that rounding of a
boundary.

The graphs are built here with `onnx.helper` when the placement is made (a variant per
logits element type: float32, or float16 in fp16 exports, built on first use), like the row
operations of `tfserve.runtime.cache_graphs`, and run with IO binding on the same device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

if TYPE_CHECKING:
    from tfserve.generation.search import SampleDraws
    from tfserve.runtime.cache import RunCounters

OPSET = 17
# a run's small inputs and their element types on the host: every variant's, then top-k's
# and top-p's
DRAW_INPUTS = {"rows": np.int64, "uniforms": np.float64, "temperature": np.float32,
               "blocked_ids": np.int64, "blocked": np.bool_}
TOP_K_INPUTS = {"top_k": np.int64}
TOP_P_INPUTS = {"top_p": np.float32}
DRAW_OUTPUTS = ("token", "log_prob")


class _GraphBuilder:
    """Nodes and constants of one graph, named in order."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.count = 0

    def __call__(self, op: str, *inputs: str, **attributes: Any) -> str:
        """One node with one output; its name."""
        from onnx import helper

        self.count += 1
        out = f"{op.lower()}_{self.count}"
        self.nodes.append(helper.make_node(op, list(inputs), [out], **attributes))
        return out

    def outputs(self, op: str, inputs: list[str], count: int, **attributes: Any
                ) -> list[str]:
        """One node with `count` outputs; their names."""
        from onnx import helper

        self.count += 1
        outs = [f"{op.lower()}_{self.count}_{i}" for i in range(count)]
        self.nodes.append(helper.make_node(op, inputs, outs, **attributes))
        return outs

    def const(self, value: Any, dtype: type) -> str:
        """A constant tensor (a 0-d one for a scalar)."""
        from onnx import helper, numpy_helper

        self.count += 1
        out = f"const_{self.count}"
        tensor = numpy_helper.from_array(np.array(value, dtype), out)
        self.nodes.append(helper.make_node("Constant", [], [out], value=tensor))
        return out

    def log_softmax(self, x: str, axes: str) -> str:
        """x - (peak + log(sum(exp(x - peak)))) over axis 1 of x [S,V] (kernels.log_softmax)."""
        return self("Sub", x, self.logsumexp(x, axes))

    def logsumexp(self, x: str, axes: str) -> str:
        """[S,1] of x [S,V], as kernels._logsumexp_rows computes it."""
        peak = self("ReduceMax", x, axes=[1], keepdims=1)  # [S,1]
        total = self("ReduceSum", self("Exp", self("Sub", x, peak)), axes, keepdims=1)
        return self("Add", peak, self("Log", total))


def _graph_bytes(logits_type: int, top_k: bool, nucleus: bool) -> bytes:
    """The draw graph for logits [B,T,V] of element type `logits_type` (module docstring);
    top_k: with step 4, nucleus: with step 5 (a run without either skips its passes)."""
    from onnx import TensorProto, helper

    g = _GraphBuilder()
    axis1 = g.const([1], np.int64)
    ninf = g.const(-np.inf, np.float32)
    # 1. the drawn rows' last position, float32 [S,V]; their logsumexp before any ban
    picked = g("Gather", "logits", "rows", axis=0)  # [S,T,V]
    last = g("Gather", picked, g.const(-1, np.int64), axis=1)  # [S,V]
    x = g("Cast", last, to=TensorProto.FLOAT) if logits_type != TensorProto.FLOAT else last
    lse = g.logsumexp(x, axis1)  # [S,1]
    vocab = g("Gather", g("Shape", x), g.const(1, np.int64), axis=0)  # scalar V
    # 2. bans: blocked_ids [S,m] each row's banned ids and eos, blocked [S,m] which of them
    # go to -inf; the others are written back as they are (a row that lets eos through)
    held = g("GatherElements", x, "blocked_ids", axis=1)  # [S,m]
    allowed = g("ScatterElements", x, "blocked_ids", g("Where", "blocked", ninf, held),
                axis=1)  # [S,V]
    # 3. temperature
    filtered = g("Div", allowed, g("Unsqueeze", "temperature", axis1))  # [S,V]
    if top_k:
        # 4. top-k: below the k-th largest (k of the rows with 0 < top_k < V; K the largest)
        k_on = g("And", g("Greater", "top_k", g.const(0, np.int64)),
                 g("Less", "top_k", vocab))  # [S]
        k = g("Where", k_on, "top_k", g.const(0, np.int64))  # [S]
        widest = g("Max", g("ReduceMax", k, axes=[0], keepdims=1),
                   g.const([1], np.int64))  # [1]
        best, _ = g.outputs("TopK", [filtered, widest], 2, axis=1)  # [S,K], largest first
        kth_index = g("Unsqueeze", g("Max", g("Sub", k, g.const(1, np.int64)),
                                     g.const(0, np.int64)), axis1)  # [S,1]
        kth = g("Where", g("Unsqueeze", k_on, axis1),
                g("GatherElements", best, kth_index, axis=1), ninf)  # [S,1]
        filtered = g("Where", g("Less", filtered, kth), ninf, filtered)  # [S,V]
    if nucleus:
        # 5. top-p over the row sorted by logit (ties: lower id first)
        ordered, order = g.outputs("TopK", [filtered, g("Reshape", vocab, axis1)], 2,
                                   axis=1, largest=1, sorted=1)  # [S,V] each
        sorted_probs = g("Exp", g.log_softmax(ordered, axis1))  # [S,V]
        before = g("Sub", g("CumSum", sorted_probs, g.const(1, np.int64)), sorted_probs)
        first = g("Unsqueeze", g("Equal", g("Range", g.const(0, np.int64), vocab,
                                            g.const(1, np.int64)), g.const(0, np.int64)),
                  g.const([0], np.int64))  # [1,V]: the most likely token always stays
        remove = g("And", g("GreaterOrEqual", before, g("Unsqueeze", "top_p", axis1)),
                   g("Not", first))  # [S,V]
        remove = g("And", remove, g("Unsqueeze", g("Less", "top_p", g.const(1.0, np.float32)),
                                    axis1))  # top_p 1: no filter
        kept_sorted = g("Where", remove, ninf, ordered)  # [S,V]
        filtered = g("ScatterElements", filtered, order, kept_sorted, axis=1)  # id order
    # 6. the inverse-CDF draw in id order
    probs = g("Exp", g.log_softmax(filtered, axis1))  # [S,V] float32
    cdf = g("CumSum", g("Cast", probs, to=TensorProto.DOUBLE), g.const(1, np.int64))
    total = g("Gather", cdf, g.const(-1, np.int64), axis=1)  # [S]
    threshold = g("Unsqueeze", g("Mul", "uniforms", total), axis1)  # [S,1]
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
    g.nodes.append(helper.make_node("Squeeze", [token, axis1], ["token"]))
    g.nodes.append(helper.make_node("Squeeze", [g("Sub", logit, lse), axis1], ["log_prob"]))

    types = {np.int64: TensorProto.INT64, np.float64: TensorProto.DOUBLE,
             np.float32: TensorProto.FLOAT, np.bool_: TensorProto.BOOL}
    inputs = [helper.make_tensor_value_info("logits", logits_type, ["batch", "time", "vocab"])]
    for name, dtype in _inputs(top_k, nucleus).items():
        shape = ["draws", "blocked"] if name.startswith("blocked") else ["draws"]
        inputs.append(helper.make_tensor_value_info(name, types[dtype], shape))
    outputs = [helper.make_tensor_value_info("token", TensorProto.INT64, ["draws"]),
               helper.make_tensor_value_info("log_prob", TensorProto.FLOAT, ["draws"])]
    name = "sample_draws" + "_top_k" * top_k + "_top_p" * nucleus
    graph = helper.make_graph(g.nodes, name, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model.SerializeToString()


def _inputs(top_k: bool, nucleus: bool) -> dict[str, type]:
    """The small inputs of a variant, with their element types."""
    return {**DRAW_INPUTS, **(TOP_K_INPUTS if top_k else {}),
            **(TOP_P_INPUTS if nucleus else {})}


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


class DeviceSampler:
    """The draw graphs on one device, and their runs on a step's logits OrtValue."""

    def __init__(self, device_kind: str, device_index: int, providers: list[Any],
                 dtype: type[np.floating], counters: RunCounters | None = None) -> None:
        """dtype: the logits' element type to build the variants for now (another one: on
        first use); counters: a `RunCounters` that the runs and the bytes they move are
        added to."""
        self.device_kind, self.device_index = device_kind, device_index
        self.providers = providers
        self.counters = counters
        self.sessions: dict[tuple[str, bool, bool], ort.InferenceSession] = {}
        element = "tensor(float16)" if np.dtype(dtype) == np.float16 else "tensor(float)"
        for top_k in (False, True):
            for nucleus in (False, True):
                self._session(element, top_k, nucleus)

    def _session(self, element: str, top_k: bool, nucleus: bool) -> ort.InferenceSession:
        """The variant for logits of ONNX Runtime type `element` ('tensor(float)', ...)."""
        session = self.sessions.get((element, top_k, nucleus))
        if session is None:
            from onnx import TensorProto

            types = {"tensor(float)": TensorProto.FLOAT, "tensor(float16)": TensorProto.FLOAT16}
            if element not in types:
                raise TypeError(f"sampling on the device takes float or float16 logits, not "
                                f"{element}")
            options = ort.SessionOptions()
            options.log_severity_level = 3
            session = self.sessions[(element, top_k, nucleus)] = ort.InferenceSession(
                _graph_bytes(types[element], top_k, nucleus), sess_options=options,
                providers=self.providers)
        return session

    def draw(self, logits: ort.OrtValue, draws: SampleDraws) -> tuple[np.ndarray, np.ndarray]:
        """One token per draw from the rows of logits [B,T,V] (their last position): the
        drawn ids [S] int64 and their log-probabilities [S] float32 (logit - logsumexp of
        the unscaled row)."""
        vocab = logits.shape()[-1]
        top_k_values = np.asarray(draws.top_k)
        top_k = bool(((top_k_values > 0) & (top_k_values < vocab)).any())
        nucleus = bool((np.asarray(draws.top_p) < 1.0).any())
        session = self._session(logits.data_type(), top_k, nucleus)
        blocked_ids, blocked = blocked_tokens(draws)
        small = {"rows": draws.rows, "uniforms": draws.uniforms,
                 "temperature": draws.temperature, "top_k": draws.top_k,
                 "top_p": draws.top_p, "blocked_ids": blocked_ids, "blocked": blocked}
        binding = session.io_binding()
        binding.bind_ortvalue_input("logits", logits)
        moved = 0
        for name, dtype in _inputs(top_k, nucleus).items():
            value = np.ascontiguousarray(small[name], dtype=dtype)
            binding.bind_cpu_input(name, value)
            moved += value.nbytes
        for name in DRAW_OUTPUTS:
            binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        token, log_prob = (value.numpy() for value in binding.get_outputs())
        if self.counters is not None:
            self.counters.runs += 1
            self.counters.to_device += moved
            self.counters.to_host += token.nbytes + log_prob.nbytes
        return token, log_prob
