"""The decoder graph over a static KV cache: fixed buffers written in place, one column a step.

The exported decoder takes past K/V [B,H,P,Dh] and gives present K/V [B,H,P+1,Dh]: every
step makes a cache one column longer, and the rows joining or leaving a running batch pad,
concatenate and slice it. Rewritten here at load time, the decoder takes instead, per layer,
a buffer [R,H,L,Dh] (R rows, L columns: the bucket) and gives it back with the step's column
written in place:

- `cache_rows` int64 [B]: the buffer row each row continues (a Gather, axis 0: the beam
  reorder, and rows leaving by not being named; a newcomer names any row, see below);
- the step's new key and value [B,H,1,Dh] are scattered (ScatterElements, axis 2) into column
  `position_ids` of their row: a row's history fills columns [0, position) of its buffer row,
  left-aligned, whatever the other rows' lengths, so a row joins at position 0 without
  padding anyone's cache;
- self-attention reads the whole updated buffer (MultiHeadAttention with keys and values
  [B,H,L,Dh], the form the graph's cross-attention uses), with the mask computed in the graph
  from the positions (column j is valid for a row at position p when j <= p) in place of the
  `self_attention_mask` input, which the rewritten graph no longer takes. T5's relative
  positions count a key's position from that mask (a cumulative sum), so they follow too;
- `present_key_l` / `present_value_l` are the updated buffers [B,H,L,Dh], which the runtime
  binds to the bucket's other buffer set (`tfserve.runtime.static_cache`: two sets per
  bucket, each step reading one and writing the other), so nothing is allocated per step.

The runtime runs every step of a bucket at the bucket's shapes (B = R, its rows padded), with
the cross K/V in fixed buffers too (`cross_write_graph` writes a joining source's rows into
them), the buffers and the small inputs at fixed addresses, and nothing crossing to the host
inside the step but the top candidates: what a captured graph (CUDA graphs) needs to replay
it. A newcomer's row content is never read: at position 0 only the column it writes is valid.

One new token per row (T = 1, what `DecodeBatch` steps); graphs whose self-attention is not
ONNX Runtime's fused MultiHeadAttention with past inputs (fp16 exports with standard-op
attention) are refused.
"""

from __future__ import annotations

from pathlib import Path

from tfserve.runtime.ort_runs import model_bytes
from tfserve.runtime.step_graph import CACHE_ROWS, load_decoder

SELF_ATTENTION_MASK = "self_attention_mask"
POSITION_IDS = "position_ids"
# MultiHeadAttention's inputs (com.microsoft): query, key, value, bias, key_padding_mask,
# attention_bias, past_key, past_value; outputs: output, present_key, present_value
_KEY, _VALUE, _PAST_KEY, _PAST_VALUE = 1, 2, 6, 7


