"""The region-pattern autotuning workflow, and the reference tool's benchmark entry points.

``region_pattern_autotuning_workflow`` drives QDQAutotuner over every region: it measures each
generated scheme paired against the live float baseline, saves the state after every measurement
(so a killed run resumes at the next unmeasured scheme), re-measures a pattern's best schemes with
more rounds before committing the winner (the best of many noisy measurements is biased low), and
writes one log per measurement and the model after each committed pattern. Its ``SearchSession``
says where the state is saved, what it must have been made with to be resumed, where progress goes
(``tasks.autotune.progress``, the protocol subgraph mode reports through too) and what seeds the
schemes (a pattern cache of an earlier run, a Q/DQ model's placement).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from pipeline.artifacts import atomic_write_json
from pipeline.backends import Backend, PreparedModel
from pipeline.graph.model import load_model, remove_model, save_model
from pipeline.quant.calibration import Calibration
from tasks.autotune.benchmark import PairedBenchmark
from tasks.autotune.crash_guard import CrashGuard
from tasks.autotune.progress import OnProgress, Progress
from tasks.autotune.region.autotuner import Config, QDQAutotuner
from tasks.autotune.region.pattern_cache import PatternCache
from tasks.autotune.region.region import Region
from tasks.autotune.region.scheme import Measurement, PatternSchemes, SchemeRecord
from tasks.autotune.state_file import REGION_STATE, resume_or_set_aside

log = logging.getLogger("tune.autotune")

REMEASURE_TOP = 3


@dataclass(frozen=True)
class SearchSession:
    """How a region search is saved, resumed, reported and seeded."""

    # saved after every measurement; default <output_dir>/autotuner_state.yaml, the stage's own (one of
    # another model or setting is set aside), while a state file named here is refused instead
    state_file: str | Path | None = None
    context: str | None = None  # fingerprint of calibration, backend, rules...: a state of another is stale
    on_progress: OnProgress | None = None
    # the best schemes of an earlier run, measured first (warm start): a PatternCache, or the path of its
    # YAML (an autotuner_state_pattern_cache.yaml), loaded with the config's distance and size limits
    pattern_cache: PatternCache | str | Path | None = None
    # a Q/DQ model (e.g. quantize's): its placement is imported as each pattern's baseline scheme
    qdq_baseline: onnx.ModelProto | None = None


def init_benchmark_instance(backend: Backend, reference_model: str | Path, warmup_runs: int = 5,
                            timing_runs: int = 40, rounds: int = 4,
                            accuracy: Callable[[PreparedModel], Any] | None = None,
                            guard: CrashGuard | None = None) -> PairedBenchmark:
    """A benchmark paired against ``reference_model`` (pass it explicitly; there is no global one);
    ``accuracy`` judges each candidate before it is timed; ``guard`` keeps candidates that crashed the
    process out of a resumed run (see PairedBenchmark)."""
    return PairedBenchmark(backend, reference_model, warmup_runs, timing_runs, rounds, accuracy, guard)


def benchmark_onnx_model(model: str | Path | bytes, benchmark: PairedBenchmark) -> Measurement:
    """Measure one model (path or serialized bytes) against the benchmark's live reference."""
    return benchmark.measure(model)


@dataclass(frozen=True)
class MeasuredScheme:
    """Which scheme a measurement log is of: the region it was measured on, its index among the
    pattern's schemes, the pattern, where the scheme came from and its key."""

    region: int
    index: int
    pattern: str
    origin: str
    key: str


def _log_measurement(path: Path, scheme: MeasuredScheme, m: Measurement, extra: dict | None = None) -> None:
    atomic_write_json(path, {**(extra or {}),
        "region": scheme.region, "scheme_index": scheme.index, "pattern": scheme.pattern, "origin": scheme.origin,
        "scheme": scheme.key,
        "ok": m.ok, "latency_ms_p10": m.latency_ms, "reference_ms_p10": m.reference_ms, "ratio": m.ratio,
        "error": m.error, "remeasure": m.remeasure, "accuracy": m.accuracy,
    })


