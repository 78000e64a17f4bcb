"""Hugging Face mBART checkpoints (mBART-50 and mBART-cc25, model_type "mbart") -> tfserve.

mBART is the pre-norm Transformer with a final LayerNorm per stack, learned positions
(offset 2), a LayerNorm on the embeddings and a final logits bias
(export.importers.bart_family). Both variants share the model; their tokenizers place the
language codes (`en_XX`, `fr_XX`, ...) differently, which tokenizer_config.json's
tokenizer_class tells apart:

- mBART-50 (MBart50Tokenizer): `[src_lang] text </s>`; decoding starts from eos and the
  target language is the forced first token (transformers' forced_bos_token_id);
- mBART-cc25 and its fine-tunes (MBartTokenizer): `text </s> [src_lang]`; decoding starts
  from the target language token itself (decoder_start_token_id), so the model has the one
  target language its config names.

Without a tokenizer_class, a tokenizer holding mBART-50's own codes (`af_ZA`, ...) is read as
mBART-50, else as cc25. The tokenizer runs from tokenizer.json without its post-processor
(which holds the source language it was saved with); tfserve places the request's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from export.importers.bart_family import (
    Family,
    TokenizerInfo,
    checkpoint_language,
    hf_json_spec,
    special_added_tokens,
    tokenizer_class,
)
from export.sources import Source, SourceError
from tfserve.text.languages import LanguageConventions

CODE = re.compile(r"^[a-z]{2}_[A-Z]{2}$")  # en_XX, fr_XX, zh_CN
MBART50_ONLY = ("af_ZA", "az_AZ", "bn_IN", "fa_IR", "he_IL", "pl_PL", "pt_XX", "sv_SE")
DEFAULT_SOURCE = "en_XX"  # MBartTokenizer's and MBart50Tokenizer's src_lang default

REFUSED = (("normalize_before", False, "post-norm layers"),
           ("add_final_layer_norm", False, "no final LayerNorm"))


def variant(tokenizer_config: dict[str, Any], codes: dict[str, int]) -> str:
    """"mbart-50" or "mbart-cc25" (module docstring)."""
    name = tokenizer_class(tokenizer_config)
    if name == "MBart50Tokenizer":
        return "mbart-50"
    if name == "MBartTokenizer":
        return "mbart-cc25"
    return "mbart-50" if any(code in codes for code in MBART50_ONLY) else "mbart-cc25"


def tokenizer(directory: Path, config: dict[str, Any],
              tokenizer_config: dict[str, Any]) -> TokenizerInfo:
    read = hf_json_spec(directory, config, FAMILY, tokenizer_config, "mBART")
    spec = read.spec
    codes = {token: token_id for token, token_id in special_added_tokens(read.loaded).items()
             if CODE.match(token)}
    if not codes:
        raise SourceError(f"{directory / spec.source} has no mBART language codes (special "
                          "tokens such as en_XX)")
    kind = variant(tokenizer_config, codes)
    source = checkpoint_language(tokenizer_config.get("src_lang"), codes)
    default_source = source or (DEFAULT_SOURCE if DEFAULT_SOURCE in codes else "")
    spec.languages = LanguageConventions(
        codes=codes, source_layout="prefix" if kind == "mbart-50" else "suffix",
        target_mode="forced" if kind == "mbart-50" else "start",
        default_source=default_source).to_dict()
    return TokenizerInfo(spec, source,
                         checkpoint_language(tokenizer_config.get("tgt_lang"), codes),
                         read.built)


FAMILY = Family(
    kind="hf-mbart",
    defaults={"vocab_size": 50265, "activation_function": "gelu", "scale_embedding": False},
    pre_norm=True,
    positions="learned",
    embedding_norm=True,
    final_logits_bias=True,
    tokenizer=tokenizer,
    refused=REFUSED,
)


def load(directory: Path, config: dict[str, Any]) -> Source:
    """export.importers entry point: an mBART directory -> Source."""
    from export.importers.bart_family import load as load_family

    return load_family(FAMILY, directory, config)
