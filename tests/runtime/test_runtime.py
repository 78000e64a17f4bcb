"""Runtime + generation: backends agree, beam search is exact on a tiny vocabulary,
batch invariance, sampling, options, the Translator API and the CLI."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from tests.exported import artifacts, demo_artifacts, demo_trained, eager_model
from tfserve.artifacts.model_config import ModelConfig
from tfserve.generation import DecodingOptions, filter_logits, log_softmax
from tfserve.generation.batch import generate
from tfserve.model import Seq2SeqTransformer
from tfserve.model.eager import EagerBackend
from tfserve.runtime import Runtime, parse_device
from tfserve.translator import Translator

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


def mixed_batch(runtime: Runtime, lengths: list[int], seed: int = 0):
    rng = np.random.default_rng(seed)
    sources = [rng.integers(3, runtime.vocab_size, size=n).tolist() + [runtime.eos_token_id]
               for n in lengths]
    return sources, runtime.tokenizer.pad_batch(sources)


def joining(runtime: Runtime, sources: list[list[int]], rows: list[int],
            options: DecodingOptions | list[DecodingOptions]):
    """Sources `rows` encoded in one run, each a fresh search (with `options`, or with
    `options[row]`) tagged by its row: what joins a DecodeBatch."""
    from tfserve.generation import make_search
    from tfserve.generation.batch import Joining

    ids, mask = runtime.tokenizer.pad_batch([sources[r] for r in rows])
    _, cross = runtime.encode(ids, mask)
    searches = [make_search(options[r] if isinstance(options, list) else options,
                            runtime.eos_token_id, runtime.decoder_start_token_id) for r in rows]
    return Joining(searches, rows, cross, mask)


def assert_same(ref, got, what: str, atol: float = 1e-4) -> None:
    assert len(ref) == len(got), what
    for i, (r, g) in enumerate(zip(ref, got)):
        assert [h.token_ids for h in r] == [h.token_ids for h in g], f"{what}: source {i}"
        for hr, hg in zip(r, g):
            assert abs(hr.score - hg.score) <= atol, f"{what}: source {i}: {hr.score} {hg.score}"


@pytest.mark.parametrize("positions", ["sinusoidal", "rope", "learned"])
@pytest.mark.parametrize("num_beams", [1, 4])
def test_backends_agree_on_random_models(positions: str, num_beams: int) -> None:
    runtime = Runtime(artifacts(positions, "pre"))
    eager = EagerBackend(eager_model(positions, "pre"))
    _, (ids, mask) = mixed_batch(runtime, [3, 9, 1, 6])
    options = DecodingOptions(max_new_tokens=12, num_beams=num_beams,
                              num_return_sequences=min(2, num_beams))
    assert_same(generate(eager, ids, mask, options), generate(runtime, ids, mask, options),
                f"{positions} beams={num_beams}")


@pytest.mark.skipif(not demo_trained(), reason="demo checkpoint not trained yet")
def test_backends_agree_on_demo_beam() -> None:
    from tfserve.demo import CHECKPOINT_DIR
    from tfserve.model import load_checkpoint

    runtime = Runtime(demo_artifacts())
    eager = EagerBackend(load_checkpoint(CHECKPOINT_DIR))
    texts = (CHECKPOINT_DIR / "samples.txt").read_text().splitlines()[:24]
    ids, mask = runtime.tokenizer.pad_batch([runtime.tokenizer.encode(t) for t in texts])
    options = DecodingOptions(max_new_tokens=40, num_beams=4, num_return_sequences=2)
    assert_same(generate(eager, ids, mask, options), generate(runtime, ids, mask, options), "demo")


# -- beam search against exhaustive search ----------------------------------------------------


def exhaustive(model: Seq2SeqTransformer, source: list[int], max_len: int, length_penalty: float,
               banned: set[int]) -> list[tuple[list[int], float]]:
    """Every output up to max_len tokens, scored as documented, best first."""
    cfg = model.config
    ids = torch.tensor([source])
    mask = torch.ones_like(ids)
    results = []
    tokens = [t for t in range(cfg.vocab_size) if t not in banned and t != cfg.eos_token_id]

    def logprobs(prefix: list[int]) -> np.ndarray:
        with torch.no_grad():
            dec = torch.tensor([[cfg.decoder_start_token_id] + prefix])
            logits = model(ids, mask, dec)[0, -1].numpy().astype(np.float32)
        logprobs = log_softmax(logits[None])[0]
        logprobs[list(banned)] = -np.inf  # banned after the softmax, as the search does
        return logprobs

    for length in range(0, max_len + 1):
        for prefix in itertools.product(tokens, repeat=length):
            prefix = list(prefix)
            total = sum(float(logprobs(prefix[:i])[t]) for i, t in enumerate(prefix))
            if length < max_len:  # finishes with eos at position length + 1
                done = total + float(logprobs(prefix)[cfg.eos_token_id])
                results.append((prefix, done / (length + 1) ** length_penalty))
            else:  # cut by max_new_tokens
                results.append((prefix, total / length ** length_penalty))
    return sorted(results, key=lambda r: -r[1])


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_beam_search_matches_exhaustive_search(length_penalty: float) -> None:
    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=6, d_model=16, num_heads=2, encoder_layers=1, decoder_layers=1,
                      ffn_dim=32, positions="rope", max_source_positions=16,
                      max_target_positions=16)
    model = Seq2SeqTransformer(cfg).eval()
    with torch.no_grad():  # sharpen the distributions so ranks are well separated
        model.shared.weight.mul_(8.0)
    source = [3, 4, 5, 1]
    max_len = 3
    expected = exhaustive(model, source, max_len, length_penalty, banned={cfg.pad_token_id})
    options = DecodingOptions(max_new_tokens=max_len, num_beams=16, num_return_sequences=16,
                              length_penalty=length_penalty)
    got = generate(EagerBackend(model), np.array([source]), np.ones((1, 4), np.int64),
                   options)[0]
    assert len(got) == 16
    assert [h.token_ids for h in got] == [tokens for tokens, _ in expected[:16]], \
        f"length_penalty={length_penalty}"
    for hyp, (_, score) in zip(got, expected):
        assert abs(hyp.score - score) < 1e-4


def test_length_penalty_and_n_best_as_documented() -> None:
    """score = sum of token log-probs (eos included) / length ** length_penalty."""
    model = eager_model("rope", "pre")
    backend = EagerBackend(model)
    source = [5, 9, 14, 1]
    ids, mask = np.array([source]), np.ones((1, 4), np.int64)
    for length_penalty in (0.6, 2.0):
        hyps = generate(backend, ids, mask, DecodingOptions(
            max_new_tokens=10, num_beams=5, num_return_sequences=3,
            length_penalty=length_penalty))[0]
        assert len(hyps) == 3
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        for hyp in hyps:
            tokens = hyp.token_ids + ([1] if hyp.finished else [])
            with torch.no_grad():
                dec = torch.tensor([[0] + tokens[:-1]])
                logits = model(torch.tensor(ids), torch.tensor(mask), dec)[0].numpy()
            logprobs = log_softmax(logits)
            total = sum(float(logprobs[i, t]) for i, t in enumerate(tokens))
            assert abs(hyp.score - total / len(tokens) ** length_penalty) < 1e-4


# -- batch invariance ---------------------------------------------------------------------------


# one of each search, for the tests that must hold whatever the search
EVERY_SEARCH = pytest.mark.parametrize("options", [
    DecodingOptions(max_new_tokens=10),
    DecodingOptions(max_new_tokens=10, num_beams=3, num_return_sequences=2),
    DecodingOptions(max_new_tokens=10, do_sample=True, seed=11, top_k=20,
                    num_return_sequences=2),
], ids=["greedy", "beam", "sample"])


@EVERY_SEARCH
def test_batch_invariance(options: DecodingOptions) -> None:
    runtime = Runtime(artifacts("sinusoidal", "pre"))
    sources, (ids, mask) = mixed_batch(runtime, [7, 2, 12, 4, 1], seed=5)
    batched = generate(runtime, ids, mask, options)
    for i, source in enumerate(sources):
        alone = generate(runtime, np.array([source]), np.ones((1, len(source)), np.int64),
                         options)
        assert_same(alone, [batched[i]], f"source {i} alone vs batched", atol=1e-5)


# -- sampling -----------------------------------------------------------------------------------


def test_sampling_is_reproducible_and_top_k_1_is_greedy() -> None:
    runtime = Runtime(artifacts("rope", "pre"))
    _, (ids, mask) = mixed_batch(runtime, [5, 8, 3])
    sample = DecodingOptions(max_new_tokens=12, do_sample=True, seed=1234, temperature=1.3,
                             num_return_sequences=3)
    first, second = generate(runtime, ids, mask, sample), generate(runtime, ids, mask, sample)
    assert_same(first, second, "same seed", atol=0.0)
    other = generate(runtime, ids, mask, DecodingOptions(**{**sample.__dict__, "seed": 99}))
    assert [h.token_ids for r in first for h in r] != [h.token_ids for r in other for h in r]
    greedy = generate(runtime, ids, mask, DecodingOptions(max_new_tokens=12))
    top1 = generate(runtime, ids, mask, DecodingOptions(max_new_tokens=12, do_sample=True,
                                                        top_k=1, seed=5, temperature=0.7))
    assert [r[0].token_ids for r in greedy] == [r[0].token_ids for r in top1]


@pytest.mark.parametrize("top_p, temperature", [(1.0, 1.0), (0.7, 1.4)])
def test_top_k_sampling_from_the_graphs_candidates_equals_whole_rows(
        top_p: float, temperature: float) -> None:
    """Top-k sampling decides from the graph's top candidates (no logits row fetched), and
    draws the same samples as from whole rows with the same seed."""
    runtime = Runtime(artifacts("rope", "pre"))
    _, (ids, mask) = mixed_batch(runtime, [5, 8, 3, 6])
    options = DecodingOptions(max_new_tokens=12, do_sample=True, seed=77, top_k=10,
                              top_p=top_p, temperature=temperature, num_return_sequences=2)
    asked: list[bool] = []  # need_logits of each step
    step = runtime.step
    runtime.step = lambda *args, **kwargs: (  # type: ignore[method-assign]
        asked.append(kwargs.get("need_logits", True)) or step(*args, **kwargs))
    candidates = generate(runtime, ids, mask, options)
    assert asked and not any(asked)
    rows = generate(runtime, ids, mask, options, use_top_candidates=False)
    assert_same(candidates, rows, "candidates vs whole rows", atol=1e-5)


def test_top_p_filters_as_specified() -> None:
    probs = np.array([[0.5, 0.3, 0.15, 0.05]])
    logits = np.log(probs)
    kept = lambda p: np.isfinite(filter_logits(logits, 0, p))[0].tolist()  # noqa: E731
    assert kept(0.8) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert kept(0.81) == [True, True, True, False]
    assert kept(0.1) == [True, False, False, False]  # the most likely token always stays
    assert kept(1.0) == [True, True, True, True]
    assert np.isfinite(filter_logits(logits, 2, 1.0))[0].tolist() == [True, True, False, False]


def test_sampled_tokens_stay_inside_the_nucleus() -> None:
    runtime = Runtime(artifacts("rope", "pre"))
    _, (ids, mask) = mixed_batch(runtime, [4])
    _, cross = runtime.encode(ids, mask)
    logits, _ = runtime.step(np.array([[0]]), np.array([[0]]), np.ones((1, 1), np.int64),
                             mask, runtime.empty_past(1), cross)[:2]
    first = logits[0, -1].copy()
    first[0] = -np.inf
    allowed = set(np.flatnonzero(np.isfinite(filter_logits(first[None], 0, 0.5))[0]).tolist())
    seen = set()
    for seed in range(40):
        hyp = generate(runtime, ids, mask, DecodingOptions(max_new_tokens=1, do_sample=True,
                                                           top_p=0.5, seed=seed))[0][0]
        seen.add(hyp.token_ids[0] if hyp.token_ids else 1)
    assert seen <= allowed, f"sampled {seen - allowed} outside the top_p=0.5 nucleus {allowed}"


def test_min_and_max_new_tokens() -> None:
    runtime = Runtime(artifacts("rope", "pre"))
    _, (ids, mask) = mixed_batch(runtime, [5, 2])
    for beams in (1, 3):
        hyps = generate(runtime, ids, mask, DecodingOptions(max_new_tokens=6, min_new_tokens=6,
                                                            num_beams=beams))
        for hyp in (r[0] for r in hyps):
            assert len(hyp.token_ids) == 6 and not hyp.finished


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,needle", [
    (dict(num_beams=0), "num_beams"),
    (dict(num_beams=17), "num_beams"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=10_000), "max_new_tokens"),
    (dict(min_new_tokens=9, max_new_tokens=4), "min_new_tokens"),
    (dict(top_k=-1), "top_k"),
    (dict(colour="blue"), "colour"),
])
def test_translator_rejects_bad_options(overrides: dict, needle: str) -> None:
    translator = Translator(artifacts("rope", "pre"))
    with pytest.raises(ValueError, match=needle):
        translator.translate(["seven"], **overrides)


def test_translator_rejects_bad_texts_and_truncates_on_request() -> None:
    translator = Translator(artifacts("rope", "pre"))
    with pytest.raises(ValueError, match="must not be empty"):
        translator.translate([])
    with pytest.raises(ValueError, match=r"texts\[1\] is empty"):
        translator.translate(["seven", "  "])
    with pytest.raises(ValueError, match="list of strings"):
        translator.translate("seven")
    long_text = " ".join(["seven hundred"] * 200)
    with pytest.raises(ValueError, match=r"texts\[0\] is \d+ tokens, over the limit of 300"):
        translator.translate([long_text], max_new_tokens=2)
    assert len(translator.translate([long_text], max_new_tokens=2, truncate=True)) == 1


def test_encode_pools_the_hidden_states() -> None:
    translator = Translator(artifacts("rope", "pre"))
    eager = Translator.from_backend(EagerBackend(eager_model("rope", "pre")),
                                    translator.tokenizer)
    texts = ["seven", "three hundred and forty-two thousand"]
    for pooling in ("mean", "max", "first"):
        got = translator.encode(texts, pooling=pooling)
        ref = eager.encode(texts, pooling=pooling)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g.embedding, r.embedding, atol=1e-4)
            np.testing.assert_allclose(g.hidden_states, r.hidden_states, atol=1e-4)
    mean = translator.encode(texts)[1]
    np.testing.assert_allclose(mean.embedding, mean.hidden_states.mean(0), atol=1e-5)
    with pytest.raises(ValueError, match="pooling"):
        translator.encode(texts, pooling="sum")


def test_device_strings() -> None:
    assert parse_device("cpu") == ("cpu", 0)
    assert parse_device("cuda:3") == ("cuda", 3)
    with pytest.raises(ValueError, match="device"):
        parse_device("tpu")
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="onnxruntime-gpu"):
            Runtime(artifacts("rope", "pre"), device="cuda")


def test_serving_path_does_not_import_torch() -> None:
    code = ("import sys, tfserve.runtime, tfserve.translator, tfserve.generation, "
            "tfserve.generation.batch, tfserve.text.tokenizer, tfserve.artifacts.manifest; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu and a CUDA device")
def test_cuda_matches_cpu() -> None:
    cpu = Runtime(artifacts("rope", "pre"))
    cuda = Runtime(artifacts("rope", "pre"), device="cuda")
    _, (ids, mask) = mixed_batch(cpu, [5, 9, 2])
    # ONNX Runtime's CUDA provider runs fp32 MatMuls in TF32 (its use_tf32 default): a
    # token's log-probability moves by ~5e-4 (measured on an H100: 0.005 over 12 tokens)
    for options in (DecodingOptions(max_new_tokens=12),
                    DecodingOptions(max_new_tokens=12, num_beams=4)):
        assert_same(generate(cpu, ids, mask, options), generate(cuda, ids, mask, options),
                    "cuda vs cpu", atol=2e-2)


# -- the CLI ------------------------------------------------------------------------------------


def run_cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TFSERVE_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "tfserve", *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)


@pytest.mark.skipif(not demo_trained(), reason="demo checkpoint not trained yet")
def test_cli_translates_the_demo(tmp_path: Path) -> None:
    phrases = ["three hundred and forty-two", "seven", "twenty-one thousand and one"]
    result = run_cli("translate", *phrases, cache=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["trois cent quarante-deux", "sept",
                                          "vingt et un mille un"]
    result = run_cli("translate", "--beams", "4", "--n-best", "2", "--scores", "seven",
                     cache=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and lines[0].endswith("\tsept")


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    model = str(artifacts("rope", "pre"))
    for args, needle in ((["--beams", "0", "x"], "num_beams"),
                         (["--top-p", "2", "x"], "top_p"),
                         (["--model", str(tmp_path / "missing"), "x"], "missing"),
                         (["--device", "tpu", "x"], "device")):
        full = ["translate", *args] if "--model" in args else ["translate", "--model", model,
                                                                 *args]
        result = run_cli(*full, cache=tmp_path)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (args, result.stderr)


# -- the device-resident cache path (what runs on CUDA), checked with CPU OrtValues -----------


@EVERY_SEARCH
def test_device_cache_path_matches_host_path(options: DecodingOptions) -> None:
    """IO binding + OrtValue cache + on-device row ops give the host path's results."""
    host = Runtime(artifacts("rope", "pre"))
    device = Runtime(artifacts("rope", "pre"), device_cache=True)
    assert isinstance(device.empty_past(1)[0], ort.OrtValue)
    _, (ids, mask) = mixed_batch(host, [6, 2, 9])
    assert_same(generate(host, ids, mask, options), generate(device, ids, mask, options),
                "device cache vs host", atol=1e-5)