def region_pattern_autotuning_workflow(
    model: onnx.ModelProto | str | Path,
    output_dir: str | Path,
    benchmark: PairedBenchmark,
    config: Config | None = None,
    calibration: Calibration | None = None,
    session: SearchSession | None = None,
) -> QDQAutotuner:
    """Tune every pattern; returns the autotuner with every pattern committed. ``session`` says where
    the state is saved, where progress goes and what seeds the schemes (see SearchSession)."""
    session = session or SearchSession()
    out = Path(output_dir)
    region_models = out / "region_models"
    region_models.mkdir(parents=True, exist_ok=True)
    autotuner, state_path = _prepared_autotuner(model, out, config or Config(), calibration, session)

    def progress() -> None:
        if session.on_progress is not None:
            session.on_progress(_progress(autotuner))

    progress()
    for region in autotuner.regions:
        autotuner.set_profile_region(region, commit=False)
        ps = autotuner.current_profile_pattern_schemes
        if ps is None:
            continue
        _search_pattern(autotuner, region, benchmark, out, state_path, progress)
        _remeasure_winners(autotuner, ps, benchmark, region.id, out, state_path)
        autotuner.commit_current()
        autotuner.save_state(state_path)
        best = ps.find(ps.best) if ps.best is not None else None
        save_model(autotuner.export_model(), region_models / f"region_{region.id}_level_{region.level}.onnx")
        log.info("pattern %s (%d regions, %d nodes): fastest of %d schemes: %s", ps.pattern[:10],
                 len(autotuner.pattern_regions[ps.pattern]), autotuner.patterns[region.id].num_nodes,
                 len(ps.records), _winner(best, len(ps.candidates)))
        progress()
    autotuner.set_profile_region(None, commit=False)
    autotuner.save_state(state_path)
    return autotuner


def _winner(best: SchemeRecord | None, candidates: int) -> str:
    """The pattern's winning scheme and the whole model's speed with it, as the headline prints it."""
    if best is None or not math.isfinite(best.ratio):
        return "none measurable (every scheme failed to build or run: see autotune/logs/)"
    return (f"{best.describe(candidates)}, the model at {1.0 / best.ratio:.2f}x speedup vs float "
            f"(latency ratio {best.ratio:.3f}, lower is faster)")


def _prepared_autotuner(model: onnx.ModelProto | str | Path, out: Path, config: Config,
                        calibration: Calibration | None, session: SearchSession) -> tuple[QDQAutotuner, Path]:
    """The autotuner of ``model`` seeded from the session's pattern cache and Q/DQ baseline, resumed
    from the session's state file when there is one to resume; and the path its state is saved to."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if not isinstance(model, onnx.ModelProto):
        model = load_model(model)
    pattern_cache = session.pattern_cache
    if isinstance(pattern_cache, (str, Path)):
        pattern_cache = PatternCache.load(pattern_cache, config.pattern_cache_minimum_distance,
                                          config.pattern_cache_max_entries_per_pattern)
    autotuner = QDQAutotuner(model)
    autotuner.initialize(config, pattern_cache, calibration)
    autotuner.context = session.context
    if session.qdq_baseline is not None:
        n = autotuner.import_qdq_baseline(session.qdq_baseline)
        log.info("QDQ baseline: seeded %d of %d patterns", n, autotuner.num_patterns)
    state_path = Path(session.state_file) if session.state_file else out / "autotuner_state.yaml"
    # the default state file is the stage's own: one of another model or setting is set aside
    if resume_or_set_aside(lambda: autotuner.load_state(state_path), state_path, REGION_STATE,
                           own=not session.state_file,
                           companions=[state_path.with_name(f"{state_path.stem}_pattern_cache.yaml")]):
        done = sum(ps.done for ps in autotuner.pattern_schemes.values())
        log.info("resuming from %s: %d/%d patterns done, %d measurements kept", state_path, done,
                 autotuner.num_patterns, autotuner.num_measurements)
    return autotuner, state_path


def _progress(autotuner: QDQAutotuner) -> Progress:
    """Patterns done, measurements so far and the best speedup any scheme measured."""
    done = sum(ps.done for ps in autotuner.pattern_schemes.values())
    best = min((r.ratio for ps in autotuner.pattern_schemes.values() for r in ps.records if r.ok), default=math.inf)
    speedup = (1.0 / best) if math.isfinite(best) and best > 0 else None
    return Progress("autotune", done, autotuner.num_patterns, unit="pattern",
                    postfix={"schemes": autotuner.num_measurements, "best": f"{speedup:.2f}x" if speedup else "-"})


def _search_pattern(autotuner: QDQAutotuner, region: Region, benchmark: PairedBenchmark, out: Path,
                    state_path: Path, progress: Callable[[], None]) -> None:
    """Measure every scheme the autotuner generates for ``region``'s pattern, saving the state after each."""
    ps = autotuner.current_profile_pattern_schemes
    assert ps is not None
    while (idx := autotuner.generate()) != -1:
        rec = autotuner.pending_scheme
        assert rec is not None
        try:
            data = autotuner.export_model(check=False).SerializeToString()
        except Exception as exc:  # noqa: BLE001 - an unbuildable candidate is a failed measurement
            log.debug("export of scheme %s failed", rec.scheme.key, exc_info=True)
            m = Measurement.failed(f"export failed: {type(exc).__name__}: {exc}")
        else:
            m = benchmark.measure(data, what=f"region {region.id} scheme {idx} ({rec.scheme.key})",
                                  family=f"region {region.id}")
        log_path = out / "logs" / f"region_{region.id}_scheme_{idx}.log"
        m.log_path = str(log_path.relative_to(out))
        _log_measurement(log_path, MeasuredScheme(region.id, idx, ps.pattern, rec.origin, rec.scheme.key), m)
        autotuner.submit(m)
        if autotuner.config.verbose:
            log.info("  region %d scheme %d (%s): %s", region.id, idx, rec.describe(len(ps.candidates)),
                     f"latency ratio {m.ratio:.3f} vs float (lower is faster)" if m.ok else f"failed: {m.error}")
        autotuner.save_state(state_path)
        progress()


