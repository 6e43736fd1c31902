"""The runtime half of int8 speed: the runtime settings the shipped model runs fastest with, searched
after placement and shipped beside it. One search serves every kind of runtime settings; the
backend decides what is searched (its ``search_space()``) and what ships (its ``shipped_settings``,
e.g. ONNX Runtime's session settings in autotune/ort_session.json).

The search is greedy and sequential: every candidate is the current settings plus one change,
checked against the accuracy budget, then timed against the current settings on the same model in
paired rounds until the 95% interval of the latency ratio is clear of ``keep_below``; it is kept only
when it lies below. Every step is saved to autotune/runtime_search.json, so an interrupted search
resumes at the next candidate. A final interleaved run compares float and shipped models with and
without the settings, and the backend's own settings ship unless the found ones win there too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.artifacts import atomic_write_json, read_json
from pipeline.backends.base import Backend
from pipeline.backends.ratios import ratio_interval, round_ratios
from pipeline.backends.timing import TimingPlan, duel_runs, time_interleaved
from pipeline.errors import first_line
from pipeline.graph.model import model_hash
from tasks.autotune.state_file import RUNTIME_STATE, StateDocument, StateHeader, resume_or_set_aside

log = logging.getLogger("tune.autotune")

STATE_VERSION = 1
# the name a candidate's second try carries (after a kept change, on the settings found)
AGAIN = " (again)"


@dataclass(frozen=True)
class SettingsChange:
    """One change to the current settings: what it is called in logs and the state file, and the
    settings with it applied."""

    name: str
    settings: Any


@dataclass
class RuntimeStep:
    """One step of the search: a ``SettingsChange`` judged on the holdout and, if it met the budget,
    timed against the settings before it; ``kept`` when the ratio's interval lies below ``keep_below``."""

    name: str
    settings: dict[str, Any]  # the change's settings (settings type's to_dict())
    kept: bool = False
    accuracy: dict[str, Any] | None = None  # the holdout verdict (AccuracyVerdict.to_dict())
    ratio: float | None = None  # median latency ratio, changed / current settings
    interval: list[float] | None = None  # its 95% interval
    rounds: int | None = None  # paired rounds timed (None: never timed)
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "settings": self.settings, "kept": self.kept}
        if self.accuracy is not None:
            d["accuracy"] = self.accuracy
        if self.rounds is not None:
            d.update(ratio=self.ratio, interval=self.interval, rounds=self.rounds)
        d["why"] = self.why
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RuntimeStep:
        return cls(d["name"], d["settings"], bool(d.get("kept", False)), d.get("accuracy"), d.get("ratio"),
                   d.get("interval"), d.get("rounds"), d.get("why", ""))


@dataclass
class RuntimeOutcome:
    """What the runtime search reports (the autotune metrics' "runtime") and adds to the headline."""

    searched: bool
    why: str | None = None  # why nothing was searched
    settings: dict[str, Any] | None = None  # what ships (settings type's to_dict())
    file: str | None = None  # its artifact key
    steps: list[RuntimeStep] = field(default_factory=list)
    found: dict[str, Any] = field(default_factory=dict)  # what the search space reports beside its steps
    # the final comparison: p10 latencies of float and shipped models with the backend's own settings
    # and with the found ones ("float_default", "float_tuned", "shipped_default", "shipped_tuned")
    p10_ms: dict[str, float] | None = None
    comparison_error: str | None = None
    rejected: dict[str, Any] | None = None  # found settings the final comparison measured no faster
    describe: str | None = None  # the shipped settings in words
    what: str | None = None  # what the settings are called, e.g. "session settings"
    defaults: str | None = None  # what runs without them, e.g. "ORT's defaults"

    @property
    def ships_found(self) -> bool:
        """The found settings ship, measured faster than the backend's own in the final comparison."""
        return self.p10_ms is not None and self.rejected is None

    def speedups(self) -> dict[str, float]:
        """The final comparison's speedups (those of the found settings only when they ship)."""
        if self.p10_ms is None:
            return {}
        ms = self.p10_ms
        out = {"speedup_vs_float_default": ms["float_default"] / ms["shipped_tuned"],
               "speedup_vs_float_same_settings": ms["float_tuned"] / ms["shipped_tuned"]} if self.ships_found else {}
        return {**out, "speedup_default_session": ms["float_default"] / ms["shipped_default"]}

    def to_dict(self) -> dict[str, Any]:
        if not self.searched:
            d: dict[str, Any] = {"searched": False, "why": self.why}
            return d if self.settings is None else {**d, "settings": self.settings, "file": self.file}
        d = {"steps": [st.to_dict() for st in self.steps], **self.found}
        if self.comparison_error is not None:
            d["comparison_error"] = self.comparison_error
        elif self.p10_ms is not None:
            d.update(p10_ms=self.p10_ms, **self.speedups())
        if self.rejected is not None:
            d["rejected"] = self.rejected
        d.update(searched=True, settings=self.settings, describe=self.describe, file=self.file, what=self.what,
                 defaults=self.defaults)
        return d

    def headline(self) -> str:
        """The clause the stage's headline gains when the found settings ship ("" otherwise)."""
        if not self.ships_found:
            return ""
        sp = self.speedups()
        return (f"; {self.what}: {self.describe} -> {sp['speedup_vs_float_default']:.2f}x vs float with "
                f"{self.defaults} ({sp['speedup_vs_float_same_settings']:.2f}x vs float with the same settings)")