def static_decoder(
    decoder: Path, past_names: list[str], present_names: list[str], heads: int, head_dim: int
) -> bytes:
    """The decoder graph at `decoder` (its weights left in their files) rewritten for a static
    cache (module docstring). past_names / present_names: past_key_0, past_value_0, ... and
    present_key_0, ... in the same order."""
    from onnx import TensorProto, helper

    model = load_decoder(decoder, (*past_names, SELF_ATTENTION_MASK, POSITION_IDS))
    graph = model.graph
    attention = {}  # past key name -> the index of the self-attention node that reads it
    for index, node in enumerate(graph.node):
        for name in node.input:
            if name in past_names:
                if (
                    node.op_type != "MultiHeadAttention"
                    or len(node.input) <= _PAST_VALUE
                    or node.input[_PAST_KEY] not in past_names
                ):
                    raise ValueError(
                        f"{decoder}: {name!r} is read by a {node.op_type} node "
                        f"({node.name}); the static cache needs ONNX Runtime's "
                        "fused MultiHeadAttention with past inputs"
                    )
                attention[node.input[_PAST_KEY]] = index
    missing = [name for name in past_names[::2] if name not in attention]
    if missing:
        raise ValueError(f"{decoder}: no self-attention reads {missing[0]!r}")
    unit = {past: present for past, present in zip(past_names, present_names)}

    made = []  # new nodes, placed first (they read graph inputs only) or before their node
    # the mask over the buffer's columns, from the positions: [B,L], 1 where j <= position
    mask = "static/self_attention_mask"
    made += [
        helper.make_node("Shape", [past_names[0]], ["static/length"], start=2, end=3),
        helper.make_node("Squeeze", ["static/length"], ["static/length_scalar"]),
        helper.make_node(
            "Constant",
            [],
            ["static/zero"],
            value=helper.make_tensor("zero", TensorProto.INT64, [], [0]),
        ),
        helper.make_node(
            "Constant",
            [],
            ["static/one"],
            value=helper.make_tensor("one", TensorProto.INT64, [], [1]),
        ),
        helper.make_node(
            "Range", ["static/zero", "static/length_scalar", "static/one"], ["static/columns"]
        ),  # [L]
        helper.make_node(
            "Unsqueeze", ["static/columns", "static/axis_0"], ["static/columns_row"]
        ),  # [1,L]
        helper.make_node(
            "Constant",
            [],
            ["static/axis_0"],
            value=helper.make_tensor("axis_0", TensorProto.INT64, [1], [0]),
        ),
        helper.make_node(
            "LessOrEqual", ["static/columns_row", POSITION_IDS], ["static/valid"]
        ),  # [1,L] <= [B,1] -> [B,L]
        helper.make_node("Cast", ["static/valid"], [mask], to=TensorProto.INT64),
        # the write index of each row's new column, [B,1,1,1] (T = 1)
        helper.make_node(
            "Constant",
            [],
            ["static/axes_1_3"],
            value=helper.make_tensor("axes_1_3", TensorProto.INT64, [2], [1, 3]),
        ),
        helper.make_node("Unsqueeze", [POSITION_IDS, "static/axes_1_3"], ["static/column"]),
        helper.make_node(
            "Constant",
            [],
            ["static/split_heads"],
            value=helper.make_tensor(
                "split_heads", TensorProto.INT64, [4], [0, 0, heads, head_dim]
            ),
        ),
    ]
    # Constant before use: the node list must stay topologically sorted
    made.sort(key=lambda node: node.op_type != "Constant")
    placed: dict[int, list] = {}  # self-attention node index -> the nodes placed before it
    for past_key, index in attention.items():
        node = graph.node[index]
        past_value = node.input[_PAST_VALUE]
        updated = []
        for past, new in ((past_key, node.input[_KEY]), (past_value, node.input[_VALUE])):
            gathered, heads_first = f"{past}/gathered", f"{past}/new_column"
            # the step's key or value [B,1,H*Dh] -> [B,H,1,Dh]
            nodes = [
                helper.make_node("Gather", [past, CACHE_ROWS], [gathered], axis=0),
                helper.make_node("Reshape", [new, "static/split_heads"], [f"{past}/split"]),
                helper.make_node("Transpose", [f"{past}/split"], [heads_first], perm=[0, 2, 1, 3]),
                helper.make_node("Shape", [heads_first], [f"{past}/new_shape"]),
                helper.make_node(
                    "Expand", ["static/column", f"{past}/new_shape"], [f"{past}/index"]
                ),
                helper.make_node(
                    "ScatterElements",
                    [gathered, f"{past}/index", heads_first],
                    [unit[past]],
                    axis=2,
                ),
            ]
            placed.setdefault(index, []).extend(nodes)
            updated.append(unit[past])
        # attend over the updated buffers: keys and values [B,H,L,Dh], no past, no present
        del node.input[_PAST_KEY:]
        node.input[_KEY], node.input[_VALUE] = updated
        del node.output[1:]
    nodes = list(made)
    for index, node in enumerate(graph.node):
        nodes.extend(placed.get(index, []))
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    # the mask is computed: every reader of the input reads it instead
    for node in graph.node:
        for position, name in enumerate(node.input):
            if name == SELF_ATTENTION_MASK:
                node.input[position] = mask
    kept = [value for value in graph.input if value.name != SELF_ATTENTION_MASK]
    del graph.input[:]
    graph.input.extend(kept)
    graph.input.append(helper.make_tensor_value_info(CACHE_ROWS, TensorProto.INT64, ["batch"]))
    for value in graph.input:  # the buffers' time axis is the bucket's length
        if value.name in unit:
            value.type.tensor_type.shape.dim[0].dim_param = "buffer_rows"
            value.type.tensor_type.shape.dim[2].dim_param = "buffer_length"
    for value in graph.output:
        if value.name in present_names:
            value.type.tensor_type.shape.dim[2].dim_param = "buffer_length"
    return model.SerializeToString()


CROSS_ROWS = "rows"  # cross_write_graph's row index input, int64 [N,1]
CROSS_PADS = "pads"  # its time padding of the written rows, int64 [8] (Pad's begin and end)


def cross_write_graph(count: int, elem_type: int) -> bytes:
    """A graph that writes N sources' cross K/V into rows of fixed buffers: for each of the
    `count` tensors, `out_i` = ScatterND(`buffer_i` [Rc,H,Sc,Dh], `rows` [N,1],
    Pad(`part_i` [N,H,S,Dh], `pads`) [N,H,Sc,Dh]): the part's rows, right-padded with zeros to
    the buffer's Sc columns, at buffer rows `rows`. The runtime binds `out_i` to `buffer_i`
    itself, so the rows are written in place and the buffer keeps its address (ScatterND
    copies its input to its output only where the two differ, on CPU and CUDA alike: ONNX
    Runtime may run it in place)."""
    from onnx import TensorProto, helper

    inputs = [
        helper.make_tensor_value_info(CROSS_ROWS, TensorProto.INT64, ["sources", 1]),
        helper.make_tensor_value_info(CROSS_PADS, TensorProto.INT64, [8]),
    ]
    outputs, nodes = [], []
    for i in range(count):
        buffer_dims = ["buffer_rows", "heads", "buffer_length", "head_dim"]
        inputs += [
            helper.make_tensor_value_info(f"buffer_{i}", elem_type, buffer_dims),
            helper.make_tensor_value_info(
                f"part_{i}", elem_type, ["sources", "heads", "length", "head_dim"]
            ),
        ]
        outputs.append(helper.make_tensor_value_info(f"out_{i}", elem_type, buffer_dims))
        nodes += [
            # [N,H,S,Dh] -> [N,H,Sc,Dh]: zeros after the source's columns
            helper.make_node("Pad", [f"part_{i}", CROSS_PADS], [f"padded_{i}"], mode="constant"),
            # [Rc,H,Sc,Dh] with rows `rows` replaced
            helper.make_node("ScatterND", [f"buffer_{i}", CROSS_ROWS, f"padded_{i}"],
                             [f"out_{i}"]),
        ]
    return model_bytes(helper.make_graph(nodes, "static_cross_write", inputs, outputs))