def _remeasure_winners(autotuner: QDQAutotuner, ps: PatternSchemes, benchmark: PairedBenchmark, region_id: int,
                       out: Path, state_path: Path) -> None:
    """Settle the pattern's winner in a duel against the incumbent, not against float.

    The search ranks schemes against the float baseline, which is cheap but noisy: these machines
    slow int8 models more than float ones in their slow phases, so float-relative ratios of int8
    candidates drift. The finalists (best few of the search) are therefore re-measured with twice
    the rounds against the incumbent (the QDQ-baseline scheme, else the search's best), int8
    against int8, and their ratios are rescaled by the incumbent's float-relative ratio.
    """
    search = sorted((r for r in ps.records if any(m.ok and not m.remeasure for m in r.measurements)),
                    key=lambda r: (min(m.ratio for m in r.measurements if m.ok and not m.remeasure), r.scheme.key))
    if len(search) < 2:
        return
    base = ps.find(ps.baseline_scheme) if ps.baseline_scheme is not None else None
    incumbent = base if base is not None and base in search else search[0]
    finalists = [r for r in search if r is not incumbent][:REMEASURE_TOP]
    inc_ratio = incumbent.ratio  # its float-relative estimate: the scale the duel results are put on
    ps.incumbent = incumbent.scheme
    todo = [r for r in finalists if not any(m.remeasure for m in r.measurements)]  # some may be done already
    if not todo:
        return
    inc_path = out / f"incumbent_region_{region_id}.onnx"
    save_model(autotuner.export_model(assignment=autotuner.assignment(candidate=incumbent.scheme)), inc_path)
    duel = PairedBenchmark(benchmark.backend, inc_path, benchmark.warmup_runs,
                           benchmark.runs_per_round * benchmark.rounds, benchmark.rounds * 2, guard=benchmark.guard)
    try:
        for rec in todo:
            data = autotuner.export_model(assignment=autotuner.assignment(candidate=rec.scheme),
                                          check=False).SerializeToString()
            idx = ps.records.index(rec)
            rel = duel.measure(data, use_cache=False, what=f"region {region_id} scheme {idx} (duel)",
                               family=f"region {region_id}")
            m = (Measurement(rel.latency_ms, rel.ratio * inc_ratio, rel.reference_ms, remeasure=True) if rel.ok
                 else Measurement.failed(rel.error or "duel failed"))
            m.remeasure = True  # failed duels too: they count as the finalist's re-measurement
            log_path = out / "logs" / f"region_{region_id}_scheme_{idx}_remeasure.log"
            m.log_path = str(log_path.relative_to(out))
            _log_measurement(log_path, MeasuredScheme(region_id, idx, ps.pattern, rec.origin, rec.scheme.key), m,
                             {"versus": "incumbent", "incumbent": incumbent.scheme.key, "relative_ratio": rel.ratio})
            rec.measurements.append(m)
            autotuner.save_state(state_path)
    finally:
        duel.close()
        remove_model(inc_path)
