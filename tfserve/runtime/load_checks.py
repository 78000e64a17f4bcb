"""The checks a `Runtime` makes at load: the manifest against the graphs it loaded (names,
heads, head dim, float type, vocabulary, position tables), and one encoder run and one
decoder step at the last target position. A manifest that claims what its graphs do not
take is refused there, naming the field, instead of failing requests later."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tfserve.artifacts.manifest import MANIFEST_FILE, GraphFacts
from tfserve.runtime.static_step import SELF_ATTENTION_MASK

if TYPE_CHECKING:
    from tfserve.runtime.sessions import Runtime


def check_against_graphs(runtime: Runtime, encoder_facts: GraphFacts,
                         decoder_facts: GraphFacts | None) -> None:
    """Refuse, naming the field, its value and the graph's figure, a manifest that claims
    what its graphs do not take, instead of failing requests later (or, on CUDA, where an
    out-of-range position is not an error, answering from garbage).

    From the loaded graphs' inputs and outputs: the layers (the names), heads, head dim and
    float type (past_key_0 [B,H,P,Dh]), the vocabulary (logits [B,T,V]). From the files:
    the position tables (RotaryEmbedding cos/sin caches, sinusoidal or learned tables)
    bound max_source_positions and max_target_positions; graphs that compute positions
    (fp16 RoPE) or have relative ones (T5's bias per distance bucket) have no bound.
    Then one decoder step at the last target position runs, which proves that the graphs
    run together and, on CPU, that the position is taken. An encoder-only model: its
    encoder graph's names, its position table, one encoder run.
    """
    where = runtime.directory / MANIFEST_FILE
    cfg = runtime.config
    files = {"encoder": runtime.manifest.encoder_file, "decoder": runtime.manifest.decoder_file}
    # the inputs the load's rewrite added (Runtime.rewrite_inputs); the static cache
    # computes the self-attention mask
    step_inputs = list(runtime.rewrite_inputs)
    decoder_inputs = [name for name in runtime.decoder_inputs
                      if not (runtime.static_cache and name == SELF_ATTENTION_MASK)]
    expected = {"encoder": (runtime.encoder_inputs, runtime.encoder_outputs),
                "decoder": (decoder_inputs + step_inputs, runtime.decoder_outputs)}
    graphs = [("encoder", runtime.encoder)]
    if runtime.decoder is not None:
        graphs.append(("decoder", runtime.decoder))
    for graph, loaded in graphs:
        inputs = {value.name for value in loaded.get_inputs()}
        outputs = {value.name for value in loaded.get_outputs()}
        # layers: the decoder takes past_key_l and the encoder gives cross_key_l per layer
        marker, names = ("cross_key_", outputs) if graph == "encoder" else ("past_key_",
                                                                             inputs)
        layers = sum(name.startswith(marker) for name in names)
        if layers != cfg.decoder_layers:
            raise ValueError(f"{where}: model.decoder_layers is {cfg.decoder_layers}, but "
                             f"{files[graph]} has {layers} decoder layers ({marker}*)")
        wanted_in, wanted_out = expected[graph]
        for kind, wanted, have in (("input", wanted_in, inputs),
                                   ("output", wanted_out, outputs)):
            missing = [name for name in wanted if name not in have]
            if missing:
                raise ValueError(f"{where}: {files[graph]} has no {kind} {missing[0]!r}: "
                                 f"not a tfserve {graph} graph")
        extra = sorted(inputs - set(wanted_in))
        if extra:
            raise ValueError(f"{where}: {files[graph]} takes an input {extra[0]!r} that "
                             f"the {graph} interface does not have")
    if runtime.decoder is not None:
        _check_decoder(runtime, files)
    if runtime.tokenizer.vocab_size > cfg.vocab_size:
        name = runtime.manifest.tokenizer.vocab or runtime.manifest.tokenizer.source
        raise ValueError(f"{where}: model.vocab_size is {cfg.vocab_size}, but the "
                         f"tokenizer ({name}) has {runtime.tokenizer.vocab_size} ids")
    _check_positions(runtime, encoder_facts, decoder_facts)
    _run_once(runtime, files)

def _check_decoder(runtime: Runtime, files: dict[str, str]) -> None:
    """The decoder graph's heads, head dim, float type and vocabulary against the
    manifest (_check_against_graphs)."""
    assert runtime.decoder is not None
    where = runtime.directory / MANIFEST_FILE
    cfg = runtime.config
    past = next(v for v in runtime.decoder.get_inputs() if v.name == "past_key_0")
    heads, head_dim = past.shape[1], past.shape[3]  # [B,H,P,Dh]
    if isinstance(heads, int) and heads != cfg.num_heads:
        raise ValueError(f"{where}: model.num_heads is {cfg.num_heads}, but "
                         f"{files['decoder']}'s past_key_0 has {heads} heads")
    if isinstance(head_dim, int) and head_dim != cfg.head_dim:
        source = (f"model.attention_head_dim is {cfg.head_dim}" if cfg.attention_head_dim
                  else f"model.d_model {cfg.d_model} / num_heads {cfg.num_heads} is a "
                       f"head dim of {cfg.head_dim}")
        raise ValueError(f"{where}: {source}, but {files['decoder']}'s past_key_0 has "
                         f"{head_dim}")
    float_type = "tensor(float16)" if runtime.manifest.dtype == "fp16" else "tensor(float)"
    if past.type != float_type:
        raise ValueError(f"{where}: dtype is {runtime.manifest.dtype}, but "
                         f"{files['decoder']}'s past_key_0 is {past.type}")
    logits = next(v for v in runtime.decoder.get_outputs() if v.name == "logits")
    vocab = logits.shape[-1]  # [B,T,V]
    if isinstance(vocab, int) and vocab != cfg.vocab_size:
        raise ValueError(f"{where}: model.vocab_size is {cfg.vocab_size}, but the decoder "
                         f"graph's logits have {vocab} entries ({files['decoder']})")

def _check_positions(runtime: Runtime, encoder_facts: GraphFacts,
                     decoder_facts: GraphFacts | None) -> None:
    """The graphs' position tables must hold max_source_positions / max_target_positions
    (_check_against_graphs)."""
    where = runtime.directory / MANIFEST_FILE
    cfg = runtime.config
    files = {"encoder": runtime.manifest.encoder_file, "decoder": runtime.manifest.decoder_file}
    checked = [("encoder", encoder_facts, "max_source_positions", cfg.max_source_positions)]
    if decoder_facts is not None:
        checked.append(("decoder", decoder_facts, "max_target_positions",
                        cfg.max_target_positions))
    for graph, facts, field_name, limit in checked:
        # relative positions (T5) read a table of buckets, not of positions: any length
        tables = facts.position_tables() if cfg.positions != "relative" else []
        if not tables:
            continue
        table, rows = min(tables, key=lambda item: item[1])
        # position p reads row p + position_offset (BART's learned tables, M2M100's)
        rows -= cfg.position_offset if cfg.positions in ("sinusoidal", "learned") else 0
        if limit > rows:
            takes = (f"the encoder graph cannot take {limit} tokens" if graph == "encoder"
                     else f"the decoder graph cannot take position {limit - 1}")
            offset = (f" after its {cfg.position_offset} offset rows"
                      if cfg.position_offset else "")
            raise ValueError(f"{where}: model.{field_name} is {limit}, but {takes}: "
                             f"{files[graph]}'s position table {table!r} has {rows} rows"
                             f"{offset}")

def _run_once(runtime: Runtime, files: dict[str, str]) -> None:
    """Encode one token and decode one step at the last target position (an
    encoder-only model: encode)."""
    where = runtime.directory / MANIFEST_FILE
    cfg = runtime.config
    input_ids = np.array([[cfg.eos_token_id]], np.int64)  # [1,1]
    try:
        _, cross = runtime.encode(input_ids, np.ones_like(input_ids))
    except Exception as exc:  # onnxruntime's own classes too
        raise ValueError(f"{runtime.directory / files['encoder']}: the encoder graph does "
                         f"not run ({first_line(exc)})") from None
    if runtime.decoder is None:
        return
    last = cfg.max_target_positions - 1
    try:
        out = runtime.step(np.array([[cfg.decoder_start_token_id]], np.int64),  # [1,1]
                        np.array([[last]], np.int64),  # [1,1]: the last position
                        np.ones((1, 1), np.int64), np.ones((1, 1), np.int64),
                        runtime.empty_past(1), cross)
    except Exception as exc:
        raise ValueError(f"{where}: the decoder graph cannot take position {last} "
                         f"(model.max_target_positions {cfg.max_target_positions}): "
                         f"{first_line(exc)}") from None
    vocab = out.logits.shape[-1]  # [1,1,V]
    if vocab != cfg.vocab_size:
        raise ValueError(f"{where}: model.vocab_size is {cfg.vocab_size}, but the decoder "
                         f"graph's logits have {vocab} entries ({files['decoder']})")


def first_line(exc: BaseException) -> str:
    """An exception's message, its first line (300 characters at most)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
