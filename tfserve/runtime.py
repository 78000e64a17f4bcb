"""ONNX Runtime sessions over an artifacts directory: the serving backend of the search.

Imports numpy and onnxruntime only (never torch), so the serving image carries no PyTorch.

`Runtime` loads model.json, the two graphs and the tokenizer, creates one session per graph
on the requested device (`cpu`, `cuda`, `cuda:N`) with the given session options, and
implements `tfserve.generation.Backend`: encode, one decoder step, and the cache row
operations the continuous-batching loop needs.

On CPU the cache is a list of numpy arrays [k_0, v_0, k_1, v_1, ...], each [B,H,P,Dh].
On CUDA (or with device_cache=True) each step is run with IO binding: the cross and present
K/V stay in device memory as OrtValues and are bound as the next step's inputs, so a step moves
only token ids, masks and logits between host and device; row operations (beam reorder, rows
joining or leaving) run on the device too (tfserve.cache_ops).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from tfserve.generation import StepOutput, narrow_first, numpy_pool
from tfserve.manifest import (
    GROUPED_CROSS_REVISION,
    MANIFEST_FILE,
    TOP_OUTPUTS,
    GraphFacts,
    Manifest,
    ManifestError,
    decoder_io,
    encoder_io,
    read_graph_facts,
)
from tfserve.tokenizer import Tokenizer

POOL_MIN_BYTES = 4 << 20  # cache row operations below this total size run on one thread
SHARED_ARENA_INITIAL_BYTES = 512 << 20  # address space reserved up front; RSS only when used
_shared_arena_lock = threading.Lock()
_shared_arena_registered = False

OPTIMIZATION_LEVELS = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def parse_device(device: str) -> tuple[str, int]:
    """'cpu' | 'cuda' | 'cuda:N' -> (kind, index); ValueError naming the field otherwise."""
    text = device.strip().lower()
    if text == "cpu":
        return "cpu", 0
    if text == "cuda":
        return "cuda", 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return "cuda", int(text[5:])
    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def make_session(
    path: str | Path,
    device: str = "cpu",
    intra_op_threads: int = 0,
    inter_op_threads: int = 0,
    optimization: str = "all",
    allow_spinning: bool = False,
    shared_arena: bool = True,
) -> ort.InferenceSession:
    """One InferenceSession with explicit threads and optimization level.

    0 threads lets ONNX Runtime choose (one per physical core). allow_spinning lets idle pool
    threads busy-wait: faster only when nothing else needs the cores between runs.
    shared_arena (CPU): allocate from one process-wide arena (`share_cpu_arena`) instead of
    one per session.
    """
    kind, index = parse_device(device)
    if optimization not in OPTIMIZATION_LEVELS:
        raise ValueError(f"optimization must be one of {sorted(OPTIMIZATION_LEVELS)}, "
                         f"got {optimization!r}")
    for name, value in (("intra_op_threads", intra_op_threads),
                        ("inter_op_threads", inter_op_threads)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    options = ort.SessionOptions()
    options.graph_optimization_level = OPTIMIZATION_LEVELS[optimization]
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if not allow_spinning:
        # idle intra-op threads otherwise spin-wait for the next op, and between two decoder
        # steps they burn the cores the search's numpy work and the gRPC loop need
        # (measured on 2 cores: beam4 x 32 +16%, demo single-text latency -27%)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if shared_arena and kind == "cpu":
        share_cpu_arena()
        options.add_session_config_entry("session.use_env_allocators", "1")
    # fatal only: every error of a run reaches the caller as an exception, which the server
    # logs as one record (ONNX Runtime's own line on stderr would say it a second time)
    options.log_severity_level = 4
    if kind == "cuda":
        available = ort.get_available_providers()
        if "CUDAExecutionProvider" not in available:
            raise RuntimeError(
                "device 'cuda' needs onnxruntime-gpu with the CUDA execution provider; "
                f"this onnxruntime offers {available} (pip install 'tfserve[gpu]')"
            )
        providers: list[Any] = [("CUDAExecutionProvider", {"device_id": index}),
                                "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
    if kind == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        # onnxruntime falls back to CPU with only a warning when CUDA/cuDNN or the driver is
        # missing: a server asked for a GPU must not quietly serve from the CPU
        raise RuntimeError("device 'cuda': ONNX Runtime could not create the CUDA execution "
                           "provider (CUDA/cuDNN libraries matching onnxruntime-gpu, a driver "
                           f"and a visible GPU are needed); the session got "
                           f"{session.get_providers()}")
    return session


def share_cpu_arena() -> None:
    """Register one CPU memory arena for every session of this process that opts in (once).

    By default each session has its own arena, which keeps the high-water mark of its own
    peak: the encoder's activations and the decoder's caches never reuse each other's memory.
    One shared arena, created with one initial region large enough for a batch's working set
    rather than regions doubling as it grows (where fragments pile up), lowered the peak RSS
    of the opus-mt-base-sized model over the compare cases from 667 to 616 MiB (fp32) and
    from 438 to 434 MiB (int8), at the same speed (256 MiB initial: 633 / 443; each the same
    in repeated runs). The region is address space: only the pages used count in the RSS.
    """
    global _shared_arena_registered
    with _shared_arena_lock:
        if _shared_arena_registered:
            return
        memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                   ort.OrtMemType.DEFAULT)
        # (max_mem 0: no limit, extend strategy 0: next power of two, initial chunk,
        #  max_dead_bytes_per_chunk -1: the default)
        config = ort.OrtArenaCfg(0, 0, SHARED_ARENA_INITIAL_BYTES, -1)
        ort.create_and_register_allocator(memory, config)
        _shared_arena_registered = True


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
    ) -> None:
        """device_cache: keep the KV cache as OrtValues on the device (default: on CUDA)."""
        self.directory = Path(artifacts_dir)
        self.manifest = Manifest.load(self.directory)
        self.config = cfg = self.manifest.config
        self.tokenizer = Tokenizer(self.directory, self.manifest.tokenizer)
        self.device = device
        self.device_kind, self.device_index = parse_device(device)
        session_args = dict(device=device, intra_op_threads=intra_op_threads,
                            inter_op_threads=inter_op_threads, optimization=optimization,
                            allow_spinning=allow_spinning)
        # read before ONNX Runtime opens them: their external data must lie in the directory
        encoder_facts = _graph_facts(self.directory / self.manifest.encoder_file,
                                     self.directory)
        decoder_facts = _graph_facts(self.directory / self.manifest.decoder_file,
                                     self.directory)
        self.encoder = _load_graph(self.directory / self.manifest.encoder_file, session_args)
        self.decoder = _load_graph(self.directory / self.manifest.decoder_file, session_args)
        self.float_dtype = np.float16 if self.manifest.dtype == "fp16" else np.float32
        self.encoder_inputs, self.encoder_outputs = encoder_io(cfg.decoder_layers)
        self.decoder_inputs, self.decoder_outputs = decoder_io(cfg.decoder_layers)
        # the optional outputs of graph revision 2; older exports run without them
        graph_outputs = {output.name for output in self.decoder.get_outputs()}
        self.top_outputs = [name for name in TOP_OUTPUTS if name in graph_outputs]
        if len(self.top_outputs) != len(TOP_OUTPUTS):
            self.top_outputs = []
        self.layers = cfg.decoder_layers
        self._past_names = self.decoder_inputs[4 : 4 + 2 * self.layers]
        self._cross_names = self.decoder_inputs[4 + 2 * self.layers :]
        # the decoder takes cross K/V with one row per group of G rows (a sentence's beams)
        revision = self.manifest.provenance.get("graph_revision", 1)
        self.grouped_cross = revision >= GROUPED_CROSS_REVISION
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = cfg.eos_token_id
        self.pad_token_id = cfg.pad_token_id
        self.decoder_start_token_id = cfg.decoder_start_token_id
        self.max_target_positions = cfg.max_target_positions
        self.max_source_positions = cfg.max_source_positions
        self.device_cache = self.device_kind == "cuda" if device_cache is None else device_cache
        self.cache_ops = None
        if self.device_cache:
            from tfserve.cache_ops import DeviceCacheOps

            self.cache_ops = DeviceCacheOps(2 * self.layers, self.float_dtype, self.device_kind,
                                            self.device_index, self.decoder.get_providers())
        self._check_against_graphs(encoder_facts, decoder_facts)

    def _check_against_graphs(self, encoder_facts: GraphFacts,
                              decoder_facts: GraphFacts) -> None:
        """Refuse, naming the field, its value and the graph's figure, a manifest that claims
        what its graphs do not take, instead of failing requests later (or, on CUDA, where an
        out-of-range position is not an error, answering from garbage).

        From the loaded graphs' inputs and outputs: the layers (the names), heads, head dim and
        float type (past_key_0 [B,H,P,Dh]), the vocabulary (logits [B,T,V]). From the files:
        the position tables (RotaryEmbedding cos/sin caches, sinusoidal or learned tables)
        bound max_source_positions and max_target_positions; graphs that compute positions
        (fp16 RoPE) have no bound. Then one decoder step at the last target position runs,
        which proves that the graphs run together and, on CPU, that the position is taken.
        """
        where = self.directory / MANIFEST_FILE
        cfg = self.config
        files = {"encoder": self.manifest.encoder_file, "decoder": self.manifest.decoder_file}
        expected = {"encoder": (self.encoder_inputs, self.encoder_outputs),
                    "decoder": (self.decoder_inputs, self.decoder_outputs)}
        for graph, loaded in (("encoder", self.encoder), ("decoder", self.decoder)):
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
        past = next(v for v in self.decoder.get_inputs() if v.name == "past_key_0")
        heads, head_dim = past.shape[1], past.shape[3]  # [B,H,P,Dh]
        if isinstance(heads, int) and heads != cfg.num_heads:
            raise ValueError(f"{where}: model.num_heads is {cfg.num_heads}, but "
                             f"{files['decoder']}'s past_key_0 has {heads} heads")
        if isinstance(head_dim, int) and head_dim != cfg.head_dim:
            raise ValueError(f"{where}: model.d_model {cfg.d_model} / num_heads "
                             f"{cfg.num_heads} is a head dim of {cfg.head_dim}, but "
                             f"{files['decoder']}'s past_key_0 has {head_dim}")
        float_type = "tensor(float16)" if self.manifest.dtype == "fp16" else "tensor(float)"
        if past.type != float_type:
            raise ValueError(f"{where}: dtype is {self.manifest.dtype}, but "
                             f"{files['decoder']}'s past_key_0 is {past.type}")
        logits = next(v for v in self.decoder.get_outputs() if v.name == "logits")
        vocab = logits.shape[-1]  # [B,T,V]
        if isinstance(vocab, int) and vocab != cfg.vocab_size:
            raise ValueError(f"{where}: model.vocab_size is {cfg.vocab_size}, but the decoder "
                             f"graph's logits have {vocab} entries ({files['decoder']})")
        if self.tokenizer.vocab_size > cfg.vocab_size:
            name = self.manifest.tokenizer.vocab or self.manifest.tokenizer.source
            raise ValueError(f"{where}: model.vocab_size is {cfg.vocab_size}, but the "
                             f"tokenizer ({name}) has {self.tokenizer.vocab_size} ids")
        for graph, facts, field_name, limit in (
                ("encoder", encoder_facts, "max_source_positions", cfg.max_source_positions),
                ("decoder", decoder_facts, "max_target_positions", cfg.max_target_positions)):
            tables = facts.position_tables()
            if not tables:
                continue
            table, rows = min(tables, key=lambda item: item[1])
            if limit > rows:
                takes = (f"the encoder graph cannot take {limit} tokens" if graph == "encoder"
                         else f"the decoder graph cannot take position {limit - 1}")
                raise ValueError(f"{where}: model.{field_name} is {limit}, but {takes}: "
                                 f"{files[graph]}'s position table {table!r} has {rows} rows")
        self._run_once(files)

    def _run_once(self, files: dict[str, str]) -> None:
        """Encode one token and decode one step at the last target position."""
        where = self.directory / MANIFEST_FILE
        cfg = self.config
        input_ids = np.array([[cfg.eos_token_id]], np.int64)  # [1,1]
        try:
            _, cross = self.encode(input_ids, np.ones_like(input_ids))
        except Exception as exc:  # onnxruntime's own classes too
            raise ValueError(f"{self.directory / files['encoder']}: the encoder graph does "
                             f"not run ({_first_line(exc)})") from None
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

    def describe(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "providers": self.decoder.get_providers(),
            "intra_op_threads": self.decoder.get_session_options().intra_op_num_threads,
            "dtype": self.manifest.dtype,
            "quantization": self.manifest.quantization,
        }

    # -- encoder ----------------------------------------------------------------------------

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray,
                                                                                 list[Any]]:
        """-> encoder hidden states [B,S,D] (numpy) and cross K/V [k_0, v_0, ...] [B,H,S,Dh]."""
        feeds = {"input_ids": _int64(input_ids), "attention_mask": _int64(attention_mask)}
        if self.device_cache:
            binding = self.encoder.io_binding()
            for name, value in feeds.items():
                binding.bind_cpu_input(name, value)
            binding.bind_output("encoder_hidden_states", "cpu")
            for name in self.encoder_outputs[1:]:
                binding.bind_output(name, self.device_kind, self.device_index)
            self.encoder.run_with_iobinding(binding)
            outputs = binding.get_outputs()
            return outputs[0].numpy(), list(outputs[1:])
        hidden, *cross = self.encoder.run(self.encoder_outputs, feeds)
        return hidden, cross

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
    ) -> StepOutput:
        """One step -> logits float32 [B,T,V], the present cache [k_0, v_0, ...] and the
        graph's top candidates when it has them (graph revision 2)."""
        small = {
            "input_ids": _int64(input_ids),
            "position_ids": _int64(position_ids),
            "self_attention_mask": _int64(self_attention_mask),
            "encoder_attention_mask": _int64(encoder_attention_mask),
        }
        past_names, cross_names = self._past_names, self._cross_names
        if self.device_cache:
            binding = self.decoder.io_binding()
            for name, value in small.items():
                binding.bind_cpu_input(name, value)
            for name, value in zip(past_names + cross_names, list(past) + list(cross)):
                binding.bind_ortvalue_input(name, self._device_value(value))
            binding.bind_output("logits", "cpu")
            for name in self.decoder_outputs[1:]:
                binding.bind_output(name, self.device_kind, self.device_index)
            for name in self.top_outputs:
                binding.bind_output(name, "cpu")
            self.decoder.run_with_iobinding(binding)
            outputs = binding.get_outputs()
            cache_end = len(self.decoder_outputs)
            return StepOutput(outputs[0].numpy().astype(np.float32, copy=False),
                              list(outputs[1:cache_end]),
                              *[value.numpy() for value in outputs[cache_end:]])
        feeds = dict(small)
        feeds.update(zip(past_names, past))
        feeds.update(zip(cross_names, cross))
        logits, *rest = self.decoder.run(self.decoder_outputs + self.top_outputs, feeds)
        cache_end = len(self.decoder_outputs) - 1
        return StepOutput(logits.astype(np.float32, copy=False), rest[:cache_end],
                          *rest[cache_end:])

    # -- cache rows (generation.Backend) ----------------------------------------------------
    # numpy arrays on the host; OrtValues on the device with device_cache (tfserve.cache_ops)

    def _device_value(self, value: Any) -> ort.OrtValue:
        if isinstance(value, ort.OrtValue):
            return value
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), self.device_kind,
                                                self.device_index)

    def _device(self, cache: Sequence[Any]) -> list[ort.OrtValue]:
        return [self._device_value(v) for v in cache]

    def empty_past(self, rows: int) -> list[Any]:
        shape = (rows, self.config.num_heads, 0, self.config.head_dim)  # [B,H,0,Dh]
        empty = [np.zeros(shape, self.float_dtype) for _ in range(2 * self.layers)]
        return self._device(empty) if self.cache_ops else empty

    def _each(self, fn: Callable[[Any], np.ndarray], cache: Sequence[Any],
              nbytes: int | None = None) -> list[np.ndarray]:
        """fn over every tensor of a cache; nbytes: the data moved, when `cache` is not the
        tensors themselves."""
        # one tensor per thread: numpy releases the GIL while copying, and the fresh pages of
        # 2L new arrays fault in in parallel (3-4x faster on 2 cores). Small caches stay on
        # this thread: handing them to the pool costs more than the copies (a demo-sized join
        # of 4 rows into 28: 1.1 ms in a loop, 2.6 ms through the pool)
        if nbytes is None:
            nbytes = sum(t.nbytes for t in cache)
        if nbytes < POOL_MIN_BYTES:
            return [fn(t) for t in cache]
        return list(numpy_pool().map(fn, cache))

    def take_rows(self, cache: Sequence[Any], index: np.ndarray, reuse: bool = False
                  ) -> list[Any]:
        if self.cache_ops:
            return self.cache_ops.take(self._device(cache), index)
        rows = cache[0].shape[0] if len(cache) else 0
        if reuse and len(index) == rows and all(t.flags.writeable for t in cache):
            # a beam step keeps the row count and most rows keep their own history: copy only
            # the rows whose parent is another row, in place (t[src] is gathered before the
            # write, so overlapping moves are safe). Measured on beam 4 x 32 rows of an
            # opus-mt-base-sized model: 8% faster per step than gathering every row anew.
            moved = np.flatnonzero(index != np.arange(rows))
            src = index[moved]

            def move(t: np.ndarray) -> np.ndarray:
                t[moved] = t[src]
                return t

            return self._each(move, cache) if len(moved) else list(cache)
        return self._each(lambda t: t[index], cache)  # fancy indexing: faster than np.take

    def concat_rows(self, caches: Sequence[Sequence[Any]], length: int | None = None,
                    left: bool = False, first_rows: np.ndarray | None = None,
                    first_time: tuple[int, int] | None = None) -> list[Any]:
        if (first_rows is not None or first_time is not None) and (self.cache_ops
                                                                    or length is None):
            caches = narrow_first(self, caches, first_rows, first_time)
            first_rows = first_time = None
        if self.cache_ops:
            if length is not None:
                caches = [self.pad_time(cache, length, left) for cache in caches]
            joined = self._device(caches[0])
            for other in caches[1:]:
                joined = self.cache_ops.concat(joined, self._device(other))
            return joined
        if length is None:
            return self._each(lambda i: np.concatenate([c[i] for c in caches], axis=0),
                              range(len(caches[0])), sum(t.nbytes for c in caches for t in c))

        counts = [c[0].shape[0] if len(c) else 0 for c in caches]
        if first_rows is not None:
            counts[0] = len(first_rows)

        def stack(i: int) -> np.ndarray:
            # one pass: each part copied into its rows (the first cache's `first_rows` only),
            # only the padding zeroed (padding first and stacking after copied the whole
            # cache twice)
            first = caches[0][i]
            out = np.empty((sum(counts), first.shape[1], length, first.shape[3]), first.dtype)
            row = 0
            for part_index, cache in enumerate(caches):
                part = cache[i]
                if part_index == 0 and first_time is not None:
                    part = part[:, :, first_time[0]:first_time[1]]  # a view: copied below
                if part.dtype != out.dtype or part.shape[2] > length:
                    raise ValueError(f"concat_rows: a {part.dtype} part of length "
                                     f"{part.shape[2]} cannot join {out.dtype} rows of "
                                     f"length {length}")
                end = row + counts[part_index]
                _place(out[row:end], part, left, first_rows if part_index == 0 else None)
                row = end
            return out

        nbytes = sum(t.nbytes for c in caches for t in c)
        return self._each(stack, range(len(caches[0])), nbytes)

    def pad_time(self, cache: Sequence[Any], length: int, left: bool) -> list[Any]:
        if self.cache_ops:
            cache = self._device(cache)
            extra = length - cache[0].shape()[2]
            return self.cache_ops.pad_time(cache, extra, left) if extra > 0 else cache

        def pad(t: np.ndarray) -> np.ndarray:
            if t.shape[2] >= length:
                return t
            # one slice copy and the padding zeroed: several times faster than np.pad here
            out = np.empty((t.shape[0], t.shape[1], length, t.shape[3]), t.dtype)
            _place(out, t, left)
            return out

        return self._each(pad, cache)

    def slice_time(self, cache: Sequence[Any], start: int, stop: int) -> list[Any]:
        if self.cache_ops:
            return self.cache_ops.slice_time(self._device(cache), start, stop)
        return self._each(lambda t: np.ascontiguousarray(t[:, :, start:stop]), cache)


