"""Decoding controls for multilingual models, checked against transformers' generate().

prefix_token_ids (forced leading tokens: a target-language token as transformers'
forced_bos_token_id, a target prefix as its decoder_input_ids), repetition_penalty,
no_repeat_ngram_size, forced_eos (forced_eos_token_id at the length limit),
decoder_start_token_id and early_stopping "never", on a random MarianMT checkpoint built
here (tests/marian_helpers.py) and exported with `python -m export --from-hf`: greedy and
beam-4 on 50 inputs give MarianMTModel.generate's tokens (and beam scores), over ONNX
Runtime and the eager model; requests with different controls decoded together in one
continuous batch give what they give alone; the limits are refused with the field named.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only, never the hub
transformers = pytest.importorskip("transformers")

import marian_helpers as mh  # noqa: E402

from export.cli import main as export_main  # noqa: E402
from export.importers import import_hf  # noqa: E402
from tfserve.generation import (  # noqa: E402
    DecodingOptions,
    RepetitionControls,
    banned_ngram_tokens,
    make_search,
)
from tfserve.generation.batch import DecodeBatch, Joining, generate  # noqa: E402
from tfserve.model.eager import EagerBackend  # noqa: E402
from tfserve.runtime import Runtime  # noqa: E402

MAX_NEW_TOKENS = 20
LANGUAGE_CODES = (">>fr<<", ">>de<<", ">>it<<")
SOURCES = 50


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Any, Any, dict[str, int]]:
    """(directory, MarianMTModel, vocab) of a small checkpoint of unusual sizes and language
    codes in its vocabulary (the tokens a multilingual model forces first)."""
    source = mh.train_spm(mh.corpus(mh.SOURCE_WORDS, 300, seed=0), 110)
    target = mh.train_spm(mh.corpus(mh.TARGET_WORDS, 300, seed=1), 90)
    vocab = mh.build_vocab(source, target, language_codes=LANGUAGE_CODES)
    directory = tmp_path_factory.mktemp("hf") / "opus-mt-en-mul"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Recommended: pip install sacremoses"
        model = mh.write_checkpoint(directory, source, target, vocab, seed=3, d_model=18,
                                    encoder_attention_heads=3, decoder_attention_heads=3,
                                    encoder_layers=1, decoder_layers=2, encoder_ffn_dim=37,
                                    decoder_ffn_dim=37, max_position_embeddings=48)
    return directory, model, vocab


@pytest.fixture(scope="module")
def backends(checkpoint, tmp_path_factory) -> dict[str, Any]:
    """The checkpoint behind tfserve's two backends: the exported graphs and the eager model."""
    directory = checkpoint[0]
    out = tmp_path_factory.mktemp("artifacts") / "mul"
    assert export_main(["--from-hf", str(directory), "--out", str(out), "--quiet"]) == 0
    return {"onnxruntime": Runtime(out, intra_op_threads=1),
            "eager": EagerBackend(import_hf(directory).model)}


