"""backend=auto's choice: every runtime's shipped model (with the settings it ships with) and its float as
deployed, timed side by side with the reference float (``Backend.reference``'s FP32) in one interleaved run
(``TimingPlan.choice``); the fastest ships, a runtime's float only where clearly faster than its own shipped
model. Deployments checked on another host are judged here first (``pipeline.app.host_choice``). The choice
is kept in autotune/runtime_choice.json with a key of what it compared (models, settings, rule, host), so a
re-run with nothing changed does not time again. The rule's version is ``CHOICE_RULE``; who may not
contend at all is the races' (``pipeline.app.race``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from pipeline.accuracy.kinds import host_key
from pipeline.app.comparison import Comparison
from pipeline.app.host_choice import recheck_here, remember
from pipeline.app.race import race_line
from pipeline.app.runtime_runs import (
    RuntimeRun,
)
from pipeline.artifacts import Manifest, atomic_write_json, fingerprint, read_json, sha256_file
from pipeline.backends import Backend, create_backend
from pipeline.backends.base import Timing
from pipeline.backends.ratios import ratio_interval, round_ratios
from pipeline.backends.timing import MIN_BLOCK_MS, TimingPlan, time_pairs
from pipeline.errors import PipelineError, StateError
from pipeline.records.autotune import AutotuneMetrics
from pipeline.runtime_choice import CHOICE, SHIPPED, RuntimeChoice, RuntimeRow, headline
from pipeline.values import section

log = logging.getLogger("tune.auto")

# the version of the rule ``decide`` chooses by: a choice kept from an older rule is made again
CHOICE_RULE = 2


def _shipped(run: RuntimeRun) -> tuple[Backend, Path, AutotuneMetrics]:
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
    return backend, model, AutotuneMetrics.from_dict(manifest.metrics("autotune"),
                                                     manifest.entry_name("autotune"))


def reference_float(runs: list[RuntimeRun]) -> Backend:
    """The float every runtime is compared with: the reference runtime's FP32 (``Backend.reference``: ONNX
    Runtime) where it takes part, else the first runtime in FP32."""
    backends = [create_backend(r.cfg.backend) for r in runs]
    backend = next((b for b in backends if b.reference), backends[0]).as_deployed()
    return backend.fp32_variant() or backend


def choose(cfg: DictConfig, top: Path, runs: list[RuntimeRun], left_out: dict[str, str], reference: Backend
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
    # fewer rounds once the pick is clear; a tie between runtimes, or a float near its own runtime's
    # shipped model, takes all of them. What contends: the shipped model unless it missed the budget here,
    # the float unless it is the reference float (``RuntimeRow.contenders``)
    contending = [(s if f == ref_slot else f, s if r.name not in misses else f)
                  for r, (f, s) in zip(runs, slots, strict=True)]
    plan = TimingPlan.choice(cfg.backend.timing_runs, cfg.backend.warmup_runs, contending)
    timings, blocks = time_pairs(compare.pairs, plan, name="auto")
    timed = [TimedRuntime(timings[f], timings[s] if r.name not in misses else Timing.failed(r.name, misses[r.name]),
                          f == s, f == ref_slot, ratio_interval(round_ratios(blocks[s], blocks[f])) if f != s else None)
             for r, (f, s) in zip(runs, slots, strict=True)]
    choice = decide(key, path, reference, timings[ref_slot], timed, shipped, left_out, race_line(top))
    remember(top, choice, judged)
    return choice


def float_deployment(run: RuntimeRun, metrics: AutotuneMetrics) -> Backend:
    """The runtime's float baseline as a deployment runs it (no tuned settings): the precision its autotune
    chose (``float_baseline``: FP32 where its own precision misses the budget or runs slower), within
    the budget either way. Its settings say that precision, so shipping it ships the precision too."""
    backend = create_backend(run.cfg.backend).as_deployed()
    chosen = metrics.float_baseline
    fp32 = backend.fp32_variant() if chosen is not None and chosen.precision == "FP32" else None
    return fp32 or backend


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
           shipped: dict[str, tuple[Backend, Path, AutotuneMetrics]], left_out: dict[str, str], race: str = ""
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
        final = metrics.accuracy.final
        row = RuntimeRow(name, metrics.shipped or "float", float_precision(metrics, backend),
                         final.what if final is not None else "", t.ship_t.p10_ms if t.ship_t.ok else None,
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


def float_precision(metrics: AutotuneMetrics, backend: Backend) -> str:
    """The precision of the runtime's float baseline: its autotune's choice, else the runtime's own."""
    chosen = metrics.float_baseline
    return chosen.precision if chosen is not None else backend.float_precision()


