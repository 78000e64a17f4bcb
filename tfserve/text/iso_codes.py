"""ISO 639 language codes: a code as a request, a detector or a model names it, brought to
one form (ISO 639-1 where the language has one, else ISO 639-3) so that they can be compared.

Models name languages their own way (tfserve.text.languages): NLLB-200 "fra_Latn" (ISO 639-3
and script), mBART "fr_XX", M2M100 "fr", Marian multi-target models ">>fra<<" tokens. The
sentence splitter knows languages by ISO 639-1 code, the detector answers in ISO 639-1 where
one exists. Pure Python.
"""

from __future__ import annotations

import re

# ISO 639-3 (and 639-2/B) codes (and the individual codes of macrolanguages NLLB uses:
# arb, pes, zsm, ...) of the languages that have an ISO 639-1 code
ISO_639_3_TO_1 = {
    "afr": "af", "amh": "am", "ara": "ar", "arb": "ar", "asm": "as", "aze": "az", "bel": "be",
    "ben": "bn", "bod": "bo", "tib": "bo", "bos": "bs", "bul": "bg", "cat": "ca", "ces": "cs",
    "cze": "cs", "cym": "cy", "wel": "cy", "dan": "da", "deu": "de", "ger": "de", "ell": "el",
    "gre": "el", "eng": "en", "epo": "eo", "est": "et", "ekk": "et", "eus": "eu", "baq": "eu",
    "fas": "fa", "per": "fa", "pes": "fa", "fin": "fi", "fra": "fr", "fre": "fr", "gle": "ga",
    "glg": "gl", "guj": "gu", "heb": "he", "hin": "hi", "hrv": "hr", "hun": "hu", "hye": "hy",
    "arm": "hy", "ind": "id", "isl": "is", "ice": "is", "ita": "it", "jpn": "ja", "kat": "ka",
    "geo": "ka", "kaz": "kk", "khm": "km", "kan": "kn", "kor": "ko", "kir": "ky", "lao": "lo",
    "lit": "lt", "lav": "lv", "lvs": "lv", "mkd": "mk", "mac": "mk", "mal": "ml", "mon": "mn",
    "khk": "mn", "mar": "mr", "msa": "ms", "may": "ms", "zsm": "ms", "mya": "my", "bur": "my",
    "nep": "ne", "npi": "ne", "nld": "nl", "dut": "nl", "nob": "nb", "nno": "nn", "nor": "no",
    "ori": "or", "ory": "or", "pan": "pa", "pol": "pl", "pus": "ps", "pbt": "ps", "por": "pt",
    "ron": "ro", "rum": "ro", "rus": "ru", "sin": "si", "slk": "sk", "slo": "sk", "slv": "sl",
    "som": "so", "sqi": "sq", "alb": "sq", "als": "sq", "srp": "sr", "swe": "sv", "swa": "sw",
    "swh": "sw", "tam": "ta", "tel": "te", "tgk": "tg", "tha": "th", "tgl": "tl", "tur": "tr",
    "ukr": "uk", "urd": "ur", "uzb": "uz", "uzn": "uz", "vie": "vi", "yid": "yi", "zho": "zh",
    "chi": "zh", "cmn": "zh",
    "spa": "es", "jav": "jv", "sun": "su", "hau": "ha", "ibo": "ig", "yor": "yo", "zul": "zu",
    "xho": "xh", "mlt": "mt", "ltz": "lb", "lat": "la", "kur": "ku", "kmr": "ku", "tat": "tt",
    "bak": "ba", "uig": "ug", "snd": "sd", "tuk": "tk", "oci": "oc", "bre": "br", "fao": "fo",
    "fry": "fy", "gla": "gd", "hat": "ht", "kin": "rw", "lin": "ln", "lug": "lg", "mri": "mi",
    "nya": "ny", "orm": "om", "gaz": "om", "sna": "sn", "sot": "st", "ssw": "ss", "tsn": "tn",
    "tso": "ts", "wol": "wo", "twi": "tw", "ewe": "ee", "aka": "ak", "bam": "bm", "kik": "ki",
    "run": "rn", "smo": "sm", "tir": "ti", "grn": "gn", "aym": "ay", "quy": "qu", "que": "qu",
    "div": "dv", "kas": "ks", "san": "sa", "nav": "nv", "azj": "az", "plt": "mg",
    "mlg": "mg", "ydd": "yi",
}



def language_base(code: str) -> str:
    """The language part of a code: "fra_Latn" -> "fra", "fr_XX" -> "fr", "zh-Hant" -> "zh",
    ">>fra<<" -> "fra", "__fr__" -> "fr"; lower case."""
    code = code.strip().strip("<>_").strip()
    return re.split(r"[_\-]", code, maxsplit=1)[0].lower()


def iso_language(code: str) -> str:
    """`code` as ISO 639-1 where the language has such a code, else its language part as
    given (an ISO 639-3 code)."""
    base = language_base(code)
    return ISO_639_3_TO_1.get(base, base)