@pytest.fixture(scope="module")
def sources(checkpoint) -> dict[str, torch.Tensor]:
    """50 source texts encoded by MarianTokenizer (a padded batch)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = transformers.MarianTokenizer.from_pretrained(str(checkpoint[0]))
    return tokenizer(mh.corpus(mh.SOURCE_WORDS, SOURCES, seed=5), return_tensors="pt",
                     padding=True)


def language_ids(vocab: dict[str, int]) -> list[int]:
    return [vocab[code] for code in LANGUAGE_CODES]


def target_prefixes(vocab: dict[str, int], count: int) -> list[tuple[int, ...]]:
    """A prefix of 1 to 3 target tokens per source (language codes and ordinary pieces)."""
    rng = np.random.default_rng(7)
    ordinary = [i for piece, i in vocab.items() if piece not in ("</s>", "<unk>", "<pad>")]
    return [tuple(int(t) for t in rng.choice(ordinary, size=1 + i % 3)) for i in range(count)]


# -- running both sides ---------------------------------------------------------------------


def hf_generate(model, batch: dict[str, torch.Tensor], rows: list[int], num_beams: int,
                **settings: Any) -> tuple[list[list[int]], list[float] | None]:
    """MarianMTModel.generate's tokens for sources `rows` (the start token, eos and padding
    removed; a decoder_input_ids prefix stays) and, for beams, its sequence scores.

    Everything that tfserve's options do not say is pinned (settings may change it): no
    sampling, length_penalty 1, early_stopping off, no forced eos at max_length (the
    checkpoint's forced_eos_token_id: DecodingOptions.forced_eos is off by default); the
    checkpoint's bad_words_ids [[pad]] stays (tfserve never produces pad either).
    """
    index = torch.tensor(rows)
    settings = {"forced_eos_token_id": None, "max_new_tokens": MAX_NEW_TOKENS,
                "min_new_tokens": 0, "length_penalty": 1.0, "early_stopping": False,
                **settings}
    with torch.no_grad():
        out = model.generate(input_ids=batch["input_ids"][index],
                             attention_mask=batch["attention_mask"][index],
                             do_sample=False, num_beams=num_beams,
                             return_dict_in_generate=True, output_scores=True, **settings)
    eos = model.config.eos_token_id
    tokens = []
    for row in out.sequences[:, 1:].tolist():
        tokens.append(row[: row.index(eos)] if eos in row else row)
    scores = out.get("sequences_scores")
    return tokens, None if scores is None else scores.tolist()


# a case: name -> groups of (source rows, transformers' settings, tfserve's options) for a
# number of beams and the vocabulary; each group is one generate() call on each side
Group = tuple[list[int], dict[str, Any], DecodingOptions]
ALL = list(range(SOURCES))


def case_groups(name: str, num_beams: int, vocab: dict[str, int]) -> list[Group]:
    base = dict(num_beams=num_beams, max_new_tokens=MAX_NEW_TOKENS)
    if name.startswith("repetition_penalty"):
        penalty = float(name.split("=")[1])
        return [(ALL, dict(repetition_penalty=penalty),
                 DecodingOptions(**base, repetition_penalty=penalty))]
    if name.startswith("no_repeat_ngram_size"):
        size = int(name.split("=")[1])
        return [(ALL, dict(no_repeat_ngram_size=size),
                 DecodingOptions(**base, no_repeat_ngram_size=size))]
    # forced and prefixed outputs: a shorter max_new_tokens and a min_new_tokens, so that
    # how each counts the forced tokens shows in the outputs
    base.update(max_new_tokens=12, min_new_tokens=3)
    if name == "forced_bos":
        codes = language_ids(vocab)
        return [([r for r in ALL if r % len(codes) == i],
                 dict(forced_bos_token_id=code, max_new_tokens=12, min_new_tokens=3),
                 DecodingOptions(**base, prefix_token_ids=(code,), prefix_counts_as_new=True))
                for i, code in enumerate(codes)]
    prefixes = target_prefixes(vocab, SOURCES)
    extra: dict[str, Any] = {}
    if name == "prefix+controls":
        extra = dict(repetition_penalty=1.3, no_repeat_ngram_size=2)
    groups = []
    for length in (1, 2, 3):
        rows = [r for r in ALL if len(prefixes[r]) == length]
        start = vocab["<pad>"]
        decoder_input_ids = torch.tensor([[start, *prefixes[r]] for r in rows])
        # one DecodingOptions per source: each has its own prefix
        groups.append((rows, dict(decoder_input_ids=decoder_input_ids, max_new_tokens=12,
                                  min_new_tokens=3, **extra),
                       [DecodingOptions(**base, prefix_token_ids=prefixes[r], **extra)
                        for r in rows]))
    return groups


CASES = ["repetition_penalty=1.3", "repetition_penalty=0.8", "no_repeat_ngram_size=2",
         "no_repeat_ngram_size=3", "forced_bos", "prefix", "prefix+controls"]


@pytest.fixture(scope="module")
def hf_results(checkpoint, sources) -> Callable[[str, int], list]:
    """(case, num_beams) -> [(rows, tokens, scores)] per group, computed once each."""
    done: dict[tuple[str, int], list] = {}

    def results(name: str, num_beams: int) -> list:
        if (name, num_beams) not in done:
            _, model, vocab = checkpoint
            done[name, num_beams] = [
                (rows, *hf_generate(model, sources, rows, num_beams, **settings))
                for rows, settings, _ in case_groups(name, num_beams, vocab)]
        return done[name, num_beams]

    return results


def tfserve_results(backend, batch, groups: list[Group]) -> list:
    out = []
    for rows, _, options in groups:
        index = torch.tensor(rows)
        hyps = generate(backend, batch["input_ids"][index].numpy(),
                        batch["attention_mask"][index].numpy(), options)
        out.append((rows, hyps))
    return out


def plain_tokens(backend, batch, num_beams: int) -> list[list[int]]:
    hyps = generate(backend, batch["input_ids"].numpy(), batch["attention_mask"].numpy(),
                    DecodingOptions(max_new_tokens=MAX_NEW_TOKENS, num_beams=num_beams))
    return [h[0].token_ids for h in hyps]


# -- against transformers -------------------------------------------------------------------


@pytest.mark.parametrize("num_beams", [1, 4], ids=["greedy", "beam4"])
@pytest.mark.parametrize("name", CASES)
def test_controls_match_transformers(name, num_beams, checkpoint, backends, sources,
                                     hf_results):
    vocab = checkpoint[2]
    backend = backends["onnxruntime"]
    groups = case_groups(name, num_beams, vocab)
    ours = tfserve_results(backend, sources, groups)
    theirs = hf_results(name, num_beams)
    tokens: dict[int, list[int]] = {}
    for (rows, hyps), (_, expected, scores) in zip(ours, theirs, strict=True):
        got = [h[0].token_ids for h in hyps]
        bad = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
        assert not bad, (f"{name}, {num_beams} beams: {len(bad)}/{len(rows)} differ, source "
                         f"{rows[bad[0]]}: ours {got[bad[0]]} transformers {expected[bad[0]]}")
        if scores is not None:  # the documented scores: forced tokens 0, penalised repeats
            np.testing.assert_allclose([h[0].score for h in hyps], scores, atol=1e-4, rtol=0)
        tokens.update(zip(rows, got))
    # meaningful: the outputs depend on the input, and the control changed some of them
    assert len({tuple(t) for t in tokens.values()}) >= 10
    plain = plain_tokens(backend, sources, num_beams)
    changed = sum(tokens[r] != plain[r] for r in ALL)
    assert changed >= 5, f"{name} changed only {changed} of {SOURCES} outputs"
    if name.startswith("no_repeat_ngram_size"):
        size = int(name.split("=")[1])
        start = vocab["<pad>"]
        assert not any(repeats([start, *tokens[r]], size) for r in ALL)
        assert sum(repeats([start, *plain[r]], size) for r in ALL) >= 5
    if name in ("forced_bos", "prefix"):
        # the counts: max_new_tokens is reached with the forced token counted (forced_bos)
        # or after the prefix (prefix), as transformers counts them
        prefixes = target_prefixes(vocab, SOURCES)
        counted = 0 if name == "forced_bos" else None
        lengths = [len(tokens[r]) - (counted if counted is not None else len(prefixes[r]))
                   for r in ALL]
        assert max(lengths) == 12 and sum(n == 12 for n in lengths) >= 5
        assert min(lengths) >= 3  # min_new_tokens


@pytest.mark.parametrize("name", ["forced_bos", "prefix+controls"])
def test_eager_backend_gives_the_same(name, checkpoint, backends, sources, hf_results):
    """The same searches over the eager PyTorch model (beam-4, the harder case)."""
    groups = case_groups(name, 4, checkpoint[2])
    ours = tfserve_results(backends["eager"], sources, groups)
    for (_, hyps), (_, expected, _) in zip(ours, hf_results(name, 4), strict=True):
        assert [h[0].token_ids for h in hyps] == expected


def repeats(sequence: list[int], size: int) -> bool:
    grams = [tuple(sequence[i : i + size]) for i in range(len(sequence) - size + 1)]
    return len(grams) != len(set(grams))


# -- continuous batching ----------------------------------------------------------------------


def decode(backend, ids: np.ndarray, mask: np.ndarray, requests: list[DecodingOptions],
           waves: list[list[int]], start: int | None = None) -> dict[int, list]:
    """Sources `ids[i]` decoded with `requests[i]` in one DecodeBatch: each wave of sources
    joins two steps after the one before; `start`: the decoder start token (the backend's
    by default). Returns source -> hypotheses."""
    start = backend.decoder_start_token_id if start is None else start
    batch = DecodeBatch(backend)
    results: dict[int, list] = {}

    def step() -> None:
        for tag, search in batch.step():
            assert search.error is None
            results[tag] = search.results()

    for wave in waves:
        _, cross = backend.encode(ids[wave], mask[wave])
        searches = [make_search(requests[i], backend.eos_token_id, start) for i in wave]
        batch.join([Joining(searches, wave, cross, mask[wave])])
        for _ in range(2):
            step()
    while len(batch):
        step()
    return results



def mixed_requests(vocab: dict[str, int]) -> list[DecodingOptions]:
    """Requests with different controls, for one batch."""
    codes = language_ids(vocab)
    prefixes = target_prefixes(vocab, 8)
    return [
        DecodingOptions(max_new_tokens=MAX_NEW_TOKENS),
        DecodingOptions(prefix_token_ids=(codes[0],), prefix_counts_as_new=True),
        DecodingOptions(prefix_token_ids=(codes[1],), prefix_counts_as_new=True, num_beams=4),
        DecodingOptions(prefix_token_ids=prefixes[1], repetition_penalty=1.3),
        DecodingOptions(prefix_token_ids=prefixes[2], num_beams=3, no_repeat_ngram_size=2),
        DecodingOptions(repetition_penalty=0.8, num_beams=4, min_new_tokens=4),
        DecodingOptions(no_repeat_ngram_size=3),
        DecodingOptions(prefix_token_ids=(codes[2], *prefixes[3]), do_sample=True, seed=11,
                        num_return_sequences=2, repetition_penalty=1.2),
        DecodingOptions(num_beams=4, max_new_tokens=MAX_NEW_TOKENS),
        DecodingOptions(prefix_token_ids=prefixes[4]),
    ]


@pytest.mark.parametrize("backend_name", ["onnxruntime", "eager"])
def test_mixed_requests_in_one_batch_equal_each_alone(backend_name, checkpoint, backends,
                                                      sources):
    """Requests with different forced tokens, prefixes and penalties join one DecodeBatch
    at different steps (three joins, two steps apart); each ends as it ends alone."""
    backend = backends[backend_name]
    requests = mixed_requests(checkpoint[2])
    limit = backend.max_target_positions - 1
    requests = [options.validate(limit, vocab_size=backend.vocab_size,
                                 eos_token_id=backend.eos_token_id) for options in requests]
    ids, mask = sources["input_ids"].numpy(), sources["attention_mask"].numpy()
    alone = [generate(backend, ids[i : i + 1], mask[i : i + 1], options)[0]
             for i, options in enumerate(requests)]
    together = decode(backend, ids, mask, requests, waves=[[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]])
    for i, expected in enumerate(alone):
        got = together[i]
        assert [h.token_ids for h in got] == [h.token_ids for h in expected], requests[i]
        np.testing.assert_allclose([h.score for h in got], [h.score for h in expected],
                                   atol=1e-5, rtol=0)
    # the prefixes are in the outputs
    for i, options in enumerate(requests):
        for hyp in together[i]:
            assert tuple(hyp.token_ids[: len(options.prefix_token_ids)]) == \
                options.prefix_token_ids


@pytest.mark.parametrize("num_beams", [1, 4], ids=["greedy", "beam4"])
def test_the_start_token_is_penalised(num_beams, checkpoint, backends, sources):
    """The penalised sequence begins with the decoder start token, as in transformers (for
    NLLB and M2M100 that token is eos). With the most frequent output token as the start
    token, the outputs follow generate(decoder_start_token_id=that token), and differ from
    what a penalty that left the start token out would give."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    model = checkpoint[1]
    backend = backends["onnxruntime"]
    ids, mask = sources["input_ids"].numpy(), sources["attention_mask"].numpy()
    counts = np.bincount(np.concatenate([t for t in plain_tokens(backend, sources, 1) if t]))
    start = int(counts.argmax())
    expected, scores = hf_generate(model, sources, ALL, num_beams, decoder_start_token_id=start,
                                   repetition_penalty=1.3)
    options = DecodingOptions(max_new_tokens=MAX_NEW_TOKENS, num_beams=num_beams,
                              repetition_penalty=1.3).validate(backend.max_target_positions - 1)
    got = decode(backend, ids, mask, [options] * SOURCES, waves=[ALL], start=start)
    if scores is None:
        assert [got[r][0].token_ids for r in ALL] == expected
    else:
        # a beam whose tokens differ must tie with transformers' best: two hypotheses whose
        # scores differ by float rounding (ONNX Runtime's and torch's kernels order their
        # sums differently, and a degenerate repeated-token output has many such ties)
        differ = [r for r in ALL if got[r][0].token_ids != expected[r]]
        assert len(differ) <= 1, differ
        np.testing.assert_allclose([got[r][0].score for r in ALL], scores, atol=1e-4, rtol=0)
    # meaningful: without the start token in the penalised sequence, the outputs differ
    start_left_out, _ = hf_generate(
        model, sources, ALL, num_beams, decoder_start_token_id=start,
        logits_processor=[RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=1)])
    assert sum(a != b for a, b in zip(expected, start_left_out, strict=True)) >= 5


