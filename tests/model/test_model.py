"""Model tests: KV-cache decoding, padding, positions, checkpoints, input checks, generation.

Every model is tiny (d_model 32, 2 heads, 2 layers, vocab 50) and random; the tests compare
two ways of computing the same numbers, so no trained weights are needed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import (
    NORMS,
    POSITIONS,
    decoder_inputs,
    describe,
    incremental_logits,
    max_masked_diff,
    padded_batch,
    tiny_config,
    tiny_model,
)

from tfserve.generation import DecodingOptions, make_search
from tfserve.generation.batch import DecodeBatch, generate
from tfserve.model import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    FusedRotary,
    RotaryEmbedding,
    Seq2SeqTransformer,
    apply_rope,
    load_checkpoint,
    merge_heads,
    save_checkpoint,
    sinusoidal_table,
    split_heads,
)
from tfserve.model.eager import EagerBackend

ATOL = 1e-5

# source padding (lengths 6 / 3 / 8) and mixed decoder lengths (7 / 4 / 5)
SRC_LENGTHS = [6, 3, 8]
TGT_LENGTHS = [7, 4, 5]


# -- incremental decoding with the KV cache ----------------------------------------------------


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("positions", POSITIONS)
def test_incremental_decode_matches_full_forward(positions: str, norm: str) -> None:
    model = tiny_model(positions, norm)
    src, src_mask = padded_batch(SRC_LENGTHS, seed=1)
    tgt, _ = decoder_inputs([max(TGT_LENGTHS)] * len(TGT_LENGTHS), seed=2)
    with torch.no_grad():
        full = model(src, src_mask, tgt)
    step = incremental_logits(model, src, src_mask, tgt, chunk=1)
    diff = float((full - step).abs().max())
    assert diff <= ATOL, (
        f"token-by-token decode differs from forward by {diff}: {describe(model.config)}"
    )


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("positions", POSITIONS)
def test_incremental_decode_with_padded_targets(positions: str, norm: str) -> None:
    """Mixed target lengths: right-padded decoder rows, padded new tokens masked out."""
    model = tiny_model(positions, norm)
    src, src_mask = padded_batch(SRC_LENGTHS, seed=3)
    tgt, tgt_mask = decoder_inputs(TGT_LENGTHS, seed=4)
    with torch.no_grad():
        full = model(src, src_mask, tgt, tgt_mask)
    step = incremental_logits(model, src, src_mask, tgt, tgt_mask, chunk=1)
    diff = max_masked_diff(full, step, tgt_mask)
    assert diff <= ATOL, (
        f"padded token-by-token decode differs from forward by {diff}: {describe(model.config)}"
    )


@pytest.mark.parametrize("chunk", [2, 3])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("positions", POSITIONS)
def test_chunked_decode_matches_full_forward(positions: str, norm: str, chunk: int) -> None:
    model = tiny_model(positions, norm)
    src, src_mask = padded_batch(SRC_LENGTHS, seed=5)
    tgt, tgt_mask = decoder_inputs(TGT_LENGTHS, seed=6)
    with torch.no_grad():
        full = model(src, src_mask, tgt, tgt_mask)
    chunked = incremental_logits(model, src, src_mask, tgt, tgt_mask, chunk=chunk)
    diff = max_masked_diff(full, chunked, tgt_mask)
    assert diff <= ATOL, (
        f"decode in chunks of {chunk} differs from forward by {diff}: {describe(model.config)}"
    )


@pytest.mark.parametrize(
    "overrides",
    [dict(tie_word_embeddings=False, final_logits_bias=True), dict(sinusoidal_layout="half"),
     dict(activation="relu", scale_embedding=False, attention_bias=False)],
    ids=["untied-bias", "half-layout", "relu-unscaled-nobias"],
)
def test_incremental_decode_other_variants(overrides: dict) -> None:
    model = tiny_model("sinusoidal", "pre", **overrides)
    src, src_mask = padded_batch(SRC_LENGTHS, seed=7)
    tgt, tgt_mask = decoder_inputs(TGT_LENGTHS, seed=8)
    with torch.no_grad():
        full = model(src, src_mask, tgt, tgt_mask)
    step = incremental_logits(model, src, src_mask, tgt, tgt_mask, chunk=1)
    diff = max_masked_diff(full, step, tgt_mask)
    assert diff <= ATOL, f"decode differs from forward by {diff}: {describe(model.config)}"


def test_decode_step_returns_grown_cache() -> None:
    model = tiny_model("rope", "pre")
    cfg = model.config
    src, src_mask = padded_batch([4, 2], seed=9)
    cross = model.cross_kv(model.encode(src, src_mask))
    past = model.empty_cache(2)
    assert len(past) == cfg.decoder_layers
    assert past[0][0].shape == (2, cfg.num_heads, 0, cfg.head_dim)
    ids = torch.tensor([[0, 5, 6], [0, 7, 8]])
    logits, present = model.decode_step(ids, torch.arange(3).expand(2, -1),
                                        torch.ones(2, 3, dtype=torch.int64), src_mask, past, cross)
    assert logits.shape == (2, 3, cfg.vocab_size)
    for key, value in present:
        assert key.shape == value.shape == (2, cfg.num_heads, 3, cfg.head_dim)


# -- padding invariance -------------------------------------------------------------------------


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("positions", POSITIONS)
def test_sentence_unchanged_when_batched_with_longer_ones(positions: str, norm: str) -> None:
    model = tiny_model(positions, norm)
    cfg = describe(model.config)
    src, src_mask = padded_batch([7, 3, 9], seed=10)  # row 1 is the short sentence
    tgt, tgt_mask = decoder_inputs([6, 2, 5], seed=11)
    alone_src, alone_mask = src[1:2, :3], src_mask[1:2, :3]
    alone_tgt, alone_tgt_mask = tgt[1:2, :2], tgt_mask[1:2, :2]
    with torch.no_grad():
        enc_alone = model.encode(alone_src, alone_mask)
        enc_batch = model.encode(src, src_mask)
        logits_alone = model(alone_src, alone_mask, alone_tgt, alone_tgt_mask)
        logits_batch = model(src, src_mask, tgt, tgt_mask)
    enc_diff = float((enc_alone[0] - enc_batch[1, :3]).abs().max())
    assert enc_diff <= ATOL, f"encoder output changed by padding ({enc_diff}): {cfg}"
    dec_diff = float((logits_alone[0] - logits_batch[1, :2]).abs().max())
    assert dec_diff <= ATOL, f"decoder logits changed by padding ({dec_diff}): {cfg}"


@pytest.mark.parametrize("positions", POSITIONS)
def test_masked_positions_are_ignored(positions: str) -> None:
    """Whatever ids sit under mask 0 (source and target), the valid outputs are the same."""
    model = tiny_model(positions, "pre")
    src, src_mask = padded_batch(SRC_LENGTHS, seed=12)
    tgt, tgt_mask = decoder_inputs(TGT_LENGTHS, seed=13)
    noisy_src = torch.where(src_mask.bool(), src, torch.randint(3, 50, src.shape))
    noisy_tgt = torch.where(tgt_mask.bool(), tgt, torch.randint(3, 50, tgt.shape))
    with torch.no_grad():
        enc = model.encode(src, src_mask)
        enc_noisy = model.encode(noisy_src, src_mask)
        logits = model(src, src_mask, tgt, tgt_mask)
        logits_noisy = model(noisy_src, src_mask, noisy_tgt, tgt_mask)
    cfg = describe(model.config)
    assert max_masked_diff(enc, enc_noisy, src_mask) <= ATOL, f"encoder reads padding: {cfg}"
    assert max_masked_diff(logits, logits_noisy, tgt_mask) <= ATOL, f"decoder reads padding: {cfg}"


@pytest.mark.parametrize("hole_fill", ["zeros", "noise"])
@pytest.mark.parametrize("positions", POSITIONS)
def test_rows_with_leading_holes_match_rows_decoded_alone(positions: str, hole_fill: str) -> None:
    """Continuous batching: row A joins row B after B decoded `history` tokens.

    A's cache is left-padded (mask 0) to B's length; both then decode together. Each row's
    logits must equal those of the row decoded alone, whatever the holes contain.
    """
    model = tiny_model(positions, "pre")
    cfg = model.config
    history, steps = 3, 4
    src_a, mask_a = padded_batch([4], seed=14)
    src_b, mask_b = padded_batch([7], seed=15)
    tgt_a, _ = decoder_inputs([steps], seed=16)
    tgt_b, _ = decoder_inputs([history + steps], seed=17)
    alone_a = incremental_logits(model, src_a, mask_a, tgt_a)
    alone_b = incremental_logits(model, src_b, mask_b, tgt_b)

    with torch.no_grad():
        cross_a = model.cross_kv(model.encode(src_a, mask_a))
        cross_b = model.cross_kv(model.encode(src_b, mask_b))
        # B alone for its first `history` tokens
        _, past_b = model.decode_step(tgt_b[:, :history], torch.arange(history)[None],
                                      torch.ones(1, history, dtype=torch.int64), mask_b,
                                      model.empty_cache(1), cross_b)
        # join: A's cache is all holes; A's cross K/V right-padded to B's source length
        source_len = src_b.shape[1]
        pad = source_len - src_a.shape[1]

        def hole(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(t) if hole_fill == "zeros" else torch.randn_like(t)

        past = [(torch.cat([hole(k), k]), torch.cat([hole(v), v])) for k, v in past_b]
        cross = [
            (torch.cat([torch.nn.functional.pad(ka, (0, 0, 0, pad)), kb]),
             torch.cat([torch.nn.functional.pad(va, (0, 0, 0, pad)), vb]))
            for (ka, va), (kb, vb) in zip(cross_a, cross_b, strict=True)
        ]
        enc_mask = torch.cat([torch.nn.functional.pad(mask_a, (0, pad)), mask_b])
        self_mask = torch.tensor([[0] * history, [1] * history])
        for step in range(steps):
            ids = torch.stack([tgt_a[0, step], tgt_b[0, history + step]])[:, None]
            position_ids = torch.tensor([[step], [history + step]])
            self_mask = torch.cat([self_mask, torch.ones(2, 1, dtype=torch.int64)], dim=1)
            logits, past = model.decode_step(ids, position_ids, self_mask, enc_mask, past, cross)
            diff_a = float((logits[0, 0] - alone_a[0, step]).abs().max())
            diff_b = float((logits[1, 0] - alone_b[0, history + step]).abs().max())
            assert diff_a <= ATOL, (
                f"late row with {hole_fill} holes differs at step {step} by {diff_a}: "
                f"{describe(cfg)}"
            )
            assert diff_b <= ATOL, (
                f"row with history differs at step {step} by {diff_b}: {describe(cfg)}"
            )


# -- RoPE ---------------------------------------------------------------------------------------


def _rotated_dot(rope: RotaryEmbedding, q: torch.Tensor, k: torch.Tensor, m: int, n: int) -> float:
    return float((apply_rope(q, rope(torch.tensor([[m]]))) *
                  apply_rope(k, rope(torch.tensor([[n]])))).sum())


def test_rope_dot_product_depends_only_on_relative_position() -> None:
    head_dim = 16
    rope = RotaryEmbedding(head_dim, 10000.0, 64)
    q = torch.randn(1, 1, 1, head_dim)
    k = torch.randn(1, 1, 1, head_dim)
    base = _rotated_dot(rope, q, k, 5, 2)
    for m, n in [(13, 10), (3, 0), (40, 37)]:
        other = _rotated_dot(rope, q, k, m, n)
        assert abs(base - other) <= 1e-4, f"offset 3 at ({m},{n}) gives {other}, at (5,2) {base}"
    for m, n in [(5, 3), (2, 5), (9, 2)]:
        other = _rotated_dot(rope, q, k, m, n)
        assert abs(base - other) > 1e-3, f"offset {m - n} gives the same dot as offset 3"


def test_fused_rotary_reference_equals_the_eager_rotation() -> None:
    """FusedRotary (what the fp32 graphs trace) looks the angles up in the tables: the same
    rotation as apply_rope's on-the-fly angles, bit for bit, on heads side by side."""
    heads, head_dim = 3, 8
    rope = RotaryEmbedding(head_dim, 10000.0, 64)
    positions = torch.tensor([[0, 5, 63], [7, 2, 40]])  # [B,T], rows with their own positions
    x = torch.randn(2, 3, heads * head_dim)  # [B,T,D]
    fused = FusedRotary.apply(x, positions, rope.cos_table, rope.sin_table, heads)
    eager = merge_heads(apply_rope(split_heads(x, heads, head_dim), rope(positions)))
    assert torch.equal(fused, eager)


