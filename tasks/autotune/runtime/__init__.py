"""Runtime settings tuned after the placement: one greedy search (``search``) over the candidates of the
backend's own search space (``Backend.search_space``: e.g. ONNX Runtime session settings, TensorRT builder
settings, OpenVINO compile properties)."""