def test_scheduler_mixes_controls_and_streams_the_prefix():
    """Through the server's scheduler (on the numpy fake backend): requests with different
    prefixes and controls arriving at different passes each get their answer alone; a
    greedy request streams its prefix first; eos in a prefix is refused at submit."""
    from fake_backend import EOS
    from test_scheduler import alone, answer, drive, make_scheduler

    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="prefix_token_ids must not contain the eos token"):
        scheduler.submit_translate([[5, 9, EOS]], DecodingOptions(prefix_token_ids=(3, EOS)))
    with pytest.raises(ValueError, match="prefix_token_ids must hold token ids in"):
        scheduler.submit_translate([[5, 9, EOS]], DecodingOptions(prefix_token_ids=(16,)))
    requests = [
        ([5, 9, EOS], DecodingOptions(max_new_tokens=12, prefix_token_ids=(3, 4))),
        ([6, 2, EOS], DecodingOptions(max_new_tokens=12, num_beams=3, repetition_penalty=2.0)),
        ([12, 3, 3, EOS], DecodingOptions(max_new_tokens=12, prefix_token_ids=(7,),
                                          prefix_counts_as_new=True, num_beams=2,
                                          no_repeat_ngram_size=1)),
        ([4, EOS], DecodingOptions(max_new_tokens=12)),
        ([13, 8, EOS], DecodingOptions(max_new_tokens=12, repetition_penalty=0.5,
                                       prefix_token_ids=(2, 2, 5))),
    ]
    events: list = []
    jobs = []
    for index, (source, options) in enumerate(requests):
        jobs.append(scheduler.submit_translate(
            [source], options, on_event=events.append if index == 0 else None))
        scheduler.run_once()  # the next one arrives while these decode
    drive(scheduler, jobs)
    for job, (source, options) in zip(jobs, requests, strict=True):
        assert answer(job) == alone(source, options), options
    streamed = [token for event in events for token in event.token_ids]
    assert streamed[:2] == [3, 4] and streamed == jobs[0].result(0)[0][0].token_ids


