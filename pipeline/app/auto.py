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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.accuracy.evaluation import EvaluateMetrics, FloatBaseline, runtime_evaluation
from pipeline.accuracy.kinds import checked_on, float_kinds, host_key
from pipeline.app.comparison import Comparison
from pipeline.app.host_choice import HOST_CHOICES, judged_hosts, recheck_here, remember
from pipeline.app.race import race_floats, race_line, tune_racing
from pipeline.app.runtime_runs import (
    EachRuntime,
    RuntimeRun,
    reroot,
    run_scope_of,
    runnable,
)
from pipeline.app.scope import tuning_frozen
from pipeline.artifacts import (
    Manifest,
    atomic_write_json,
    external_data_files,
    fingerprint,
    read_json,
    sha256_file,
)
from pipeline.backends import Backend, create_backend, settings_artifacts
from pipeline.backends.base import Timing
from pipeline.backends.ratios import ratio_interval, round_ratios
from pipeline.backends.timing import MIN_BLOCK_MS, TimingPlan, time_pairs
from pipeline.config import ordered_stages
from pipeline.errors import BackendUnavailable, PipelineError, StateError, first_line
from pipeline.quant.shared_stats import sharing
from pipeline.registry import load_stage
from pipeline.runtime_choice import CHOICE, FLOAT, SHIPPED, RuntimeChoice, RuntimeRow, headline
from pipeline.stage import Stage
from pipeline.values import section

log = logging.getLogger("tune.auto")

PER_RUNTIME = ("quantize", "autotune")  # the stages each runtime runs in its own results_dir
# the version of the rule ``decide`` chooses by: a choice kept from an older rule is made again
CHOICE_RULE = 2


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
        if "quantize" in per_runtime:
            runs = each.run(race_floats(cfg, results_dir, runs, each), "quantize")
        if "autotune" in per_runtime:
            runs = tune_racing(cfg, results_dir, runs, each)
    failures, outcomes = each.failures, each.outcomes
    if not runs and failures:
        raise failures[0]  # every runtime failed: the first one's error (a bad input fails them all alike)
    if not runs:
        raise BackendUnavailable("backend=auto: no runtime in backend.runtimes could run here: "
                                 + "; ".join(f"{k}: {v}" for k, v in left_out.items()))
    if "autotune" in wanted:
        choice = _choose(cfg, results_dir, runs, left_out, reference_float(everyone))
        winner = next(r for r in runs if r.name == choice.winner)
        if "evaluate" in rest:
            choice = _evaluate_others(cfg, results_dir, runs, choice, run_stages)
        _publish(results_dir, winner, choice)
        place_shipped(results_dir, [a for r in everyone for a in settings_artifacts(r.cfg.backend)])
    else:
        winner = _earlier_winner(results_dir, runs, bool(rest))
        if rest and not (results_dir / CHOICE).exists():
            _publish(results_dir, winner, None)  # e.g. evaluate compares this runtime's PTQ model with float
    # what auto published at the top level (its own headline), else the winner's own run
    shown = Manifest(results_dir if "autotune" in wanted else winner.results_dir)
    for stage in per_runtime:
        status = outcomes.get(winner.name, {}).get(stage, {}).get("status", "skipped")
        summary[stage] = {"status": status, "metrics": shown.metrics(stage)}
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
                                                f"{run.results_dir}/manifest.json's evaluate entry")
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


def _shipped(run: RuntimeRun) -> tuple[Backend, Path, dict[str, Any]]:
    """The runtime's backend with the settings its autotune ships, its shipped model, its autotune metrics."""
    manifest = Manifest(run.results_dir)
    model = manifest.artifact("autotune/optimized_final.onnx")
    if model is None:
        raise StateError(f"backend=auto: {run.name} has no tuned model in {run.results_dir}: include autotune "
                         f"in stages")
    backend = create_backend(run.cfg.backend)
    kind = backend.shipped_settings
    settings_path = manifest.artifact(kind.artifact) if kind is not None else None
    if settings_path is not None:
        backend = backend.with_settings(kind.type.load(settings_path))
    return backend, model, manifest.metrics("autotune")


