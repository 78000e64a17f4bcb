"""`Runtime`: an artifacts directory on ONNX Runtime, implementing `generation.Backend`.

It loads model.json, the two graphs and the tokenizer, checks the manifest against the
graphs, and runs the encoder and one decoder step; the runs' feeds and fetches and the cache
row operations go to the cache placement chosen once here (`tfserve.runtime.cache`). An
encoder-only model (model.decoder_layers 0) has the encoder graph alone: it encodes, and a
decoder step is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from tfserve.artifacts.manifest import (
    GROUPED_CROSS_REVISION,
    MANIFEST_FILE,
    SHARED_TABLE_REVISION,
    TOP_CANDIDATES,
    TOP_OUTPUTS,
    GraphFacts,
    Manifest,
    ManifestError,
    decoder_io,
    encoder_io,
    read_graph_facts,
)
from tfserve.generation import StepOutput
from tfserve.runtime.cache import CacheStorage, DeviceCache, HostCache, RunCounters
from tfserve.runtime.packed_weights import constant_weights
from tfserve.runtime.providers import PROVIDERS, ProviderError, make_session, parse_device
from tfserve.runtime.sampling_graph import STEP_DRAW_INPUTS
from tfserve.runtime.shared_weights import SharedInitializers, shared_initializers
from tfserve.runtime.static_cache import StaticCache
from tfserve.runtime.static_step import SELF_ATTENTION_MASK, static_decoder
from tfserve.runtime.step_graph import (
    CACHE_ROWS,
    loads_rewritten_graphs,
    reads_graph_bytes,
    rewritten_decoder,
)
from tfserve.text.tokenizer import Tokenizer


class Runtime:
    """An exported model on ONNX Runtime; implements `generation.Backend`."""

    def __init__(
        self,
        artifacts_dir: str | Path,
        device: str = "cpu",
        intra_op_threads: int = 0,
        inter_op_threads: int = 0,
        optimization: str = "all",
        device_cache: bool | None = None,
        allow_spinning: bool = False,
        pack_weights: bool | None = None,
        kv_cache: str = "auto",
    ) -> None:
        """device_cache: keep the KV cache as OrtValues on the device (default: on CUDA).
        kv_cache: "dynamic" (a tensor per step, one column longer each time), "static"
        (preallocated buffers per bucket written in place, tfserve.runtime.static_cache; the
        device placement, and so device_cache, is implied) or "auto" (the provider's
        choice: dynamic on CPU, where it is faster).
        pack_weights: on CPU, let ONNX Runtime pre-pack the tied output projection's weight
        (its fastest kernel; the table's pages leave the process as packing reads them, so
        the packed copy takes the table's place in memory; default: on CPU;
        tfserve.runtime.packed_weights, tfserve.runtime.shared_weights)."""
        self.directory = Path(artifacts_dir)
        self.manifest = Manifest.load(self.directory)
        self.config = cfg = self.manifest.config
        # how export built the graphs (artifacts.manifest.GRAPH_REVISION; 1: before it said)
        self.graph_revision = self.manifest.provenance.get("graph_revision", 1)
        self.tokenizer = Tokenizer(self.directory, self.manifest.tokenizer)
        self.device = device
        self.device_kind, self.device_index = parse_device(device)
        session_args = dict(device=device, intra_op_threads=intra_op_threads,
                            inter_op_threads=inter_op_threads, optimization=optimization,
                            allow_spinning=allow_spinning)
        # read before ONNX Runtime opens them: their external data must lie in the directory
        self.encoder_only = cfg.encoder_only
        encoder_facts = _graph_facts(self.directory / self.manifest.encoder_file,
                                     self.directory)
        decoder_facts = None if self.encoder_only else _graph_facts(
            self.directory / self.manifest.decoder_file, self.directory)
        graph_files = [self.directory / self.manifest.encoder_file]
        if not self.encoder_only:
            graph_files.append(self.directory / self.manifest.decoder_file)
        # a tensor both graphs name at the same bytes (the shared embedding) is mapped once and
        # that one buffer is given to both sessions; a device's sessions copy their
        # initializers to it, so there is nothing to share on the host
        mapped = (shared_initializers(graph_files)
                  if PROVIDERS[self.device_kind].memory == "cpu"
                  else SharedInitializers([{} for _ in graph_files]))
        shared = mapped.per_graph
        # graph -> initializer name -> OrtValue; they must outlive the sessions
        self.shared_weights: dict[str, dict[str, ort.OrtValue]] = dict(
            zip(("encoder", "decoder"), shared))
        self.encoder_inputs, self.encoder_outputs = encoder_io(cfg.decoder_layers)
        self.decoder_inputs, self.decoder_outputs = decoder_io(cfg.decoder_layers)
        self.layers = cfg.decoder_layers
        self._past_names = self.decoder_inputs[4 : 4 + 2 * self.layers]
        self._cross_names = self.decoder_inputs[4 + 2 * self.layers :]
        provider = PROVIDERS[self.device_kind]
        self.static_cache = not self.encoder_only and _static_cache(
            kv_cache, provider.static_cache, device_cache)
        # an encoder-only model has no KV cache to keep anywhere: its encoder's output is
        # fetched to the host (and DeviceCache's row graphs would have no tensors to move)
        self.device_cache = not self.encoder_only and (
            self.static_cache or (provider.cache_on_device if device_cache is None
                                  else device_cache))
        # the device placement reorders a beam step's cache inside the step's one run (the
        # decoder graph with cache_rows, tfserve.runtime.step_graph); the host placement moves
        # only the rows that change, in place, which is cheaper there than a gather of all.
        # The static cache's rows travel with its StaticPast: the batch never passes them
        self.reorders_in_step = (self.device_cache and not self.static_cache
                                 and loads_rewritten_graphs())
        cpu = self.device_kind == "cpu"
        self.pack_weights = cpu if pack_weights is None else pack_weights and cpu
        # the decoder graph as this runtime runs it, and whether its tied table became a
        # constant ONNX Runtime pre-packs
        decoder_bytes, self._packs_table = ((None, False) if self.encoder_only
                                            else self._decoder_bytes(graph_files[1]))
        # the decoder first, so that pre-packing its projection comes before the encoder's
        # weights add to the peak; the tied table's pages leave the process as packing reads
        # them (the projection reads its packed copy, the embedding lookups a row per token:
        # tfserve.runtime.shared_weights)
        with mapped.dropping_pages() if self._packs_table else nullcontext():
            self.decoder = None if self.encoder_only else _load_graph(
                graph_files[1], session_args, shared[1], decoder_bytes)
        self.encoder = _load_graph(graph_files[0], session_args, shared[0])
        # the session that tells the providers and threads (the decoder's, where there is one)
        self._session = self.decoder or self.encoder
        self.float_dtype = np.float16 if self.manifest.dtype == "fp16" else np.float32
        # the optional outputs of graph revision 2; older exports run without them
        graph_outputs = {output.name for output in self.decoder.get_outputs()} \
            if self.decoder is not None else set()
        self.top_outputs = [name for name in TOP_OUTPUTS if name in graph_outputs]
        if len(self.top_outputs) != len(TOP_OUTPUTS):
            self.top_outputs = []
        # the decoder takes cross K/V with one row per group of G rows (a sentence's beams)
        self.grouped_cross = self.graph_revision >= GROUPED_CROSS_REVISION
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = cfg.eos_token_id
        self.pad_token_id = cfg.pad_token_id
        # the tokens no search produces (generation.banned_tokens): model.json's record
        self.banned_token_ids = self.manifest.banned_tokens()
        self.decoder_start_token_id = cfg.decoder_start_token_id
        self.max_target_positions = cfg.max_target_positions
        self.max_source_positions = cfg.max_source_positions
        # where the KV cache lives between steps, chosen once: every run and row operation
        # goes through it
        cache_shape = (2 * self.layers, cfg.num_heads, cfg.head_dim, self.float_dtype)
        self.cache_storage: CacheStorage
        if self.static_cache:
            self.cache_storage = StaticCache(*cache_shape, provider.memory, self.device_index,
                                             self._session.get_providers(),
                                             cfg.max_target_positions, self.grouped_cross)
        elif self.device_cache:
            self.cache_storage = DeviceCache(*cache_shape, provider.memory, self.device_index,
                                             self._session.get_providers())
        else:
            self.cache_storage = HostCache(*cache_shape)
        self._check_against_graphs(encoder_facts, decoder_facts)
        if isinstance(self.cache_storage, StaticCache):
            # the check stepped at the last target position: a bucket serving rarely needs
            self.cache_storage.drop_pool()

    def _decoder_bytes(self, path: Path) -> tuple[bytes | None, bool]:
        """The decoder graph rewritten for how this runtime runs it (None: the file as it
        is): cache_rows where it reorders in the step, the static cache's buffers where it
        keeps one, its tied table constant where it pre-packs weights (graph revision 8
        lists the table as an input; an ONNX Runtime that reads graphs as bytes); and whether
        that last rewrite was made."""
        model = None
        if self.static_cache:
            cfg = self.config
            presents = [name.replace("past_", "present_", 1) for name in self._past_names]
            model = static_decoder(path, self._past_names, presents, cfg.num_heads,
                                   cfg.head_dim)
        elif self.reorders_in_step:  # and the step's sampling draws, in the same run
            model = rewritten_decoder(path, self._past_names, self.decoder_outputs[0])
        if (self.pack_weights and self.graph_revision >= SHARED_TABLE_REVISION
                and reads_graph_bytes()):
            packed, names = constant_weights(path.read_bytes() if model is None else model)
            if names:
                return packed, True
        return model, False

    def _check_against_graphs(self, encoder_facts: GraphFacts,
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
        where = self.directory / MANIFEST_FILE
        cfg = self.config
        files = {"encoder": self.manifest.encoder_file, "decoder": self.manifest.decoder_file}
        # the load's rewrite: cache_rows (and the draws where it reorders in the step); the
        # static cache computes the self-attention mask
        step_inputs = [CACHE_ROWS] if self.reorders_in_step or self.static_cache else []
        if self.reorders_in_step:
            step_inputs += STEP_DRAW_INPUTS
        decoder_inputs = [name for name in self.decoder_inputs
                          if not (self.static_cache and name == SELF_ATTENTION_MASK)]
        expected = {"encoder": (self.encoder_inputs, self.encoder_outputs),
                    "decoder": (decoder_inputs + step_inputs, self.decoder_outputs)}
        graphs = [("encoder", self.encoder)]
        if self.decoder is not None:
            graphs.append(("decoder", self.decoder))
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
        if self.decoder is not None:
            self._check_decoder(files)
        if self.tokenizer.vocab_size > cfg.vocab_size:
            name = self.manifest.tokenizer.vocab or self.manifest.tokenizer.source
            raise ValueError(f"{where}: model.vocab_size is {cfg.vocab_size}, but the "
                             f"tokenizer ({name}) has {self.tokenizer.vocab_size} ids")
        self._check_positions(encoder_facts, decoder_facts)
        self._run_once(files)

    def _check_decoder(self, files: dict[str, str]) -> None:
        """The decoder graph's heads, head dim, float type and vocabulary against the
        manifest (_check_against_graphs)."""
        assert self.decoder is not None
        where = self.directory / MANIFEST_FILE
        cfg = self.config
        past = next(v for v in self.decoder.get_inputs() if v.name == "past_key_0")
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
        float_type = "tensor(float16)" if self.manifest.dtype == "fp16" else "tensor(float)"
        if past.type != float_type:
            raise ValueError(f"{where}: dtype is {self.manifest.dtype}, but "
                             f"{files['decoder']}'s past_key_0 is {past.type}")
        logits = next(v for v in self.decoder.get_outputs() if v.name == "logits")
        vocab = logits.shape[-1]  # [B,T,V]
        if isinstance(vocab, int) and vocab != cfg.vocab_size:
            raise ValueError(f"{where}: model.vocab_size is {cfg.vocab_size}, but the decoder "
                             f"graph's logits have {vocab} entries ({files['decoder']})")

    def _check_positions(self, encoder_facts: GraphFacts,
                         decoder_facts: GraphFacts | None) -> None:
        """The graphs' position tables must hold max_source_positions / max_target_positions
        (_check_against_graphs)."""
        where = self.directory / MANIFEST_FILE
        cfg = self.config
        files = {"encoder": self.manifest.encoder_file, "decoder": self.manifest.decoder_file}
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

    def _run_once(self, files: dict[str, str]) -> None:
        """Encode one token and decode one step at the last target position (an
        encoder-only model: encode)."""
        where = self.directory / MANIFEST_FILE
        cfg = self.config
        input_ids = np.array([[cfg.eos_token_id]], np.int64)  # [1,1]
        try:
            _, cross = self.encode(input_ids, np.ones_like(input_ids))
        except Exception as exc:  # onnxruntime's own classes too
            raise ValueError(f"{self.directory / files['encoder']}: the encoder graph does "
                             f"not run ({_first_line(exc)})") from None
        if self.decoder is None:
            return
        last = cfg.max_target_positions - 1
        try:
            out = self.step(np.array([[cfg.decoder_start_token_id]], np.int64),  # [1,1]
                            np.array([[last]], np.int64),  # [1,1]: the last position
                            np.ones((1, 1), np.int64), np.ones((1, 1), np.int64),
                            self.empty_past(1), cross)
        except Exception as exc:
            raise ValueError(f"{where}: the decoder graph cannot take position {last} "
                             f"(model.max_target_positions {cfg.max_target_positions}): "
                             f"{_first_line(exc)}") from None
        vocab = out.logits.shape[-1]  # [1,1,V]
        if vocab != cfg.vocab_size:
            raise ValueError(f"{where}: model.vocab_size is {cfg.vocab_size}, but the decoder "
                             f"graph's logits have {vocab} entries ({files['decoder']})")

    @property
    def top_candidates(self) -> int:
        """The candidates per position each step gives (generation.Backend.top_candidates):
        the graph's top outputs' K, 0 without them."""
        return min(TOP_CANDIDATES, self.vocab_size) if self.top_outputs else 0

    @property
    def counters(self) -> RunCounters:
        """ONNX Runtime runs and host <-> device bytes so far (the cache placement's)."""
        return self.cache_storage.counters

    def describe(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "providers": self._session.get_providers(),
            "intra_op_threads": self._session.get_session_options().intra_op_num_threads,
            "dtype": self.manifest.dtype,
            # the tied projection's weight pre-packed (tfserve.runtime.packed_weights): asked
            # for, and a decoder whose tied table can be made a constant
            "pack_weights": self._packs_table,
            # the self-attention cache: "static" (buffers per bucket written in place,
            # tfserve.runtime.static_cache) or "dynamic" (a tensor per step)
            "kv_cache": "static" if self.static_cache else "dynamic",
            "quantization": self.manifest.quantization,
        }

    # -- encoder ----------------------------------------------------------------------------

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray,
                                                                                 list[Any]]:
        """-> encoder hidden states [B,S,D] (numpy) and cross K/V [k_0, v_0, ...] [B,H,S,Dh]."""
        feeds = {"input_ids": _int64(input_ids), "attention_mask": _int64(attention_mask)}
        return self.cache_storage.run_encoder(self.encoder, feeds, self.encoder_outputs)

    def hidden_states(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Encoder hidden states [B,S,D] as float32 (for embeddings: no cross K/V fetched)."""
        hidden = self.encoder.run(["encoder_hidden_states"], {
            "input_ids": _int64(input_ids), "attention_mask": _int64(attention_mask)})[0]
        return hidden.astype(np.float32, copy=False)

    # -- decoder ----------------------------------------------------------------------------

    def step(
        self,
        input_ids: np.ndarray,
        position_ids: np.ndarray,
        self_attention_mask: np.ndarray,
        encoder_attention_mask: np.ndarray,
        past: list[Any],
        cross: list[Any],
        need_logits: bool = True,
        cache_rows: np.ndarray | None = None,
    ) -> StepOutput:
        """One step -> logits float32 [B,T,V] (None unless need_logits), the present cache
        [k_0, v_0, ...] and the graph's top candidates when it has them (graph revision 2).

        cache_rows [B]: the row of `past` each row continues (None: its own), where the
        runtime reorders in the step (`reorders_in_step`); else `past` must be in row order.
        """
        if self.decoder is None:
            raise ValueError(f"{self.directory} is an encoder-only model (model.decoder_layers "
                             "0): it encodes, it does not generate")
        small = {
            "input_ids": _int64(input_ids),
            "position_ids": _int64(position_ids),
            "self_attention_mask": _int64(self_attention_mask),
            "encoder_attention_mask": _int64(encoder_attention_mask),
        }
        if self.reorders_in_step:
            small[CACHE_ROWS] = (np.arange(small["input_ids"].shape[0], dtype=np.int64)
                                 if cache_rows is None else _int64(cache_rows))
        elif cache_rows is not None:
            raise ValueError("cache_rows: this runtime does not reorder in the step "
                             "(reorders_in_step is False)")
        return self.cache_storage.run_decoder(self.decoder, small, self._past_names, past,
                                              self._cross_names, cross, self.decoder_outputs,
                                              self.top_outputs,
                                              need_logits or not self.top_outputs)

    # -- cache rows (generation.Backend): numpy arrays or OrtValues (tfserve.runtime.cache) --

    def empty_past(self, rows: int) -> list[Any]:
        return self.cache_storage.empty_past(rows)

    def take_rows(self, cache: Sequence[Any], index: np.ndarray, reuse: bool = False
                  ) -> list[Any]:
        return self.cache_storage.take_rows(cache, index, reuse)

    def concat_rows(self, caches: Sequence[Sequence[Any]], length: int | None = None,
                    left: bool = False, first_rows: np.ndarray | None = None,
                    first_time: tuple[int, int] | None = None) -> list[Any]:
        return self.cache_storage.concat_rows(caches, length, left, first_rows, first_time)

    def pad_time(self, cache: Sequence[Any], length: int, left: bool) -> list[Any]:
        return self.cache_storage.pad_time(cache, length, left)

    def slice_time(self, cache: Sequence[Any], start: int, stop: int) -> list[Any]:
        return self.cache_storage.slice_time(cache, start, stop)


KV_CACHES = ("auto", "static", "dynamic")


def _static_cache(kv_cache: str, provider_default: bool, device_cache: bool | None) -> bool:
    """Whether the runtime keeps the static KV cache (Runtime's kv_cache)."""
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHES)}, not {kv_cache!r}")
    # auto: the provider's choice, unless the cache is kept on the host
    static = (provider_default and device_cache is not False if kv_cache == "auto"
              else kv_cache == "static")
    if kv_cache == "static" and device_cache is False:
        raise ValueError("kv_cache 'static' keeps the cache in OrtValues (the device "
                         "placement): it cannot be used with device_cache=False")
    if static and not loads_rewritten_graphs():
        if kv_cache == "auto":
            return False
        raise ValueError("kv_cache 'static' rewrites the decoder graph at load: it needs "
                         "ONNX Runtime 1.21 or later and the onnx package")
    return static


def _int64(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.int64)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _graph_facts(path: Path, directory: Path) -> GraphFacts:
    """What the graph file declares; its external data files confined to `directory`."""
    facts = read_graph_facts(path)
    root = directory.resolve()
    for location in sorted(facts.external_files):
        # an absolute location replaces the base in the join; links are resolved
        if not (path.parent / location).resolve().is_relative_to(root):
            raise ManifestError(f"{path} names external data {location!r}, which is outside "
                                f"{directory}")
    return facts


def _load_graph(path: Path, session_args: dict[str, Any],
                initializers: dict[str, ort.OrtValue] | None = None,
                model: bytes | None = None) -> ort.InferenceSession:
    """make_session (with `initializers` taken as they are; `model`: the graph rewritten, its
    weights in the files beside `path`), with ONNX Runtime's load errors (empty, truncated
    or foreign files, missing external data) as one ValueError naming the file."""
    try:
        return make_session(path, **session_args, initializers=initializers, model=model)
    except ProviderError:
        raise  # the device's own message
    except Exception as exc:  # onnxruntime's own classes (InvalidProtobuf, Fail, ...)
        raise ValueError(f"{path}: not a loadable ONNX graph ({_first_line(exc)})") from None