@pytest.mark.parametrize("norm", NORMS)
def test_rope_decoder_depends_only_on_relative_positions(norm: str) -> None:
    """Shifting every decoder position by a constant leaves RoPE logits unchanged.

    Catches queries and keys rotated inconsistently (e.g. cached keys left unrotated), which
    the incremental-vs-full comparison cannot see since both paths share the code.
    """
    model = tiny_model("rope", norm)
    src, src_mask = padded_batch(SRC_LENGTHS, seed=18)
    tgt, tgt_mask = decoder_inputs([5, 5, 5], seed=19)
    with torch.no_grad():
        cross = model.cross_kv(model.encode(src, src_mask))
        outputs = []
        for offset in (0, 7):
            positions = torch.arange(5).expand(3, -1) + offset
            logits, _ = model.decode_step(tgt, positions, tgt_mask, src_mask, model.empty_cache(3),
                                          cross)
            outputs.append(logits)
    diff = float((outputs[0] - outputs[1]).abs().max())
    assert diff <= 1e-4, f"RoPE decoder logits change with a position offset ({diff}): " + describe(
        model.config)


def test_rope_is_a_rotation() -> None:
    head_dim = 8
    rope = RotaryEmbedding(head_dim, 10000.0, 64)
    x = torch.randn(2, 3, 5, head_dim)  # [B,H,T,Dh]
    position_ids = torch.tensor([[0, 1, 2, 7, 100], [3, 3, 0, 9, 1]])
    angles = rope(position_ids)  # eager: no table, so position 100 is fine with 64 rows
    assert angles.cos.shape == angles.sin.shape == (2, 1, 5, head_dim)
    rotated = apply_rope(x, angles)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5), "RoPE changed norms"
    # position 0 is the identity
    assert torch.allclose(rotated[0, :, 0], x[0, :, 0], atol=1e-6)
    assert torch.allclose(rotated[1, :, 2], x[1, :, 2], atol=1e-6)


