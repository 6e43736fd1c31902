"""The gen_trt_engine stage: builds a deployable engine from the newest model in results_dir.

The model is autotune's optimized_final.onnx, else quantize's quantized_model.onnx, else export's
model.onnx (or `gen_trt_engine.onnx_file`); autotune's model is built with the runtime settings it
was tuned with (autotune/trt_build.json on tensorrt and trtexec, ort_session.json on onnxruntime). With a TensorRT backend (tensorrt, tensorrt_rtx, trtexec)
it writes gen_trt_engine/model.engine and the builder log build.log; with backend=onnxruntime there
is no engine to build, so it writes the graph ONNX Runtime actually runs after its fusions
(model.ort.onnx) and the build facts (build.json) instead.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.artifacts import check_onnx_path, user_path
from pipeline.backends import create_backend
from pipeline.errors import StageError, first_line
from pipeline.graph.model import load_model
from pipeline.stage import MODEL_KEYS, Stage, StageContext, StageResult
from pipeline.values import enum_value

log = logging.getLogger("tune.gen_trt_engine")

ONNX_FILE_KEY = "gen_trt_engine.onnx_file"


def _shapes(node: Any) -> dict[str, list[int]]:
    if not node:
        return {}
    return {str(k): [int(d) for d in v] for k, v in OmegaConf.to_container(node, resolve=True).items()}


class GenTrtEngineStage(Stage):
    name = "gen_trt_engine"
    # the runtime settings autotune ships for its model, one file per backend kind
    optional_inputs = (*MODEL_KEYS, "autotune/ort_session.json", "autotune/trt_build.json",
                       "autotune/openvino_compile.json")
    outputs = ()  # which files depends on the backend (engine + build.log, model.ort.onnx or OpenVINO IR + build.json)
    config_keys = ("gen_trt_engine", "backend")

    def resolve_inputs(self, ctx: StageContext) -> dict[str, Path]:
        # an explicit onnx_file is the only input: its content (not results_dir's models) decides re-runs
        explicit = self._onnx_file(ctx.cfg)
        if explicit is not None:
            return {ONNX_FILE_KEY: explicit}
        return super().resolve_inputs(ctx)

    @staticmethod
    def _onnx_file(cfg: DictConfig) -> Path | None:
        f = cfg.gen_trt_engine.get("onnx_file")
        if not f:
            return None
        return check_onnx_path(user_path(f), ONNX_FILE_KEY)

    def _pick_model(self, ctx: StageContext) -> tuple[Path, str]:
        explicit = self._onnx_file(ctx.cfg)
        if explicit is not None:
            # a corrupt or non-ONNX file is one line naming the key, not a protobuf traceback
            load_model(explicit, what=ONNX_FILE_KEY, check=False)
            return explicit, ONNX_FILE_KEY
        for key in MODEL_KEYS:
            p = ctx.artifact(key)
            if p is not None:
                return p, key
        raise StageError(f"gen_trt_engine has no model to build in {ctx.results_dir}: run stage 'export' first "
                         f"(e.g. stages=[export,gen_trt_engine]) or set gen_trt_engine.onnx_file=<file.onnx>")

    @staticmethod
    def engine_options(cfg: DictConfig):
        """gen_trt_engine.tensorrt.* (plus the backend's timing cache and plugins) as build options."""
        from pipeline.backends.trt_common import EngineOptions, plugin_paths

        t = cfg.gen_trt_engine.tensorrt
        timing_cache = t.get("timing_cache") or cfg.backend.get("timing_cache")
        plugins = [*plugin_paths(cfg.backend.get("plugin_libraries"), "backend.plugin_libraries"),
                   *plugin_paths(t.get("plugin_libraries"), "gen_trt_engine.tensorrt.plugin_libraries")]
        return EngineOptions(
            data_type=enum_value(t.data_type), workspace_mb=int(t.workspace_size),
            min_batch=int(t.min_batch_size), opt_batch=int(t.opt_batch_size), max_batch=int(t.max_batch_size),
            min_shapes=_shapes(t.min_shapes), opt_shapes=_shapes(t.opt_shapes), max_shapes=_shapes(t.max_shapes),
            timing_cache=user_path(timing_cache) if timing_cache else None,
            plugin_libraries=list(dict.fromkeys(plugins)),
        )

    def run(self, ctx: StageContext) -> StageResult:
        model_path, source = self._pick_model(ctx)
        out_dir = ctx.stage_dir("gen_trt_engine")
        backend = self._tuned(ctx, create_backend(ctx.cfg.backend), source)
        if backend.name == "onnxruntime":
            return self._ort(backend, model_path, source, out_dir)
        if backend.name == "openvino":
            return self._openvino(backend, model_path, source, out_dir)
        engine, build_log = out_dir / "model.engine", out_dir / "build.log"
        log.info("building a %s engine from %s (%s)", backend.name, model_path, source)
        result = backend.build(model_path, engine, build_log, options=self.engine_options(ctx.cfg))
        info = result.info
        size = engine.stat().st_size
        seconds = float(info.get("build_seconds", 0.0))
        precision = "strongly typed (Q/DQ)" if info.get("strongly_typed") else str(info.get("data_type", "FP32"))
        metrics: dict[str, Any] = {
            "source": source, "model": str(model_path), "backend": backend.describe(),
            "engine_bytes": size, "build_seconds": seconds, "precision": precision,
            "strongly_typed": bool(info.get("strongly_typed")),
        }
        for k in ("profile", "layers"):
            if info.get(k) is not None:
                metrics[k] = info[k]
        tuned = f", {backend.settings.describe()}" if backend.settings is not None else ""
        metrics["headline"] = (f"{backend.name} engine from {source}: {size / 2**20:.2f} MB, {precision}{tuned}, "
                               f"built in {seconds:.1f} s")
        log.info("wrote %s (%s)", engine, metrics["headline"])
        return StageResult(artifacts={"gen_trt_engine/model.engine": engine, "gen_trt_engine/build.log": build_log},
                           metrics=metrics)

    @staticmethod
    def _tuned(ctx: StageContext, backend: Any, source: str) -> Any:
        """The backend with the runtime settings autotune shipped beside its model (ort_session.json,
        trt_build.json: the backend's kind), when that model is the one built; else as configured."""
        kind = backend.shipped_settings
        path = ctx.artifact(kind.artifact) if kind is not None and source == "autotune/optimized_final.onnx" else None
        if path is None:
            return backend
        settings = kind.type.load(path)
        if settings == kind.type():  # nothing to change
            return backend
        log.info("building with the %s autotune tuned the model with (%s): %s", kind.what, kind.artifact,
                 settings.describe())
        return backend.with_settings(settings)

    @staticmethod
    def _openvino(backend: Any, model_path: Path, source: str, out_dir: Path) -> StageResult:
        """What an OpenVINO deployment loads: the model as OpenVINO IR (model.xml + model.bin, read by
        ``core.read_model``) and compiled for this CPU with the shipped compile settings (model.blob,
        ``core.import_model``), with build.json naming the precision of every kind of layer."""
        xml, facts = out_dir / "model.xml", out_dir / "build.json"
        log.info("building an OpenVINO model from %s (%s)", model_path, source)
        try:
            result = backend.build(model_path, xml, facts)
        except Exception as exc:  # noqa: BLE001 - OpenVINO's own error types for models it cannot compile
            raise StageError(f"gen_trt_engine: OpenVINO cannot compile {source} ({model_path}): "
                             f"{first_line(exc)}") from None
        info = result.info
        blob = out_dir / info["blob"]
        int8 = sum(n for k, n in info["layer_precisions"].items() if k.endswith((" i8", " u8")))
        metrics: dict[str, Any] = {
            "source": source, "model": str(model_path), "backend": backend.describe(),
            "engine_bytes": blob.stat().st_size, "build_seconds": float(info["build_seconds"]),
            "precision": info["inference_precision"], "layer_precisions": info["layer_precisions"],
        }
        metrics["headline"] = (f"OpenVINO IR and compiled blob from {source}: {int8} int8 layers, the rest "
                               f"{info['inference_precision']}, {blob.stat().st_size / 2**20:.2f} MB compiled in "
                               f"{info['build_seconds']:.1f} s")
        return StageResult(artifacts={"gen_trt_engine/model.xml": xml, "gen_trt_engine/model.bin": xml.with_suffix(".bin"),
                                      "gen_trt_engine/model.blob": blob, "gen_trt_engine/build.json": facts},
                           metrics=metrics)

    @staticmethod
    def _ort(backend: Any, model_path: Path, source: str, out_dir: Path) -> StageResult:
        out, facts = out_dir / "model.ort.onnx", out_dir / "build.json"
        log.info("backend=onnxruntime has no TensorRT engine to build: writing the graph ONNX Runtime runs "
                 "(after its fusions) to %s", out)
        try:
            result = backend.build(model_path, out, facts)
        except Exception as exc:  # noqa: BLE001 - ORT's own error types for models it cannot load or run
            raise StageError(f"gen_trt_engine: onnxruntime cannot load and run {source} ({model_path}): "
                             f"{first_line(exc)}") from None
        ops = result.info.get("optimized_op_counts", {})
        seconds = float(result.info.get("build_seconds", 0.0))
        fused = {k: v for k, v in ops.items() if k.startswith(("QLinear", "QGemm", "MatMulInteger", "ConvInteger"))}
        metrics: dict[str, Any] = {
            "source": source, "model": str(model_path), "backend": backend.describe(),
            "engine_bytes": out.stat().st_size, "build_seconds": seconds, "optimized_op_counts": ops,
        }
        shown = ", ".join(f"{k} x{v}" for k, v in fused.items()) or "no integer kernels"
        metrics["headline"] = (f"onnxruntime optimized graph from {source}: {sum(ops.values())} nodes ({shown}), "
                               f"{out.stat().st_size / 2**20:.2f} MB in {seconds:.1f} s")
        return StageResult(artifacts={"gen_trt_engine/model.ort.onnx": out, "gen_trt_engine/build.json": facts},
                           metrics=metrics)