def reference_float(runs: list[RuntimeRun]) -> Backend:
    """The float every runtime is compared with: the reference runtime's FP32 (``Backend.reference``: ONNX
    Runtime) where it takes part, else the first runtime in FP32."""
    backends = [create_backend(r.cfg.backend) for r in runs]
    backend = next((b for b in backends if b.reference), backends[0]).as_deployed()
    return backend.fp32_variant() or backend


def _choose(cfg: DictConfig, top: Path, runs: list[RuntimeRun], left_out: dict[str, str], reference: Backend
            ) -> RuntimeChoice:
    """The kept choice when nothing it compared changed, else one interleaved run of every runtime's shipped
    model and float against the ``reference`` float (``reference_float`` of every runtime that runs here,
    those the race did not tune included)."""
    float_path = Manifest(top).artifact("export/model.onnx")
    if float_path is None:
        raise StateError(f"backend=auto: no export/model.onnx in {top}: run stage 'export' first")
    shipped = {r.name: _shipped(r) for r in runs}
    compared = {}
    for r in runs:
        backend, model, _ = shipped[r.name]
        compared[r.name] = [sha256_file(model), backend.settings.to_dict() if backend.settings is not None else None,
                            section(r.cfg, "backend"), float_precision(shipped[r.name][2], backend)]
    # the host is part of the key: on another CPU kind or other runtime versions the choice is made again
    key = fingerprint({"float": sha256_file(float_path), "runtimes": compared, "rule": CHOICE_RULE,
                       "reference": reference.describe(),
                       "timing": [int(cfg.backend.warmup_runs), int(cfg.backend.timing_runs),
                                  float(cfg.backend.get("min_block_ms", MIN_BLOCK_MS))], "host": host_key()})
    path = top / CHOICE
    if path.exists():
        kept = RuntimeChoice.from_dict(read_json(path, CHOICE))
        if kept.key == key:
            log.info("auto: %s (kept: nothing it compared changed)", kept.headline)
            return kept
    judged = recheck_here(runs[0].cfg, float_path, shipped)  # models checked on another host, judged here
    misses = {name: f"misses the accuracy budget on this host ({v.what})" for name, v in judged.items() if not v.ok}
    compare = Comparison()
    ref_slot = compare.slot(reference, float_path)
    slots = [(compare.slot(float_deployment(r, shipped[r.name][2]), float_path),
              compare.slot(shipped[r.name][0], shipped[r.name][1])) for r in runs]
    # a race: fewer rounds once one deployment is clearly the fastest; a tie, or a float against its own
    # runtime's shipped model, takes all of them, as do cheap rounds
    plan = TimingPlan.race(cfg.backend.timing_runs, cfg.backend.warmup_runs)
    timings, blocks = time_pairs(compare.pairs, plan, name="auto")
    timed = [TimedRuntime(timings[f], timings[s] if r.name not in misses else Timing.failed(r.name, misses[r.name]),
                          f == s, f == ref_slot, ratio_interval(round_ratios(blocks[s], blocks[f])) if f != s else None)
             for r, (f, s) in zip(runs, slots, strict=True)]
    choice = decide(key, path, reference, timings[ref_slot], timed, shipped, left_out, race_line(top))
    remember(top, choice, judged)
    return choice


def float_deployment(run: RuntimeRun, metrics: dict[str, Any]) -> Backend:
    """The runtime's float baseline as a deployment runs it (no tuned settings): the precision its autotune
    chose (``float_baseline``: FP32 where its own precision misses the budget or runs slower), within
    the budget either way. Its settings say that precision, so shipping it ships the precision too."""
    backend = create_backend(run.cfg.backend).as_deployed()
    chosen = float_baseline(metrics)
    fp32 = backend.fp32_variant() if chosen is not None and chosen.precision == "FP32" else None
    return fp32 or backend


