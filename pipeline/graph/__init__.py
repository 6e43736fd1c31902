"""ONNX graph surgery: loading and saving models (``model``), the one node/tensor index (``index``),
shape inference (``shapes``), weights that stay on disk (``weights``), memory planning (``memory``)
and what control-flow bodies read (``bodies``). Imports only the framework modules at the top of
``pipeline``."""
