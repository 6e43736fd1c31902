"""What gen_trt_engine writes on a TensorRT backend (tensorrt, tensorrt_rtx, trtexec): a serialized engine
built with the `gen_trt_engine.tensorrt` options (plus the backend's timing cache and plugins) and the
builder log."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.artifacts import user_path
from pipeline.backend_config import EngineBuildConfig
from pipeline.backends.base import Backend, Deployment, DeploymentMetrics
from pipeline.backends.tensorrt.common import plugin_paths

log = logging.getLogger("tune.gen_trt_engine")


def engine_options(cfg: DictConfig) -> EngineBuildConfig:
    """gen_trt_engine.tensorrt (its schema is the build options) plus the backend's timing cache and
    plugins, paths resolved from where tune started."""
    t = cfg.gen_trt_engine.tensorrt
    timing_cache = t.get("timing_cache") or cfg.backend.get("timing_cache")
    plugins = [*plugin_paths(cfg.backend.get("plugin_libraries"), "backend.plugin_libraries"),
               *plugin_paths(t.get("plugin_libraries"), "gen_trt_engine.tensorrt.plugin_libraries")]
    return EngineBuildConfig(**{**OmegaConf.to_container(t, resolve=True),
                                "timing_cache": str(user_path(timing_cache)) if timing_cache else None,
                                "plugin_libraries": list(dict.fromkeys(plugins))})


def deploy_engine(backend: Backend, model_path: Path, out_dir: Path, source: str, cfg: DictConfig) -> Deployment:
    """Build ``model_path`` into out_dir/model.engine (and build.log) with ``engine_options(cfg)``."""
    engine, build_log = out_dir / "model.engine", out_dir / "build.log"
    log.info("building a %s engine from %s (%s)", backend.name, model_path, source)
    info = backend.build(model_path, engine, build_log, options=engine_options(cfg)).info
    size = engine.stat().st_size
    seconds = float(info.get("build_seconds", 0.0))
    precision = "strongly typed (Q/DQ)" if info.get("strongly_typed") else str(info.get("data_type", "FP32"))
    tuned = f", {backend.settings.describe()}" if backend.settings is not None else ""
    headline = f"{backend.name} engine from {source}: {size / 2**20:.2f} MB, {precision}{tuned}, built in {seconds:.1f} s"
    return Deployment({"model.engine": engine, "build.log": build_log}, DeploymentMetrics(
        source=source, headline=headline, model=str(model_path), runtime=backend.describe(), engine_bytes=size,
        build_seconds=seconds, precision=precision, strongly_typed=bool(info.get("strongly_typed")),
        profile=info.get("profile"), layers=info.get("layers")))