def float_baseline(metrics: dict[str, Any]) -> FloatBaseline | None:
    """The float baseline a runtime's autotune chose (its metrics' ``float_baseline``), if it recorded one."""
    recorded = metrics.get("float_baseline")
    return FloatBaseline.from_dict(recorded) if recorded else None


@dataclass(frozen=True)
class TimedRuntime:
    """One runtime in the final comparison: its float's and shipped model's timings, and whether its float
    is the same deployment as its shipped model or as the reference float (timed once, one speed)."""

    float_t: Timing
    ship_t: Timing
    float_is_shipped: bool
    float_is_reference: bool
    # 95% interval of the float's latency over the shipped model's, from their per-round ratios
    float_interval: tuple[float, float] | None = None


def decide(key: str, path: Path, reference: Backend, ref_t: Timing, timed: list[TimedRuntime],
           shipped: dict[str, tuple[Backend, Path, dict[str, Any]]], left_out: dict[str, str], race: str = ""
           ) -> RuntimeChoice:
    """The choice from the reference float's timing and each runtime's timings: the fastest of every
    runtime's shipped model and float baseline ships. A float displaces its own runtime's shipped model
    only when clearly faster (``Contender.rank_ms``): that runtime's autotune chose the shipped model over
    it by its own paired measurements, and a tie goes to the shipped model."""
    if not ref_t.ok:
        raise PipelineError(f"backend=auto: the reference float did not run on {reference.name}: {ref_t.error}")
    rows, contenders = [], []
    for (name, (backend, _, metrics)), t in zip(shipped.items(), timed, strict=True):
        error = next((x.error for x in (t.float_t, t.ship_t) if not x.ok), None)
        final = (metrics.get("accuracy") or {}).get("final") or {}
        row = RuntimeRow(name, str(metrics.get("shipped", "float")), float_precision(metrics, backend),
                         str(final.get("what", "")), t.ship_t.p10_ms if t.ship_t.ok else None,
                         t.float_t.p10_ms if t.float_t.ok else None, error)
        rows.append(row)
        contenders += row.contenders(t.float_is_shipped, t.float_is_reference, t.float_interval)
        if error:
            log.warning("auto: %s left out of the choice: %s", name, error)
    contenders.sort(key=lambda c: (c.rank, c.what != SHIPPED))
    if not contenders:
        raise PipelineError("backend=auto: no runtime's shipped model ran in the final comparison: "
                            + "; ".join(f"{r.runtime}: {r.error}" for r in rows))
    reference_name = f"{reference.name} {reference.float_precision()} float"
    choice = RuntimeChoice(key, reference_name, ref_t.p10_ms, contenders[0].runtime, rows, dict(left_out),
                           contenders=contenders, race=race)
    choice.headline = headline(choice)
    atomic_write_json(path, choice.to_dict(), indent=1)
    log.info("auto: %s", choice.headline)
    return choice


def float_precision(metrics: dict[str, Any], backend: Backend) -> str:
    """The precision of the runtime's float baseline: its autotune's choice, else the runtime's own."""
    chosen = float_baseline(metrics)
    return chosen.precision if chosen is not None else backend.float_precision()


def _publish(top: Path, winner: RuntimeRun, choice: RuntimeChoice | None) -> None:
    """The top-level manifest's quantize and autotune entries: the winner's, pointing at its files, the
    autotune one with the choice beside it (``choice`` None: no choice made yet). Where the winner's float
    ships (clearly faster than its own shipped model in the final comparison), autotune's model is the exported
    float and its settings file the float deployment's, written at the top level."""
    sub = Manifest(winner.results_dir)
    manifest = Manifest(top)
    for stage in PER_RUNTIME:
        entry = sub.entry(stage)
        if entry is not None:
            manifest.stages[stage] = {**reroot(entry, winner.results_dir, top), **_every_runtime_seconds(top, stage)}
    auto = manifest.stages.get("autotune")
    if auto is not None and choice is not None:
        auto["outputs"][CHOICE] = manifest.describe_file(top / CHOICE)
        metrics = auto.get("metrics", {})
        if choice.ships == FLOAT:
            metrics = _ship_float(manifest, winner, auto["outputs"], metrics)
        if (top / HOST_CHOICES).exists():
            auto["outputs"][HOST_CHOICES] = manifest.describe_file(top / HOST_CHOICES)
            choices = read_json(top / HOST_CHOICES, HOST_CHOICES)
            metrics = {**metrics, "host_choices": choices}
            if metrics.get("checked_on") and choice.ships != FLOAT:  # the winner's model as other hosts judged it
                metrics["checked_on"] = {**metrics["checked_on"], "hosts": judged_hosts(choices, winner.name)}
        auto["metrics"] = {**metrics, "headline": choice.headline, "runtime_choice": choice.to_dict(),
                           "runtime_headline": metrics.get("headline")}
    manifest.save()


