"""The encoder-decoder Transformer in PyTorch: the eager reference every other backend matches.

Read in this order: positions (sinusoidal, RoPE, T5's relative position bias), attention,
layers (feed-forward, norms, encoder and decoder layers, embeddings), transformer (the stacks
and the model), checkpoint.

Shapes use B batch rows, S source length, T new target tokens, P past (cached) length,
H heads, Dh head dim, D model dim, V vocab, L layers.

The decoder is driven one way only, `decode_step`, which is exactly the exported decoder
graph's interface (see docs/graph-interface.md): new tokens, their per-row `position_ids`, a
`self_attention_mask` over past + new keys (0 = a hole), the encoder mask, the self-attention
cache and the cross-attention K/V. The full-sequence forward is the same call with an empty
past, so training, incremental decoding and export share one code path.
"""

from tfserve.model.attention import (  # noqa: F401
    FusedAttention,
    KVCache,
    MultiHeadAttention,
    blocked_to_bias,
    scaled_dot_product,
)
from tfserve.model.checkpoint import (  # noqa: F401
    CONFIG_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    load_checkpoint,
    load_state,
    save_checkpoint,
)
from tfserve.model.heads import merge_heads, split_heads  # noqa: F401
from tfserve.model.layers import (  # noqa: F401
    DecoderLayer,
    Embeddings,
    EncoderLayer,
    FeedForward,
    Residual,
    RMSNorm,
    make_norm,
    rows_of_groups,
)
from tfserve.model.positions import (  # noqa: F401
    FusedRotary,
    RelativePositionBias,
    Rope,
    RotaryEmbedding,
    apply_rope,
    bucket_of_distance,
    rotate,
    rotate_half,
    sinusoidal_table,
)
from tfserve.model.transformer import (  # noqa: F401
    Seq2SeqTransformer,
)
