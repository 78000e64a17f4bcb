"""Hugging Face BART checkpoints (bart-large, bart-large-cnn, distilbart) -> tfserve.

BART is the post-norm Transformer with learned positions (offset 2), a LayerNorm on the
embeddings and a final logits bias (export.importers.bart_family). It has no language codes:
its tokenizer (byte-level BPE, RobertaTokenizer) runs from tokenizer.json with the file's own
post-processor (`<s> text </s>`). Decoding starts from eos (decoder_start_token_id 2);
bart-large's generation settings force `<s>` as the first token (forced_bos_token_id 0),
which tfserve applies as the first output token (tfserve.artifacts.generation_defaults).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from export.importers.bart_family import Family, TokenizerInfo, hf_json_spec
from export.sources import Source

# fairseq flags of old BART configs; transformers' BartModel runs post-norm layers
# without final norms whatever they say
REFUSED = (("normalize_before", True, "pre-norm layers"),
           ("add_final_layer_norm", True, "a final LayerNorm after each stack"),
           ("normalize_embedding", False, "no LayerNorm on the embeddings"))


def tokenizer(directory: Path, config: dict[str, Any],
              tokenizer_config: dict[str, Any]) -> TokenizerInfo:
    read = hf_json_spec(directory, config, FAMILY, tokenizer_config, "BART")
    return TokenizerInfo(read.spec, built=read.built)


FAMILY = Family(
    kind="hf-bart",
    defaults={"vocab_size": 50265, "activation_function": "gelu", "scale_embedding": False,
              "decoder_start_token_id": 2},
    pre_norm=False,
    positions="learned",
    embedding_norm=True,
    final_logits_bias=True,
    tokenizer=tokenizer,
    refused=REFUSED,
)


def load(directory: Path, config: dict[str, Any]) -> Source:
    """export.importers entry point: a BART directory -> Source."""
    from export.importers.bart_family import load as load_family

    return load_family(FAMILY, directory, config)
