"""The autotune stage's final guard: what ships as optimized_final.onnx.

The float model, the PTQ model and the tuned model are compared by a fresh interleaved measurement
(not by the search's best-of-N), or, in subgraph mode, by the paired steps that already measured
these very models (by content hash) when they decide clearly. Last, ``checked_where`` records what the shipped model was checked on and
its verdict on every CPU kind. The shipped model must beat the
float baseline (``tune_setup.float_baseline``: the runtime's own float precision, FP32 where that misses
the accuracy budget or runs slower) by ``performance_threshold`` or the float model ships, and if the
PTQ model measures faster than the tuned one, the PTQ model ships. Either way the stage says so, and
the file written is byte for byte the model that was measured.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline.accuracy.budget import AccuracyVerdict
from pipeline.accuracy.kinds import CheckedOn, checked_on, float_kinds, kind_verdicts, log_kinds
from pipeline.backends.base import Timing
from pipeline.errors import StageError, first_line
from pipeline.graph.model import copy_model, has_qdq, model_hash
from pipeline.records.autotune import AutotuneMetrics, GuardSource, TunedAccuracy
from pipeline.records.quantize import quantize_decisions
from tasks.autotune.paired_step import PairedStep
from tasks.autotune.tune_setup import ModeResult, TuneSetup

log = logging.getLogger("tune.autotune")


def finalize(setup: TuneSetup, result: ModeResult) -> AutotuneMetrics:
    """The float, PTQ and tuned models' timings and accuracy verdicts (from the mode's own paired
    steps when they measured these very models and decide clearly, else from one fresh
    interleaved measurement); ship the fastest model that meets the budget and beats float by
    ``performance_threshold``, else the float model. The metrics carry the mode's ``result.summary``."""
    if result.bench is not None:
        result.bench.close()  # free the search's live reference before the final comparison
    baseline, tuned, ptq = setup.baseline_path, result.tuned, setup.ptq_model
    paths = [baseline, tuned] + ([ptq] if ptq is not None and model_hash(ptq) != model_hash(tuned) else [])
    timings, verdicts, source, guard = _final_timings(setup, paths, result)
    backend = setup.backend
    precision = backend.float_precision()
    float_copies = frozenset(p for p in paths[1:] if _float_copy(p))
    choice, why = choose_shipped(setup, paths, timings, verdicts, float_copies)
    if quantize_decisions(setup.inputs.get("quantize/calibration.json")).all_float:
        # nothing was quantized: a "tuned" or "PTQ" model is the float graph again, and timing noise
        # must not pick one of those copies over the float model itself
        choice, why = baseline, "the quantize stage left every quantizable node float to meet the accuracy budget"
    base_t, tuned_t = timings[0], timings[1]
    ptq_t = timings[2] if len(timings) > 2 and timings[2].ok else None
    ptq_v = verdicts[2] if len(verdicts) > 2 else None
    chosen_t = timings[paths.index(choice)]
    chosen_v = verdicts[paths.index(choice)]
    copy_model(choice, setup.out / "optimized_final.onnx")
    speedup = base_t.p10_ms / chosen_t.p10_ms
    chosen_float = setup.float_baseline
    note = f" ({chosen_float.note})" if chosen_float is not None and chosen_float.note else ""
    where = f"[{source}; baseline = {precision} float model on {backend.name}{note}]"
    shipped = {baseline: "float", tuned: "tuned", ptq: "ptq"}.get(choice, "tuned")
    if shipped == "float":
        line = f"Baseline: {base_t.p10_ms:.3f} ms / Final: the float model itself (no speedup) {where}"
        headline = (f"ships float: the {precision} float model on {backend.name}{note}; {why}"
                    f"{_measured_note(timings, paths, tuned, ptq, float_copies)}")
    else:
        line = (f"Baseline: {base_t.p10_ms:.3f} ms / Final: {chosen_t.p10_ms:.3f} ms ({speedup:.2f}x speedup), "
                f"accuracy {chosen_v.what} {where}")
        headline = f"{speedup:.2f}x vs {precision} float{note}, {chosen_v.what} ({shipped if choice == tuned else why})"
    log.info(line)
    if shipped == "float":
        log.warning("autotune: ships the float model (optimized_final.onnx is %s): %s", choice.name, why)
    elif choice != tuned:
        log.warning("autotune: optimized_final.onnx is %s because %s", choice.name, why)
    tuned_is_float = tuned in float_copies
    return AutotuneMetrics(
        baseline_ms=base_t.p10_ms, final_ms=chosen_t.p10_ms, speedup=speedup,
        baseline_median_ms=base_t.median_ms, final_median_ms=chosen_t.median_ms,
        tuned_ms=tuned_t.p10_ms, tuned_speedup=None if tuned_is_float else base_t.p10_ms / tuned_t.p10_ms,
        tuned_is_float=tuned_is_float, ptq_ms=ptq_t.p10_ms if ptq_t else None,
        ptq_speedup=(base_t.p10_ms / ptq_t.p10_ms) if ptq_t else None,
        accuracy=TunedAccuracy(chosen_v, verdicts[1], ptq_v),
        shipped=shipped, shipped_reason=why, guard=guard, baseline_precision=precision,
        runtime=backend.describe(), final_line=line, float_baseline=chosen_float, headline=headline,
        search=result.summary)


