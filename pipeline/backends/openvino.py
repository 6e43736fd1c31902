"""OpenVINO backend: OpenVINO's CPU plugin, a compiling runtime that runs on every x86 and Arm CPU.

OpenVINO reads the ONNX file itself (external data included), turns each QuantizeLinear /
DequantizeLinear pair into a FakeQuantize, and its low-precision transformations fuse the quantized
regions into int8 kernels (AMX or VNNI); everything else runs in its inference precision (bf16 on CPUs
with AMX or AVX-512 BF16, f32 elsewhere, unless the compile properties say otherwise). The compiled
model tells what it did: its runtime graph names, for every executed layer, the ONNX nodes fused into
it (``originalLayersNames``), the layer type, runtime precision and kernel; ``PERF_COUNT`` gives
per-layer times. Those are subgraph mode's fusion groups and profiles (``layer_info``,
``layer_samples``), the role TensorRT's layer information plays.

The compile properties (precision, performance hint, threads, streams, ...) are the runtime settings
a model ships with: ``CompileSettings``, a flat map of OpenVINO property names to values exactly as
``compile_model`` takes them (autotune/openvino_compile.json).
"""

from __future__ import annotations

import copy
import functools
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.artifacts import atomic_write_bytes, atomic_write_json, read_settings
from pipeline.backends.base import Backend, BuildResult, PreparedModel, ShippedSettings
from pipeline.data.adapters import fixed_feeds
from pipeline.errors import BackendUnavailable
from pipeline.graph.model import input_specs, load_model, output_names
from pipeline.values import enum_value

INSTALL = "pip install openvino"
# config value -> INFERENCE_PRECISION_HINT (default: what OpenVINO picks on this CPU)
PRECISIONS = {"default": None, "bf16": "bf16", "f16": "f16", "f32": "f32"}
HINTS = ("LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT")
# the compile properties a shipped openvino_compile.json may hold, with the values each accepts
# (None: a non-negative integer)
PROPERTIES: dict[str, tuple[str, ...] | None] = {
    "INFERENCE_PRECISION_HINT": ("bf16", "f16", "f32"),
    "PERFORMANCE_HINT": HINTS,
    "EXECUTION_MODE_HINT": ("PERFORMANCE", "ACCURACY"),
    "INFERENCE_NUM_THREADS": None,
    "NUM_STREAMS": None,
    "ENABLE_CPU_PINNING": ("YES", "NO"),
    "ENABLE_HYPER_THREADING": ("YES", "NO"),
    "CPU_DENORMALS_OPTIMIZATION": ("YES", "NO"),
}
# runtime layers that only move or convert data at the model's edges: left out of a subgraph's compute
EDGE_LAYER_TYPES = frozenset({"Parameter", "Input", "Result", "Output", "Const", "Reorder", "Convert"})


def _module() -> Any:
    try:
        import openvino
    except ImportError:
        raise BackendUnavailable(f"backend=openvino needs OpenVINO, which is not installed; {INSTALL}") from None
    return openvino


@functools.lru_cache(maxsize=1)
def core() -> Any:
    """One OpenVINO Core per process (it holds the loaded plugins)."""
    return _module().Core()


def _check_value(name: str, value: Any) -> str:
    allowed = PROPERTIES[name]
    text = str(value).upper() if allowed is None or allowed[0].isupper() else str(value).lower()
    if allowed is None:
        if not text.isdigit():
            raise ValueError(f"{name}={value!r}: expected a non-negative integer")
    elif text not in allowed:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(allowed)}")
    return text


def check_device(device: str, key: str) -> None:
    """A BackendUnavailable naming ``key`` when OpenVINO has no such device here."""
    devices = core().available_devices
    if device not in devices:
        raise BackendUnavailable(f"{key}={device}: OpenVINO sees only {devices} here; set {key} to one of them")