SHIPPED_MODEL = "autotune/optimized_final.onnx"


def place_shipped(top: Path, settings_files: list[str]) -> None:
    """The shipped deployment where a reader finds it without the manifest, whatever runtime won: the model
    the top-level autotune entry ships (with the data files it names) linked as
    results_dir/autotune/optimized_final.onnx, and its settings file (one of ``settings_files``, the
    runtimes' settings artifacts) beside it; another runtime's settings file left there by an earlier
    choice is removed."""
    outputs = (Manifest(top).entry("autotune") or {}).get("outputs", {})
    for key in settings_files:
        if key not in outputs:
            (top / key).unlink(missing_ok=True)
    for key in [SHIPPED_MODEL, *dict.fromkeys(k for k in settings_files if k in outputs)]:
        if key not in outputs:
            continue
        src, dst = (top / outputs[key]["path"]).resolve(), top / key
        if src == dst.resolve():
            continue
        extra = [(f, dst.parent / f.name) for f in external_data_files(src)] if key == SHIPPED_MODEL else []
        for a, b in [(src, dst), *extra]:
            _link(a, b)


def _link(src: Path, dst: Path) -> None:
    """``dst`` the same file as ``src`` (a hard link, a copy across file systems), replaced atomically."""
    import shutil

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def _every_runtime_seconds(top: Path, stage: str) -> dict[str, Any]:
    """The seconds every runtime's own run spent in ``stage`` (the ones the race dropped too), and their sum:
    what the top level's entry reports for the whole auto run."""
    spent = {}
    for sub in sorted((top / "runtimes").glob("*/manifest.json")):
        entry = Manifest(sub.parent).entry(stage) or {}
        if entry.get("seconds") is not None:
            spent[sub.parent.name] = float(entry["seconds"])
    return {"seconds": round(sum(spent.values()), 3), "seconds_by_runtime": spent} if spent else {}


def _ship_float(manifest: Manifest, winner: RuntimeRun, outputs: dict[str, Any], metrics: dict[str, Any]
                ) -> dict[str, Any]:
    """Point ``outputs`` at the exported float and the float deployment's settings (written at the top level);
    the autotune metrics of what ships then: the float, with its verdict against FP32 where it runs lower."""
    top = manifest.results_dir
    backend = float_deployment(winner, metrics)
    float_path = manifest.artifact("export/model.onnx")
    if float_path is None:
        raise StateError(f"backend=auto: no export/model.onnx in {top}: run stage 'export' first")
    outputs["autotune/optimized_final.onnx"] = manifest.describe_file(float_path)
    kind = backend.shipped_settings
    if kind is not None:
        outputs.pop(kind.artifact, None)
        if backend.settings is not None:
            pinned = backend.settings.pinned(backend)
            outputs[kind.artifact] = manifest.describe_file(pinned.save(top / kind.artifact))
    chosen = float_baseline(metrics)
    judged = chosen.verdict if chosen is not None and chosen.precision == chosen.default else None
    return {**metrics, "shipped": "float", "shipped_reason": "auto: its float ran clearly faster than its shipped model",
            "final_ms": metrics.get("baseline_ms"), "speedup": 1.0,
            "accuracy": {**(metrics.get("accuracy") or {}), "final": judged.to_dict() if judged is not None else None},
            "checked_on": checked_on(backend, float_kinds(judged)).to_dict()}