def test_scheduler_honours_start_tokens_and_forced_eos():
    """Through the server's scheduler (on the numpy fake backend): requests with their own
    decoder start token and with forced eos arrive at different passes and each gets its
    answer alone; the start token changes a beam search's answer; the forced eos is not
    streamed; a start token outside the vocabulary is refused at submit, naming the field."""
    from fake_backend import EOS, VOCAB
    from test_scheduler import alone, answer, drive, make_scheduler

    scheduler = make_scheduler()
    with pytest.raises(ValueError, match=r"decoder_start_token_id must be in \[0, 15\] \(a "
                                         r"token id of the model\), got 16"):
        scheduler.submit_translate([[5, 9, EOS]], DecodingOptions(decoder_start_token_id=VOCAB))
    requests = [
        ([5, 9, EOS], DecodingOptions(max_new_tokens=12, num_beams=3, num_return_sequences=3,
                                      decoder_start_token_id=2)),
        ([5, 9, EOS], DecodingOptions(max_new_tokens=12, num_beams=3, num_return_sequences=3,
                                      decoder_start_token_id=4)),
        ([12, 3, 3, EOS], DecodingOptions(max_new_tokens=4, forced_eos=True,
                                          decoder_start_token_id=7)),
        ([13, 8, EOS], DecodingOptions(max_new_tokens=4, num_beams=2, forced_eos=True,
                                       min_new_tokens=4)),
        ([6, 2, EOS], DecodingOptions(max_new_tokens=4, do_sample=True, seed=5,
                                      forced_eos=True, num_return_sequences=2)),
        ([5, 9, EOS], DecodingOptions(max_new_tokens=12, num_beams=3, num_return_sequences=3)),
    ]
    events: list = []
    jobs = []
    for index, (source, options) in enumerate(requests):
        jobs.append(scheduler.submit_translate(
            [source], options, on_event=events.append if index == 2 else None))
        scheduler.run_once()  # the next one arrives while these decode
    drive(scheduler, jobs)
    answers = [answer(job) for job in jobs]
    for got, (source, options) in zip(answers, requests, strict=True):
        assert got == alone(source, options), options
    assert answers[0] != answers[1] != answers[5]  # the fake model reads the input token
    for got in answers[2:5]:  # cut by the forced eos: max_new_tokens - 1 tokens, finished
        assert all(len(tokens) == 3 for hyps in got for tokens, _ in hyps)
    assert all(h.finished for job in jobs[2:5] for hyps in job.result(0) for h in hyps)
    streamed = [token for event in events for token in event.token_ids]
    assert streamed == jobs[2].result(0)[0][0].token_ids and EOS not in streamed