def _place(out: np.ndarray, part: np.ndarray, left: bool, rows: np.ndarray | None = None
           ) -> None:
    """Write part [N,H,p,Dh] (or its `rows`) into out [N,H,length,Dh] (p <= length) on the
    left or the right of the time axis, and zero the rest of it."""
    p = part.shape[2]
    extra = out.shape[2] - p
    target = out[:, :, extra:] if left else out[:, :, :p]
    if rows is None:
        target[...] = part
    else:
        np.take(part, rows, axis=0, out=target)  # gathered straight into place
    if left:
        out[:, :, :extra] = 0
    else:
        out[:, :, p:] = 0


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


def _load_graph(path: Path, session_args: dict[str, Any]) -> ort.InferenceSession:
    """make_session, with ONNX Runtime's load errors (empty, truncated or foreign files,
    missing external data) as one ValueError naming the file."""
    try:
        return make_session(path, **session_args)
    except RuntimeError as exc:
        if "device 'cuda'" in str(exc):
            raise  # the device's own message
        raise ValueError(f"{path}: not a loadable ONNX graph ({_first_line(exc)})") from None
    except Exception as exc:  # onnxruntime's own classes (InvalidProtobuf, Fail, ...)
        raise ValueError(f"{path}: not a loadable ONNX graph ({_first_line(exc)})") from None


def default_threads() -> int:
    """Intra-op threads when none are given: the cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
