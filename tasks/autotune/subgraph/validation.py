"""Subgraph mode, phase 3: incremental validation of the local winners on the full model.

Full-model steps are paired measurements of a candidate against the current model, recorded in the
cache one by one (a killed run replays them); rejected multi-group steps are bisected, a single
group over the budget falls back to its next locally faster scheme. See the package docstring for
the start step and the two passes.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.artifacts import atomic_write_json
from pipeline.backends import Backend
from pipeline.backends.ratios import ratio_interval
from pipeline.errors import StateError
from pipeline.graph.model import model_bytes, model_hash, write_model_bytes
from tasks.autotune.benchmark import PairedBenchmark
from tasks.autotune.paired_step import PairedStep
from tasks.autotune.progress import OnProgress, Progress
from tasks.autotune.region.autotuner import QDQAutotunerBase
from tasks.autotune.region.scheme import InsertionScheme, Measurement
from tasks.autotune.subgraph.profiling import GroupSet
from tasks.autotune.subgraph.records import (
    BISECT,
    MIN_LOCAL_GAIN,
    MIN_STEP_GAIN,
    PASSES,
    PTQ,
    SCHEMES,
    GroupResult,
    SubgraphCache,
)
from tasks.autotune.subgraph.report import phase_summary
from tasks.autotune.tune_setup import TuneSetup

log = logging.getLogger("tune.autotune")

PHASE3 = "phase 3: validation"
State = dict[str, str]  # reuse key -> scheme name (PTQ: as the PTQ placement has it)


class Assignments:
    """Phase-3 states as region assignments (every instance of a key gets the key's scheme)."""

    def __init__(self, gs: GroupSet, results: dict[str, GroupResult],
                 ptq_regions: dict[int, InsertionScheme] | None):
        self.by_key, self.results = gs.by_key, results
        # without quantize's model, the PTQ placement is every group's preferred form
        self.ptq_regions = ptq_regions if ptq_regions is not None else {
            r.id: results[k].points("preferred") for k, rs in gs.by_key.items() for r in rs
            if results[k].ok("preferred")}

    def __call__(self, chosen: State) -> dict[int, InsertionScheme]:
        out: dict[int, InsertionScheme] = {}
        for k, n in chosen.items():
            for r in self.by_key[k]:
                s = self.ptq_regions.get(r.id) if n == PTQ else self.results[k].points(n)
                if s is not None and len(s):
                    out[r.id] = s
        return out


def _plan_key(plan: Any) -> tuple:
    """What a plan changes in the model (its Q/DQ, weights and biases; not its notes)."""
    return tuple(plan.activations), tuple(plan.weights), tuple(plan.biases)


class _Models:
    """The model of each phase-3 state (reuse key -> scheme name, PTQ for the PTQ placement), as bytes.

    The empty state is the float model the speedups are against and the PTQ state is quantize's own
    model file, so the guard finds the very files it compares among the measured steps. (Where the
    groups' points cannot express all of quantize's placement, e.g. a Gemm too small to tune, only the
    start model has that part: the next step measures its loss along with the step's changes.)
    """

    def __init__(self, tuner: QDQAutotunerBase, assign: Callable[[State], dict[int, InsertionScheme]],
                 ptq_model: Path | None, float_model: Path | None):
        self.tuner, self.assign = tuner, assign
        self.ptq_model, self.float_model = ptq_model, float_model
        self._data: dict[frozenset, bytes] = {}
        self._shas: dict[frozenset, str] = {}
        self._plans: dict[frozenset, tuple] = {}

    def data(self, state: State) -> bytes:
        key = frozenset(state.items())
        if key not in self._data:
            if len(self._data) >= 3:  # the current model and a candidate or two: large models are large
                self._data.pop(next(iter(self._data)))
            self._data[key] = self._build(state)
        return self._data[key]

    def _build(self, state: State) -> bytes:
        if not state and self.float_model is not None:
            return model_bytes(self.float_model)
        if state and self.ptq_model is not None and set(state.values()) == {PTQ}:
            return model_bytes(self.ptq_model)
        return self.tuner.export_model(assignment=self.assign(state), check=False).SerializeToString()

    def sha(self, state: State) -> str:
        key = frozenset(state.items())
        if key not in self._shas:
            self._shas[key] = model_hash(self.data(state))
        return self._shas[key]

    def plan(self, state: State) -> tuple:
        key = frozenset(state.items())
        if key not in self._plans:
            self._plans[key] = _plan_key(self.tuner.build_plan(self.assign(state)))
        return self._plans[key]

    def changes(self, state: State, key: str, scheme: str) -> bool:
        """Whether giving ``key`` ``scheme`` changes the model of ``state`` at all."""
        return self.plan({**state, key: scheme}) != self.plan(state)


class _FullModel:
    """Full-model paired measurements: the current model stays loaded as the live reference until a
    step changes it."""

    def __init__(self, setup: TuneSetup, path: Path):
        runs = setup.runs
        self.args = (runs.warmup_runs, runs.timing_runs, runs.rounds, setup.accuracy_check)
        self.backend: Backend = setup.backend
        self.guard = setup.crash_guard
        self.path = path
        self.bench: PairedBenchmark | None = None
        self.reference: str | None = None

    def measure(self, reference: bytes, sha: str, candidate: bytes) -> Measurement:
        """``candidate`` paired with ``reference`` (whose content hash is ``sha``)."""
        if self.bench is None or self.reference != sha:
            self.close()
            write_model_bytes(reference, self.path, share_weights=True)
            self.bench = PairedBenchmark(self.backend, self.path, *self.args, guard=self.guard)
            self.reference = sha
        return self.bench.measure(candidate, use_cache=False, stop_at=1.0 - MIN_STEP_GAIN)

    def close(self) -> None:
        if self.bench is not None:
            self.bench.close()
            self.bench = None
        shutil.rmtree(self.path.parent, ignore_errors=True)


def _outcome(m: Measurement) -> tuple[str, str]:
    """(kept | slower | neutral | over_budget | failed, why) of one measured step."""
    if m.over_budget:
        return "over_budget", f"rejected: {m.error}"
    if not m.ok:
        return "failed", f"rejected: measurement failed ({m.error})"
    margin = max(MIN_STEP_GAIN, m.noise)
    low, high = ratio_interval(m.round_ratios)
    how = f"{len(m.round_ratios)} rounds, 95% interval {low:.3f}-{high:.3f}"
    if m.decided == "below" or (m.decided is None and m.ratio < 1.0 - margin):
        return "kept", f"kept: full model {1.0 / m.ratio:.3f}x faster ({how})"
    if m.ratio > 1.0 + margin:
        return "slower", f"rejected: full model {m.ratio:.3f}x of the current latency, slower ({how})"
    return "neutral", (f"rejected: full model {m.ratio:.3f}x of the current latency, no gain "
                       f"(needs < {1.0 - margin:.3f}; {how})")


class Phase3:
    """The full-model steps of phase 3 and the group test over them.

    ``measure(before, after)`` pairs the model of state ``after`` with that of ``before`` (states map
    reuse keys to scheme names); ``sha(state)`` names a state's model. Steps already in the cache are
    replayed in order (each must be the step this run takes next), new ones are measured, recorded
    and saved one by one.
    """

    def __init__(self, cache: SubgraphCache, measure: Callable[[State, State], Measurement],
                 sha: Callable[[State], str], on_step: Callable[[PairedStep], None] | None = None,
                 fallback: Callable[[str, str], str | None] | None = None):
        self.cache, self.measure, self.sha, self.on_step = cache, measure, sha, on_step
        # a group's next scheme to try after ``scheme`` missed the budget alone (None: none left)
        self.fallback = fallback or (lambda key, scheme: None)
        self.chosen: State = {}
        self.over_budget: set[str] = set()  # keys whose every scheme tried alone missed the budget
        self.steps: list[PairedStep] = cache.step_records()
        self._next = 0  # replay cursor

    def step(self, pass_: int, changes: State, parent: PairedStep | None = None,
             known: PairedStep | None = None) -> PairedStep:
        """Apply ``changes`` to the current model in one step (``known``: a rejected step whose candidate
        is this very model, so this one is rejected alike without measuring)."""
        where = parent.index if parent is not None else None
        if self._next < len(self.steps):
            rec = self.steps[self._next]
            if (rec.pass_, rec.changes, rec.parent) != (pass_, changes, where):
                raise StateError(f"autotune cache {self.cache.path}: its phase-3 step {self._next} is not the step "
                                 f"this run takes next (made by another qdq-tune?); delete it to tune afresh")
        else:
            rec = self._known(pass_, changes, where, known) if known is not None else \
                self._measured(pass_, changes, where)
            self.steps.append(rec)
            self.cache.add_step(rec, parent)
            if self.on_step is not None:
                self.on_step(rec)
        self._next += 1
        if rec.kept:
            self.chosen.update(changes)
        return rec

    def _known(self, pass_: int, changes: State, parent: int | None, known: PairedStep) -> PairedStep:
        source = self.steps[known.index if known.known_from is None else known.known_from]
        return PairedStep(len(self.steps), pass_, changes, parent, measured=False, known_from=source.index,
                          outcome=source.outcome, over_budget=source.over_budget, ratio=None, interval=None,
                          rounds=0, reason=f"{source.reason} (the same model as step {source.index}: not measured)")

    def _measured(self, pass_: int, changes: State, parent: int | None) -> PairedStep:
        before, after = dict(self.chosen), {**self.chosen, **changes}
        m = self.measure(before, after)
        outcome, reason = _outcome(m)
        return PairedStep(len(self.steps), pass_, changes, parent, measured=True, known_from=None,
                          outcome=outcome, over_budget=m.over_budget, ratio=m.ratio if m.ok else None,
                          interval=list(ratio_interval(m.round_ratios)) if m.ok else None,
                          rounds=len(m.round_ratios), round_ratios=list(m.round_ratios),
                          latency_ms=m.latency_ms if m.ok else None,
                          reference_ms=m.reference_ms if m.ok else None, noise=m.noise, accuracy=m.accuracy,
                          reference_sha=self.sha(before), candidate_sha=self.sha(after), reason=reason)

    def test(self, items: list[tuple[str, str]], pass_: int, parent: PairedStep | None = None,
             known: PairedStep | None = None) -> State:
        """Group test of ``items`` (key, scheme): all in one step; a step rejected as slower, over the
        budget or failed is split in halves, and when the first half is kept whole, the second
        half's step is its parent's model again (known, not measured). A single group over the
        budget falls back to ``fallback(key, scheme)``. Returns the items kept."""
        step = self.step(pass_, dict(items), parent, known)
        if step.kept:
            return dict(items)
        kept: State = {}
        if len(items) > 1 and step.outcome in BISECT:
            half = (len(items) + 1) // 2
            first = self.test(items[:half], pass_, step)
            kept.update(first)
            kept.update(self.test(items[half:], pass_, step, step if first == dict(items[:half]) else None))
        elif len(items) == 1 and step.outcome == "over_budget":
            key, scheme = items[0]
            nxt = self.fallback(key, scheme)
            if nxt is None:
                self.over_budget.add(key)
            else:
                kept.update(self.test([(key, nxt)], pass_, step))
        return kept


def _gain(rec: GroupResult, scheme: str, current: str = "none") -> float:
    """Expected saving (ms, all instances) of ``scheme`` over ``current`` on the group's subgraph."""
    base, win = rec.ms(current), rec.ms(scheme)
    return (base - win) * len(rec.instances) if base is not None and win is not None else 0.0


def _pass1_from_ptq(phase: Phase3, results: dict[str, GroupResult], models: _Models,
                    alternatives: dict[str, list[str]]) -> list[tuple[str, str]]:
    """Pass 1 from the PTQ placement: only the groups whose local result says they should change (a
    scheme, float included, beat the group's PTQ form on its subgraph)."""
    items = []
    for k, rec in results.items():
        ratios = rec.ok_ratios()
        base = ratios.get(rec.ptq_form)
        if base is None:
            continue
        better = sorted((n for n in ratios if ratios[n] < base * (1.0 - MIN_LOCAL_GAIN)),
                        key=lambda n: (ratios[n], SCHEMES.index(n)))
        alternatives[k] = better
        target = next((n for n in better if models.changes(phase.chosen, k, n)), None)
        if target is not None:
            items.append((k, target))
    items.sort(key=lambda kv: (-_gain(results[kv[0]], kv[1], results[kv[0]].ptq_form), kv[0]))
    return items


def _pass2_from_float(phase: Phase3, gs: GroupSet, results: dict[str, GroupResult], models: _Models,
                      items1: list[tuple[str, str]], kept1: State) -> list[tuple[str, str]]:
    """Pass 2 from the float model: every group not kept, in graph order (without a local winner:
    its preferred form)."""
    items = []
    for k in sorted(gs.by_key, key=gs.first_id):
        rec = results[k]
        pick = rec.ranked[0] if rec.ranked else ("preferred" if rec.ok("preferred") else None)
        if k in kept1 or k in phase.over_budget or pick is None or not models.changes(phase.chosen, k, pick):
            continue
        if not kept1 and (k, pick) in items1:
            continue  # pass 1 changed nothing: the same step would measure the same models
        items.append((k, pick))
    return items


def _validate(phase: Phase3, gs: GroupSet, results: dict[str, GroupResult], models: _Models,
              ptq_state: State) -> tuple[State, list[dict[str, Any]]]:
    """Start, pass 1 and pass 2 (see the package docstring); the chosen state and the phase summary."""
    alternatives: dict[str, list[str]] = {}  # per key, the schemes pass 1 may try, best first

    def fallback(key: str, scheme: str) -> str | None:
        later = alternatives.get(key, [])
        later = later[later.index(scheme) + 1:] if scheme in later else []
        return next((n for n in later if models.changes(phase.chosen, key, n)), None)

    phase.fallback = fallback
    if ptq_state:
        phase.step(0, ptq_state)
    start = "ptq" if ptq_state and phase.chosen == ptq_state else "float"
    if start == "ptq":
        items1 = _pass1_from_ptq(phase, results, models, alternatives)
    else:
        alternatives.update({k: list(rec.ranked) for k, rec in results.items()})
        items1 = sorted(((k, rec.winner) for k, rec in results.items() if rec.winner != "none"),
                        key=lambda kv: (-_gain(results[kv[0]], kv[1]), kv[0]))
    kept1 = phase.test(items1, 1) if items1 else {}
    if start == "ptq":
        # in context: what pass 1 rejected, once something else was kept
        items2 = sorted(((k, n) for k, n in items1 if kept1 and k not in kept1 and k not in phase.over_budget
                         and models.changes(phase.chosen, k, n)), key=lambda kv: gs.first_id(kv[0]))
    else:
        items2 = _pass2_from_float(phase, gs, results, models, items1, kept1)
    if items2:
        phase.test(items2, 2)
    idle = None if items2 else (
        "pass 1 kept nothing: the same steps would measure the same models" if start == "ptq" and not kept1
        else "nothing left to retry")
    return phase.chosen, phase_summary(phase.steps, start, len(items1), len(items2), idle)


def validate(setup: TuneSetup, gs: GroupSet, results: dict[str, GroupResult], assign: Assignments,
             cache: SubgraphCache, on_progress: OnProgress | None) -> tuple[State, bytes, list[dict[str, Any]]]:
    """Phase 3: (the chosen state, its model as measured, the phase summary)."""
    models = _Models(gs.tuner, assign, setup.ptq_model, setup.baseline_path)
    # a working folder: the current model may share hard links of on-disk weights (pipeline.graph.weights)
    full = _FullModel(setup, Path(tempfile.mkdtemp(prefix=".validation.", dir=setup.out)) / "current.onnx")
    phase = Phase3(cache, lambda a, b: full.measure(models.data(a), models.sha(a), models.data(b)), models.sha,
                    lambda st: _log_step(st, gs, setup.out / "logs", on_progress))
    try:
        chosen, phases = _validate(phase, gs, results, models, {k: PTQ for k in gs.by_key}
                                   if assign.ptq_regions else {})
        tuned = models.data(chosen)
    finally:
        full.close()
    if on_progress:
        on_progress(Progress(PHASE3, len(cache.steps), len(cache.steps)))
    return chosen, tuned, phases


def _log_step(step: PairedStep, gs: GroupSet, logs: Path, on_progress: OnProgress | None) -> None:
    atomic_write_json(logs / f"validation_step_{step.index}.json", step.to_dict(), indent=1)
    ids = sorted(gs.first_id(k) for k in step.changes if k in gs.by_key)
    what = ("the PTQ placement" if step.pass_ == 0 else
            f"group{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids[:6]))}{' ...' if len(ids) > 6 else ''}"
            f" ({', '.join(sorted(set(step.changes.values())))})")
    log.info("validation %s, step %d: %s%s -> %s", PASSES[step.pass_], step.index, what,
             f" [bisecting step {step.parent}]" if step.parent is not None else "", step.reason)
    if on_progress:
        on_progress(Progress(PHASE3, step.index + 1, step.index + 2))
