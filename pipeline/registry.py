"""The explicit stage registry: the only place `pipeline` reaches into `tasks`.

Data only: stage name -> import paths of its Stage class and its config module. Stage modules are
imported lazily when a stage runs, so `tune --help` never pays for torch or TensorRT imports.
A config module exposes ``SCHEMA`` (the dataclass) and ``validate(cfg) -> list[str]``.
``import_object`` is the one importer of dotted names: stages, backends and the `_target_`s of
user models and data.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from pipeline.errors import ConfigError


@dataclass(frozen=True)
class StageEntry:
    stage: str  # "package.module.Class"
    config: str  # module with SCHEMA and validate()


STAGES: dict[str, StageEntry] = {
    "export": StageEntry("tasks.export.stage.ExportStage", "tasks.export.config"),
    "quantize": StageEntry("tasks.quantize.stage.QuantizeStage", "tasks.quantize.config"),
    "autotune": StageEntry("tasks.autotune.stage.AutotuneStage", "tasks.autotune.config"),
    "gen_trt_engine": StageEntry("tasks.gen_trt_engine.stage.GenTrtEngineStage", "tasks.gen_trt_engine.config"),
    "evaluate": StageEntry("tasks.evaluate.stage.EvaluateStage", "tasks.evaluate.config"),
}


def stage_schemas() -> dict[str, type]:
    return {name: importlib.import_module(e.config).SCHEMA for name, e in STAGES.items()}


def stage_validators() -> dict[str, Callable[[DictConfig], list[str]]]:
    return {name: importlib.import_module(e.config).validate for name, e in STAGES.items()}


def import_object(path: str, key: str) -> Any:
    """The object a dotted path names ("pkg.module.Name": a `_target_`, a stage, a backend); a ConfigError
    naming the config ``key`` if it cannot be imported. User code raising while it is imported keeps its
    traceback (that is not a typo)."""
    module_name, _, attr = str(path).rpartition(".")
    if not module_name:
        raise ConfigError(f"{key}={path}: give a dotted path like my_pkg.module.Name")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigError(f"{key}={path}: no module named '{exc.name}' (is it installed / on PYTHONPATH?)") \
                from None
        raise
    if not hasattr(module, attr):
        raise ConfigError(f"{key}={path}: module '{module_name}' has no attribute '{attr}'")
    return getattr(module, attr)


def load_stage(name: str):
    """Instantiate the Stage registered under ``name``."""
    return import_object(STAGES[name].stage, f"stages[{name}]")()