# -- the pieces on their own ----------------------------------------------------------------


@pytest.mark.parametrize("penalty", [1.3, 0.8, 7.0])
def test_penalty_is_transformers_processor_bit_for_bit(penalty):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    scores = (3 * rng.standard_normal((5, 40))).astype(np.float32)
    scores[:, 7] = -np.inf  # a banned token stays banned
    scores[1, 3] = 0.0
    history = rng.integers(0, 40, size=(5, 9))  # repeats included: penalised once
    ours = RepetitionControls(penalty, 0).apply(scores, history)
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.from_numpy(history),
                                                       torch.from_numpy(scores.copy()))
    np.testing.assert_array_equal(ours, theirs.numpy())


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_ngram_bans_are_transformers_processor(size):
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    rng = np.random.default_rng(size)
    for length in range(1, 12):
        history = rng.integers(0, 4, size=(6, length))  # a small alphabet: many repeats
        scores = rng.standard_normal((6, 5)).astype(np.float32)
        ours = RepetitionControls(1.0, size).apply(scores, history)
        theirs = NoRepeatNGramLogitsProcessor(size)(torch.from_numpy(history),
                                                    torch.from_numpy(scores.copy()))
        np.testing.assert_array_equal(ours, theirs.numpy())
    rows, tokens = banned_ngram_tokens(np.array([[5, 1, 2, 5, 1]]), 3)
    assert (rows.tolist(), tokens.tolist()) == ([0], [2])  # "5 1" was followed by 2


def test_fast_path_unchanged_without_controls():
    """Without controls the searches decide from the backend's top candidates as before; a
    prefix alone keeps that path (its forced steps need no candidates); repetition controls
    ask for whole logits rows."""
    greedy = make_search(DecodingOptions(), 0, 5)
    beam = make_search(DecodingOptions(num_beams=3), 0, 5)
    assert (greedy.top_needed(), beam.top_needed(), beam.candidates_per_row()) == (1, 6, 7)
    assert greedy.controls is None and beam.controls is None
    prefixed = make_search(DecodingOptions(num_beams=3, prefix_token_ids=(4, 2)).validate(30),
                           0, 5)
    assert prefixed.top_needed() == 1 and prefixed.candidates_per_row() == 0
    ids, log_probs = np.array([[3, 9]]), np.array([[-0.1, -2.0]], np.float32)
    prefixed.advance_candidates(ids, log_probs)
    prefixed.advance_candidates(ids, log_probs)
    assert (prefixed.top_needed(), prefixed.beams, prefixed.generated) == (6, [[4, 2]], 0)
    for options in (DecodingOptions(repetition_penalty=1.1),
                    DecodingOptions(no_repeat_ngram_size=2, num_beams=2),
                    DecodingOptions(no_repeat_ngram_size=2, do_sample=True)):
        assert make_search(options, 0, 5).top_needed() == 0
    # forced eos: the candidates as without it, none needed at the forced step
    ending = make_search(DecodingOptions(num_beams=3, max_new_tokens=2, forced_eos=True,
                                         num_return_sequences=2), 0, 5)
    assert (ending.top_needed(), ending.candidates_per_row()) == (6, 7)
    ending.advance_candidates(ids, log_probs)
    assert (ending.ending, ending.top_needed(), ending.candidates_per_row()) == (True, 1, 0)
    ending.advance_candidates(ids[:, :1], log_probs[:, :1])
    assert ending.done and [(h.token_ids, h.score) for h in ending.results()] == [
        ([3], pytest.approx(-0.1 / 2)), ([9], -2.0 / 2)]  # scores / max_new_tokens
    # a start token of the request's own is the first step's input, and in the history
    started = make_search(DecodingOptions(decoder_start_token_id=7), 0, 5)
    assert started.last_tokens.tolist() == [7] and started.histories().tolist() == [[7]]


