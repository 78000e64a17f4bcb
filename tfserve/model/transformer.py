"""The encoder-decoder stacks and the model: `Seq2SeqTransformer`."""

from __future__ import annotations

import torch
from torch import nn

from tfserve.artifacts.manifest import TOP_CANDIDATES
from tfserve.artifacts.model_config import ModelConfig
from tfserve.model.attention import KVCache, blocked_to_bias, mask_bias
from tfserve.model.layers import DecoderLayer, Embeddings, EncoderLayer, make_norm
from tfserve.model.positions import RelativePositionBias, RotaryEmbedding

# ModelConfig.extra key: the modules (names or name suffixes, e.g. "ffn.fc2") that stay
# float32 when the model is cast to a half precision (`Seq2SeqTransformer.to_precision`)
KEEP_IN_FP32 = "keep_in_fp32_modules"
HALF_DTYPES = (torch.float16, torch.bfloat16)


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder Transformer with an incremental (KV-cached) decoder."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        shared = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_token_id)
        self.shared = shared
        # an encoder-only model (decoder_layers 0) has no decoder parts at all: no decoder
        # embeddings, norm, position bias or output projection
        decoder = not cfg.encoder_only
        self.encoder_embed = Embeddings(cfg, shared, cfg.max_source_positions)
        self.decoder_embed = (Embeddings(cfg, shared, cfg.max_target_positions) if decoder
                              else None)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        pre = cfg.norm == "pre"
        # pre-norm stacks leave the residual stream unnormalised, so each ends with a norm
        self.encoder_norm = make_norm(cfg) if pre else None
        self.decoder_norm = make_norm(cfg) if pre and decoder else None
        rope = cfg.positions == "rope"
        max_positions = max(cfg.max_source_positions, cfg.max_target_positions)
        self.rope = (RotaryEmbedding(cfg.head_dim, cfg.rope_base, max_positions) if rope
                     else None)
        # T5: one relative position bias per stack, shared by its layers' self-attention
        relative = cfg.positions == "relative"
        self.encoder_positions = RelativePositionBias(
            cfg.relative_buckets, cfg.relative_max_distance, cfg.num_heads, bidirectional=True
        ) if relative else None
        self.decoder_positions = RelativePositionBias(
            cfg.relative_buckets, cfg.relative_max_distance, cfg.num_heads, bidirectional=False
        ) if relative and decoder else None
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if decoder else None
        if self.lm_head is not None and cfg.tie_word_embeddings:
            self.lm_head.weight = shared.weight
        if cfg.final_logits_bias and decoder:
            self.final_logits_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        else:
            self.final_logits_bias = None
        # export-time switch (export.graphs): trace attention as ONNX Runtime's fused
        # MultiHeadAttention op; the eager maths are the same either way
        self.use_fused_attention = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.d_model**-0.5
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.shared.weight, std=std)
        if self.lm_head is not None and not self.config.tie_word_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)
        with torch.no_grad():
            self.shared.weight[self.config.pad_token_id].zero_()

    def fp32_module_names(self) -> list[str]:
        """The modules the config keeps in float32 in a half-precision model
        (extra["keep_in_fp32_modules"]: each a module name or a suffix after a dot)."""
        kept = self.config.extra.get(KEEP_IN_FP32) or []
        return [name for name, _ in self.named_modules() if name and any(
            name == suffix or name.endswith("." + suffix) for suffix in kept)]

    def to_precision(self, dtype: torch.dtype) -> Seq2SeqTransformer:
        """Cast the model to `dtype` in place and return it; in a half precision, the modules
        of fp32_module_names stay float32 (T5's FFN output projection, as transformers'
        `_keep_in_fp32_modules = ["wo"]` keeps it: T5 v1.1's FFN outputs exceed float16's
        range). float32 casts every module."""
        self.to(dtype)
        if dtype in HALF_DTYPES:
            modules = dict(self.named_modules())
            for name in self.fp32_module_names():
                modules[name].float()
        return self

    # -- input checks (eager only: they would be data-dependent branches in a traced graph) --

    def _check_ids(self, name: str, ids: torch.Tensor, limit: int) -> None:
        if torch.jit.is_tracing() or torch.compiler.is_compiling():
            return
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must be an integer tensor, got {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
            raise ValueError(
                f"{name} holds ids outside [0, {limit}): min {int(ids.min())}, max {int(ids.max())}"
            )

    # -- encoder ------------------------------------------------------------------------------

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask [B,S] (1 token, 0 pad) -> encoder hidden states [B,S,D]."""
        self._check_ids("input_ids", input_ids, self.config.vocab_size)
        if not (torch.jit.is_tracing() or torch.compiler.is_compiling()):
            if input_ids.shape[1] > self.config.max_source_positions:
                raise ValueError(
                    f"input_ids length {input_ids.shape[1]} exceeds max_source_positions "
                    f"{self.config.max_source_positions}"
                )
        seq_len = input_ids.shape[1]
        position_ids = torch.arange(seq_len, device=input_ids.device)[None, :]  # [1,S]
        position_ids = position_ids.expand_as(input_ids)  # [B,S]
        if self.config.position_padding:
            # fairseq counts the non-pad tokens: a pad inside the text takes no position
            # (Embeddings gives pads the zero row) and the tokens after it are numbered as
            # if it were not there
            counted = (input_ids != self.config.pad_token_id).long()  # [B,S]
            position_ids = counted.cumsum(dim=1) - 1  # [B,S]
        x = self.encoder_embed(input_ids, position_ids)
        mask = attention_mask[:, None, None, :] == 0  # [B,1,1,S] keys that are padding
        position_bias = None
        if self.encoder_positions is not None:
            # every row's positions are 0..S-1: one bias for all rows
            position_bias = self.encoder_positions(position_ids[:1], position_ids[:1])  # [1,H,S,S]
        if self.use_fused_attention:
            if position_bias is not None:
                # [1,H,S,S] -> [B,H,S,S], mask_bias where a key is padding
                mask = position_bias.to(x.dtype).masked_fill(mask, mask_bias(x.dtype))
                position_bias = None
            else:
                # the fused kernel wants the bias at its full [B,1,S,S] shape
                mask = blocked_to_bias(mask.expand(-1, -1, seq_len, -1), x.dtype)
        rope = self.rope(position_ids) if self.rope is not None else None
        for layer in self.encoder_layers:
            x = layer(x, mask, rope, position_bias)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return x

    def cross_kv(self, encoder_hidden_states: torch.Tensor) -> KVCache:
        """Every decoder layer's cross-attention K/V, computed once per source: [B,H,S,Dh]."""
        return [layer.cross_attn.project_kv(encoder_hidden_states) for layer in self.decoder_layers]

    # -- decoder ------------------------------------------------------------------------------

    def empty_cache(self, batch: int, device: torch.device | None = None,
                    dtype: torch.dtype | None = None) -> KVCache:
        """A P = 0 self-attention cache for the first step."""
        dtype = dtype or self.shared.weight.dtype
        shape = (batch, self.config.num_heads, 0, self.config.head_dim)  # [B,H,0,Dh]
        return [
            (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device,
                                                                         dtype=dtype))
            for _ in self.decoder_layers
        ]

    def decode_step(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        self_attention_mask: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        past: KVCache,
        cross: KVCache,
    ) -> tuple[torch.Tensor, KVCache]:
        """One decoder call over T new tokens; returns logits [B,T,V] and the grown cache.

        input_ids, position_ids [B,T]; self_attention_mask [B,P+T] (0 = a hole: a cache slot
        this row never filled); encoder_attention_mask [B,S]; past [B,H,P,Dh] per layer;
        cross [B,H,S,Dh] per layer. New token t sits at key index P + t and may see the keys
        j <= P + t that its row's mask marks valid (look-ahead + padding masks). With relative
        positions, query t is at position_ids[:, t] and a key at the number of slots its row
        filled before it.
        """
        if self.decoder_embed is None or self.lm_head is None:
            raise ValueError("an encoder-only model (decoder_layers 0) has no decoder: it "
                             "encodes, it does not generate")
        self._check_ids("decoder input_ids", input_ids, self.config.vocab_size)
        if (self.config.positions != "rope" and not torch.jit.is_tracing()
                and not torch.compiler.is_compiling() and position_ids.numel()):
            limit = self.config.max_target_positions
            if int(position_ids.max()) >= limit or int(position_ids.min()) < 0:
                raise ValueError(f"position_ids must be in [0, max_target_positions={limit})")
        new_len = input_ids.shape[1]
        total_len = self_attention_mask.shape[1]
        query_pos = torch.arange(new_len, device=input_ids.device) + (total_len - new_len)  # [T]
        key_pos = torch.arange(total_len, device=input_ids.device)  # [P+T]
        future = key_pos[None, :] > query_pos[:, None]  # [T,P+T] look-ahead
        self_blocked = (self_attention_mask[:, None, None, :] == 0) | future  # [B,1,T,P+T]
        # the cross K/V and encoder mask may have one row per group of G consecutive rows
        # (a beam search's rows share their sentence's): Bc = B / G rows
        cross_blocked = encoder_attention_mask[:, None, None, :] == 0  # [Bc,1,1,S]
        position_bias = None
        if self.decoder_positions is not None:
            # a key's position is the number of keys its row filled before it: rows that
            # joined a running batch have holes (mask 0) in front of their first token
            key_positions = self_attention_mask.cumsum(dim=1) - 1  # [B,P+T]
            position_bias = self.decoder_positions(position_ids, key_positions)  # [B,H,T,P+T]
        if self.use_fused_attention:
            # additive biases at the full shapes the fused kernel takes: [B,1,T,P+T] (with
            # relative positions [B,H,T,P+T]: the position bias per head, mask_bias where
            # blocked) and, with a group's queries side by side, [Bc,1,G*T,S]
            dtype = self.shared.weight.dtype
            if position_bias is not None:
                self_blocked = position_bias.to(dtype).masked_fill(
                    self_blocked, mask_bias(dtype))
                position_bias = None
            else:
                self_blocked = blocked_to_bias(self_blocked, dtype)  # type: ignore[assignment]
            group_queries = input_ids.shape[0] * new_len // encoder_attention_mask.shape[0]
            cross_blocked = blocked_to_bias(
                cross_blocked.expand(-1, -1, group_queries, -1), dtype)

        x = self.decoder_embed(input_ids, position_ids)
        rope = self.rope(position_ids) if self.rope is not None else None
        present: KVCache = []
        for layer, layer_past, layer_cross in zip(self.decoder_layers, past, cross):
            x, kv = layer(x, self_blocked, cross_blocked, layer_past, layer_cross, rope,
                          position_bias)
            present.append(kv)
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        if self.config.output_scale != 1.0:
            x = x * self.config.output_scale  # T5 v1.0's tied output projection: d_model^-0.5
        logits = self.lm_head(x)  # [B,T,V]
        if self.final_logits_bias is not None:
            logits = logits + self.final_logits_bias
        return logits, present

    def top_candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each position's best K = min(TOP_CANDIDATES, V) log-probabilities [B,T,K] (float32
        even for fp16 logits: the search's scores accumulate them; best first) and their token
        ids [B,T,K]: the decoder graph's top outputs, and the eager backend's."""
        k = min(TOP_CANDIDATES, self.config.vocab_size)
        # no cast of fp32 logits: traced, .float() is a Cast that copies [B,T,V] every step
        # (ONNX Runtime keeps it, its output being a graph output)
        scores = logits if logits.dtype == torch.float32 else logits.float()
        return scores.log_softmax(dim=-1).topk(k, dim=-1)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        decoder_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher-forced logits [B,T,V] for right-padded decoder inputs [B,T]."""
        hidden = self.encode(input_ids, attention_mask)
        batch, tgt_len = decoder_input_ids.shape
        if decoder_attention_mask is None:
            decoder_attention_mask = torch.ones_like(decoder_input_ids)
        position_ids = torch.arange(tgt_len, device=decoder_input_ids.device).expand(batch, -1)
        logits, _ = self.decode_step(
            decoder_input_ids,
            position_ids,
            decoder_attention_mask,
            attention_mask,
            self.empty_cache(batch, decoder_input_ids.device, hidden.dtype),
            self.cross_kv(hidden),
        )
        return logits

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


# -- checkpoints ----------------------------------------------------------------------------
