"""`backend=auto`: the fastest accurate deployment on this machine, chosen by measurement.

Export runs once. Each runtime in ``backend.runtimes`` that can run here gets its own results_dir,
results_dir/runtimes/<name>/, whose manifest points at the shared export, and quantize and autotune run
there with that runtime's section as the backend (each resumable and skipped when up to date, as any run).
A runtime that cannot run here, or whose run fails, is reported in one line and left out. Then every
runtime's shipped model (with the settings it ships with) and its float baseline as deployed are timed side
by side with the reference float (ONNX Runtime FP32 where it is in the list) in one interleaved run, and the
fastest of them ships (a runtime's float displaces that runtime's shipped model only where its per-round
ratios put it clearly ahead: the runtime's autotune chose the shipped model over it by its own paired
measurements): every shipped model already met the accuracy budget in its own autotune, and every
float baseline is within it (the FP32 reference, or a lower precision held to the budget). The choice is
kept in autotune/runtime_choice.json with a fingerprint of what it compared, so a re-run with nothing
changed does not time again; the top-level manifest's quantize and autotune entries point at the winner's
files (at the exported float and the float's settings where a float wins), and gen_trt_engine and evaluate
run on the winner.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.app.choice import choose, reference_float
from pipeline.app.publish import publish
from pipeline.app.race import quantize_racing, race_floats, tune_racing
from pipeline.app.runtime_runs import (
    PER_RUNTIME,
    EachRuntime,
    RuntimeRun,
    run_scope_of,
    runnable,
)
from pipeline.app.scope import tuning_frozen
from pipeline.artifacts import Manifest, atomic_write_json, entry_name, read_json
from pipeline.backends import settings_artifacts
from pipeline.config import ordered_stages
from pipeline.errors import BackendUnavailable, PipelineError, first_line
from pipeline.quant.shared_stats import sharing
from pipeline.records.evaluate import EvaluateMetrics, runtime_evaluation
from pipeline.records.stages import stage_metrics
from pipeline.registry import load_stage
from pipeline.runtime_choice import CHOICE, RuntimeChoice
from pipeline.stage import Stage

log = logging.getLogger("tune.auto")


def run_auto(cfg: DictConfig, results_dir: Path,
             run_stages: Callable[[DictConfig, list[Stage], Path], dict[str, Any]]) -> dict[str, Any]:
    """Run ``cfg.stages`` with backend=auto in ``results_dir`` (``run_stages(cfg, stages, dir)`` runs stages
    in one results_dir, as the runner does); the summary of the top-level run."""
    wanted = ordered_stages(cfg)
    summary: dict[str, Any] = {}
    if "export" in wanted:
        summary.update(run_stages(cfg, [load_stage("export")], results_dir))
    per_runtime = [s for s in PER_RUNTIME if s in wanted]
    rest = [s for s in wanted if s not in ("export", *PER_RUNTIME)]
    if not per_runtime and not rest:
        return summary
    runs, left_out = runnable(cfg, results_dir)
    everyone = list(runs)  # the reference float is among them, tuned or not
    each = EachRuntime(cfg, results_dir, run_stages, left_out)
    # calibration statistics are collected once, by the first runtime that quantizes; a re-choice
    # (backend.tuned_only) runs no tuning stage
    with sharing(), tuning_frozen(bool(cfg.backend.get("tuned_only", False))):
        lead_race = None
        if "quantize" in per_runtime:
            runs, lead_race = quantize_racing(cfg, results_dir, race_floats(cfg, results_dir, runs, each), each)
        if "autotune" in per_runtime:
            runs = tune_racing(cfg, results_dir, runs, each, lead_race)
    failures, outcomes = each.failures, each.outcomes
    if not runs and failures:
        raise failures[0]  # every runtime failed: the first one's error (a bad input fails them all alike)
    if not runs:
        raise BackendUnavailable("backend=auto: no runtime in backend.runtimes could run here: "
                                 + "; ".join(f"{k}: {v}" for k, v in left_out.items()))
    if "autotune" in wanted:
        choice = choose(cfg, results_dir, runs, left_out, reference_float(everyone))
        winner = next(r for r in runs if r.name == choice.winner)
        if "evaluate" in rest:
            choice = _evaluate_others(cfg, results_dir, runs, choice, run_stages)
        publish(results_dir, winner, choice, [a for r in everyone for a in settings_artifacts(r.cfg.backend)])
    else:
        # in backend.runtimes' order (the races order runs by float latency)
        names = {r.name for r in runs}
        winner = _earlier_winner(results_dir, [r for r in everyone if r.name in names], bool(rest))
        if rest and not (results_dir / CHOICE).exists():
            publish(results_dir, winner, None)  # e.g. evaluate compares this runtime's PTQ model with float
    # what auto published at the top level (its own headline), else the winner's own run
    shown = Manifest(results_dir if "autotune" in wanted else winner.results_dir)
    for stage in per_runtime:
        status = outcomes.get(winner.name, {}).get(stage, {}).get("status", "skipped")
        summary[stage] = {"status": status,
                          "metrics": stage_metrics(stage, shown.metrics(stage), shown.entry_name(stage))}
    if rest:
        summary.update(run_stages(winner.cfg, [load_stage(s) for s in rest], results_dir))
    return summary


def _evaluate_others(cfg: DictConfig, top: Path, runs: list[RuntimeRun], choice: RuntimeChoice,
                     run_stages: Callable[[DictConfig, list[Stage], Path], dict[str, Any]]) -> RuntimeChoice:
    """Evaluate each runtime that does not ship in its own results_dir (skipped when up to date, as any
    stage), its summary kept on its row of the choice for the top-level report; a failed one is one line."""
    rows = []
    for row in choice.rows:
        run = next((r for r in runs if r.name == row.runtime), None)
        if run is None or row.runtime == choice.winner:
            rows.append(row)
            continue
        log.info("auto: evaluate %s in %s", run.name, run.results_dir)
        try:
            with run_scope_of(cfg, run):
                run_stages(run.cfg, [load_stage("evaluate")], run.results_dir)
            report = os.path.relpath(run.results_dir / "evaluate" / "report.md", top)
            metrics = EvaluateMetrics.from_dict(Manifest(run.results_dir).metrics("evaluate"),
                                                entry_name(run.results_dir, "evaluate"))
            evaluation = runtime_evaluation(metrics, report)
            rows.append(replace(row, evaluation=evaluation, evaluation_error=None))
        except PipelineError as exc:
            log.warning("auto: evaluate on %s failed: %s", run.name, first_line(exc))
            rows.append(replace(row, evaluation=None, evaluation_error=first_line(exc)))
    evaluated = replace(choice, rows=rows)
    if evaluated != choice:
        atomic_write_json(top / CHOICE, evaluated.to_dict(), indent=1)
    return evaluated


def _earlier_winner(top: Path, runs: list[RuntimeRun], later_stages: bool) -> RuntimeRun:
    """Without autotune in this run: the runtime an earlier run chose, else the first that runs here (said in
    one line where ``later_stages`` run on it)."""
    path = top / CHOICE
    name = RuntimeChoice.from_dict(read_json(path, CHOICE)).winner if path.exists() else None
    chosen = next((r for r in runs if r.name == name), None)
    if chosen is None:
        chosen = runs[0]
        if later_stages:
            log.info("auto: no runtime chosen yet (autotune chooses one): the later stages run on %s",
                     chosen.name)
    return chosen


