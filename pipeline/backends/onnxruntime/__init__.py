"""ONNX Runtime, the default runtime and the pipeline's own compute engine: the backend
(``backend``: ``OnnxRuntimeBackend``), the sessions every stage runs models in and the session settings a
tuned model ships with (``session``), and the session settings worth searching (``search``)."""

from pipeline.backends.onnxruntime.backend import OnnxRuntimeBackend

__all__ = ["OnnxRuntimeBackend"]