def test_device_cache_rows_join_a_running_batch() -> None:
    """Continuous batching on the device path: pad + concat when rows join mid-decode."""
    from tfserve.generation.batch import DecodeBatch

    results = {}
    for name, runtime in (("host", Runtime(artifacts("sinusoidal", "pre"))),
                          ("device", Runtime(artifacts("sinusoidal", "pre"), device_cache=True))):
        sources, (ids, mask) = mixed_batch(runtime, [5, 3, 8, 2], seed=9)
        batch = DecodeBatch(runtime)
        options = DecodingOptions(max_new_tokens=8, num_beams=2).validate(100)
        out: dict[int, list] = {}

        def join(rows: list[int], runtime=runtime, batch=batch, options=options,
                 sources=sources) -> None:
            batch.join([joining(runtime, sources, rows, options)])

        join([0, 1])
        for step in range(20):
            if step == 2:
                join([2, 3])  # joins with holes in front of its history
            for tag, search in batch.step():
                out[tag] = [h.token_ids for h in search.results()]
            if not len(batch) and step > 2:
                break
        results[name] = out
    assert results["host"] == results["device"]


@pytest.mark.parametrize("device_cache", [False, True], ids=["host", "device"])
def test_several_encoder_runs_join_at_once(device_cache: bool) -> None:
    """DecodeBatch.join of several encoder runs (different source lengths, into an empty and
    into a running batch) decodes every source as if it were alone."""
    from tfserve.generation.batch import DecodeBatch, Joining

    runtime = Runtime(artifacts("rope", "pre"), device_cache=device_cache)
    sources, _ = mixed_batch(runtime, [5, 3, 9, 2, 7, 4], seed=4)
    options = DecodingOptions(max_new_tokens=8, num_beams=2).validate(100)
    alone = {}
    for tag, source in enumerate(sources):
        ids, mask = runtime.tokenizer.pad_batch([source])
        alone[tag] = [h.token_ids for h in generate(runtime, ids, mask, options)[0]]

    def group(rows: list[int]) -> Joining:
        return joining(runtime, sources, rows, options)

    batch = DecodeBatch(runtime)
    batch.join([group([0, 1]), group([2])])
    out: dict[int, list] = {}
    for step in range(30):
        if step == 2:
            batch.join([group([3]), group([4, 5])])
        for tag, search in batch.step():
            out[tag] = [h.token_ids for h in search.results()]
        if not len(batch) and step > 2:
            break
    assert out == alone


