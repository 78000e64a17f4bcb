"""tfserve: export encoder-decoder Transformers to ONNX and serve them over batched gRPC.

The serving path (runtime, generation, scheduler, server, client) imports numpy and
onnxruntime only; torch is needed by `tfserve.model`, `tfserve.model.eager` and `python -m export`.
"""

from tfserve.version import __version__

__all__ = ["__version__", "Translator", "DecodingOptions"]


def __getattr__(name: str):  # lazy, so `import tfserve` stays light
    if name == "Translator":
        from tfserve.translator import Translator

        return Translator
    if name == "DecodingOptions":
        from tfserve.generation import DecodingOptions

        return DecodingOptions
    raise AttributeError(name)
