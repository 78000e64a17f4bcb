"""Search over a step function: greedy, beam search and sampling, written once for every backend.

The search code sees numpy logits and an opaque KV cache; a backend (`tfserve.runtime`'s
ONNX Runtime sessions, or `tfserve.model.eager`'s PyTorch model) runs the encoder and one decoder
step and knows how to select, concatenate and trim cache rows. What a step takes and gives is
the step contract of `tfserve.step` (Backend, StepOutput, SampleDraws), which both sides import
and which `backend` re-exports. It imports numpy only.

The searches advance rows that `tfserve.generation.batch.DecodeBatch` (continuous batching) steps
for
many of them at once; offline `tfserve.generation.batch.generate` is that loop with every search
added
up front.

Every search starts from a single row holding the decoder start token (the model's, or the
request's own: DecodingOptions.decoder_start_token_id); beam search and sampling fan out to
their beams / samples after the first step, so the first step and the cross-attention K/V
are never computed per beam.

Modules: `backend` (what a model must offer), `options` (DecodingOptions, Hypothesis),
`kernels` (numpy passes over logits and their thread pool), `controls` (repetition_penalty
and no_repeat_ngram_size over a search's rows), `search` (the Search base class
and the registry `make_search` picks from), one module per strategy (`greedy`, `beam`,
`sampling`). A new strategy is a module with a Search subclass decorated with
`register_search`, imported below.
"""

from tfserve.generation.backend import Backend, Cache, StepOutput, banned_tokens, narrow_first
from tfserve.generation.beam import BeamSearch
from tfserve.generation.controls import RepetitionControls, banned_ngram_tokens
from tfserve.generation.greedy import GreedySearch
from tfserve.generation.kernels import (
    PARALLEL_MIN_ELEMENTS,
    SCORE_BLOCK_ELEMENTS,
    filter_logits,
    log_softmax,
    logsumexp,
    numpy_pool,
    score_rows,
    top_k_unordered,
)
from tfserve.generation.options import DEFAULT_MAX_NEW_TOKENS, DecodingOptions, Hypothesis
from tfserve.generation.sampling import SamplingSearch
from tfserve.generation.search import (
    GroupDecision,
    Search,
    make_search,
    register_search,
    registered_searches,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "PARALLEL_MIN_ELEMENTS",
    "SCORE_BLOCK_ELEMENTS",
    "Backend",
    "BeamSearch",
    "Cache",
    "DecodingOptions",
    "GreedySearch",
    "GroupDecision",
    "Hypothesis",
    "RepetitionControls",
    "SamplingSearch",
    "Search",
    "StepOutput",
    "banned_ngram_tokens",
    "banned_tokens",
    "filter_logits",
    "log_softmax",
    "logsumexp",
    "make_search",
    "narrow_first",
    "numpy_pool",
    "register_search",
    "registered_searches",
    "score_rows",
    "top_k_unordered",
]