# -- the decoder graph's top candidates (graph revision 2) ------------------------------------


@pytest.mark.parametrize("options", [
    DecodingOptions(max_new_tokens=10),
    DecodingOptions(max_new_tokens=10, min_new_tokens=6),
    DecodingOptions(max_new_tokens=10, num_beams=3, num_return_sequences=2),
    DecodingOptions(max_new_tokens=10, min_new_tokens=7, num_beams=16, num_return_sequences=3,
                    length_penalty=0.5),
], ids=["greedy", "greedy-min", "beam", "beam16-min"])
@pytest.mark.parametrize("favour_specials", [False, True], ids=["plain", "pad-eos-favoured"])
def test_graph_top_candidates_match_the_full_logits(options: DecodingOptions,
                                                    favour_specials: bool) -> None:
    """Greedy and beam rows decided from the graph's top_log_probs/top_ids give the tokens,
    and within float rounding the scores, of the search over the full logits (which is also
    how artifacts exported before graph revision 2 decode). 16 beams need all 34 candidates
    when pad and eos are both banned."""
    model = artifacts("sinusoidal", "pre", favour_specials=favour_specials)
    with_top = Runtime(model)
    assert with_top.top_outputs == ["top_log_probs", "top_ids"]
    without = Runtime(model)
    without.top_outputs = []
    _, (ids, mask) = mixed_batch(with_top, [6, 2, 9, 4], seed=3)
    out = with_top.step(ids[:, :1], np.zeros((4, 1), np.int64), np.ones((4, 1), np.int64), mask,
                        with_top.empty_past(4), with_top.encode(ids, mask)[1])
    assert out.top_ids is not None and out.top_ids.shape == (4, 1, 34)
    expected = generate(without, ids, mask, options)
    assert_same(expected, generate(with_top, ids, mask, options), "candidates vs full logits",
                atol=1e-5)
    if favour_specials:  # the bans decided: pad never appears, eos not before the minimum
        produced = [t for per_source in expected for h in per_source for t in h.token_ids]
        assert with_top.pad_token_id not in produced
        assert all(len(h.token_ids) >= options.min_new_tokens for r in expected for h in r)


