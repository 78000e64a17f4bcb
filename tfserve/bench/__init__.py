"""The benchmark and load tools; the serving path never imports this package.

- `offline`: ONNX Runtime vs eager PyTorch on one model (`python -m tfserve bench`);
- `loadgen`, `closed_loop`: a running server under closed-loop clients, against the same texts
  offline (`python -m tfserve.bench.loadgen`, or `python -m tfserve bench --server HOST:PORT`);
- `compare`, `engines`, `report`: tfserve vs CTranslate2 vs Hugging Face on one Marian model
  (`python -m tfserve.bench.compare`);
- `large_requests`: a server's resident memory under large refused requests
  (`python -m tfserve.bench.large_requests`);
- `models`: the random models and inputs they build; `common`: timing, percentiles, CPU and
  RSS readers, the quiet export.

`python -m tfserve.bench.loadgen` and `python -m tfserve.bench.compare` still run the last two.
"""
