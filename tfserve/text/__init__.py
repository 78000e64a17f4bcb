"""Text in and out: the tokenizer protocol and its spec (`tokenizer`), one tokenizer class per
kind of files (`tokenizers`), the language codes of multilingual models (`languages`), and a
request's texts, languages, prefixes and options checked and turned into source ids and
decoding options (`inputs`, `translation_inputs`); and documents: a text or an HTML page planned
as rows of sentences and put back together in its layout (`documents`, over `segmentation`,
`long_sentences`, `html_document`), and its language detected (`language_detection`,
`iso_codes`)."""
