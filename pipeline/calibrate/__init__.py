"""Calibration statistics: the float model run on the calibration batches (ONNX Runtime, one batch at a
time), the running statistics of every tensor that could carry a Q/DQ pair and the range searches over
them (``collect``: minmax, max, percentile, entropy, mse, auto). Imports the framework, ``graph``,
``quant``, ``data`` and ``backends`` (ONNX Runtime's sessions, the pipeline's own compute engine)."""