def test_rope_pairs_dimension_i_with_i_plus_half() -> None:
    """Dims (i, i + Dh/2) rotate together by angle pos * base^(-2i/Dh)."""
    head_dim, base, pos = 8, 10000.0, 3
    angles = RotaryEmbedding(head_dim, base, 8)(torch.tensor([[pos]]))
    for i in range(head_dim // 2):
        x = torch.zeros(1, 1, 1, head_dim)
        x[..., i] = 1.0
        out = apply_rope(x, angles)[0, 0, 0]
        angle = pos * base ** (-2 * i / head_dim)
        expected = torch.zeros(head_dim)
        expected[i] = math.cos(angle)
        expected[i + head_dim // 2] = math.sin(angle)
        assert torch.allclose(out, expected, atol=1e-6), f"pair {i}: {out} != {expected}"


# -- sinusoidal positions -------------------------------------------------------------------------


def _paper_table(num_positions: int, dim: int) -> np.ndarray:
    table = np.zeros((num_positions, dim), dtype=np.float64)
    for pos in range(num_positions):
        for i in range(dim // 2):
            angle = pos / 10000.0 ** (2 * i / dim)
            table[pos, 2 * i] = math.sin(angle)
            table[pos, 2 * i + 1] = math.cos(angle)
    return table


@pytest.mark.parametrize("num_positions,dim", [(50, 16), (600, 32)])
def test_sinusoidal_table_matches_paper_formula(num_positions: int, dim: int) -> None:
    expected = _paper_table(num_positions, dim)
    table = sinusoidal_table(num_positions, dim)
    assert table.dtype == torch.float32 and table.shape == (num_positions, dim)
    diff = np.abs(table.double().numpy() - expected).max()
    assert diff <= 1e-6, f"interleaved table differs from the paper formula by {diff}"


@pytest.mark.parametrize("num_positions,dim", [(50, 16), (600, 32)])
def test_sinusoidal_half_layout(num_positions: int, dim: int) -> None:
    paper = _paper_table(num_positions, dim)
    expected = np.concatenate([paper[:, 0::2], paper[:, 1::2]], axis=1)  # [sin... | cos...]
    table = sinusoidal_table(num_positions, dim, layout="half")
    diff = np.abs(table.double().numpy() - expected).max()
    assert diff <= 1e-6, f"half-layout table differs from [sin | cos] by {diff}"


def test_sinusoidal_table_rejects_unknown_layout() -> None:
    with pytest.raises(ValueError, match="layout"):
        sinusoidal_table(4, 8, layout="bogus")


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_model_uses_configured_sinusoidal_layout(layout: str) -> None:
    model = Seq2SeqTransformer(tiny_config("sinusoidal", sinusoidal_layout=layout))
    cfg = model.config
    assert torch.equal(model.encoder_embed.position_table,
                       sinusoidal_table(cfg.max_source_positions, cfg.d_model, layout))
    assert torch.equal(model.decoder_embed.position_table,
                       sinusoidal_table(cfg.max_target_positions, cfg.d_model, layout))


# -- checkpoints ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tie,bias",
    [(True, False), (False, False), (True, True), (False, True)],
    ids=["tied", "untied", "tied-bias", "untied-bias"],
)
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_checkpoint_round_trip(tmp_path, positions: str, tie: bool, bias: bool) -> None:
    model = tiny_model(positions, "pre", tie_word_embeddings=tie, final_logits_bias=bias)
    save_checkpoint(model, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / CONFIG_FILE).is_file()
    assert (tmp_path / "ckpt" / WEIGHTS_FILE).is_file()
    loaded = load_checkpoint(tmp_path / "ckpt")
    cfg = describe(model.config)
    assert loaded.config == model.config, f"config changed on round trip: {cfg}"
    assert not loaded.training
    if tie:
        assert loaded.lm_head.weight is loaded.shared.weight, f"tie lost on load: {cfg}"
    else:
        assert loaded.lm_head.weight is not loaded.shared.weight
    original, restored = model.state_dict(), loaded.state_dict()
    assert original.keys() == restored.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, restored[name]), f"{name} changed on round trip: {cfg}"
    src, src_mask = padded_batch(SRC_LENGTHS, seed=20)
    tgt, tgt_mask = decoder_inputs(TGT_LENGTHS, seed=21)
    with torch.no_grad():
        expected, got = model(src, src_mask, tgt, tgt_mask), loaded(src, src_mask, tgt, tgt_mask)
    assert torch.equal(expected, got), f"outputs changed on round trip: {cfg}"


@pytest.fixture
def saved_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    save_checkpoint(tiny_model("sinusoidal", "post"), directory)
    return directory


def _assert_checkpoint_error(directory, path) -> None:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(directory)
    assert str(path) in str(info.value), f"message does not name {path}: {info.value}"


def test_checkpoint_missing_directory(tmp_path) -> None:
    missing = tmp_path / "nope"
    _assert_checkpoint_error(missing, missing)


def test_checkpoint_missing_config(saved_checkpoint) -> None:
    (saved_checkpoint / CONFIG_FILE).unlink()
    _assert_checkpoint_error(saved_checkpoint, saved_checkpoint / CONFIG_FILE)


def test_checkpoint_missing_weights(saved_checkpoint) -> None:
    (saved_checkpoint / WEIGHTS_FILE).unlink()
    _assert_checkpoint_error(saved_checkpoint, saved_checkpoint / WEIGHTS_FILE)


@pytest.mark.parametrize("damage", ["truncated", "header-only", "garbage", "empty"])
def test_checkpoint_corrupt_weights(saved_checkpoint, damage: str) -> None:
    weights = saved_checkpoint / WEIGHTS_FILE
    data = weights.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    corrupted = {
        "truncated": data[: len(data) // 2],
        "header-only": data[: 8 + header_len],
        "garbage": bytes(np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8)),
        "empty": b"",
    }[damage]
    weights.write_bytes(corrupted)
    _assert_checkpoint_error(saved_checkpoint, weights)


def test_checkpoint_corrupt_config(saved_checkpoint) -> None:
    """A broken config.json is refused with its path (as a ConfigError, also a ValueError)."""
    config_path = saved_checkpoint / CONFIG_FILE
    config_path.write_text('{"vocab_size": 50, "d_model": ', encoding="utf-8")
    with pytest.raises(ValueError) as info:
        load_checkpoint(saved_checkpoint)
    assert str(config_path) in str(info.value), f"message does not name {config_path}"


@pytest.mark.parametrize(
    "other",
    [dict(vocab_size=60), dict(ffn_dim=48), dict(tie_word_embeddings=False),
     dict(positions="learned")],
    ids=["vocab", "ffn", "untied", "learned-positions"],
)
def test_checkpoint_weights_from_another_config(saved_checkpoint, other: dict) -> None:
    tiny_config(**{"positions": "sinusoidal", "norm": "post", **other}).save(
        saved_checkpoint / CONFIG_FILE)
    _assert_checkpoint_error(saved_checkpoint, saved_checkpoint / WEIGHTS_FILE)


# -- input checks -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", [50, 1000, -1])
def test_encode_rejects_out_of_range_ids(bad_id: int) -> None:
    model = tiny_model()
    ids = torch.tensor([[5, 6, bad_id]])
    with pytest.raises(ValueError, match="input_ids"):
        model.encode(ids, torch.ones_like(ids))


@pytest.mark.parametrize("bad_id", [50, 1000, -1])
def test_decode_step_rejects_out_of_range_ids(bad_id: int) -> None:
    model = tiny_model()
    src, src_mask = padded_batch([3])
    cross = model.cross_kv(model.encode(src, src_mask))
    ids = torch.tensor([[0, bad_id]])
    with pytest.raises(ValueError, match="decoder input_ids"):
        model.decode_step(ids, torch.arange(2)[None], torch.ones(1, 2, dtype=torch.int64),
                          src_mask, model.empty_cache(1), cross)


def test_encode_rejects_float_ids() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="input_ids"):
        model.encode(torch.tensor([[3.0, 4.0]]), torch.ones(1, 2, dtype=torch.int64))


