"""What an artifacts directory holds, as the runtime reads it: the model's configuration
(`model_config.ModelConfig`), the manifest `model.json` (`manifest`) and the checkpoint's own
decoding settings (`generation_defaults`). Imports nothing of tfserve above it."""