@dataclass(frozen=True)
class CompileSettings:
    """The OpenVINO compile properties a model ships with (autotune/openvino_compile.json): they are
    not stored in the model, and its speed and accuracy depend on them. Empty: OpenVINO's defaults."""

    properties: tuple[tuple[str, str], ...] = ()

    def to_dict(self) -> dict[str, str]:
        return dict(self.properties)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompileSettings:
        if not isinstance(d, dict):
            raise ValueError("expected a JSON object of OpenVINO property names to values")
        unknown = sorted(set(d) - set(PROPERTIES))
        if unknown:
            raise ValueError(f"unknown OpenVINO properties {unknown}; known: {', '.join(PROPERTIES)}")
        return cls(tuple(sorted((k, _check_value(k, v)) for k, v in d.items())))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CompileSettings:
        """The settings of an openvino_compile.json; a StateError names a file that is not one."""
        return read_settings(path, "OpenVINO compile settings", cls.from_dict)

    def save(self, path: str | os.PathLike) -> Path:
        return atomic_write_json(path, self.to_dict())

    def changed(self, **properties: Any) -> CompileSettings:
        """These settings with ``properties`` set (a value of None removes one)."""
        merged = {**self.to_dict(), **properties}
        return CompileSettings.from_dict({k: v for k, v in merged.items() if v is not None})

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.properties) or "OpenVINO's defaults"

    def compile(self, model: str | os.PathLike, device: str = "CPU") -> Any:
        """``model`` compiled with these properties, as they were measured: what a deployment runs."""
        check_device(device, "device")
        return core().compile_model(str(model), device, self.to_dict())


class OvPrepared(PreparedModel):
    """A compiled model and one infer request on fixed inputs."""

    def __init__(self, compiled: Any, specs: list, profile: bool = False, graph_outputs: list[str] | None = None):
        self.compiled = compiled
        self.specs = specs
        self.request = compiled.create_infer_request()
        self._outputs = list(compiled.outputs)
        self.output_names = [onnx_output_name(o, graph_outputs or ()) for o in self._outputs]
        self._profile = profile
        self._calls: list[list[dict[str, float]]] = []
        self._layer_types: dict[str, str] = {}
        self._run_request: Any = None
        self.set_timing_feeds(fixed_feeds(specs))

    def set_timing_feeds(self, feeds: dict[str, np.ndarray]) -> None:
        self._fixed = _tensors(self.compiled, feeds)  # kept alive: the request reads their memory
        ov = _module()
        for name, array in self._fixed.items():
            self.request.set_tensor(name, ov.Tensor(array, shared_memory=True))

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self._run_request is None:  # a request of its own: the timing request keeps its fixed inputs
            self._run_request = self.compiled.create_infer_request()
        result = self._run_request.infer(_tensors(self.compiled, feeds))
        return [np.array(result[o], copy=True) for o in self._outputs]

    def time_runs(self, n: int) -> list[float]:
        out, infer = [], self.request.infer
        runs: list[dict[str, float]] = []
        for _ in range(n):
            t0 = time.perf_counter()
            infer()
            out.append((time.perf_counter() - t0) * 1e3)
            if self._profile:
                runs.append(self._layer_times())
        if self._profile:
            self._calls.append(runs)
        return out

    def _layer_times(self) -> dict[str, float]:
        times: dict[str, float] = {}
        for p in self.request.get_profiling_info():
            if str(p.status).endswith("EXECUTED"):
                times[p.node_name] = times.get(p.node_name, 0.0) + p.real_time.total_seconds() * 1e3
                self._layer_types[p.node_name] = p.node_type
        return times

    def layer_samples(self) -> list[list[dict[str, float]]] | None:
        if not self._profile:
            return None
        self.overhead_layers = frozenset(k for k, t in self._layer_types.items() if t in EDGE_LAYER_TYPES)
        return self._calls

    def close(self) -> None:
        self.request = self._run_request = self.compiled = None


