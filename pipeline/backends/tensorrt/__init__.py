"""TensorRT, TensorRT-RTX and trtexec: the Python API backends (``backend``: ``TensorRTBackend``,
``TensorRTRtxBackend``; their build set-up in ``builder``, the build's log in ``build_log``), trtexec as a
subprocess (``trtexec``: ``TrtexecBackend``; its command line in ``trtexec_command``, readers for what it
writes in ``trtexec_parse``), and what they share: build options, shapes and layer-info parsers
(``common``), the builder settings a model ships with (``settings``), the builder settings worth
searching (``search``) and the engine gen_trt_engine writes (``deploy``). Nothing here imports TensorRT
until a backend needs it."""

from pipeline.backends.tensorrt.backend import TensorRTBackend, TensorRTRtxBackend
from pipeline.backends.tensorrt.trtexec import TrtexecBackend

__all__ = ["TensorRTBackend", "TensorRTRtxBackend", "TrtexecBackend"]
