"""Runtimes behind one protocol (``base.Backend``: prepare, run, time, build), chosen by `backend=`:
ONNX Runtime (``onnxruntime``, with its sessions and session settings in ``ort``), TensorRT and
TensorRT-RTX (``tensorrt``, builder settings in ``trt_build``), trtexec. Imports the framework,
``graph`` and ``data``."""

from __future__ import annotations

from omegaconf import DictConfig

from pipeline.backends.base import Backend, BuildResult, PreparedModel, Timing, compare_interleaved
from pipeline.errors import ConfigError
from pipeline.registry import import_object
from pipeline.values import enum_value

# backend name -> "package.module.Class"; imported lazily so a missing TensorRT only matters when chosen
BACKENDS: dict[str, str] = {
    "onnxruntime": "pipeline.backends.onnxruntime.OnnxRuntimeBackend",
    "tensorrt": "pipeline.backends.tensorrt.TensorRTBackend",
    "tensorrt_rtx": "pipeline.backends.tensorrt.TensorRTRtxBackend",
    "trtexec": "pipeline.backends.trtexec.TrtexecBackend",
    "openvino": "pipeline.backends.openvino.OpenVinoBackend",
}


def create_backend(cfg: DictConfig) -> Backend:
    """Instantiate the configured backend and check that it can run here (BackendUnavailable if not)."""
    name = enum_value(cfg.name)
    if name not in BACKENDS:
        raise ConfigError(f"backend.name={name}: choose one of {', '.join(BACKENDS)}")
    backend = import_object(BACKENDS[name], "backend.name")(cfg)
    backend.check_available()
    return backend


def check_backend(cfg: DictConfig) -> None:
    """Start-up check of the whole config's backend: raises BackendUnavailable (one line naming the fix)
    when the chosen runtime is missing, before any stage runs. Measuring may still need a GPU later;
    that is reported when a stage measures."""
    create_backend(cfg.backend)


__all__ = ["BACKENDS", "Backend", "BuildResult", "PreparedModel", "Timing", "check_backend", "compare_interleaved",
           "create_backend"]