def _final_timings(setup: TuneSetup, paths: list[Path], result: ModeResult
                   ) -> tuple[list[Timing], list[AccuracyVerdict], str, GuardSource]:
    """(timings, verdicts, where they come from, the guard's record) of ``paths`` (float, tuned[, PTQ]):
    from the mode's own paired steps where they measured these very models and decide clearly, else one
    fresh interleaved measurement."""
    timings, verdicts, source = _from_steps(setup, paths, result.steps) if result.steps else (None, None, "")
    if timings is None:
        why = ("measured float, tuned" + (" and PTQ models" if len(paths) > 2 else " models")
               + f" in one interleaved run ({source or 'no paired steps to reuse'})")
        timings, verdicts = _measure_final(setup, paths)
        return timings, verdicts, f"p10 of {timings[1].n} interleaved runs", GuardSource(True, why)
    return timings, verdicts, source, GuardSource(False, source)


def checked_where(setup: TuneSetup, final: AccuracyVerdict | None, shipped_float: bool,
                  artifacts: dict[str, Path]) -> CheckedOn:
    """What the shipped model (optimized_final.onnx, judged ``final`` here, with the settings in
    ``artifacts``) was checked on, with its verdict on every CPU kind (``kind_verdicts``), logged."""
    backend = setup.backend
    kind = backend.shipped_settings
    path = artifacts.get(kind.artifact) if kind is not None else None
    if path is not None:
        backend = backend.with_settings(kind.type.load(path))
    if shipped_float:
        kinds = float_kinds(final)
    else:
        kinds = kind_verdicts(backend, setup.out / "optimized_final.onnx", setup.holdout, setup.budget, final)
    log_kinds(kinds, "autotune")
    return checked_on(backend, kinds)


def _float_copy(path: Path) -> bool:
    """The model has no Q/DQ node anywhere (bodies included): the float graph again."""
    import onnx

    return not has_qdq(onnx.load(str(path), load_external_data=False))


def _measured_note(timings: list[Any], paths: list[Path], tuned: Path, ptq: Path | None,
                   float_copies: frozenset[Path]) -> str:
    """'; tuned 0.96x, PTQ 0.90x' of the quantized models that were measured (speedups vs float), or ''."""
    parts = []
    for label, p in (("tuned", tuned), ("PTQ", ptq)):
        if p is None or p not in paths or p in float_copies:
            continue
        t = timings[paths.index(p)]
        if t.ok and t.p10_ms > 0:
            parts.append(f"{label} {timings[0].p10_ms / t.p10_ms:.2f}x")
    return f" (measured: {', '.join(parts)})" if parts else ""