def test_encode_rejects_too_long_source() -> None:
    model = tiny_model()
    ids = torch.full((1, 33), 5)
    with pytest.raises(ValueError, match="max_source_positions"):
        model.encode(ids, torch.ones_like(ids))


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
@pytest.mark.parametrize("bad_position", [32, -1])
def test_decode_step_rejects_out_of_range_positions(positions: str, bad_position: int) -> None:
    model = tiny_model(positions)
    src, src_mask = padded_batch([3])
    cross = model.cross_kv(model.encode(src, src_mask))
    with pytest.raises(ValueError, match="position_ids"):
        model.decode_step(torch.tensor([[4]]), torch.tensor([[bad_position]]),
                          torch.ones(1, 1, dtype=torch.int64), src_mask, model.empty_cache(1),
                          cross)


# -- generation with the eager backend ------------------------------------------------------------

MAX_NEW = 12
GEN_SRC_LENGTHS = [5, 9, 3, 7]


def generation_model() -> Seq2SeqTransformer:
    """A random model whose eos bias makes sentences stop at different steps (or never)."""
    model = tiny_model("rope", "pre", seed=3, final_logits_bias=True)
    with torch.no_grad():
        model.final_logits_bias[model.config.eos_token_id] = 3.0
    return model


@torch.no_grad()
def hand_greedy(model: Seq2SeqTransformer, src: torch.Tensor, src_mask: torch.Tensor,
                max_new_tokens: int) -> tuple[list[int], float, bool]:
    """Greedy decoding by re-running the full forward on the growing prefix.

    As the search does, the pad token is never generated (unless pad is also eos): it is
    banned after the log-softmax, without renormalising (Hugging Face's bad_words_ids).
    """
    cfg = model.config
    prefix = [cfg.decoder_start_token_id]
    tokens: list[int] = []
    score = 0.0
    for _ in range(max_new_tokens):
        logits = model(src, src_mask, torch.tensor([prefix]))[0, -1].double()
        logprobs = torch.log_softmax(logits, dim=-1)
        if cfg.pad_token_id != cfg.eos_token_id:
            logprobs[cfg.pad_token_id] = -math.inf
        token = int(logprobs.argmax())
        score += float(logprobs[token])
        if token == cfg.eos_token_id:
            return tokens, score, True
        tokens.append(token)
        prefix.append(token)
    return tokens, score, False


