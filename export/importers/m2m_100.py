"""Hugging Face M2M100 and NLLB-200 checkpoints (model_type "m2m_100") -> tfserve.

Both are the pre-norm Transformer with a final LayerNorm per stack and fairseq's sinusoidal
positions, counted from pad + 1 over the non-pad tokens (export.importers.bart_family).
Decoding starts from eos; the target language is the forced first token (transformers'
forced_bos_token_id), so requests into different languages share a batch. Their
tokenizers differ (tokenizer_config.json's tokenizer_class tells them apart):

- NLLB-200 (NllbTokenizer): tokenizer.json, run without its post-processor (which holds the
  source language it was saved with); the request's source language token goes first,
  `[src_lang] text </s>` (with `legacy_behaviour: true` in tokenizer_config.json, after:
  `text </s> [src_lang]`). Codes such as `fra_Latn` are the tokenizer's special tokens.
- M2M100 (M2M100Tokenizer): sentencepiece.bpe.model + vocab.json (no tokenizer.json),
  mapped as transformers maps them (tokenizer kind "spm-vocab",
  tfserve.text.tokenizers.spm_vocab);
  `__en__ text </s>`. The codes (`fr`, token `__fr__`) sit after vocab.json's ids, in the
  order of the list `language_codes` names ("m2m100": 100 languages, "wmt21": 8).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from export.importers.bart_family import (
    Family,
    TokenizerInfo,
    check_special_ids,
    checkpoint_language,
    hf_json_spec,
    special_added_tokens,
    tokenizer_class,
)
from export.importers.hf_files import read_json
from export.sources import Source, SourceError
from tfserve.text.languages import LanguageConventions
from tfserve.text.tokenizer import TokenizerSpec
from tfserve.text.tokenizers.spm_vocab import AddedToken

NLLB_CODE = re.compile(r"^[a-z]{3}_[A-Z][a-z]{3}$")  # fra_Latn, zho_Hans
SPM_FILE = "sentencepiece.bpe.model"
VOCAB_FILE = "vocab.json"

# transformers' M2M100Tokenizer: its language lists (FAIRSEQ_LANGUAGE_CODES), in id order
M2M100_CODES = {
    "m2m100": (
        "af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga "
        "gd gl gu ha he hi hr ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv "
        "mg mk ml mn mr ms my ne nl no ns oc or pa pl ps pt ro ru sd si sk sl so sq sr ss su "
        "sv sw ta th tl tn tr uk ur uz vi wo xh yi yo zh zu").split(),
    "wmt21": "en ha is ja cs ru zh de".split(),
}


def nllb_tokenizer(directory: Path, config: dict[str, Any],
                   tokenizer_config: dict[str, Any]) -> TokenizerInfo:
    read = hf_json_spec(directory, config, FAMILY, tokenizer_config, "NLLB")
    spec = read.spec
    codes = {token: token_id for token, token_id in special_added_tokens(read.loaded).items()
             if NLLB_CODE.match(token)}
    if not codes:
        raise SourceError(f"{directory / spec.source} has no NLLB language codes (special "
                          "tokens such as eng_Latn)")
    legacy = tokenizer_config.get("legacy_behaviour", False) is True
    source = checkpoint_language(tokenizer_config.get("src_lang"), codes)
    default_source = source or ("eng_Latn" if "eng_Latn" in codes else "")
    spec.languages = LanguageConventions(
        codes=codes, source_layout="suffix" if legacy else "prefix", target_mode="forced",
        default_source=default_source).to_dict()
    return TokenizerInfo(spec, source,
                         checkpoint_language(tokenizer_config.get("tgt_lang"), codes),
                         read.built)


def m2m100_tokenizer(directory: Path, config: dict[str, Any],
                     tokenizer_config: dict[str, Any]) -> TokenizerInfo:
    for name in (SPM_FILE, VOCAB_FILE):
        if not (directory / name).is_file():
            raise SourceError(f"M2M100 tokenizer file not found: {directory / name}")
    vocab = read_json(directory / VOCAB_FILE, "M2M100 vocabulary")
    if not isinstance(vocab, dict) or not vocab:
        raise SourceError(f"{directory / VOCAB_FILE} must map pieces to integer ids")
    list_name = tokenizer_config.get("language_codes", "m2m100")
    if list_name not in M2M100_CODES:
        raise SourceError(f"{directory / 'tokenizer_config.json'}: language_codes "
                          f"{list_name!r} is not one of {', '.join(M2M100_CODES)}")
    # M2M100Tokenizer: the language tokens follow vocab.json's entries
    codes = {code: len(vocab) + index for index, code in enumerate(M2M100_CODES[list_name])}
    tokens = {code: f"__{code}__" for code in codes}
    added = []
    listed = tokenizer_config.get("added_tokens_decoder") or {}
    if not isinstance(listed, dict):
        raise SourceError(f"{directory / 'tokenizer_config.json'}: added_tokens_decoder must "
                          "be a JSON object")
    for token_id, token in sorted(listed.items(), key=lambda item: int(item[0])):
        if not isinstance(token, dict) or not isinstance(token.get("content"), str):
            raise SourceError(f"{directory / 'tokenizer_config.json'}: added token {token_id} "
                              "has no content")
        added.append(AddedToken(token["content"], int(token_id), bool(token.get("lstrip")),
                                bool(token.get("rstrip")), bool(token.get("special", True))))
    by_content = {token.content: token.id for token in added}
    for code, token in tokens.items():
        if token in by_content and by_content[token] != codes[code]:
            raise SourceError(f"{directory / 'tokenizer_config.json'} gives {token} the id "
                              f"{by_content[token]}, M2M100Tokenizer {codes[code]}")

    def token_to_id(token: str) -> int | None:
        return by_content.get(token, vocab.get(token))

    ids = check_special_ids(directory, config, FAMILY, VOCAB_FILE, token_to_id,
                            tokenizer_config)
    source = checkpoint_language(tokenizer_config.get("src_lang"), codes)
    target = checkpoint_language(tokenizer_config.get("tgt_lang"), codes)
    spec = TokenizerSpec(
        kind="spm-vocab", source=SPM_FILE, vocab=VOCAB_FILE, pad_token_id=ids["pad"],
        eos_token_id=ids["eos"], unk_token_id=ids["unk"],
        added_tokens=[token.to_dict() for token in added],
        languages=LanguageConventions(
            codes=codes, source_layout="prefix", target_mode="forced",
            default_source=source or ("en" if "en" in codes else ""),
            tokens=tokens).to_dict())
    return TokenizerInfo(spec, source, target)


def tokenizer(directory: Path, config: dict[str, Any],
              tokenizer_config: dict[str, Any]) -> TokenizerInfo:
    """NLLB's or M2M100's (module docstring); without a tokenizer_class, NLLB when a
    tokenizer.json is there."""
    name = tokenizer_class(tokenizer_config)
    nllb = name == "NllbTokenizer" or (name != "M2M100Tokenizer"
                                       and (directory / "tokenizer.json").is_file())
    if nllb:
        return nllb_tokenizer(directory, config, tokenizer_config)
    return m2m100_tokenizer(directory, config, tokenizer_config)


FAMILY = Family(
    kind="hf-m2m100",
    defaults={"vocab_size": 128112, "activation_function": "relu", "scale_embedding": True,
              "decoder_start_token_id": 2},
    pre_norm=True,
    positions="sinusoidal",
    embedding_norm=False,
    final_logits_bias=False,
    tokenizer=tokenizer,
)


def load(directory: Path, config: dict[str, Any]) -> Source:
    """export.importers entry point: an M2M100 / NLLB directory -> Source."""
    from export.importers.bart_family import load as load_family

    return load_family(FAMILY, directory, config)
