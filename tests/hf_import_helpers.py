"""What the Hugging Face import tests share (tests/export/test_marian.py, test_t5.py,
test_families.py; their fixtures `exported`, `runtimes`, `imported` and `hf_tokenizers` are in
tests/export/conftest.py): transformers' tokenizer on a checkpoint, the teacher-forced logits
comparison, a continuous batch whose rows join at different steps, and copies of a
checkpoint with edited JSON files. Needs transformers and torch.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from export.cli import main as export_main
from export.verify import relative_diff
from tfserve.generation import DecodingOptions, make_search
from tfserve.generation.batch import DecodeBatch, Joining

RELATIVE_TOLERANCE = 1e-5  # |ours - transformers| / the row's largest |logit|
JOIN_STEPS = (0, 3, 7, 11, 16)  # where the groups of `continuous_batch` join
JOIN_GROUP = 10  # inputs per group


def auto_tokenizer(directory: Path, source_language: str = "") -> Any:
    """transformers' AutoTokenizer on the checkpoint (the reference for token ids), with
    the checkpoint's default source language or `source_language`."""
    from transformers import AutoTokenizer

    kwargs = {"src_lang": source_language} if source_language else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(str(directory), **kwargs)


def export_each(directories: Mapping[str, Path], out: Path) -> dict[str, Path]:
    """name -> the artifacts directory `python -m export --from-hf` wrote under `out`."""
    exported = {}
    for name, directory in directories.items():
        target = out / name
        code = export_main(["--from-hf", str(directory), "--out", str(target), "--quiet"])
        assert code == 0, f"export of checkpoint {name} failed with exit code {code}"
        exported[name] = target
    return exported


# -- logits ---------------------------------------------------------------------------------


def teacher_forced(model: Any, batch: Any, first_id: int, end_id: int, length: int,
                   seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded random decoder inputs [B,T] of ids in [first_id, end_id), each row
    starting with the start token (row r > 0 ends with 3r pads), their mask, and
    transformers' logits for them over the source `batch`."""
    count = batch["input_ids"].shape[0]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(first_id, end_id, (count, length), generator=gen)
    ids[:, 0] = model.config.decoder_start_token_id
    mask = torch.ones_like(ids)
    for row in range(1, count):
        mask[row, length - 3 * row:] = 0
        ids[row, length - 3 * row:] = model.config.pad_token_id
    with torch.no_grad():
        expected = model(**batch, decoder_input_ids=ids, decoder_attention_mask=mask).logits
    return ids, mask, expected


def assert_logits_close(got: Any, expected: Any, keep: np.ndarray, what: str) -> None:
    """|got - expected| / the row's largest |logit| under RELATIVE_TOLERANCE where keep."""
    got, expected = np.asarray(got)[keep], np.asarray(expected)[keep]
    diff = relative_diff(got, expected)
    print(f"{what}: max |logits diff| / row scale vs transformers {diff:.2e}")
    assert diff < RELATIVE_TOLERANCE, what
    assert float(expected.std()) > 0.5  # the comparison is not between near-constants


def assert_onnx_logits_close(runtime: Any, model: Any, batch: Any, ids: torch.Tensor,
                             mask: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """The exported graphs' logits against transformers' (`teacher_forced`): all decoder
    inputs in one step, then one token per step through the KV cache."""
    source_ids, source_mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy()
    keep = mask.bool().numpy()
    _, cross = runtime.encode(source_ids, source_mask)
    rows, length = ids.shape
    positions = np.broadcast_to(np.arange(length), (rows, length))
    got = runtime.step(ids.numpy(), positions, mask.numpy(), source_mask,
                       runtime.empty_past(rows), cross).logits
    assert_logits_close(got, expected.numpy(), keep, f"{name} ONNX, all at once")
    past, steps = runtime.empty_past(rows), []
    for t in range(length):
        out = runtime.step(ids[:, t: t + 1].numpy(), np.full((rows, 1), t, np.int64),
                           np.ones((rows, t + 1), np.int64), source_mask, past, cross)
        past = out.present
        steps.append(out.logits)
    # step by step without decoder padding: every position of transformers' unpadded run
    with torch.no_grad():
        unpadded_logits = model(**batch, decoder_input_ids=ids).logits.numpy()
    assert_logits_close(np.concatenate(steps, axis=1), unpadded_logits, np.ones_like(keep),
                        f"{name} ONNX, cached")


# -- continuous batching --------------------------------------------------------------------


def unpadded(batch: Any) -> list[list[int]]:
    """The batch's sources without their padding."""
    return [[int(t) for t, m in zip(ids, mask) if m] for ids, mask in
            zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist())]


def continuous_batch(runtime: Any, batch: Any, options_of: Callable[[int, int], DecodingOptions]
                     ) -> tuple[dict[int, str], dict[int, list[int]]]:
    """One DecodeBatch over the batch's sources: greedy and beam 4 alternating
    (options_of(row, num_beams) gives each input's options), groups of JOIN_GROUP inputs
    joining the running batch at JOIN_STEPS, so that its rows sit at different positions
    with holes in front of the late ones' caches. Returns each input's mode ("greedy" or
    "beam4") and its output's tokens."""
    sources = unpadded(batch)
    rows = list(range(len(sources)))
    modes = {row: "beam4" if row % 2 else "greedy" for row in rows}
    joins = {step: rows[JOIN_GROUP * k: JOIN_GROUP * (k + 1)]
             for k, step in enumerate(JOIN_STEPS)}
    decode = DecodeBatch(runtime)
    results: dict[int, list[int]] = {}
    step = 0
    while step < 200 and len(results) < len(rows):
        if step in joins:
            group = joins[step]
            ids, mask = runtime.tokenizer.pad_batch([sources[r] for r in group])
            _, cross = runtime.encode(ids, mask)
            searches = [make_search(options_of(r, 4 if modes[r] == "beam4" else 1),
                                    runtime.eos_token_id, runtime.decoder_start_token_id)
                        for r in group]
            decode.join([Joining(searches, group, cross, mask)])
        for tag, search in decode.step():
            assert search.error is None
            results[tag] = search.results()[0].token_ids
        step += 1
    return modes, results


def assert_each_gets_its_own_answer(modes: dict[int, str], results: dict[int, list[int]],
                                    expected: Mapping[str, Sequence[list[int]]]) -> None:
    """Every input of `continuous_batch` got transformers' answer for it alone."""
    rows = sorted(modes)
    assert {row: results[row] for row in rows} == {row: expected[modes[row]][row]
                                                   for row in rows}


# -- refusals -------------------------------------------------------------------------------


def copy_checkpoint(checkpoints: Mapping[str, tuple[Any, ...]], tmp_path: Path,
                    name: str) -> Path:
    """A copy of checkpoint `name` (checkpoints: name -> (directory, ...)) to edit."""
    target = tmp_path / f"copy-{name}"
    shutil.copytree(checkpoints[name][0], target)
    return target


def edit_json(path: Path, **changes: Any) -> None:
    """Set the JSON object's fields in place; a None value removes the field."""
    data = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data), encoding="utf-8")
