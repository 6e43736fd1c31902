"""Interleaved timing: models timed in alternating blocks, one deployment after the other each round, so
a machine that drifts slows them all alike. ``time_interleaved`` is the one timer (a ``TimingPlan`` says
how many rounds, runs and warm-up runs, and when to stop early); ``time_pairs`` and ``compare_*`` prepare
models and pool its blocks into ``Timing`` records; the least length of a timed block is run-wide
(``min_block_configured``). The protocol and its records are ``pipeline.backends.base``'s; the statistics
over per-round blocks are ``pipeline.backends.ratios``'."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.backends.base import Backend, PreparedModel, Timing
from pipeline.backends.ratios import (
    CHEAP_ROUNDS,
    CHEAP_SECONDS,
    choice_decided,
    clear_leader,
    race_decided,
    round_ratios,
    sequential_verdict,
    timed_seconds,
)

log = logging.getLogger("tune.backends")


@contextlib.contextmanager
def prepared_models(backend: Backend, model_paths: list[str | Path], profile: bool = False
                    ) -> Iterator[tuple[list[PreparedModel | None], list[str | None]]]:
    """Prepare every model (``profile``: with per-layer timing); one that cannot be prepared is None
    with its error. All are closed on the way out, also on Ctrl-C."""
    with prepared_pairs([(backend, p) for p in model_paths], profile) as out:
        yield out


@contextlib.contextmanager
def prepared_pairs(models: list[tuple[Backend, str | Path]], profile: bool = False
                   ) -> Iterator[tuple[list[PreparedModel | None], list[str | None]]]:
    """``prepared_models`` of (backend, model) pairs: each model on its own backend (runtimes side by side)."""
    prepared: list[PreparedModel | None] = []
    errors: list[str | None] = []
    try:
        for backend, p in models:
            try:
                prepared.append(backend.prepare(p, profile=profile) if profile else backend.prepare(p))
                errors.append(None)
            except Exception as exc:  # noqa: BLE001 - reported as a failed measurement
                log.debug("prepare %s failed", p, exc_info=True)
                prepared.append(None)
                errors.append(f"{type(exc).__name__}: {exc}")
        yield prepared, errors
    finally:
        for pm in prepared:
            if pm is not None:
                pm.close()


def compare_interleaved(backend: Backend, model_paths: list[str | Path], plan: TimingPlan | None = None
                        ) -> list[Timing]:
    """Measure several models on ``backend`` in alternating blocks by ``plan`` (default: the backend's final
    comparison, ``TimingPlan.final``); one Timing per model over all its samples. A model that cannot be
    prepared gets a failed Timing; every prepared model is closed on the way out, also on Ctrl-C."""
    plan = plan if plan is not None else TimingPlan.final(backend.timing_runs, backend.warmup_runs)
    return time_pairs([(backend, p) for p in model_paths], plan, backend.name)[0]


def time_pairs(models: list[tuple[Backend, str | Path]], plan: TimingPlan, name: str
               ) -> tuple[list[Timing], list[list[list[float]]]]:
    """(backend, model) pairs, each model on its own backend, timed by ``time_interleaved``: one Timing
    per model over all its runs (``name`` labels them; a model that could not be prepared or run is a
    failed Timing), and its blocks (per round, its timed runs) for paired ratios."""
    with prepared_pairs(models) as (prepared, errors):
        blocks, errors = time_interleaved(prepared, plan, errors)
    return pooled(blocks, errors, name), blocks


# a timed block lasts at least this long: blocks of a few runs of a model that takes a tenth of a
# millisecond measure the switch between models (the other one's worker threads), not the model. The
# run's backend.min_block_ms sets it for the run (``min_block_configured``).
MIN_BLOCK_MS = 10.0
# and has at most this many runs
MAX_BLOCK_RUNS = 1000
_MIN_BLOCK = contextvars.ContextVar("min_block_ms", default=MIN_BLOCK_MS)


@contextlib.contextmanager
def min_block_configured(ms: float) -> Iterator[None]:
    """Timed blocks of at least ``ms`` for the block (a run's ``backend.min_block_ms``), as before after it."""
    token = _MIN_BLOCK.set(float(ms))
    try:
        yield
    finally:
        _MIN_BLOCK.reset(token)


# a duel's rounds, and its runs per round: the backend's timing_runs / DUEL_SPLIT (``duel_runs``)
DUEL_ROUNDS, DUEL_SPLIT = 12, 8
# a race runs at most RACE_ROUNDS rounds; a final comparison FINAL_ROUNDS
RACE_ROUNDS, FINAL_ROUNDS = 8, 6


def duel_runs(timing_runs: int) -> int:
    """Timed runs per round of a duel on a backend that times ``timing_runs`` runs per model."""
    return max(2, int(timing_runs) // DUEL_SPLIT)


@dataclass(frozen=True)
class TimingPlan:
    """How ``time_interleaved`` times its models: ``rounds`` rounds of ``runs_per_round`` timed runs per
    model, after ``warmup_runs`` untimed ones per model. ``stop_on_error`` ends the timing at the first
    failure (a paired comparison is void once either side fails); ``until`` (given the blocks so far)
    ends it after any complete round, before ``rounds``. Every block has the same number of runs, more
    than ``runs_per_round`` where the fastest model needs them to fill ``min_block_ms``."""

    rounds: int
    runs_per_round: int
    warmup_runs: int = 0
    stop_on_error: bool = False
    until: Callable[[list[list[list[float]]]], bool] | None = None
    min_block_ms: float | None = None  # None: the run's (``min_block_configured``, else MIN_BLOCK_MS)

    @classmethod
    def duel(cls, threshold: float, rounds: int, runs_per_round: int, warmup_runs: int = 0,
             cheap_rounds: int = CHEAP_ROUNDS) -> TimingPlan:
        """A pair [reference, candidate] in paired rounds that end once the candidate's ratio is clearly
        below or above ``threshold`` (``sequential_verdict``), or after ``rounds`` rounds, or, where those
        were cheap, after more (up to ``cheap_rounds`` within CHEAP_SECONDS; 0: none past ``rounds``); the
        first failure ends it. ``duel_runs`` gives the runs per round of a backend's duels."""

        def until(blocks: list[list[list[float]]]) -> bool:
            if sequential_verdict(round_ratios(blocks[0], blocks[1]), threshold) is not None:
                return True
            return len(blocks[0]) >= rounds and timed_seconds(blocks) >= CHEAP_SECONDS

        return cls(max(rounds, cheap_rounds), runs_per_round, warmup_runs, stop_on_error=True, until=until)

    @classmethod
    def race(cls, timing_runs: int, warmup_runs: int,
             until: Callable[[list[list[list[float]]]], bool] = clear_leader) -> TimingPlan:
        """Several deployments, the fastest wanted (quantize's weight storage; auto's races and choice end
        on their own decisions, ``runtime_race`` and ``choice``): up to RACE_ROUNDS rounds of
        ``timing_runs`` / RACE_ROUNDS runs, fewer once ``until`` (default: one is clearly the fastest,
        ``clear_leader``)."""
        return cls(RACE_ROUNDS, max(2, int(timing_runs) // RACE_ROUNDS), int(warmup_runs), until=until)

    @classmethod
    def choice(cls, timing_runs: int, warmup_runs: int, runtimes: list[tuple[int, int]]) -> TimingPlan:
        """backend=auto's final choice among runtimes, each its (float, shipped) deployments (indices of the
        timed models): ``race``'s rounds, fewer once the pick is clear (``choice_decided``)."""
        return cls.race(timing_runs, warmup_runs, lambda blocks: choice_decided(blocks, runtimes))

    @classmethod
    def runtime_race(cls, timing_runs: int, warmup_runs: int, groups: list[list[int]], bar: float) -> TimingPlan:
        """backend=auto's races of runtimes, each a group of deployments (indices of the timed models; a
        runtime's latency is its best one's): ``race``'s rounds, fewer once every runtime is clearly within
        or beyond ``bar`` times the fastest one's latency (``race_decided``)."""
        return cls.race(timing_runs, warmup_runs, lambda blocks: race_decided(blocks, groups, bar))

    @classmethod
    def final(cls, timing_runs: int, warmup_runs: int, rounds: int = FINAL_ROUNDS,
              runs_per_round: int | None = None) -> TimingPlan:
        """The comparison a stage reports and ships by (autotune's guard, the runtime search's last
        comparison, evaluate): every model ``rounds`` rounds of ``timing_runs`` / 2 runs (or
        ``runs_per_round``), none ending early."""
        runs = runs_per_round if runs_per_round is not None else max(2, int(timing_runs) // 2)
        return cls(int(rounds), runs, int(warmup_runs))

    def block_runs(self, fastest_ms: float) -> int:
        """Timed runs per block for models whose fastest run takes ``fastest_ms``."""
        least = _MIN_BLOCK.get() if self.min_block_ms is None else self.min_block_ms
        if not (math.isfinite(fastest_ms) and fastest_ms > 0 and least > 0):
            return self.runs_per_round
        return max(self.runs_per_round, min(MAX_BLOCK_RUNS, math.ceil(least / fastest_ms)))


def time_interleaved(prepared: list[PreparedModel | None], plan: TimingPlan, errors: list[str | None] | None = None,
                     ) -> tuple[list[list[list[float]]], list[str | None]]:
    """Time prepared models in alternating blocks by ``plan``: per model, one list of run times per
    round, and its error (None models, and models in ``errors`` with an error already, are skipped).

    Each model is warmed up once (``plan.warmup_runs``, at least one run); each round times every model
    for ``plan.block_runs`` of the fastest warm-up run, after ``settle_runs`` untimed ones lasting at least
    the previous model's ``settle_seconds`` (its worker threads slow the first runs after a switch). A
    model whose runs raise keeps its error and drops out; the others go on, unless ``plan.stop_on_error``.
    """
    n = len(prepared)
    blocks: list[list[list[float]]] = [[] for _ in prepared]
    errors = list(errors) if errors is not None else [None] * n
    for i, pm in enumerate(prepared):
        if pm is None:
            errors[i] = errors[i] or "not prepared"

    def fail(i: int, exc: Exception) -> None:
        log.debug("timing model %d of %d failed", i + 1, n, exc_info=True)
        errors[i] = f"{type(exc).__name__}: {exc}"

    warm: list[float] = []
    for i, pm in enumerate(prepared):
        if errors[i] is None:
            try:
                warm.append(min(pm.time_runs(max(1, plan.warmup_runs))))  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001 - reported as a failed measurement
                fail(i, exc)
                if plan.stop_on_error:
                    return blocks, errors
    runs = plan.block_runs(min(warm, default=math.nan))
    settle = max([getattr(pm, "settle_runs", 1) for pm in prepared if pm is not None] or [1])
    before: Any = next((pm for pm, e in zip(reversed(prepared), reversed(errors), strict=True) if e is None), None)
    for r in range(plan.rounds):
        # rotate the order every round: no model always pays for its predecessor's lingering threads
        for i in [(r + k) % n for k in range(n)]:
            if errors[i] is not None:
                continue
            pm = prepared[i]
            try:
                _settle(pm, settle, before)
                before = pm
                blocks[i].append(pm.time_runs(runs))  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001 - reported as a failed measurement
                fail(i, exc)
                if plan.stop_on_error:
                    return blocks, errors
        if plan.until is not None and plan.until(blocks):
            break
    return blocks, errors


def _settle(pm: Any, runs: int, before: Any) -> None:
    """``runs`` untimed runs of ``pm``, for at least ``before``'s ``settle_seconds`` (its spinning threads)."""
    seconds = getattr(before, "settle_seconds", 0.0) if before is not pm else 0.0
    t0, n = time.perf_counter(), 0
    while n < runs or time.perf_counter() - t0 < seconds:
        pm.time_runs(1)
        n += 1


def compare_prepared(backend_name: str, prepared: list[PreparedModel], plan: TimingPlan) -> list[Timing]:
    """Time prepared models by ``plan`` (``time_interleaved``): one Timing per model over all its runs (the
    caller closes them)."""
    return pooled(*time_interleaved(list(prepared), plan), backend_name)


def pooled(blocks: list[list[list[float]]], errors: list[str | None], name: str) -> list[Timing]:
    """One Timing per model of ``time_interleaved``'s result, over all its timed runs (``name`` labels
    them); a model with an error or no runs is a failed Timing."""
    return [Timing.from_samples([t for b in bl for t in b], name) if e is None and bl else
            Timing.failed(name, e or "no timed runs") for bl, e in zip(blocks, errors, strict=True)]
