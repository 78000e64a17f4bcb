"""One module per kind of tokenizer files (`TokenizerSpec.kind`), each a `Tokenizer`
subclass registered in `tfserve.text.tokenizer.TOKENIZER_KINDS`: `sentencepiece`,
`hf_json`, `t5_spiece`, `spm_vocab`."""