def test_graph_top_candidates_equal_eager_ones() -> None:
    """The exported LogSoftmax + TopK give the eager backend's candidates (same ids, sorted,
    log-probabilities within 1e-5)."""
    runtime = Runtime(artifacts("rope", "pre"))
    eager = EagerBackend(eager_model("rope", "pre"))
    _, (ids, mask) = mixed_batch(runtime, [5, 3], seed=4)
    start = np.full((2, 1), runtime.decoder_start_token_id, np.int64)
    args = (start, np.zeros((2, 1), np.int64), np.ones((2, 1), np.int64), mask)
    got = runtime.step(*args, runtime.empty_past(2), runtime.encode(ids, mask)[1])
    ref = eager.step(*args, eager.empty_past(2), eager.encode(ids, mask)[1])
    assert got.top_ids is not None and ref.top_ids is not None
    assert got.top_log_probs is not None and ref.top_log_probs is not None
    np.testing.assert_array_equal(got.top_ids, ref.top_ids)
    np.testing.assert_allclose(got.top_log_probs, ref.top_log_probs, atol=1e-5)
    assert (np.diff(got.top_log_probs, axis=-1) <= 0).all()  # best first


def test_length_groups_is_the_cheapest_split_within_limits() -> None:
    """Encoder batches: every index once, limits kept, and no contiguous split of the sorted
    lengths is cheaper (brute force over all cut sets of 9 items)."""
    from tfserve.translator import length_groups

    rng = np.random.default_rng(5)
    for _ in range(20):
        lengths = rng.integers(1, 60, size=9).tolist()
        groups = length_groups(lengths, max_rows=4, max_tokens=150, call_tokens=20)
        assert sorted(i for g in groups for i in g) == list(range(9))

        def cost(parts: list, lengths: list[int] = lengths) -> float:
            return sum(len(p) * max(lengths[i] for i in p) + 20 for p in parts)

        for group in groups:
            assert len(group) <= 4 and len(group) * max(lengths[i] for i in group) <= 150
        order = sorted(range(9), key=lambda i: lengths[i])
        best = min(
            cost(parts) for cuts in itertools.product([0, 1], repeat=8)
            for parts in [np.split(np.array(order), [k + 1 for k, c in enumerate(cuts) if c])]
            if all(len(p) <= 4 and len(p) * max(lengths[i] for i in p) <= 150 for p in parts)
        )
        assert cost(groups) == best
    assert length_groups([500, 3], 32, 100) == [[1], [0]]  # one over-long text still runs alone


