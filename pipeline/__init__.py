"""qdq-tune's shared framework: CLI and Python API, runner, results_dir, config schemas, data, backends,
ONNX helpers."""
