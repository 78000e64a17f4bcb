"""tfserve.bench.compare: the engines benchmark (tfserve vs CTranslate2 vs Hugging Face).

The smoke test runs `python -m tfserve.bench.compare --quick` end to end (tiny random Marian
checkpoint, every engine in its own child process); it takes about a minute, so it is slow.
"""

from __future__ import annotations

import json

import pytest

from tfserve.bench import compare, engines, models, report


def test_marian_vocab_is_padded_with_pad_last() -> None:
    words = models.pseudo_words(300, seed=0)
    model = models.train_spm(models.pseudo_sentences(words, 300, seed=0), vocab_size=400)
    vocab = models.marian_vocab(model, 1000)
    assert len(vocab) == 1000 and sorted(vocab.values()) == list(range(1000))
    assert vocab["</s>"] == 0 and vocab["<unk>"] == 1 and vocab["<pad>"] == 999


def test_pad_batch() -> None:
    ids, mask = engines.pad_batch([[5, 6, 0], [7, 0]], pad=9)
    assert ids.tolist() == [[5, 6, 0], [7, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [1, 1, 0]]


def test_unknown_engine_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        compare.main(["--engines", "tfserve-fp32,nope"])
    assert exit_info.value.code == 2
    assert "nope" in capsys.readouterr().err


def test_passes_keep_each_engines_best_case() -> None:
    rows = [{"engine": "a", "case": "x", "tok_s": 10.0, "pass": 1},
            {"engine": "b", "case": "x", "tok_s": 7.0, "pass": 1},
            {"engine": "a", "case": "x", "tok_s": 12.0, "pass": 2},
            {"engine": "b", "case": "x", "tok_s": 6.0, "pass": 2}]
    best = report.best_rows(rows)
    assert best[("a", "x")]["pass"] == 2 and best[("b", "x")]["pass"] == 1
    with pytest.raises(SystemExit) as exit_info:
        compare.main(["--passes", "0"])
    assert exit_info.value.code == 2


def test_the_engines_children_run_from_the_bench_package() -> None:
    """The engines' children run `python -m tfserve.bench.compare` (this checkout importable)."""
    code, rows, err = compare.run_child(["--help"], threads=1, timeout=120)
    assert code == 0 and rows == [], err


def test_serving_path_imports_no_bench_module() -> None:
    """The benchmark tools import the serving modules, never the other way: outside
    tfserve/bench/, only the command line (for `tfserve bench`) imports it."""
    import ast
    from pathlib import Path

    package = Path(compare.__file__).parents[1]
    allowed = {package / "cli.py"}
    importers = []
    for path in package.rglob("*.py"):
        if path in allowed or package / "bench" in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
                [f"{node.module}.{alias.name}" for alias in node.names]  # from tfserve import bench
                if isinstance(node, ast.ImportFrom) else [])
            if any(name == "tfserve.bench" or name.startswith("tfserve.bench.")
                   for name in names):
                importers.append(str(path.relative_to(package)))
    assert importers == []


@pytest.mark.slow
def test_quick_compare_runs_every_engine(tmp_path, capsys) -> None:
    for module in ("torch", "onnx", "transformers", "ctranslate2"):
        pytest.importorskip(module)
    results = tmp_path / "results.json"
    code = compare.main(["--quick", "--work", str(tmp_path / "work"), "--json", str(results),
                         "--timeout", "600"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    data = json.loads(results.read_text())
    assert data["failures"] == {}
    assert {(r["engine"], r["case"]) for r in data["rows"]} == {
        (engine, case) for engine in compare.ENGINES for case in compare.QUICK_CASES}
    for row in data["rows"]:
        assert row["lengths_ok"], row  # every engine decoded exactly --new-tokens tokens
        assert row["tok_s"] > 0
    for engine in compare.ENGINES:
        assert 0 < data["engines"][engine]["peak_rss_mib"] < 4096
        # each engine's RSS is its own: the tfserve children hold no PyTorch
        assert data["engines"][engine]["torch_imported"] == (engine == "hf-eager")
    assert "tfserve-fp32/ct2-fp32/beam4-b32" in data["ratios"]
    # the same model in every engine: fp32 outputs agree with Hugging Face's
    for case in compare.QUICK_CASES:
        for engine in ("tfserve-fp32", "ct2-fp32"):
            assert data["agreement_with_hf"][case][engine]["tokens"] >= 0.9, (case, engine)
    assert "tfserve-fp32 / ct2-fp32" in printed and "peak RSS" in printed