def test_sessions_share_one_cpu_arena_without_changing_results() -> None:
    """CPU sessions allocate from the process-wide arena; a session with its own arena
    computes the same outputs."""
    from tfserve.runtime import make_session

    model = artifacts("rope", "pre")
    shared = make_session(model / "encoder.onnx")
    own = make_session(model / "encoder.onnx", shared_arena=False)
    options = shared.get_session_options()
    assert options.get_session_config_entry("session.use_env_allocators") == "1"
    with pytest.raises(RuntimeError):  # never set
        own.get_session_options().get_session_config_entry("session.use_env_allocators")
    runtime = Runtime(model)
    _, (ids, mask) = mixed_batch(runtime, [4, 9, 2])
    feeds = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)}
    for a, b in zip(shared.run(None, feeds), own.run(None, feeds)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("device_cache", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_concat_rows_pads_and_stacks_like_pad_then_concatenate(device_cache: bool,
                                                               left: bool) -> None:
    """concat_rows(caches, length, left) == pad_time of each part, then rows stacked."""
    runtime = Runtime(artifacts("rope", "pre"), device_cache=device_cache)
    rng = np.random.default_rng(3)
    tensors = 2 * runtime.layers
    parts = [[rng.standard_normal((rows, 2, time, 4)).astype(np.float32)
              for _ in range(tensors)] for rows, time in ((2, 5), (1, 3), (3, 0), (2, 7))]
    expected = [np.concatenate([np.pad(p[i], ((0, 0), (0, 0), (7 - p[i].shape[2], 0)
                                              if left else (0, 7 - p[i].shape[2]), (0, 0)))
                                for p in parts]) for i in range(tensors)]
    got = runtime.concat_rows(parts, 7, left=left)
    for want, tensor in zip(expected, got, strict=True):
        array = tensor.numpy() if isinstance(tensor, ort.OrtValue) else tensor
        np.testing.assert_array_equal(array, want)
    # first_rows: the first part's rows 1 then 0 only (how a join drops retired rows)
    picked = runtime.concat_rows(parts, 7, left=left, first_rows=np.array([1, 0]))
    for want, tensor in zip(expected, picked, strict=True):
        array = tensor.numpy() if isinstance(tensor, ort.OrtValue) else tensor
        np.testing.assert_array_equal(array, np.concatenate([want[[1, 0]], want[2:]]))
    picked = runtime.concat_rows(parts, 7, left=left, first_rows=np.array([1]))
    assert all(len(t.numpy() if isinstance(t, ort.OrtValue) else t) == 7 for t in picked)
    if not device_cache:
        with pytest.raises(ValueError, match="cannot join"):
            runtime.concat_rows(parts, 6, left=left)  # a part is longer than 6


@pytest.mark.parametrize("device_cache", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("policy", ["default", "until-join", "at-once"])
def test_finished_rows_retire_until_a_compaction(device_cache: bool, policy: str) -> None:
    """Rows of finished searches stay in the batch (retired) until enough of them, or a join,
    make a copy worth it; whenever they leave, every search decodes as if alone. With
    retirement until the join, the running cache is copied only by the join."""
    from tfserve.generation.batch import DecodeBatch, Joining

    runtime = Runtime(artifacts("rope", "pre"), device_cache=device_cache)
    sources, _ = mixed_batch(runtime, [5, 3, 9, 2, 7, 4], seed=6)
    # different lengths, so rows finish on different steps; beams and samples among them
    options = [DecodingOptions(max_new_tokens=n, min_new_tokens=n, **extra).validate(100)
               for n, extra in ((2, {}), (7, {"num_beams": 2}), (4, {}),
                                (9, {"do_sample": True, "seed": 3}), (3, {}), (6, {}))]
    alone = {}
    for tag, (source, opts) in enumerate(zip(sources, options)):
        ids, mask = runtime.tokenizer.pad_batch([source])
        alone[tag] = [h.token_ids for h in generate(runtime, ids, mask, opts)[0]]

    def group(rows: list[int]) -> Joining:
        return joining(runtime, sources, rows, options)

    batch = DecodeBatch(runtime)
    if policy == "until-join":
        batch.RETIRED_SHARE, batch.RETIRED_STEPS = 0, 10**6
    elif policy == "at-once":
        batch.RETIRED_SHARE = 10**6
    compactions = []  # steps where rows left the batch outside a join
    reorder = batch._reorder

    def counting_reorder(index, members, member_index):  # noqa: ANN001, ANN202
        if len(members) < len(batch.slots):
            compactions.append(batch.steps)
        reorder(index, members, member_index)

    batch._reorder = counting_reorder  # type: ignore[method-assign]
    batch.join([group([0, 1, 2, 3])])
    out: dict[int, list] = {}
    for step in range(20):
        if step == 5:
            retired = batch.retired_rows
            live = batch.rows - retired
            batch.join([group([4, 5])])
            assert batch.retired_rows == 0 and batch.rows == live + 2
            if policy == "until-join":
                assert retired == 2 and not compactions  # rows 0 and 2 waited for the join
        for tag, search in batch.step():
            out[tag] = [h.token_ids for h in search.results()]
        assert (batch.position_ids < runtime.max_target_positions).all()
        if not len(batch):
            break
    assert out == alone
    assert batch.rows == 0 and not batch.slots
    if policy == "at-once":  # a copy on every step where a search finished
        assert len(compactions) >= 4
    elif policy == "until-join":  # after the join, only the last search's end empties it
        assert len(compactions) == 1


@pytest.mark.parametrize("device_cache", [False, True], ids=["host", "device"])
def test_steady_joins_keep_the_cache_as_short_as_its_rows_need(device_cache: bool) -> None:
    """Two searches join at every step and each lives 12 steps (about 24 rows: one retired
    row per step is under the share that compacts): the retired rows leave in the joins'
    copies, and so do the cache columns no kept row uses (left holes, right source padding),
    so the cache stays as short as the rows need instead of growing every step."""
    from tfserve.generation.batch import DecodeBatch

    runtime = Runtime(artifacts("rope", "pre"), device_cache=device_cache)
    sources, _ = mixed_batch(runtime, [9, 2, 5, 3, 8, 4, 6, 2] * 8, seed=8)
    options = DecodingOptions(max_new_tokens=12, min_new_tokens=12).validate(100)
    batch = DecodeBatch(runtime)
    out: dict[int, list] = {}
    for step in range(len(sources) // 2 + 14):
        tags = [2 * step, 2 * step + 1] if 2 * step < len(sources) else []
        if tags:
            batch.join([joining(runtime, sources, tags, options)])
            assert batch.encoder_attention_mask.shape[1] == max(
                member.encoder_rows for member in batch.slots)
        if batch.self_attention_mask.shape[1]:
            assert batch.self_attention_mask.shape[1] <= 14, step
            assert batch.self_attention_mask[:, 0].any(), step  # no column that is all holes
        for tag, search in batch.step():
            out[tag] = [h.token_ids for h in search.results()]
    for tag, source in enumerate(sources[:6]):
        ids, mask = runtime.tokenizer.pad_batch([source])
        assert out[tag] == [h.token_ids for h in generate(runtime, ids, mask, options)[0]]
    assert len(out) == len(sources) and not len(batch)
