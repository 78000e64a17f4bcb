"""The eager PyTorch backend of the search: `Seq2SeqTransformer` behind `generation.Backend`.

It is the reference the ONNX Runtime backend is compared against, and what
`python -m tfserve translate --eager` runs. Not on the serving path (it imports torch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tfserve.artifacts.manifest import TOP_CANDIDATES
from tfserve.generation import StepOutput, narrow_first
from tfserve.model import KVCache, Seq2SeqTransformer


class EagerBackend:
    """Runs the PyTorch model in inference mode; caches are lists of (key, value) tensors."""

    def __init__(self, model: Seq2SeqTransformer, device: str | torch.device = "cpu",
                 banned_token_ids: Sequence[int] | None = None) -> None:
        """banned_token_ids: the tokens no search produces (a runtime's, model.json's
        banned_token_ids); None: pad unless it is eos, the rule of an older export."""
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        cfg = model.config
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = cfg.eos_token_id
        self.pad_token_id = cfg.pad_token_id
        if banned_token_ids is not None:
            self.banned_token_ids = tuple(int(token) for token in banned_token_ids)
        self.decoder_start_token_id = cfg.decoder_start_token_id
        self.max_target_positions = cfg.max_target_positions
        self.max_source_positions = cfg.max_source_positions
        self.grouped_cross = True  # decode_step repeats grouped cross rows itself
        self.top_candidates = min(TOP_CANDIDATES, cfg.vocab_size)  # as model.top_candidates

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)

    @torch.inference_mode()
    def encode(self, input_ids: np.ndarray,
               attention_mask: np.ndarray) -> tuple[np.ndarray, KVCache]:
        hidden = self.model.encode(self._tensor(input_ids), self._tensor(attention_mask))
        return hidden.float().cpu().numpy(), self.model.cross_kv(hidden)

    @torch.inference_mode()
    def hidden_states(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Encoder hidden states [B,S,D] as float32."""
        hidden = self.model.encode(self._tensor(input_ids), self._tensor(attention_mask))
        return hidden.float().cpu().numpy()

    @torch.inference_mode()
    def step(
        self,
        input_ids: np.ndarray,
        position_ids: np.ndarray,
        self_attention_mask: np.ndarray,
        encoder_attention_mask: np.ndarray,
        past: KVCache,
        cross: KVCache,
        need_logits: bool = True,
    ) -> StepOutput:
        """One decoder call, with the top candidates the exported decoder graph computes."""
        logits, present = self.model.decode_step(
            self._tensor(input_ids),
            self._tensor(position_ids),
            self._tensor(self_attention_mask),
            self._tensor(encoder_attention_mask),
            past,
            cross,
        )
        top_log_probs, top_ids = self.model.top_candidates(logits)  # [B,T,K]
        return StepOutput(logits.float().cpu().numpy() if need_logits else None, present,
                          top_log_probs.cpu().numpy(), top_ids.cpu().numpy())

    def empty_past(self, rows: int) -> KVCache:
        return self.model.empty_cache(rows, self.device)

    def take_rows(self, cache: KVCache, index: np.ndarray, reuse: bool = False) -> KVCache:
        rows = torch.from_numpy(index).to(self.device)
        return [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in cache]

    def concat_rows(self, caches: Sequence[KVCache], length: int | None = None,
                    left: bool = False, first_rows: np.ndarray | None = None,
                    first_time: tuple[int, int] | None = None) -> KVCache:
        caches = narrow_first(self, caches, first_rows, first_time)
        if length is not None:
            caches = [self.pad_time(cache, length, left) for cache in caches]
        return [
            (torch.cat([c[i][0] for c in caches]), torch.cat([c[i][1] for c in caches]))
            for i in range(len(caches[0]))
        ]

    def pad_time(self, cache: KVCache, length: int, left: bool) -> KVCache:
        def pad(t: torch.Tensor) -> torch.Tensor:
            extra = length - t.shape[2]
            if extra <= 0:
                return t
            # F.pad pads the last dims first: (Dh left, Dh right, time left, time right)
            return torch.nn.functional.pad(t, (0, 0, extra, 0) if left else (0, 0, 0, extra))

        return [(pad(k), pad(v)) for k, v in cache]

    def slice_time(self, cache: KVCache, start: int, stop: int) -> KVCache:
        return [(k[:, :, start:stop].contiguous(), v[:, :, start:stop].contiguous())
                for k, v in cache]
