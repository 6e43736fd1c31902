"""The explicit stage registry: the only place `pipeline` reaches into `tasks`.

Data only: stage name -> import paths of its Stage class and its config module. Stage modules are
imported lazily when a stage runs, so `tune --help` never pays for torch or TensorRT imports.
A config module exposes ``SCHEMA`` (the dataclass) and ``validate(cfg) -> list[str]``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig


@dataclass(frozen=True)
class StageEntry:
    stage: str  # "module:Class"
    config: str  # module with SCHEMA and validate()


STAGES: dict[str, StageEntry] = {
    "export": StageEntry("tasks.export.stage:ExportStage", "tasks.export.config"),
    "quantize": StageEntry("tasks.quantize.stage:QuantizeStage", "tasks.quantize.config"),
    "autotune": StageEntry("tasks.autotune.stage:AutotuneStage", "tasks.autotune.config"),
    "gen_trt_engine": StageEntry("tasks.gen_trt_engine.stage:GenTrtEngineStage", "tasks.gen_trt_engine.config"),
    "evaluate": StageEntry("tasks.evaluate.stage:EvaluateStage", "tasks.evaluate.config"),
}


def stage_schemas() -> dict[str, type]:
    return {name: importlib.import_module(e.config).SCHEMA for name, e in STAGES.items()}


def stage_validators() -> dict[str, Callable[[DictConfig], list[str]]]:
    return {name: importlib.import_module(e.config).validate for name, e in STAGES.items()}


def import_object(spec: str) -> Any:
    """The object an internal "package.module:Name" spec points at (stages, backends)."""
    module_name, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def load_stage(name: str):
    """Instantiate the Stage registered under ``name``."""
    return import_object(STAGES[name].stage)()
