"""qdq-tune's shared framework: CLI, runner, results_dir, config schemas, data, backends, ONNX helpers."""
