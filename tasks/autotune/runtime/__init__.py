"""Runtime settings tuned after the placement: one greedy search (``search``) over candidates from the
backend's own space: ONNX Runtime session settings (``ort``), TensorRT builder settings (``trt``) or
OpenVINO compile properties (``openvino``)."""
