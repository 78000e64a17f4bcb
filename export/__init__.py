"""`python -m export`: trace a checkpoint into ONNX artifacts and verify them (export/cli.py)."""
