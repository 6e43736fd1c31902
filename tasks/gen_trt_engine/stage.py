"""The gen_trt_engine stage: writes what a deployment loads, from the newest model in results_dir.

The model is autotune's optimized_final.onnx, else quantize's quantized_model.onnx, else export's
model.onnx (or `gen_trt_engine.onnx_file`); autotune's model is built with the runtime settings it
was tuned with (the backend's ``shipped_settings`` file). What is written is the backend's
(``Backend.deploy``): a TensorRT engine and its builder log, OpenVINO IR with its compiled blob, the
graph ONNX Runtime runs after its fusions.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.artifacts import check_onnx_path, user_path
from pipeline.backends import create_backend, settings_artifacts
from pipeline.backends.base import Backend
from pipeline.errors import StageError
from pipeline.graph.model import load_model
from pipeline.stage import MODEL_KEYS, Stage, StageContext, StageResult

log = logging.getLogger("tune.gen_trt_engine")

ONNX_FILE_KEY = "gen_trt_engine.onnx_file"


class GenTrtEngineStage(Stage):
    name = "gen_trt_engine"
    optional_inputs = MODEL_KEYS
    outputs = ()  # which files depends on the backend (engine + build.log, model.ort.onnx or OpenVINO IR + build.json)
    config_keys = ("gen_trt_engine", "backend", "target")
    host_bound = True  # an engine compiled for this host

    def optional_input_keys(self, ctx: StageContext) -> tuple[str, ...]:
        # the runtime settings autotune ships for its model (the configured runtime's file)
        return (*self.optional_inputs, *settings_artifacts(ctx.cfg.backend))

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

    def run(self, ctx: StageContext) -> StageResult:
        model_path, source = self._pick_model(ctx)
        out_dir = ctx.stage_dir("gen_trt_engine")
        backend = self._tuned(ctx, create_backend(ctx.cfg.backend), source)
        deployment = backend.deploy(model_path, out_dir, source, ctx.cfg)
        log.info("wrote %s (%s)", ", ".join(p.name for p in deployment.artifacts.values()),
                 deployment.metrics.headline)
        return StageResult(artifacts={f"gen_trt_engine/{name}": p for name, p in deployment.artifacts.items()},
                           metrics=deployment.metrics)

    @staticmethod
    def _tuned(ctx: StageContext, backend: Backend, source: str) -> Any:
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
