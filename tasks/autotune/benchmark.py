"""Noise-robust latency measurement for the search: every candidate is paired with a live baseline.

These machines drift in phases (the same model measured 52 ms and 36 ms seconds apart), so an
absolute latency says little. The float baseline stays loaded for the whole run; a candidate is
measured in alternating blocks with it (``time_interleaved``: one untimed run after each switch,
since the previous session's spinning threads slow the first run), and the result is the ratio of their low
percentiles, which held up best here: each round keeps the fastest run of a short block per model,
and the result is the median over rounds of the per-round candidate/baseline ratios. Identical
models (by content hash) are measured once.

A measurement given a keep threshold (``measure(..., stop_at=...)``) is sequential: it ends as soon
as the 95% confidence interval of the ratio lies clearly above or below the threshold (after at
least MIN_ROUNDS rounds). Its rounds are half as long and it may take twice as many, so an unclear
measurement times as many runs as a fixed one and a clear one a fraction of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.backends import Backend, PreparedModel
from pipeline.backends.ratios import MIN_ROUNDS, round_ratios, sequential_verdict
from pipeline.backends.timing import TimingPlan, prepared_models, time_interleaved
from pipeline.graph.model import model_hash, write_model_bytes
from tasks.autotune.crash_guard import CrashGuard
from tasks.autotune.region.scheme import Measurement

log = logging.getLogger("tune.autotune")


class PairedBenchmark:
    """Measures models against a live reference model with one backend.

    With ``accuracy`` (a callable judging a prepared model, e.g. on held-out batches against the
    float model), every candidate is checked first, on the very engine that is timed; one over the
    budget is rejected like a failed build, without being timed.
    """

    def __init__(self, backend: Backend, reference: str | Path, warmup_runs: int = 5, timing_runs: int = 40,
                 rounds: int = 4, accuracy: Callable[[PreparedModel], Any] | None = None,
                 guard: CrashGuard | None = None):
        self.backend = backend
        self.guard = guard  # candidates that crashed the process are failed measurements (None: no record)
        self.reference_path = Path(reference)
        self.warmup_runs = warmup_runs
        self.runs_per_round = max(2, timing_runs // max(rounds, 1))
        self.rounds = rounds
        self._reference: PreparedModel | None = None
        self.accuracy = accuracy
        self._cache: dict[str, Measurement] = {}
        self.count = 0  # measurements actually run (cache hits excluded)

    def _ref(self) -> PreparedModel:
        if self._reference is None:
            self._reference = self.backend.prepare(self.reference_path)
            self._reference.time_runs(self.warmup_runs)
        return self._reference

    def close(self) -> None:
        if self._reference is not None:
            self._reference.close()
            self._reference = None

    def measure(self, model: str | Path | bytes, rounds: int | None = None, use_cache: bool = True,
                stop_at: float | None = None, what: str = "a candidate", family: str | None = None) -> Measurement:
        """Pair ``model`` with the reference for ``rounds`` rounds; with ``stop_at`` (a keep threshold
        on the ratio) sequentially: rounds of half the runs, at least MIN_ROUNDS and at most ``rounds``
        (default: twice the benchmark's), ending once the ratio is clearly above or below it. ``what``
        names the model where it crashes the process, ``family`` the candidates like it (its region):
        see crash_guard.py."""
        key = model_hash(model)
        if use_cache and key in self._cache:
            return dataclasses.replace(self._cache[key])  # callers annotate their copy (log path)
        with contextlib.ExitStack() as stack:
            if isinstance(model, bytes):
                path = write_model_bytes(model, Path(stack.enter_context(
                    tempfile.TemporaryDirectory(prefix="qdq-tune-candidate-"))) / "candidate.onnx", share_weights=True)
            else:
                path = Path(model)
            if self.guard is not None:
                if (crashed := self.guard.why_failed(key, path, what, family)) is not None:
                    return Measurement.failed(crashed)
                stack.enter_context(self.guard.flight(key, what, family))
            cap = rounds or (2 * self.rounds if stop_at is not None else self.rounds)
            result = self._measure(path, max(cap, MIN_ROUNDS) if stop_at is not None else cap, stop_at)
        self.count += 1
        if (result.ok or result.over_budget) and use_cache:
            self._cache[key] = result
        return result

    def _measure(self, path: Path, rounds: int, stop_at: float | None = None) -> Measurement:
        ref = self._ref()
        try:
            cand = self.backend.prepare(path)
        except Exception as exc:  # noqa: BLE001 - a candidate the runtime rejects is a failed measurement
            return Measurement.failed(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        verdict = None
        try:
            if self.accuracy is not None:
                verdict = self.accuracy(cand)
                if not verdict.ok:
                    m = Measurement.failed(f"over the accuracy budget: {verdict.what}")
                    m.accuracy = verdict.to_dict()
                    return m
            cand.time_runs(self.warmup_runs)  # (the reference was warmed up once, when it was loaded)
            runs = self.runs_per_round if stop_at is None else max(2, self.runs_per_round // 2)
            plan = (TimingPlan(rounds, runs, stop_on_error=True) if stop_at is None else
                    TimingPlan.duel(stop_at, rounds, runs, cheap_rounds=0))
            blocks, errors = time_interleaved([ref, cand], plan)
            error = next((e for e in errors if e is not None), None)
            if error is not None:
                return Measurement.failed(error)
            ref_min, cand_min = ([min(b) for b in bl] for bl in blocks)
        except Exception as exc:  # noqa: BLE001
            return Measurement.failed(f"{type(exc).__name__}: {exc}")
        finally:
            cand.close()
        # across rounds: the median of the per-round ratios, so a slow phase that hits one round
        # does not decide
        ratios = round_ratios(*blocks)
        if not ratios or not all(math.isfinite(x) for x in ratios):
            return Measurement.failed("non-finite timing")
        ratio = float(np.median(ratios))
        return Measurement(latency_ms=float(np.median(cand_min)), ratio=ratio,
                           reference_ms=float(np.median(ref_min)),
                           accuracy=verdict.to_dict() if verdict is not None else None,
                           noise=float(np.median(np.abs(np.asarray(ratios) - ratio))),
                           round_ratios=tuple(ratios),
                           decided=sequential_verdict(ratios, stop_at) if stop_at is not None else None)


@dataclasses.dataclass
class ProfiledTiming:
    """One model of an interleaved, profiled comparison. Times are medians over rounds of each round's
    best run; ratios are medians of the per-round ratios to the first model. ``compute_*`` count only
    layers that are not edge overhead (None where the runtime gave no per-layer times)."""

    ok: bool
    total_ms: float = math.nan
    total_ratio: float = math.nan
    compute_ms: float | None = None
    compute_ratio: float | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProfiledTiming:
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls)})


def compare_profiled(backend: Backend, paths: list[Path], rounds: int, runs_per_round: int,
                     warmup_runs: int) -> list[ProfiledTiming]:
    """``time_interleaved`` over models prepared with per-layer profiling (the first is the reference)."""
    with prepared_models(backend, paths, profile=True) as (prepared, errors):
        # a warm-up call always: _round_compute reads the profile's calls as warm-up, then switch + block;
        # blocks as asked: a profiler keeps every run's layer events (ONNX Runtime's drops them past its buffer)
        blocks, errors = time_interleaved(prepared, TimingPlan(rounds, runs_per_round, max(1, warmup_runs),
                                                               min_block_ms=0.0), errors)
        computes = [_round_compute(pm) if pm is not None and e is None else None
                    for pm, e in zip(prepared, errors, strict=True)]
    totals = [[min(b) for b in bl] for bl in blocks]
    out = []
    for k in range(len(paths)):
        if errors[k] is not None or len(totals[k]) != rounds:
            out.append(ProfiledTiming(False, error=errors[k] or "interrupted measurement"))
            continue
        t = ProfiledTiming(True, float(np.median(totals[k])), _ratio(totals[k], totals[0]))
        if computes[k] is not None and computes[0] is not None:
            t.compute_ms, t.compute_ratio = float(np.median(computes[k])), _ratio(computes[k], computes[0])
        out.append(t)
    return out


def _ratio(values: list[float], reference: list[float]) -> float:
    ratios = [v / r for v, r in zip(values, reference, strict=False) if r > 0]
    return float(np.median(ratios)) if ratios else math.nan


def _round_compute(pm: PreparedModel) -> list[float] | None:
    """Per round, the best run's time summed over non-overhead layers (calls: warm-up, then an untimed
    switch run and a timed block per round)."""
    calls = pm.layer_samples()
    if calls is None:
        return None
    skip = pm.overhead_layers
    out = []
    for block in calls[2::2]:
        sums = [sum(ms for name, ms in run.items() if name not in skip) for run in block]
        if not sums:
            return None
        out.append(min(sums))
    return out if out and all(s > 0 for s in out) else None
