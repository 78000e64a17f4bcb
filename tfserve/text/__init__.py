"""Text in and out: tokenizers and vocabularies (`tokenizer`, `spm_vocab`), the language codes
of multilingual models (`languages`), and a request's texts, languages, prefixes and options
checked and turned into source ids and decoding options (`inputs`, `translation_inputs`)."""