def test_sampling_applies_the_controls_to_the_logits(backends, sources):
    """top_k=1 sampling with controls is greedy search with them (tokens and scores); with
    no_repeat_ngram_size=1 hot samples repeat no token, after a prefix they all start with."""
    backend = backends["onnxruntime"]
    ids, mask = sources["input_ids"][:12].numpy(), sources["attention_mask"][:12].numpy()
    controls = dict(repetition_penalty=1.4, no_repeat_ngram_size=3, prefix_token_ids=(5, 9))
    greedy = generate(backend, ids, mask, DecodingOptions(**controls))
    sampled = generate(backend, ids, mask, DecodingOptions(**controls, do_sample=True,
                                                           top_k=1, seed=1))
    assert [h[0].token_ids for h in sampled] == [h[0].token_ids for h in greedy]
    np.testing.assert_allclose([h[0].score for h in sampled], [h[0].score for h in greedy],
                               atol=1e-5)
    hot = dict(do_sample=True, temperature=3.0, num_return_sequences=4, seed=2)
    start = backend.decoder_start_token_id
    plain = generate(backend, ids, mask, DecodingOptions(**hot))
    banned = generate(backend, ids, mask, DecodingOptions(**hot, no_repeat_ngram_size=1,
                                                          prefix_token_ids=(7,)))
    assert sum(repeats([start, *h.token_ids], 1) for hyps in plain for h in hyps) >= 5
    for hyps in banned:
        assert len(hyps) == 4
        for hyp in hyps:
            assert hyp.token_ids[0] == 7 and not repeats([start, *hyp.token_ids], 1)


# -- forced eos at the length limit ----------------------------------------------------------

EOS_LIMIT = 8  # max_new_tokens of the forced-eos comparisons: many outputs reach it
FORCED_EOS_CASES = ["plain", "min_new_tokens", "length_penalty=2", "length_penalty=-0.5",
                    "forced_bos", "prefix"]


def forced_eos_groups(name: str, num_beams: int, vocab: dict[str, int]) -> list[Group]:
    """Groups as case_groups' with forced eos at EOS_LIMIT new tokens on both sides:
    transformers' forced_eos_token_id = eos, tfserve's forced_eos."""
    eos = vocab["</s>"]
    hf = dict(forced_eos_token_id=eos, max_new_tokens=EOS_LIMIT)
    ours = dict(forced_eos=True, max_new_tokens=EOS_LIMIT, num_beams=num_beams)
    if name == "plain":
        return [(ALL, hf, DecodingOptions(**ours))]
    if name == "min_new_tokens":  # eos banned until the forced one, which overrides the ban
        return [(ALL, dict(hf, min_new_tokens=EOS_LIMIT),
                 DecodingOptions(**ours, min_new_tokens=EOS_LIMIT))]
    if name.startswith("length_penalty"):
        penalty = float(name.split("=")[1])
        return [(ALL, dict(hf, length_penalty=penalty),
                 DecodingOptions(**ours, length_penalty=penalty))]
    if name == "forced_bos":  # the forced first token counts as one of the EOS_LIMIT
        codes = language_ids(vocab)
        return [([r for r in ALL if r % len(codes) == i], dict(hf, forced_bos_token_id=code),
                 DecodingOptions(**ours, prefix_token_ids=(code,), prefix_counts_as_new=True))
                for i, code in enumerate(codes)]
    prefixes = target_prefixes(vocab, SOURCES)  # decoder input: EOS_LIMIT tokens after it
    groups = []
    for length in (1, 2, 3):
        rows = [r for r in ALL if len(prefixes[r]) == length]
        decoder_input_ids = torch.tensor([[vocab["<pad>"], *prefixes[r]] for r in rows])
        groups.append((rows, dict(hf, decoder_input_ids=decoder_input_ids),
                       [DecodingOptions(**ours, prefix_token_ids=prefixes[r]) for r in rows]))
    return groups


def without_forced_eos(groups: list[Group]) -> list[Group]:
    """The same groups with tfserve's forced_eos off."""
    def off(options):
        return [dataclasses.replace(o, forced_eos=False) for o in options] \
            if isinstance(options, list) else dataclasses.replace(options, forced_eos=False)
    return [(rows, settings, off(options)) for rows, settings, options in groups]


@pytest.mark.parametrize("num_beams", [1, 4], ids=["greedy", "beam4"])
@pytest.mark.parametrize("name", FORCED_EOS_CASES)
def test_forced_eos_matches_transformers(name, num_beams, checkpoint, backends, sources):
    """forced_eos equals generate(forced_eos_token_id=eos) on 50 inputs at a limit that
    many reach: tokens, and for beams the scores (the forced eos adds 0, the length
    penalty divides by max_new_tokens); with min_new_tokens = max_new_tokens every output
    has max_new_tokens - 1 tokens; a forced first token counts as a new token, a target
    prefix does not."""
    model, vocab = checkpoint[1], checkpoint[2]
    backend = backends["onnxruntime"]
    groups = forced_eos_groups(name, num_beams, vocab)
    ours = tfserve_results(backend, sources, groups)
    plain = tfserve_results(backend, sources, without_forced_eos(groups))
    ended = changed = 0
    prefixes = target_prefixes(vocab, SOURCES)
    for (rows, settings, _), (_, hyps), (_, cut) in zip(groups, ours, plain, strict=True):
        expected, scores = hf_generate(model, sources, rows, num_beams, **settings)
        got = [h[0].token_ids for h in hyps]
        bad = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
        assert not bad, (f"{name}, {num_beams} beams: {len(bad)}/{len(rows)} differ, source "
                         f"{rows[bad[0]]}: ours {got[bad[0]]} transformers {expected[bad[0]]}")
        if scores is not None:
            np.testing.assert_allclose([h[0].score for h in hyps], scores, atol=1e-4, rtol=0)
        assert all(h.finished for hs in hyps for h in hs)  # every output ends with eos
        for row, tokens, without in zip(rows, got, cut, strict=True):
            new = len(tokens) - (len(prefixes[row]) if name == "prefix" else 0)
            assert new <= EOS_LIMIT - 1
            if name == "min_new_tokens":
                assert new == EOS_LIMIT - 1
            ended += new == EOS_LIMIT - 1
            changed += tokens != without[0].token_ids
    # meaningful: many outputs end at the forced eos, where tfserve without it differs
    assert ended >= 10 and changed >= 10, (ended, changed)