class RuntimeSearch:
    """The greedy search over one backend's runtime settings for one shipped model (see module
    docstring); what it searches comes from the backend's ``search_space()``. Its state file is a
    ``StateDocument`` kept as on disk (``steps`` holds RuntimeStep.to_dict() each)."""

    def __init__(self, backend: Backend, model: Path, judge: Any, cfg: Any, state_path: Path, context: str):
        self.backend, self.model, self.judge, self.cfg = backend, model, judge, cfg
        self.space = backend.search_space()
        self.settings_type = backend.shipped_settings.type
        self.state_path = state_path
        header = StateHeader.of(STATE_VERSION, model_hash(model), context, kind=backend.shipped_settings.artifact)
        self.document = StateDocument(header, {"steps": [], "settings": self.space.base(backend).to_dict(),
                                               "done": False})

    @property
    def doc(self) -> dict[str, Any]:
        """The state file's document, as written."""
        return self.document.to_dict()

    @property
    def steps(self) -> list[RuntimeStep]:
        return [RuntimeStep.from_dict(d) for d in self.document.body["steps"]]

    def _load(self) -> None:
        doc = read_json(self.state_path, RUNTIME_STATE.what)
        if not isinstance(doc, dict) or not isinstance(doc.get("steps"), list):
            raise RUNTIME_STATE.corrupt(self.state_path, "no 'steps' list")
        document = StateDocument.resume(doc, self.state_path, RUNTIME_STATE, self.document.header)
        try:
            self.settings_type.from_dict(doc.get("settings") or {})
        except (ValueError, TypeError) as exc:
            raise RUNTIME_STATE.corrupt(self.state_path, first_line(exc)) from None
        self.document = document

    def run(self, candidates: list[tuple[str, dict]]) -> Any:
        """The settings found by trying ``candidates`` ((name, change) in order), resuming from the state
        file when it is this model's. Where the search space says its settings interact
        (``SearchSpace.retry_after_kept``) and a change was kept, each candidate that ran within the budget
        but was not clearly faster is tried once more (``AGAIN``) on the settings found."""
        if resume_or_set_aside(self._load, self.state_path, RUNTIME_STATE, own=True):
            log.info("runtime search: resuming from %s (%d candidates measured)", self.state_path.name,
                     len(self.document.body["steps"]))
        body = self.document.body
        settings = self.settings_type.from_dict(body["settings"])
        started = time.time()
        settings, finished = self._pass(candidates, settings, started)
        if finished and self.space.retry_after_kept and any(st.kept for st in self.steps):
            slower = {st.name for st in self.steps if not st.kept and st.rounds is not None}
            settings, finished = self._pass([(n + AGAIN, c) for n, c in candidates if n in slower], settings,
                                            started)
        body["done"] = body["done"] or finished
        atomic_write_json(self.state_path, self.doc, indent=1)
        return settings

    def _pass(self, candidates: list[tuple[str, dict]], settings: Any, started: float) -> tuple[Any, bool]:
        """Each of ``candidates`` not measured yet, in order, from ``settings``: (the settings after them,
        whether every one was measured within autotune.runtime.max_seconds of ``started``)."""
        body = self.document.body
        done = {st.name for st in self.steps}
        for name, change in candidates:
            if body["done"] or name in done:
                continue
            if time.time() - started > float(self.cfg.max_seconds):
                log.info("runtime search: autotune.runtime.max_seconds=%g reached; the rest is not measured",
                         float(self.cfg.max_seconds))
                return settings, False
            step = self._step(SettingsChange(name, self.space.apply(settings, change)), settings)
            if step.kept:
                settings = self.settings_type.from_dict(step.settings)
                body["settings"] = settings.to_dict()
            body["steps"].append(step.to_dict())
            atomic_write_json(self.state_path, self.doc, indent=1)
        return settings, True

    def _step(self, change: SettingsChange, current: Any) -> RuntimeStep:
        """Judge ``change`` on the holdout, then time it against ``current`` in paired rounds."""
        step = RuntimeStep(change.name, change.settings.to_dict())
        ref_pm = cand_pm = None
        try:
            ref_pm = self.backend.with_settings(current).prepare(self.model)
            cand_pm = self.backend.with_settings(change.settings).prepare(self.model)
            verdict = self.judge(cand_pm)
            step.accuracy = verdict.to_dict()
            if not verdict.ok:
                step.why = f"misses the accuracy budget ({verdict.what})"
                log.info("runtime search: %s: %s", change.name, step.why)
                return step
            blocks, errors = time_interleaved([ref_pm, cand_pm], TimingPlan.duel(
                float(self.cfg.keep_below), int(self.cfg.max_rounds), duel_runs(self.backend.timing_runs),
                self.backend.warmup_runs, cheap_rounds=0))
        except Exception as exc:  # noqa: BLE001 - a setting the runtime rejects is a failed step, not a failed run
            step.why = f"failed: {first_line(exc)}"
            log.info("runtime search: %s %s", change.name, step.why)
            return step
        finally:
            for pm in (ref_pm, cand_pm):
                if pm is not None:
                    pm.close()
        if any(errors):
            step.why = f"timing failed: {next(e for e in errors if e)}"
            return step
        ratios = round_ratios(blocks[0], blocks[1])
        low, high = ratio_interval(ratios)
        step.ratio = float(sorted(ratios)[len(ratios) // 2]) if ratios else None
        step.interval, step.rounds, step.kept = [low, high], len(ratios), high < float(self.cfg.keep_below)
        step.why = (f"{step.ratio:.3f}x the latency (95% interval {low:.3f}-{high:.3f}, {len(ratios)} rounds): "
                    + ("kept" if step.kept else f"not below {float(self.cfg.keep_below):g}"))
        log.info("runtime search: %s: %s", change.name, step.why)
        return step


def search_runtime(setup: Any, rcfg: Any) -> tuple[dict[str, Path], RuntimeOutcome]:
    """Search the shipped model's runtime settings (the backend's ``search_space()``), write them beside
    it (the backend's ``shipped_settings`` artifact) and compare float and shipped models
    with the backend's own settings and with the found ones, in one interleaved run; (artifacts, what
    the search reports)."""
    from pipeline.artifacts import fingerprint

    backend, out = setup.backend, setup.out
    kind, space = backend.shipped_settings, backend.search_space()
    if space is None or kind is None:
        return {}, RuntimeOutcome(False, f"{backend.name} has no runtime settings autotune searches")
    shipped = out / "optimized_final.onnx"
    path, key = out / Path(kind.artifact).name, kind.artifact
    base = space.base(backend)
    if not bool(rcfg.enabled):
        base = base.pinned(backend)
        base.save(path)
        return {key: path}, RuntimeOutcome(False, "autotune.runtime.enabled=false", base.to_dict(), key)
    cands, found = space.candidates(backend, shipped)
    # max_seconds is left out: raising it must let an unfinished search go on, not start it again
    context = fingerprint({**setup.context_items, "shipped": model_hash(shipped),
                           "runtime": {k: rcfg[k] for k in ("max_rounds", "keep_below")}})
    search = RuntimeSearch(backend, shipped, setup.judge, rcfg, out / "runtime_search.json", context)
    settings = search.run(cands)
    outcome = RuntimeOutcome(True, steps=search.steps, found=found, file=key, what=kind.what, defaults=kind.defaults)
    if settings != base:
        outcome.p10_ms, outcome.comparison_error = _final_comparison(backend, setup.baseline_path, shipped,
                                                                     settings)
        ms = outcome.p10_ms
        if ms is None or ms["shipped_tuned"] >= ms["shipped_default"]:
            # each step was paired against the previous settings; the final guard compares the end
            # result with the start once more, and the backend's own settings ship unless it is faster there too
            log.info("runtime search: %s measured no faster than the backend's own settings in the final "
                     "comparison; shipping those", settings.describe())
            outcome.rejected = settings.to_dict()
            settings = base
    settings = settings.pinned(backend)
    settings.save(path)
    outcome.settings, outcome.describe = settings.to_dict(), settings.describe()
    sp = outcome.speedups()
    log.info("runtime search: ships %s%s", settings.describe(),
             f" ({sp['speedup_vs_float_default']:.2f}x float with {kind.defaults}, "
             f"{sp['speedup_vs_float_same_settings']:.2f}x float with the same settings)"
             if outcome.ships_found else "")
    return {key: path, "autotune/runtime_search.json": out / "runtime_search.json"}, outcome


def tune_runtime(setup: Any, rcfg: Any) -> tuple[dict[str, Path], dict[str, Any]]:
    """``search_runtime`` with what it reports as the stage's metrics["runtime"] (a dict)."""
    artifacts, outcome = search_runtime(setup, rcfg)
    return artifacts, outcome.to_dict()


def _final_comparison(backend: Backend, float_path: Path, shipped: Path, settings: Any
                      ) -> tuple[dict[str, float] | None, str | None]:
    """(p10 latencies, None) of float and shipped models, with the backend's own settings and with
    ``settings``, from one interleaved run (a runtime win is not reported as a quantization win), or
    (None, the error) when one of them failed."""
    from pipeline.backends.timing import compare_prepared

    plain, tuned = backend.as_deployed(), backend.with_settings(settings)
    prepared = []
    try:
        for b, p in ((plain, float_path), (tuned, float_path), (plain, shipped), (tuned, shipped)):
            prepared.append(b.prepare(p))
        t = compare_prepared(backend.name, prepared, TimingPlan.final(backend.timing_runs, backend.warmup_runs))
    finally:
        for pm in prepared:
            pm.close()
    if not all(x.ok for x in t):
        return None, next(x.error for x in t if not x.ok)
    return {k: x.p10_ms for k, x in zip(("float_default", "float_tuned", "shipped_default", "shipped_tuned"), t,
                                        strict=True)}, None