def _from_steps(setup: TuneSetup, paths: list[Path], steps: list[PairedStep]
                ) -> tuple[list[Any] | None, list[Any] | None, str]:
    """(timings, verdicts, where they come from) of ``paths`` (float, tuned[, PTQ]) from the mode's
    paired steps, or (None, None, why not).

    The kept steps chain paired ratios from the float model to the tuned one (each step's
    reference is the previous one's candidate, by content hash); the PTQ model is on that chain
    or was measured against the float model. Latencies are the float model's times the chained
    ratio. Reused only when the chain's interval clears (or misses) the performance threshold.
    """
    from pipeline.accuracy.budget import AccuracyVerdict
    from pipeline.backends.ratios import chain_interval

    shas = [model_hash(p) for p in paths]
    ratio: dict[str, float] = {shas[0]: 1.0}
    rounds: dict[str, list[list[float]]] = {shas[0]: []}
    via: dict[str, list[int]] = {shas[0]: []}
    verdict: dict[str, Any] = {shas[0]: AccuracyVerdict(True, "reference", "the float model itself")}
    float_ms = None
    for st in steps:
        ref, cand = st.reference_sha, st.candidate_sha
        if not st.measured or ref not in ratio or cand in ratio or (not st.kept and cand not in shas):
            continue
        if st.accuracy is not None:
            verdict[cand] = AccuracyVerdict.from_dict(st.accuracy)
        if st.ratio is None:
            continue  # over the budget: a verdict, no timing
        float_ms = float_ms or (st.reference_ms / ratio[ref])
        ratio[cand] = ratio[ref] * st.ratio
        rounds[cand] = [*rounds[ref], st.round_ratios]
        via[cand] = [*via[ref], st.index]
    if shas[1] not in ratio:
        return None, None, "the paired steps do not reach the tuned model from the float model"
    if any(sh not in ratio and sh not in verdict for sh in shas[2:]):
        return None, None, "the PTQ model was not measured against the float model"
    if float_ms is None:
        return None, None, "no paired step measured the float model"
    low, high = chain_interval(rounds[shas[1]])
    if low < 1.0 / setup.performance_threshold < high:
        return None, None, (f"the paired steps put the tuned model at {ratio[shas[1]]:.3f}x the float latency "
                            f"(95% interval {low:.3f}-{high:.3f}), too close to the performance threshold")
    timings = [Timing(median_ms=float_ms * ratio[sh], p10_ms=float_ms * ratio[sh],
                      n=sum(len(r) for r in rounds[sh]), backend=setup.backend.name) if sh in ratio
               else Timing.failed(setup.backend.name, "not timed: over the accuracy budget") for sh in shas]
    verdicts = []
    for p, sh in zip(paths, shas, strict=True):
        if sh not in verdict:  # the accuracy budget is off (the steps judged nothing), or a build failed
            try:
                with setup.backend.prepare(p) as pm:
                    verdict[sh] = setup.judge(pm)
            except Exception as exc:  # noqa: BLE001 - the fresh measurement reports it
                return None, None, f"{p.name} could not be judged ({first_line(exc)})"
        verdicts.append(verdict[sh])
    used = sorted({i for sh in shas if sh in via for i in via[sh]})
    return timings, verdicts, (f"reused phase-3 paired step{'s' if len(used) != 1 else ''} "
                               f"{', '.join(map(str, used)) or '(none: the tuned model is the float model)'}"
                               f"; ratios chained from the float model, not measured again")