def test_forced_eos_takes_the_place_of_a_counted_prefix(checkpoint, backends, sources):
    """max_new_tokens 1 with a forced first token: transformers' forced eos wins (its
    ForcedEOSTokenLogitsProcessor runs after ForcedBOS), so the output is empty."""
    model, vocab = checkpoint[1], checkpoint[2]
    code = language_ids(vocab)[0]
    rows = list(range(6))
    for num_beams in (1, 4):
        expected, _ = hf_generate(model, sources, rows, num_beams, max_new_tokens=1,
                                  forced_bos_token_id=code, forced_eos_token_id=vocab["</s>"])
        options = DecodingOptions(max_new_tokens=1, num_beams=num_beams, forced_eos=True,
                                  prefix_token_ids=(code,), prefix_counts_as_new=True)
        got = tfserve_results(backends["onnxruntime"], sources, [(rows, {}, options)])[0][1]
        assert [h[0].token_ids for h in got] == expected == [[]] * len(rows)
        without = dataclasses.replace(options, forced_eos=False)
        got = tfserve_results(backends["onnxruntime"], sources, [(rows, {}, without)])[0][1]
        assert [h[0].token_ids for h in got] == [[code]] * len(rows)


def test_forced_eos_in_sampling(backends, sources):
    """top_k=1 sampling with forced_eos is greedy search with it (tokens and scores); hot
    samples all end with eos by max_new_tokens, from the first step on too (max_new_tokens
    1: num_return_sequences empty outputs)."""
    backend = backends["onnxruntime"]
    ids, mask = sources["input_ids"][:20].numpy(), sources["attention_mask"][:20].numpy()
    forced = dict(forced_eos=True, max_new_tokens=EOS_LIMIT)
    greedy = generate(backend, ids, mask, DecodingOptions(**forced))
    sampled = generate(backend, ids, mask, DecodingOptions(**forced, do_sample=True, top_k=1,
                                                           seed=1))
    assert [h[0].token_ids for h in sampled] == [h[0].token_ids for h in greedy]
    np.testing.assert_allclose([h[0].score for h in sampled], [h[0].score for h in greedy],
                               atol=1e-5)
    hot = generate(backend, ids, mask, DecodingOptions(**forced, do_sample=True,
                                                       temperature=3.0,
                                                       num_return_sequences=3, seed=2))
    lengths = [len(h.token_ids) for hyps in hot for h in hyps]
    assert all(len(hyps) == 3 and all(h.finished for h in hyps) for hyps in hot)
    assert max(lengths) == EOS_LIMIT - 1 and sum(n == EOS_LIMIT - 1 for n in lengths) >= 5
    first = generate(backend, ids[:3], mask[:3], DecodingOptions(
        forced_eos=True, max_new_tokens=1, do_sample=True, num_return_sequences=2, seed=3))
    assert [[(h.token_ids, h.score, h.finished) for h in hyps] for hyps in first] == \
        [[([], 0.0, True)] * 2] * 3


# -- early_stopping "never" -------------------------------------------------------------------


@pytest.fixture(scope="module")
def eos_prone(checkpoint, tmp_path_factory) -> tuple[Any, Any]:
    """(MarianMTModel, tfserve's eager backend) of the checkpoint's sizes and vocabulary with
    eos raised: beams finish early, so when the search stops matters."""
    _, _, vocab = checkpoint
    source = mh.train_spm(mh.corpus(mh.SOURCE_WORDS, 300, seed=0), 110)
    target = mh.train_spm(mh.corpus(mh.TARGET_WORDS, 300, seed=1), 90)
    directory = tmp_path_factory.mktemp("hf") / "opus-mt-eos"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = mh.write_checkpoint(directory, source, target, vocab, seed=3, eos_boost=3.0,
                                    d_model=18, encoder_attention_heads=3,
                                    decoder_attention_heads=3, encoder_layers=1,
                                    decoder_layers=2, encoder_ffn_dim=37, decoder_ffn_dim=37,
                                    max_position_embeddings=48)
    return model, EagerBackend(import_hf(directory).model)


