"""A TensorRT build's set-up beyond the network, for the tensorrt and tensorrt_rtx backends: the
precision flag of a float model (``set_precision``), the timing cache every build of a backend shares
(``open_timing_cache`` / ``save_timing_cache``; a cache of another device or version is set aside,
never overwritten) and the plugin libraries loaded into TensorRT's registry once (``PluginLibraries``).

``trt`` is always the module the backend imported (``tensorrt`` or TensorRT-RTX's bindings), passed in.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline.artifacts import atomic_output, set_aside
from pipeline.backends.tensorrt.common import plugin_paths
from pipeline.errors import StageError

log = logging.getLogger("tune.backend")


def set_precision(trt: Any, config: Any, data_type: str, strongly_typed: bool, logger: Any) -> str:
    """Set the builder flag of ``data_type`` for a float model; returns the precision the build uses."""
    if strongly_typed:
        if data_type != "FP32":
            logger.note(f"data_type={data_type} not applied: strongly typed network (precision comes from "
                        f"the Q/DQ nodes and ONNX types)")
        return "strongly_typed"
    if data_type == "FP32":
        return "FP32"
    flag = getattr(trt.BuilderFlag, data_type, None)
    if flag is None:
        msg = (f"gen_trt_engine.tensorrt.data_type={data_type} ignored: {trt.__name__} has no {data_type} "
               f"builder flag (it builds strongly typed; convert the model to {data_type} for such layers)")
        log.warning(msg)
        logger.note(msg)
        return "FP32"
    config.set_flag(flag)
    return data_type


def _aside(path: Path | None) -> str:
    """Set a stale timing cache file aside (never overwritten by the new one); the log's clause."""
    return f"; moved to {set_aside(path)}" if path is not None and path.is_file() else ""


def open_timing_cache(config: Any, cache: Any, path: Path | None, logger: Any) -> Any:
    """Give the builder config a timing cache: ``cache`` (the one earlier builds filled), else the one
    in ``path``, else a new one. Returns the cache in use."""
    if cache is None:
        data = b""
        if path is not None and path.is_file():
            data = path.read_bytes()
            logger.note(f"loaded timing cache {path} ({len(data)} bytes)")
        try:
            cache = config.create_timing_cache(data)
        except Exception:  # noqa: BLE001 - a corrupt cache file must not fail the build
            cache = None
        if cache is None:  # unreadable file: start afresh rather than fail the build
            logger.note(f"timing cache {path} unreadable{_aside(path)}; starting a new one")
            cache = config.create_timing_cache(b"")
    if not config.set_timing_cache(cache, ignore_mismatch=False):
        # made on another device or TensorRT version: kept aside, not overwritten by the new one
        logger.note(f"timing cache does not match this device/version{_aside(path)}; starting a new one")
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
    return cache


def save_timing_cache(config: Any, path: Path, logger: Any) -> Any:
    """Write the build's timing cache to ``path`` (atomically); returns it (None if the build has none)."""
    cache = config.get_timing_cache()
    if cache is None:
        return None
    with atomic_output(path) as tmp:
        tmp.write_bytes(memoryview(cache.serialize()))
    logger.note(f"saved timing cache {path}")
    return cache


class PluginLibraries:
    """The plugin libraries one backend loaded into TensorRT's plugin registry: TensorRT's standard
    plugins once, and each library once however many builds name it."""

    def __init__(self, backend: str):
        self.backend = backend
        self.loaded: set[str] = set()
        self.standard_ready = False

    def load(self, trt: Any, libraries: list[str], logger: Any) -> None:
        if not self.standard_ready and hasattr(trt, "init_libnvinfer_plugins"):
            try:
                trt.init_libnvinfer_plugins(logger, "")
            except Exception:  # noqa: BLE001 - the standard plugins are optional for plain ONNX models
                log.debug("init_libnvinfer_plugins failed", exc_info=True)
            self.standard_ready = True
        for path in map(Path, plugin_paths(libraries)):
            if str(path) in self.loaded:
                continue
            try:
                handle = trt.get_plugin_registry().load_library(str(path))
            except Exception as exc:  # noqa: BLE001 - pybind raises RuntimeError/TypeError
                raise StageError(f"{self.backend} could not load plugin library {path}: {exc}") from None
            if handle is None:
                raise StageError(f"{self.backend} could not load plugin library {path} (wrong TensorRT version or "
                                 f"missing dependencies)")
            logger.note(f"loaded plugin library {path}")
            self.loaded.add(str(path))


__all__ = ["PluginLibraries", "open_timing_cache", "save_timing_cache", "set_precision"]