def test_greedy_generation_matches_hand_written_loop() -> None:
    model = generation_model()
    src, src_mask = padded_batch(GEN_SRC_LENGTHS, seed=3)
    results = generate(EagerBackend(model), src.numpy(), src_mask.numpy(),
                       DecodingOptions(max_new_tokens=MAX_NEW))
    lengths = set()
    for row, length in enumerate(GEN_SRC_LENGTHS):
        (hyp,) = results[row]
        tokens, score, finished = hand_greedy(model, src[row : row + 1, :length],
                                              src_mask[row : row + 1, :length], MAX_NEW)
        assert hyp.token_ids == tokens, f"row {row}: {hyp.token_ids} != {tokens}"
        assert hyp.finished == finished, f"row {row}"
        assert abs(hyp.score - score) <= ATOL, f"row {row}: score {hyp.score} != {score}"
        lengths.add((len(tokens), finished))
    # the setup is chosen so rows leave the batch at different steps; keep it that way
    assert len(lengths) >= 3, f"test setup degenerated, all rows alike: {lengths}"


@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beam3"])
def test_generation_is_batch_invariant(num_beams: int) -> None:
    model = generation_model()
    backend = EagerBackend(model)
    src, src_mask = padded_batch(GEN_SRC_LENGTHS, seed=3)
    options = DecodingOptions(max_new_tokens=MAX_NEW, num_beams=num_beams,
                              num_return_sequences=num_beams)
    batched = generate(backend, src.numpy(), src_mask.numpy(), options)
    for row, length in enumerate(GEN_SRC_LENGTHS):
        alone = generate(backend, src[row : row + 1, :length].numpy(),
                         src_mask[row : row + 1, :length].numpy(), options)[0]
        assert len(alone) == len(batched[row]) == num_beams
        for rank, (a, b) in enumerate(zip(alone, batched[row], strict=True)):
            where = f"row {row} rank {rank} num_beams={num_beams}"
            assert a.token_ids == b.token_ids, f"{where}: alone {a.token_ids} vs {b.token_ids}"
            assert a.finished == b.finished, where
            assert abs(a.score - b.score) <= ATOL, f"{where}: alone {a.score} vs {b.score}"


