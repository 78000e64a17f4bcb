"""`Runtime`: an artifacts directory on ONNX Runtime, implementing `generation.Backend`.

It loads model.json, the two graphs and the tokenizer, checks the manifest against the
graphs, and runs the encoder and one decoder step; the runs' feeds and fetches and the cache
row operations go to the cache placement chosen once here (`tfserve.runtime.cache`). An
encoder-only model (model.decoder_layers 0) has the encoder graph alone: it encodes, and a
decoder step is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from tfserve.artifacts.manifest import (
    GROUPED_CROSS_REVISION,
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
from tfserve.runtime.cache import CacheStorage, DecoderNames, HostCache
from tfserve.runtime.device_cache import DeviceCache
from tfserve.runtime.load_checks import check_against_graphs, first_line
from tfserve.runtime.ort_runs import RunCounters
from tfserve.runtime.packed_weights import constant_weights
from tfserve.runtime.providers import PROVIDERS, ProviderError, make_session, parse_device
from tfserve.runtime.sampling_graph import STEP_DRAW_INPUTS
from tfserve.runtime.shared_weights import SharedInitializers, shared_initializers
from tfserve.runtime.static_cache import StaticCache
from tfserve.runtime.static_step import static_decoder
from tfserve.runtime.step_graph import (
    CACHE_ROWS,
    loads_rewritten_graphs,
    reads_graph_bytes,
    rewritten_decoder,
)
from tfserve.step import SampleDraws, StepOutput
from tfserve.text.tokenizer import Tokenizer

log = logging.getLogger("tfserve.runtime")


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
        if self.device_cache and not self.static_cache and not self.reorders_in_step:
            # the fallback (tests/runtime/test_device_step.py forces it): said once, at load
            log.warning("the decoder graph runs as exported (ONNX Runtime %s; 1.21 and the "
                        "onnx package rewrite it at load): a beam step's reorder and a "
                        "whole-row sampling draw each take an ONNX Runtime run of their own",
                        ort.__version__)
        # the inputs the load's rewrite adds: cache_rows (and the draws where it reorders in
        # the step)
        self.rewrite_inputs = ([CACHE_ROWS] if self.reorders_in_step or self.static_cache
                               else []) + (list(STEP_DRAW_INPUTS) if self.reorders_in_step
                                           else [])
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
        self._names = DecoderNames(tuple(self._past_names), tuple(self._cross_names),
                                   tuple(self.decoder_outputs), tuple(self.top_outputs))
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
        check_against_graphs(self, encoder_facts, decoder_facts)
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

    @property
    def top_candidates(self) -> int:
        """The candidates per position each step gives (generation.Backend.top_candidates):
        the graph's top outputs' K, 0 without them."""
        return min(TOP_CANDIDATES, self.vocab_size) if self.top_outputs else 0

    @property
    def draws_in_step(self) -> bool:
        """Whether `step` takes draws and makes them where the logits are (the step
        contract): the device placements', so that no row of the logits crosses to the
        host; the host placement's searches draw from numpy rows."""
        return self.cache_storage.draws_on_device

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
        parents: np.ndarray | None = None,
        draws: SampleDraws | None = None,
    ) -> StepOutput:
        """One step (the step contract, `tfserve.step.Backend.step`) -> logits float32
        [B,T,V] (None unless need_logits), the present cache [k_0, v_0, ...], the graph's
        top candidates when it has them (graph revision 2), and the tokens of `draws`.

        parents [B]: the row of `past` each row continues (None: its own); the placement
        honours them its own way (`tfserve.runtime.cache`). draws: made where the logits
        are (`draws_in_step`; the host placement refuses them).
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
        return self.cache_storage.run_decoder(
            self.decoder, self._names, small, past, cross, need_logits or not self.top_outputs,
            None if parents is None else _int64(parents), draws)

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
        raise ValueError(f"{path}: not a loadable ONNX graph ({first_line(exc)})") from None


