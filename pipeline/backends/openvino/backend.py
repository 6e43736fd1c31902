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
import os
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from pipeline.artifacts import atomic_write_bytes, atomic_write_json
from pipeline.backends.base import (
    Backend,
    BuildResult,
    Deployment,
    DeploymentMetrics,
    FusionSource,
    PreparedModel,
    SearchSpace,
    ShippedSettings,
)
from pipeline.backends.openvino.settings import (
    PRECISIONS,
    CompileSettings,
    check_device,
    core,
    openvino_module,
    property_text,
)
from pipeline.data.adapters import fixed_feeds
from pipeline.errors import StageError, first_line
from pipeline.graph.model import input_specs, load_model, output_names
from pipeline.quant.cpu import bf16_everywhere
from pipeline.values import enum_value

# runtime layers that only move or convert data at the model's edges: left out of a subgraph's compute
EDGE_LAYER_TYPES = frozenset({"Parameter", "Input", "Result", "Output", "Const", "Reorder", "Convert"})



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
        ov = openvino_module()
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
    placement = "openvino"
    shipped_settings = ShippedSettings(CompileSettings, "autotune/openvino_compile.json", "compile settings",
                                       "OpenVINO's defaults")
    # the compile settings a tuned model ships with; None: backend.* alone
    settings: CompileSettings | None = None

    @classmethod
    def open_deployment(cls, model: Path, settings_path: Path | None, device: str = "CPU") -> Any:
        """An openvino.CompiledModel of ``model`` for ``device`` with its shipped compile properties."""
        settings = CompileSettings.load(settings_path) if settings_path is not None else CompileSettings()
        return settings.compile(model, device)

    def search_space(self) -> SearchSpace:
        from pipeline.backends.openvino import search

        return search.SPACE

    def check_available(self) -> None:
        check_device(str(self.cfg.device), "backend.device")

    def properties(self, profile: bool = False) -> dict[str, Any]:
        """The compile properties: backend.* first, the shipped settings over them."""
        props: dict[str, Any] = {"PERFORMANCE_HINT": enum_value(self.cfg.performance_hint)}
        precision = PRECISIONS[enum_value(self.cfg.inference_precision)]
        if precision is None and not bf16_everywhere():
            precision = "f32"  # a target kind runs float layers in f32: every kind runs what was checked
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

        from pipeline.backends.onnxruntime import OnnxRuntimeBackend
        from pipeline.backends.onnxruntime.config import OnnxRuntimeBackendConfig

        return OnnxRuntimeBackend(OmegaConf.structured(OnnxRuntimeBackendConfig())).prepare_reference(model_path)

    @staticmethod
    def inference_precision(compiled: Any) -> str:
        return property_text(compiled.get_property("INFERENCE_PRECISION_HINT"))

    def layer_info(self, model_path: str | Path) -> dict[str, Any]:
        """The compiled model's runtime layers (``runtime_layers``, the ONNX nodes of each as subgraph
        mode's fusion grouping reads them) and its inference precision."""
        compiled = self.compile(model_path)
        return {"layers": runtime_layers(compiled), "inference_precision": self.inference_precision(compiled)}

    def deploy(self, model_path: Path, out_dir: Path, source: str, cfg: DictConfig) -> Deployment:
        """What an OpenVINO deployment loads: the model as OpenVINO IR (model.xml + model.bin, read by
        ``core.read_model``) and compiled for this CPU with this backend's compile settings (model.blob,
        ``core.import_model``), with build.json naming the precision of every kind of layer."""
        xml, facts = out_dir / "model.xml", out_dir / "build.json"
        try:
            info = self.build(model_path, xml, facts).info
        except Exception as exc:  # noqa: BLE001 - OpenVINO's own error types for models it cannot compile
            raise StageError(f"gen_trt_engine: OpenVINO cannot compile {source} ({model_path}): "
                             f"{first_line(exc)}") from None
        blob = out_dir / info["blob"]
        int8 = sum(n for k, n in info["layer_precisions"].items() if k.endswith((" i8", " u8")))
        headline = (f"OpenVINO IR and compiled blob from {source}: {int8} int8 layers, the rest "
                    f"{info['inference_precision']}, {blob.stat().st_size / 2**20:.2f} MB compiled in "
                    f"{info['build_seconds']:.1f} s")
        return Deployment({"model.xml": xml, "model.bin": xml.with_suffix(".bin"), "model.blob": blob,
                           "build.json": facts}, DeploymentMetrics(
            source=source, headline=headline, model=str(model_path), runtime=self.describe(),
            engine_bytes=blob.stat().st_size, build_seconds=float(info["build_seconds"]),
            precision=info["inference_precision"], layer_precisions=info["layer_precisions"]))

    def fusion_source(self, model_path: Path, out_dir: Path, stem: str) -> FusionSource:
        """The compiled model's runtime graph (written to ``<stem>.openvino_layers.json``)."""
        info = self.layer_info(model_path)
        path = atomic_write_json(out_dir / f"{stem}.openvino_layers.json", info, indent=1)
        return FusionSource(f"{path.name} (OpenVINO's runtime graph, {info['inference_precision']} float)",
                            layers=info, path=path)

    def build(self, model_path: str | Path, out_path: str | Path | None = None,
              log_path: str | Path | None = None) -> BuildResult:
        """Compile ``model_path``; with ``out_path`` (an .xml), write the OpenVINO IR (.xml + .bin) of the
        model and, beside it, the compiled blob (``.blob``, what ``export_model`` writes, which
        ``core.import_model`` loads without compiling again on this machine)."""
        ov = openvino_module()
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
        ov = openvino_module()
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