def test_seeded_sampling_is_batch_invariant() -> None:
    model = generation_model()
    backend = EagerBackend(model)
    src, src_mask = padded_batch(GEN_SRC_LENGTHS, seed=3)

    def options() -> DecodingOptions:
        return DecodingOptions(max_new_tokens=MAX_NEW, do_sample=True, num_return_sequences=2,
                               top_k=10, top_p=0.9, temperature=0.8, seed=1234)

    batched = generate(backend, src.numpy(), src_mask.numpy(), [options() for _ in range(4)])
    for row, length in enumerate(GEN_SRC_LENGTHS):
        alone = generate(backend, src[row : row + 1, :length].numpy(),
                         src_mask[row : row + 1, :length].numpy(), options())[0]
        assert [h.token_ids for h in alone] == [h.token_ids for h in batched[row]], f"row {row}"
        for a, b in zip(alone, batched[row], strict=True):
            assert abs(a.score - b.score) <= ATOL, f"row {row}: {a.score} vs {b.score}"


@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beam3"])
def test_search_joining_a_running_batch_matches_alone(num_beams: int) -> None:
    """Continuous batching through DecodeBatch: a search added after 3 steps of others."""
    model = generation_model()
    backend = EagerBackend(model)
    src, src_mask = padded_batch(GEN_SRC_LENGTHS, seed=3)
    options = DecodingOptions(max_new_tokens=MAX_NEW, num_beams=num_beams,
                              num_return_sequences=num_beams)
    cfg = model.config
    expected = [generate(backend, src[r : r + 1, :n].numpy(), src_mask[r : r + 1, :n].numpy(),
                         options)[0] for r, n in enumerate(GEN_SRC_LENGTHS)]

    def new_search():
        return make_search(options, cfg.eos_token_id, cfg.decoder_start_token_id)

    batch = DecodeBatch(backend)
    results: dict[int, list] = {}
    first = [1, 3]  # the long ones start
    _, cross = backend.encode(src[first].numpy(), src_mask[first].numpy())
    batch.add([new_search() for _ in first], first, cross, src_mask[first].numpy())
    for step in range(3 + MAX_NEW + 1):  # every search ends within MAX_NEW of joining
        if step == 3:  # the others join late, with holes in their caches
            late = [0, 2]
            width = max(GEN_SRC_LENGTHS[r] for r in late)
            _, cross = backend.encode(src[late, :width].numpy(), src_mask[late, :width].numpy())
            batch.add([new_search() for _ in late], late, cross, src_mask[late, :width].numpy())
        for tag, search in batch.step():
            results[tag] = search.results()
    assert len(batch) == 0 and sorted(results) == [0, 1, 2, 3]
    for row in range(4):
        assert len(expected[row]) == len(results[row]) == num_beams
        for a, b in zip(expected[row], results[row], strict=True):
            assert a.token_ids == b.token_ids, f"row {row}: {a.token_ids} vs {b.token_ids}"
            assert abs(a.score - b.score) <= ATOL, f"row {row}: {a.score} vs {b.score}"


@pytest.mark.parametrize(
    "options,name",
    [
        (dict(num_beams=0), "num_beams"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=0.0), "temperature"),
        (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(num_beams=17), "num_beams"),
        (dict(min_new_tokens=-1), "min_new_tokens"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(do_sample=True, num_beams=2), "num_beams"),
    ],
)
def test_decoding_options_validation(options: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        DecodingOptions(**options).validate()


def test_decoding_options_limit_from_backend() -> None:
    """generate() caps max_new_tokens at max_target_positions - 1."""
    model = tiny_model()
    src, src_mask = padded_batch([3])
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(EagerBackend(model), src.numpy(), src_mask.numpy(),
                 DecodingOptions(max_new_tokens=model.config.max_target_positions))