def onnx_output_name(port: Any, graph_outputs: list[str] | tuple[str, ...]) -> str:
    """The name the ONNX graph gives a compiled model's output: OpenVINO folds Identity chains and keeps
    every name of the tensors it folded on the one port, and ``get_any_name`` may pick an inner one."""
    names = port.get_names()
    return next((n for n in graph_outputs if n in names), port.get_any_name())


def _tensors(compiled: Any, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    names = {i.get_any_name() for i in compiled.inputs}
    missing = sorted(names - set(feeds))
    if missing:
        raise KeyError(f"no feed for the model's inputs {missing}")
    return {k: np.ascontiguousarray(v) for k, v in feeds.items() if k in names}


def property_text(value: Any) -> str:
    """An OpenVINO property value as openvino_compile.json spells it: a Type as its short name (bf16),
    a bool as YES/NO, an enum as its member name, anything else as str."""
    if isinstance(value, bool):
        return "YES" if value else "NO"
    if hasattr(value, "to_string"):  # openvino.Type
        return str(value.to_string())
    if hasattr(value, "name") and not isinstance(value, str):  # a property enum, e.g. PerformanceMode
        return str(value.name)
    return str(value)


def runtime_layers(compiled: Any) -> list[dict[str, Any]]:
    """Every executed layer of a compiled model (edge layers left out): its name, type, runtime
    precision, kernel and the ONNX nodes fused into it (``onnx_nodes``)."""
    layers = []
    for op in compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        info = {k: rt[k].astype(str) if k in rt else "" for k in
                ("layerType", "runtimePrecision", "primitiveType", "originalLayersNames")}
        if info["layerType"] in EDGE_LAYER_TYPES:
            continue
        layers.append({"name": op.get_friendly_name(), "LayerType": info["layerType"],
                       "precision": info["runtimePrecision"], "primitive": info["primitiveType"],
                       "onnx_nodes": [n for n in info["originalLayersNames"].split(",") if n]})
    return layers


class OpenVinoBackend(Backend):
    name = "openvino"
    shipped_settings = ShippedSettings(CompileSettings, "autotune/openvino_compile.json", "compile settings",
                                       "OpenVINO's defaults")
    # the compile settings a tuned model ships with; None: backend.* alone
    settings: CompileSettings | None = None

    def check_available(self) -> None:
        check_device(str(self.cfg.device), "backend.device")

    def properties(self, profile: bool = False) -> dict[str, Any]:
        """The compile properties: backend.* first, the shipped settings over them."""
        props: dict[str, Any] = {"PERFORMANCE_HINT": enum_value(self.cfg.performance_hint)}
        precision = PRECISIONS[enum_value(self.cfg.inference_precision)]
        if precision is not None:
            props["INFERENCE_PRECISION_HINT"] = precision
        if int(self.cfg.threads) > 0:
            props["INFERENCE_NUM_THREADS"] = int(self.cfg.threads)
        if int(self.cfg.streams) > 0:
            props["NUM_STREAMS"] = int(self.cfg.streams)
        if self.settings is not None:
            props.update(self.settings.to_dict())
        if self.cfg.get("cache_dir"):
            props["CACHE_DIR"] = str(self.cfg.cache_dir)
        if profile:
            props["PERF_COUNT"] = True
        return props

    def compile(self, model_path: str | Path, profile: bool = False) -> Any:
        return core().compile_model(str(model_path), str(self.cfg.device), self.properties(profile))

    def prepare(self, model_path: str | Path, profile: bool = False) -> OvPrepared:
        model = load_model(model_path, check=False)
        return OvPrepared(self.compile(model_path, profile), input_specs(model), profile, output_names(model))

    def prepare_reference(self, model_path: str | Path) -> PreparedModel:
        """The Q/DQ math the fused int8 kernels must reproduce: ONNX Runtime with no graph
        optimizations runs every QuantizeLinear, DequantizeLinear and float op as written."""
        from omegaconf import OmegaConf

        from pipeline.backend_config import OnnxRuntimeBackendConfig
        from pipeline.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(OmegaConf.structured(OnnxRuntimeBackendConfig())).prepare_reference(model_path)

    @staticmethod
    def inference_precision(compiled: Any) -> str:
        return property_text(compiled.get_property("INFERENCE_PRECISION_HINT"))

    def layer_info(self, model_path: str | Path) -> dict[str, Any]:
        """The compiled model's runtime layers (``runtime_layers``, the ONNX nodes of each as subgraph
        mode's fusion grouping reads them) and its inference precision."""
        compiled = self.compile(model_path)
        return {"layers": runtime_layers(compiled), "inference_precision": self.inference_precision(compiled)}

    def build(self, model_path: str | Path, out_path: str | Path | None = None,
              log_path: str | Path | None = None) -> BuildResult:
        """Compile ``model_path``; with ``out_path`` (an .xml), write the OpenVINO IR (.xml + .bin) of the
        model and, beside it, the compiled blob (``.blob``, what ``export_model`` writes, which
        ``core.import_model`` loads without compiling again on this machine)."""
        ov = _module()
        t0 = time.perf_counter()
        compiled = self.compile(model_path)
        seconds = time.perf_counter() - t0
        info: dict[str, Any] = {"build_seconds": round(seconds, 3), **self.describe(),
                                "inference_precision": self.inference_precision(compiled)}
        kinds = Counter(f"{layer['LayerType']} {layer['precision']}" for layer in runtime_layers(compiled))
        info["layer_precisions"] = dict(sorted(kinds.items()))
        if out_path is not None:
            out = Path(out_path)
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=".ir-", dir=out.parent) as staging:
                # written aside, then moved in weights first: a failed write leaves the previous IR whole
                ov.save_model(core().read_model(str(model_path)), str(Path(staging) / out.name), compress_to_fp16=False)
                os.replace(Path(staging) / out.with_suffix(".bin").name, out.with_suffix(".bin"))
                os.replace(Path(staging) / out.name, out)
            blob = out.with_suffix(".blob")
            exported = compiled.export_model()
            atomic_write_bytes(blob, exported.getvalue() if hasattr(exported, "getvalue") else bytes(exported))
            info["ir"], info["blob"] = out.name, blob.name
        if log_path is not None:
            atomic_write_json(log_path, info)
        return BuildResult(Path(out_path) if out_path else None, Path(log_path) if log_path else None, info)

    def describe(self) -> dict[str, Any]:
        ov = _module()
        info = {"backend": self.name, "openvino": ov.get_version(), "device": str(self.cfg.device),
                "properties": {k: str(v) for k, v in self.properties().items()}}
        if self.settings is not None:
            info["compile"] = self.settings.describe()
        return info

    def float_precision(self) -> str:
        """The inference precision of float layers: the configured or shipped one, else what OpenVINO
        picks on this CPU (BF16 with AMX or AVX-512 BF16, F32 elsewhere)."""
        chosen = self.properties().get("INFERENCE_PRECISION_HINT")
        if chosen is None:
            chosen = property_text(core().get_property(str(self.cfg.device), "INFERENCE_PRECISION_HINT"))
        return {"bf16": "BF16", "bfloat16": "BF16", "f16": "FP16", "f32": "FP32", "float32": "FP32"}.get(
            str(chosen).lower(), str(chosen).upper())

    def fp32_variant(self) -> OpenVinoBackend | None:
        """This backend with ``backend.inference_precision=f32`` (and its settings, if any, in f32): its
        own keys say f32, so the settings a search starts from and ships, and ``as_deployed``, stay f32."""
        if self.float_precision() == "FP32":
            return None
        cfg = copy.deepcopy(self.cfg)
        cfg.inference_precision = "f32"
        other = self.with_settings(None if self.settings is None
                                   else self.settings.changed(INFERENCE_PRECISION_HINT="f32"))
        other.cfg = cfg
        return other

    def has_fast_kernels(self, quant_type: str) -> bool:
        # the CPU plugin has int8 kernels; FP8 Q/DQ is emulated with converts
        return quant_type != "fp8"
