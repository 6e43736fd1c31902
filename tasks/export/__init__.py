"""export stage: a built-in, user or existing ONNX model -> results_dir/export/model.onnx (verified)."""