def _measure_final(setup: TuneSetup, paths: list[Path]) -> tuple[list[Any], list[Any]]:
    """Timings (one interleaved run) and accuracy verdicts of ``paths``; the float baseline and the
    tuned model must both be measurable."""
    from pipeline.backends.timing import TimingPlan, compare_prepared

    backend = setup.backend
    warmup, timing = setup.runs.warmup_runs, setup.runs.timing_runs
    prepared, verdicts = [], []
    try:
        for p in paths:
            try:
                pm = backend.prepare(p)
            except Exception as exc:  # noqa: BLE001 - a model the runtime rejects is not shipped
                raise StageError(f"autotune: {p.name} cannot be loaded by {backend.name}: "
                                 f"{first_line(exc)}") from None
            prepared.append(pm)
            verdicts.append(setup.judge(pm))
        timings = compare_prepared(backend.name, prepared, TimingPlan.final(timing, warmup))
    finally:
        for pm in prepared:
            pm.close()
    if not all(t.ok for t in timings[:2]):
        bad = next(t for t in timings if not t.ok)
        raise StageError(f"autotune: final measurement failed: {bad.error}")
    return timings, verdicts


def choose_shipped(setup: TuneSetup, paths: list[Path], timings: list[Any], verdicts: list[Any],
                   float_copies: frozenset[Path] | None = None) -> tuple[Path, str]:
    """(model to ship, why): tuned unless it misses the budget or the PTQ model is faster; float
    when no quantized model meets the budget or beats float by the performance threshold.
    ``float_copies``: which of ``paths`` have no Q/DQ node (read from the files when not given)."""
    if float_copies is None:
        float_copies = frozenset(p for p in paths[1:] if _float_copy(p))
    budget, threshold = setup.budget, setup.performance_threshold
    baseline, tuned = paths[0], paths[1]
    ptq = paths[2] if len(paths) > 2 else None
    tuned_t, tuned_v = timings[1], verdicts[1]
    ptq_t = timings[2] if ptq is not None and timings[2].ok else None
    ptq_v = verdicts[2] if ptq is not None else None
    ok = {tuned: tuned_v.ok or not budget.enabled, ptq: ptq_v is not None and (ptq_v.ok or not budget.enabled)}
    choice, why, no_int8 = tuned, "tuned placement", None
    if tuned in float_copies:
        # every pattern measured fastest without Q/DQ: the "tuned" model is the float graph, and its
        # timing against the float model is noise, not a speedup; only the PTQ model can still ship
        no_int8 = (f"no int8 placement beat the {setup.backend.float_precision()} float on {setup.backend.name} "
                   f"on this CPU (every pattern measured fastest without Q/DQ)")
        if ptq_t is None or not ok[ptq] or ptq in float_copies:
            return baseline, no_int8
        choice, why = ptq, f"the quantize stage's model ships: {no_int8}"
    elif not ok[tuned]:
        choice, why = ptq, f"the tuned placement misses the accuracy budget ({tuned_v.what})"
    elif ptq_t is not None and ok[ptq] and ptq_t.p10_ms < tuned_t.p10_ms * 0.98:
        choice, why = ptq, "the quantize stage's model measured faster than the tuned placement"
    if choice == ptq and (ptq_t is None or not ok[ptq]):
        hint = tuned_v.hint or (ptq_v.hint if ptq_v is not None else "")
        return baseline, (f"no quantized model meets the accuracy budget ({budget.describe()}; tuned: "
                          f"{tuned_v.what}" + (f"; PTQ: {ptq_v.what}" if ptq_v is not None else "")
                          + ")" + (f" ({hint})" if hint else ""))
    speedup = timings[0].p10_ms / timings[paths.index(choice)].p10_ms
    if speedup < threshold and no_int8 is not None:
        return baseline, f"{no_int8}; the PTQ model ran {speedup:.3f}x, below the {threshold:.2f}x threshold"
    if speedup < threshold:
        return baseline, (f"no Q/DQ model beat the {setup.backend.float_precision()} float on "
                          f"{setup.backend.name} by the performance threshold {threshold:.2f}x (best {speedup:.3f}x)")
    return choice, why
