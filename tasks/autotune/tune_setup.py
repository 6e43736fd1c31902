"""What the autotune stage hands its modes and what they hand back: ``TuneSetup`` (built once per
run by ``AutotuneStage._setup``) and ``ModeResult`` (a mode's tuned model, before the final guard);
and ``float_baseline``, which float the guard and every speedup compare against."""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.accuracy.budget import AccuracyBudget
from pipeline.accuracy.holdout import Holdout
from pipeline.quant.calibration import Calibration
from tasks.autotune.crash_guard import CrashGuard
from tasks.autotune.paired_step import PairedStep

log = logging.getLogger("tune.autotune")


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
    float_baseline: FloatBaseline | None = None  # which float ``backend`` runs, and why (None: its own)

    def judge(self, prepared: Any) -> Any:
        return self.holdout.score(prepared, self.budget)

    @functools.cached_property
    def crash_guard(self) -> CrashGuard:
        """The run's record of candidates that crashed the process (one per run: the search, its duels
        and subgraph mode's validation share it)."""
        return CrashGuard(self.out)

    @property
    def accuracy_check(self) -> Any:
        """What candidates are checked with before they are timed (None: budget off)."""
        return self.judge if self.budget.enabled else None

    @property
    def ptq_model(self) -> Path | None:
        """quantize's model (the PTQ placement), if the run has one."""
        return self.inputs.get("quantize/quantized_model.onnx")


@dataclass(frozen=True)
class FloatBaseline:
    """The float the guard and every speedup compare against: the runtime's default precision, or
    FP32 where the default misses the accuracy budget (``note`` says so)."""

    precision: str  # what the baseline float runs in ("BF16", "FP32", ...)
    default: str  # the runtime's own float precision here
    verdict: dict[str, Any] | None = None  # the default float's verdict against FP32 (None: not judged)
    note: str = ""  # why the baseline is not the default ("" when it is)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def float_baseline(backend: Any, path: Path, holdout: Holdout, budget: AccuracyBudget) -> tuple[Any, FloatBaseline]:
    """Set ``holdout``'s reference to the float model at ``path`` in FP32 (``backend.fp32_variant()``
    where the runtime's default float precision is lower) and hold the default-precision float to
    ``budget`` on it, as every candidate is. (the backend to tune, time and guard with, what was
    decided): ``backend`` where its float meets the budget, else its FP32 variant."""
    fp32 = backend.fp32_variant()
    with (fp32 or backend).prepare(path) as pm:
        holdout.set_reference(pm)
    default = backend.float_precision()
    if fp32 is None or not budget.enabled:
        return backend, FloatBaseline(default, default)
    with backend.prepare(path) as pm:
        verdict = holdout.score(pm, budget)
    if verdict.ok:
        log.info("autotune: the %s float model meets the accuracy budget against the FP32 float (%s): it is the "
                 "baseline", default, verdict.what)
        return backend, FloatBaseline(default, default, verdict.to_dict())
    note = f"{default} float misses the budget: {verdict.what}"
    log.warning("autotune: the %s float model misses the accuracy budget against the FP32 float (%s): the search, "
                "the guard and every speedup run float layers in FP32", default, verdict.what)
    return fp32, FloatBaseline("FP32", default, verdict.to_dict(), note)


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