@pytest.mark.parametrize("length_penalty", [1.0, 2.0, -1.0])
def test_early_stopping_never_matches_transformers(length_penalty, eos_prone, sources):
    """Beam-4 with early_stopping "never" and with False each equal generate() with the
    same setting (tokens and scores), on a model whose beams finish early. With a positive
    length_penalty "never" scores the running beams at max_new_tokens, so it searches on
    where False stops and returns other outputs; with a negative one it is False."""
    model, backend = eos_prone
    outputs = {}
    for stopping in ("never", False):
        options = DecodingOptions(max_new_tokens=30, num_beams=4, length_penalty=length_penalty,
                                  early_stopping=stopping)
        got = tfserve_results(backend, sources, [(ALL, {}, options)])[0][1]
        expected, scores = hf_generate(model, sources, ALL, 4, early_stopping=stopping,
                                       max_new_tokens=30, length_penalty=length_penalty)
        tokens = [h[0].token_ids for h in got]
        bad = [i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b]
        assert not bad, (f"early_stopping={stopping!r}: {len(bad)}/{SOURCES} differ, source "
                         f"{bad[0]}: ours {tokens[bad[0]]} transformers {expected[bad[0]]}")
        # float32 sums (transformers) against float64 ones, times length ** -length_penalty
        np.testing.assert_allclose([h[0].score for h in got], scores, atol=1e-4, rtol=1e-6)
        outputs[stopping] = tokens
    changed = sum(a != b for a, b in zip(outputs["never"], outputs[False], strict=True))
    # how many sources it changes depends on the random model: at least one
    assert changed >= 1 if length_penalty > 0 else changed == 0, changed


# -- limits ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, needle", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be in [0.1, 10.0]"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be in [0.1, 10.0]"),
    (dict(repetition_penalty=10.5), "repetition_penalty must be in [0.1, 10.0]"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be in [0.1, 10.0]"),
    (dict(repetition_penalty=5e-324), "repetition_penalty must be in [0.1, 10.0]"),
    (dict(repetition_penalty=True), "repetition_penalty must be in [0.1, 10.0]"),
    (dict(repetition_penalty="1.2"), "repetition_penalty must be in [0.1, 10.0]"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be in [0, 64]"),
    (dict(no_repeat_ngram_size=65), "no_repeat_ngram_size must be in [0, 64]"),
    (dict(no_repeat_ngram_size=2.0), "no_repeat_ngram_size must be an integer"),
    (dict(prefix_token_ids=(3, 0, 4)), "prefix_token_ids must not contain the eos token (id 0)"),
    (dict(prefix_token_ids=(3, 100)), "prefix_token_ids must hold token ids in [0, 99]"),
    (dict(prefix_token_ids=(-1,)), "prefix_token_ids must hold token ids in [0, 99]"),
    (dict(prefix_token_ids=(1.5,)), "prefix_token_ids must hold integer token ids"),
    (dict(prefix_token_ids="hello"), "prefix_token_ids must be a sequence of token ids"),
    (dict(prefix_token_ids=tuple(range(1, 40))), "prefix_token_ids has 39 tokens, over the "
                                                 "model's limit of 38"),
    (dict(prefix_token_ids=(1, 2, 3), max_new_tokens=37),
     "max_new_tokens must be in [1, 36] (the model's limit less the 3 tokens of "
     "prefix_token_ids)"),
    (dict(prefix_token_ids=(1, 2, 3), prefix_counts_as_new=True, max_new_tokens=2),
     "max_new_tokens must be >= the 3 tokens of prefix_token_ids"),
    (dict(prefix_counts_as_new="yes"), "prefix_counts_as_new must be a boolean"),
    (dict(forced_eos="yes"), "forced_eos must be a boolean, got 'yes'"),
    (dict(forced_eos=1), "forced_eos must be a boolean, got 1"),
    (dict(early_stopping="always"), 'early_stopping must be true, false or "never", got '
                                     "'always'"),
    (dict(early_stopping=None), 'early_stopping must be true, false or "never"'),
    (dict(decoder_start_token_id=100), "decoder_start_token_id must be in [0, 99] (a token id "
                                       "of the model), got 100"),
    (dict(decoder_start_token_id=-1), "decoder_start_token_id must be in [0, 99]"),
    (dict(decoder_start_token_id=2.0), "decoder_start_token_id must be an integer, got 2.0"),
    (dict(decoder_start_token_id=True), "decoder_start_token_id must be an integer"),
])
def test_limits_are_refused_naming_the_field(overrides, needle):
    with pytest.raises(ValueError) as error:
        DecodingOptions(**overrides).validate(39, vocab_size=100, eos_token_id=0)
    assert needle in str(error.value)


def test_limits_within_bounds_and_defaults():
    limit = 39
    options = DecodingOptions().validate(limit)
    assert (options.repetition_penalty, options.no_repeat_ngram_size,
            options.prefix_token_ids, options.prefix_counts_as_new) == (1.0, 0, (), False)
    # an input prefix takes its length from the default max_new_tokens; a counted one not
    assert DecodingOptions(prefix_token_ids=[4, 5]).validate(limit).max_new_tokens == 37
    counted = DecodingOptions(prefix_token_ids=(4, 5), prefix_counts_as_new=True)
    assert counted.validate(limit).max_new_tokens == 39
    listed = DecodingOptions(prefix_token_ids=[np.int64(4), 5], max_new_tokens=3)
    assert listed.validate(limit).prefix_token_ids == (4, 5)  # a tuple of ints
    ready = DecodingOptions(max_new_tokens=5, prefix_token_ids=(4,), repetition_penalty=10,
                            no_repeat_ngram_size=64, forced_eos=True, early_stopping="never",
                            decoder_start_token_id=99)
    assert ready.validate(limit, vocab_size=100) is ready
    assert (options.forced_eos, options.early_stopping, options.decoder_start_token_id) == (
        False, False, None)
    with pytest.raises(ValueError, match="prefix_token_ids must not contain the eos"):
        make_search(DecodingOptions(prefix_token_ids=(2, 0)), 0, 5)
