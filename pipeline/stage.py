"""The stage contract shared by every task: declared artifacts in, artifacts and metrics out (each stage's
metrics a record of its own, ``StageMetrics``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig

from pipeline.artifacts import Manifest
from pipeline.errors import StageError

# the pipeline's models in results_dir, newest first: what gen_trt_engine builds from (unless
# gen_trt_engine.onnx_file is set) and what a run ships
MODEL_KEYS = ("autotune/optimized_final.onnx", "quantize/quantized_model.onnx", "export/model.onnx")


class StageMetrics(Protocol):
    """What a stage reports of its run: a record with a one-line ``headline`` (the end-of-run table) and
    ``to_dict``, the stage's manifest entry. Each stage's record is its own (pipeline/records/, and for
    gen_trt_engine the runtime's DeploymentMetrics); ``pipeline.records.stages`` reads them back."""

    @property
    def headline(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass
class StageResult:
    artifacts: dict[str, Path]  # artifact key "<stage>/<file>" -> path
    metrics: StageMetrics
    notes: list[str] = field(default_factory=list)


@dataclass
class StageContext:
    cfg: DictConfig
    results_dir: Path
    manifest: Manifest
    log: logging.Logger

    def stage_dir(self, stage: str) -> Path:
        d = self.results_dir / stage
        d.mkdir(parents=True, exist_ok=True)
        return d

    def artifact(self, key: str) -> Path | None:
        return self.manifest.artifact(key)

    def require(self, key: str) -> Path:
        """Path of an earlier stage's artifact, or a StageError naming the stage to run first."""
        p = self.artifact(key)
        if p is None:
            stage = key.split("/", 1)[0]
            raise StageError(
                f"missing input {key} in {self.results_dir}: run stage '{stage}' first "
                f"(e.g. stages=[{stage},...])"
            )
        return p


class Stage:
    """Base class. Subclasses set ``name``, ``inputs`` (required artifact keys), ``optional_inputs``,
    ``outputs`` (artifact keys they always write) and ``config_keys`` (config sections whose values
    change the outputs), ``host_bound`` where the outputs are facts of the host that made them (a
    compiled engine, measured latency: a results_dir copied to another kind of CPU or runtime version
    runs the stage again), ``tunes`` where it is tuning (quantize, autotune: a re-choice on another host
    never runs it), and implement ``run``."""

    name: str = ""
    inputs: tuple[str, ...] = ()
    optional_inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    config_keys: tuple[str, ...] = ()
    host_bound: bool = False
    tunes: bool = False

    def optional_input_keys(self, ctx: StageContext) -> tuple[str, ...]:
        """``optional_inputs``, and any the run's config adds (e.g. the configured runtime's settings file)."""
        return self.optional_inputs

    def resolve_inputs(self, ctx: StageContext) -> dict[str, Path]:
        found = {k: ctx.require(k) for k in self.inputs}
        for k in self.optional_input_keys(ctx):
            p = ctx.artifact(k)
            if p is not None:
                found[k] = p
        return found

    def run(self, ctx: StageContext) -> StageResult:  # pragma: no cover - interface
        raise NotImplementedError
