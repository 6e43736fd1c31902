"""What the autotune stage hands its modes and what they hand back: ``TuneSetup`` (built once per
run by ``AutotuneStage._setup``) and ``ModeResult`` (a mode's tuned model, before the final guard);
and ``float_baseline``, which float the guard and every speedup compare against."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.accuracy.budget import AccuracyBudget
from pipeline.accuracy.holdout import Holdout
from pipeline.artifacts import atomic_write_json, fingerprint
from pipeline.backends.base import Backend
from pipeline.errors import first_line
from pipeline.graph.model import model_hash
from pipeline.quant.calibration import Calibration
from pipeline.records.autotune import ModeSummary
from pipeline.records.evaluate import FloatBaseline
from tasks.autotune.crash_guard import CrashGuard
from tasks.autotune.paired_step import PairedStep
from tasks.autotune.state_file import FLOAT_BASELINE, StateDocument, StateHeader, read_state

log = logging.getLogger("tune.autotune")

FLOAT_BASELINE_VERSION = 1


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
    backend: Backend
    config: Any  # tasks.autotune.region.autotuner.Config
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
        return CrashGuard(self.out, self.backend)

    @property
    def accuracy_check(self) -> Any:
        """What candidates are checked with before they are timed (None: budget off)."""
        return self.judge if self.budget.enabled else None

    @property
    def ptq_model(self) -> Path | None:
        """quantize's model (the PTQ placement), if the run has one."""
        return self.inputs.get("quantize/quantized_model.onnx")


# the FP32 float is the baseline, the default precision meeting the budget, where its latency is
# clearly below this fraction of the default float's (the 95% interval of its per-round ratios)
FP32_FASTER = 0.97


def fp32_latency_ratio(backend: Backend, fp32: Backend, path: Path) -> tuple[float | None, bool]:
    """(the FP32 float's latency over the default float's: median of per-round ratios, None where
    either failed to run; whether it is clearly below FP32_FASTER), from paired rounds that end once that
    is clear or not, else after DUEL_ROUNDS rounds, or more while they are cheap (``TimingPlan.duel``)."""
    from pipeline.backends.ratios import round_ratios, sequential_verdict
    from pipeline.backends.timing import DUEL_ROUNDS, TimingPlan, duel_runs, time_interleaved

    with backend.prepare(path) as own, fp32.prepare(path) as full:
        plan = TimingPlan.duel(FP32_FASTER, DUEL_ROUNDS, duel_runs(backend.timing_runs), int(backend.warmup_runs))
        blocks, errors = time_interleaved([own, full], plan)
    ratios = round_ratios(*blocks)
    if any(errors) or not ratios:
        return None, False
    return float(np.median(ratios)), sequential_verdict(ratios, FP32_FASTER) == "below"


def float_baseline(backend: Backend, path: Path, holdout: Holdout, budget: AccuracyBudget,
                   record: Path | None = None) -> tuple[Any, FloatBaseline]:
    """Set ``holdout``'s reference to the float model at ``path`` in FP32 (``backend.fp32_variant()``
    where the runtime's default float precision is lower) and hold the default-precision float to
    ``budget`` on it, as every candidate is. (the backend to tune, time and guard with, what was
    decided): ``backend`` where its float meets the budget and is not clearly slower than the FP32
    float (tiny models on CPUs without AMX), else its FP32 variant: the fastest float within budget.
    The choice is kept in ``record`` for this model, runtime and budget: a resumed run takes it as it
    was (a timing near the threshold would otherwise set the search's state aside)."""
    fp32 = backend.fp32_variant()
    with (fp32 or backend).prepare(path) as pm:
        holdout.set_reference(pm)
    default = backend.float_precision()
    if fp32 is None:
        return backend, FloatBaseline(default, default)
    key = fingerprint({"model": model_hash(path), "runtime": backend.describe(), "budget": budget.describe(),
                       "holdout": [holdout.source, holdout.samples]})
    kept = _kept_choice(record, key)
    if kept is not None:
        choice = kept
        log.info("autotune: the %s float is the baseline, as chosen before for this model (%s)", choice.precision,
                 record)
        return (fp32 if choice.precision == "FP32" else backend), choice
    chosen_backend, choice = _choose_float(backend, fp32, path, holdout, budget, default)
    if record is not None:
        atomic_write_json(record, StateDocument(_baseline_header(key), {"baseline": choice.to_dict()}).to_dict())
    return chosen_backend, choice


def _kept_choice(record: Path | None, key: str) -> FloatBaseline | None:
    """The choice ``record`` holds for ``key``; None where there is none or it was made for another
    model, runtime, budget or held-out data (the choice is made again). A corrupt record is a one-line
    StateError."""
    document = read_state(record, FLOAT_BASELINE, _baseline_header(key)) if record is not None else None
    if document is None:
        return None
    try:
        return FloatBaseline.from_dict(document.body["baseline"])
    except (KeyError, TypeError) as exc:
        raise FLOAT_BASELINE.corrupt(record, f"{type(exc).__name__}: {first_line(exc)}") from None


def _baseline_header(key: str) -> StateHeader:
    """The header of float_baseline.json: ``key`` fingerprints the model, runtime, budget and held-out
    data (files from before the header have only the key, and read as this version)."""
    return StateHeader.of(FLOAT_BASELINE_VERSION, None, None, key=key)


def _choose_float(backend: Backend, fp32: Backend, path: Path, holdout: Holdout, budget: AccuracyBudget, default: str
                  ) -> tuple[Any, FloatBaseline]:
    verdict = None
    if budget.enabled:
        with backend.prepare(path) as pm:
            verdict = holdout.score(pm, budget)
        if not verdict.ok:
            note = f"{default} float misses the budget: {verdict.what}"
            log.warning("autotune: the %s float model misses the accuracy budget against the FP32 float (%s): the "
                        "search, the guard and every speedup run float layers in FP32", default, verdict.what)
            return fp32, FloatBaseline("FP32", default, verdict, note, "misses the budget")
    ratio, faster = fp32_latency_ratio(backend, fp32, path)
    if faster and ratio is not None:
        note = f"{default} float is slower here: the FP32 float runs at {ratio:.2f}x its latency"
        log.info("autotune: the FP32 float model runs at %.2fx the latency of the %s float: it is the baseline, and "
                 "the search, the guard and every speedup run float layers in FP32", ratio, default)
        return fp32, FloatBaseline("FP32", default, verdict, note, "is slower here", ratio)
    slower = f"FP32 at {ratio:.2f}x its latency" if ratio is not None else "FP32 not timed"
    log.info("autotune: the %s float model %s and is not slower (%s): it is the baseline", default,
             f"meets the accuracy budget against the FP32 float ({verdict.what})" if verdict is not None
             else "is not judged (accuracy budget off)", slower)
    return backend, FloatBaseline(default, default, verdict, fp32_ratio=ratio)


@dataclass
class ModeResult:
    """A mode's tuned model (not yet guarded), what it reports of its search and its own artifacts."""

    tuned: Path
    summary: ModeSummary  # the mode's part of autotune's metrics
    artifacts: dict[str, Path]
    bench: Any = None  # a live benchmark to close before the final measurement
    report: Any = None  # called with the final AutotuneMetrics to write the mode's report
    # the mode's paired full-model measurements (subgraph mode's phase-3 steps), which the guard
    # reuses where they measured the models it compares
    steps: list[PairedStep] | None = None
