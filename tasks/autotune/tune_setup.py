"""What the autotune stage hands its modes and what they hand back: ``TuneSetup`` (built once per
run by ``AutotuneStage._setup``) and ``ModeResult`` (a mode's tuned model, before the final guard)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.accuracy.budget import AccuracyBudget, Holdout
from pipeline.quant.calibration import Calibration
from tasks.autotune.paired_step import PairedStep


@dataclass(frozen=True)
class TuneRuns:
    """How much each mode measures: schemes tried per region, and the runs of one paired measurement."""

    schemes_per_region: int
    warmup_runs: int
    timing_runs: int
    rounds: int  # paired rounds of one measurement


@dataclass(frozen=True)
class TuneSetup:
    """What both modes share, built once per run (see ``AutotuneStage._setup``)."""

    out: Path
    inputs: dict[str, Path]
    model: Any  # the float graph Q/DQ go into (quantize/float_model.onnx, else export's)
    backend: Any
    config: Any  # tasks.autotune.autotuner.Config
    calibration: Calibration
    budget: AccuracyBudget
    holdout: Holdout
    baseline_path: Path  # export's float model: every speedup is against it
    qdq_baseline: Any  # the placement region mode seeds its search with (None: start from no Q/DQ)
    context_items: dict[str, Any]  # what a state file must have been made with to be resumed
    runs: TuneRuns
    performance_threshold: float  # the shipped Q/DQ model must beat float by this factor

    def judge(self, prepared: Any) -> Any:
        return self.holdout.score(prepared, self.budget)

    @property
    def accuracy_check(self) -> Any:
        """What candidates are checked with before they are timed (None: budget off)."""
        return self.judge if self.budget.enabled else None

    @property
    def ptq_model(self) -> Path | None:
        """quantize's model (the PTQ placement), if the run has one."""
        return self.inputs.get("quantize/quantized_model.onnx")


@dataclass
class ModeResult:
    """A mode's tuned model (not yet guarded), its metrics and its own artifacts."""

    tuned: Path
    metrics: dict[str, Any]
    artifacts: dict[str, Path]
    bench: Any = None  # a live benchmark to close before the final measurement
    report: Any = None  # called with the final metrics to write the mode's report
    # the mode's paired full-model measurements (subgraph mode's phase-3 steps), which the guard
    # reuses where they measured the models it compares
    steps: list[PairedStep] | None = None
