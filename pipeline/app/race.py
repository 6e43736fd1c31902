"""backend=auto's races: before quantize and after every runtime's PTQ, a runtime that cannot come within
the tie margin of the leader is not quantized, or not tuned (``race_floats`` and ``tune_racing`` run the
stages that way for ``pipeline.app.auto``).

Tuning every runtime to the end costs the sum of the single runs, though a runtime far behind after PTQ
cannot catch up: what autotune (Q/DQ placement and runtime settings) gains over the better of a
runtime's PTQ model and its float is bounded. So once every runtime has quantized, each one's PTQ model
and float (as deployed) are timed side by side in one interleaved run. A runtime's best reachable
latency is its best one divided by ``GAIN_BOUND``; it is dropped when that is still more than
``TIE_MARGIN`` times the leader's current best. The leader is tuned first, then each runtime still in
reach of the leader's tuned latency (the leader's race latency scaled by the gain its own autotune
measured), in order. A close race keeps every runtime; `backend.tune_all=true` tunes them all.

Before any runtime quantizes, the floats race the same way, against ``INT8_CEILING`` (the most a
runtime's int8 model ran faster than its own float): a runtime whose float stays out of reach is not
even quantized. The fastest float quantizes first; then the others' floats race its PTQ model against
the same ceiling (``quantize_racing``), so a runtime out of reach of the leader's PTQ model is not
quantized either. No deployment is timed twice where one interleaved run already says what a race
needs: the race after the leader's PTQ times the leader's float and PTQ model only, the others' floats
scaled from their ratio to the leader's in the race before quantize (``float_ratios``), and the race
after PTQ does not time again a float that race settled (``settled_floats``). Each race is kept
(autotune/float_race.json, autotune/lead_race.json, autotune/race.json) with a key of what it timed
(models, settings, host), so a re-run with nothing changed does not time again; a dropped runtime is
left out of the final choice with the figures that dropped it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.accuracy.kinds import host_key, kinds_deferred
from pipeline.app.comparison import Comparison
from pipeline.app.runtime_runs import EachRuntime, RuntimeRun, deployed_float
from pipeline.artifacts import Manifest, atomic_write_json, fingerprint, read_json, sha256_file
from pipeline.backends import Backend
from pipeline.backends.timing import TimingPlan, time_pairs
from pipeline.config import ordered_stages
from pipeline.errors import StateError, first_line
from pipeline.records.autotune import autotune_metrics

log = logging.getLogger("tune.auto")

RACE = "autotune/race.json"
FLOAT_RACE = "autotune/float_race.json"  # the race of the floats, before any runtime quantizes
LEAD_RACE = "autotune/lead_race.json"  # the others' floats against the first quantized runtime's PTQ model
# the races run within each stage: their timing counts in the top level's seconds of that stage
STAGE_RACES = {"quantize": (FLOAT_RACE, LEAD_RACE), "autotune": (RACE,)}
# the most autotune gained over the better of a runtime's PTQ model and its float, with its runtime
# settings, on the bench models on the CPU kinds measured (docs/measurements/2026-11-28-targets-and-race.md:
# up to 1.12x), with room above it
GAIN_BOUND = 1.3
# the most a runtime's int8 model ran faster than its own float as deployed, over the bench models and CPU
# kinds measured (ONNX Runtime's ResNet-18 on AMX: 3.46x; OpenVINO's over its bf16 float: 1.61x;
# docs/measurements/2026-11-28-targets-and-race.md), with room above it: before quantize, a runtime's
# float over this is the best its int8 could reach
INT8_CEILING = 4.0
# latencies within this factor of each other are a tie (auto's pick must be within 3% of the fastest)
TIE_MARGIN = 1.03
RACE_RULE = 1  # the version of the rule: a race kept from another rule is run again


@dataclass(frozen=True)
class RaceEntry:
    """One runtime in the race: its PTQ model's and float's p10 latency, its best reachable latency, and
    whether it was dropped, with why."""

    runtime: str
    ptq_ms: float | None
    float_ms: float | None
    reachable_ms: float | None
    dropped: bool = False
    why: str = ""

    @property
    def best_ms(self) -> float | None:
        known = [t for t in (self.ptq_ms, self.float_ms) if t is not None]
        return min(known) if known else None


@dataclass
class Race:
    """The race's record (autotune/race.json): what it timed, each runtime's entry, and the order tuned."""

    key: str
    entries: list[RaceEntry] = field(default_factory=list)
    leader: str = ""
    seconds: float = 0.0  # what timing it took, when it was timed (a kept race costs nothing more)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Race:
        try:
            return cls(str(d["key"]), [RaceEntry(**e) for e in d.get("entries", [])], str(d.get("leader", "")),
                       float(d.get("seconds", 0.0)))
        except (TypeError, KeyError) as exc:
            raise StateError(f"{RACE} has an unknown layout ({first_line(exc)}); delete it to race again") from None

    def entry(self, runtime: str) -> RaceEntry | None:
        return next((e for e in self.entries if e.runtime == runtime), None)


Measured = dict[str, tuple[float | None, float | None]]  # each runtime's (float, PTQ) p10 in a race


def reachable(best_ms: float, bound: float = GAIN_BOUND) -> float:
    """The best latency a runtime could reach from ``best_ms``: the better of its PTQ model and float over
    what autotune gains at most (``GAIN_BOUND``), or, before quantize, its float over ``INT8_CEILING``."""
    return best_ms / bound


def out_of_reach(best_ms: float, leader_ms: float, bound: float = GAIN_BOUND) -> bool:
    """Whether a runtime whose best is ``best_ms`` cannot come within the tie margin of ``leader_ms``."""
    return reachable(best_ms, bound) > leader_ms * TIE_MARGIN


def run_race(top: Path, runs: list[RuntimeRun], cfg: DictConfig, lead_race: Race | None = None) -> Race | None:
    """The race of ``runs``, each quantized in its own results_dir: its PTQ model and float as deployed,
    timed or kept (a float ``lead_race`` settled is not timed again: its figure there stands,
    ``settled_floats``); None where a runtime has no PTQ model to time (its quantize did not run)."""
    float_path = Manifest(top).artifact("export/model.onnx")
    ptq = {r.name: Manifest(r.results_dir).artifact("quantize/quantized_model.onnx") for r in runs}
    if float_path is None or any(p is None for p in ptq.values()):
        return None
    floats = {r.name: deployed_float(r) for r in runs}
    settled = {n: ms for n, ms in settled_floats(lead_race).items() if n in floats}
    key = fingerprint({"float": sha256_file(float_path), "rule": RACE_RULE, "host": host_key(),
                       "gain": GAIN_BOUND, "tie": TIE_MARGIN, "settled": settled,
                       "runtimes": {r.name: [sha256_file(ptq[r.name]), floats[r.name].describe()] for r in runs}})
    # a runtime's PTQ model runs on its float's deployment (no tuned settings yet)
    deployments = {n: ((b, float_path) if n not in settled else None, (b, ptq[n])) for n, b in floats.items()}
    return _timed_race(top / RACE, key, deployments, cfg, GAIN_BOUND, lambda _: settled)


def settled_floats(lead_race: Race | None) -> dict[str, float]:
    """The floats the race after the leader's PTQ already settled for the race after PTQ, with their figures
    there: the quantized runtime's own float where it ran over ``TIE_MARGIN`` times its PTQ model, another
    runtime's where even over ``GAIN_BOUND`` it is out of reach of that runtime's best. Neither can decide
    the race after PTQ (a float slower than its PTQ model is not its runtime's best; a float out of reach
    drops its runtime whatever its PTQ model does), so neither is timed again."""
    if lead_race is None:
        return {}
    lead = next((e for e in lead_race.entries if e.ptq_ms is not None), None)
    if lead is None or lead.best_ms is None:
        return {}
    settled = {}
    for e in lead_race.entries:
        if e.float_ms is None:
            continue
        if e is lead and lead.ptq_ms is not None and e.float_ms > TIE_MARGIN * lead.ptq_ms:
            settled[e.runtime] = e.float_ms
        elif e is not lead and out_of_reach(e.float_ms, lead.best_ms, GAIN_BOUND):
            settled[e.runtime] = e.float_ms
    return settled


def run_float_race(top: Path, runs: list[RuntimeRun], cfg: DictConfig) -> Race | None:
    """The race of ``runs``' floats as deployed, before any of them quantizes (kept in
    autotune/float_race.json like the race after PTQ): a runtime whose float over ``INT8_CEILING`` stays
    out of the fastest float's reach is not quantized; None where there is no exported model."""
    float_path = Manifest(top).artifact("export/model.onnx")
    if float_path is None:
        return None
    floats = {r.name: deployed_float(r) for r in runs}
    key = fingerprint({"float": sha256_file(float_path), "rule": RACE_RULE, "host": host_key(),
                       "ceiling": INT8_CEILING, "tie": TIE_MARGIN,
                       "runtimes": {name: b.describe() for name, b in floats.items()}})
    return _timed_race(top / FLOAT_RACE, key, {n: ((b, float_path), None) for n, b in floats.items()}, cfg,
                       INT8_CEILING)


def run_lead_race(top: Path, lead: RuntimeRun, others: list[RuntimeRun], cfg: DictConfig) -> Race | None:
    """The race of the others' floats as deployed against ``lead``'s float and PTQ model, once ``lead`` has
    quantized and before they do (kept in autotune/lead_race.json): a runtime whose float over
    ``INT8_CEILING`` is out of reach of the leader's best is not quantized; None where ``lead`` has no PTQ
    model. Where the race before quantize timed a runtime's float beside ``lead``'s, that float is not timed
    again: its figure is ``lead``'s float here times their ratio there (``float_ratios``)."""
    float_path = Manifest(top).artifact("export/model.onnx")
    ptq = Manifest(lead.results_dir).artifact("quantize/quantized_model.onnx")
    if float_path is None or ptq is None:
        return None
    floats = {r.name: deployed_float(r) for r in [lead, *others]}
    ratios = float_ratios(top, lead.name, [r.name for r in others])
    key = fingerprint({"float": sha256_file(float_path), "rule": RACE_RULE, "host": host_key(),
                       "ceiling": INT8_CEILING, "tie": TIE_MARGIN, "lead": [lead.name, sha256_file(ptq)],
                       "ratios": ratios, "runtimes": {name: b.describe() for name, b in floats.items()}})
    deployments = {n: ((b, float_path) if n not in ratios else None, (b, ptq) if n == lead.name else None)
                   for n, b in floats.items()}

    def scaled(measured: Measured) -> dict[str, float]:
        lead_float = measured[lead.name][0]
        return {n: r * lead_float for n, r in ratios.items()} if lead_float is not None else {}

    return _timed_race(top / LEAD_RACE, key, deployments, cfg, INT8_CEILING, scaled)


def float_ratios(top: Path, lead: str, others: list[str]) -> dict[str, float]:
    """Each of ``others``' float over ``lead``'s in this run's race before quantize (autotune/float_race.json),
    where it timed both: one interleaved run's ratio holds while the machine's speed drifts, so the race
    after the leader's PTQ times only the leader's deployments and scales the others' floats by it."""
    path = top / FLOAT_RACE
    if not path.exists():
        return {}
    race = Race.from_dict(read_json(path, FLOAT_RACE))
    base = race.entry(lead)
    if base is None or not base.float_ms:
        return {}
    return {n: e.float_ms / base.float_ms for n in others
            if (e := race.entry(n)) is not None and e.float_ms is not None}


def _timed_race(path: Path, key: str,
                deployments: dict[str, tuple[tuple[Backend, Path] | None, tuple[Backend, Path] | None]],
                cfg: DictConfig, bound: float, untimed: Callable[[Measured], dict[str, float]] | None = None
                ) -> Race:
    """The race kept in ``path`` where it has ``key`` and the same runtimes, else each runtime's (float or
    None, PTQ or None) deployment timed side by side, decided against ``bound`` and kept; a float not timed
    takes its figure from ``untimed`` (given what was timed: an earlier race's figure, or one scaled)."""
    if path.exists():
        kept = Race.from_dict(read_json(path, path.name))
        if kept.key == key and {e.runtime for e in kept.entries} == set(deployments):
            return kept
    started = time.monotonic()
    compare = Comparison()
    slots = {n: (compare.slot(*f) if f is not None else None, compare.slot(*p) if p is not None else None)
             for n, (f, p) in deployments.items()}
    groups = [[i for i in pair if i is not None] for pair in slots.values()]
    plan = TimingPlan.runtime_race(cfg.backend.timing_runs, cfg.backend.warmup_runs, groups, bound * TIE_MARGIN)
    timings, _ = time_pairs(compare.pairs, plan, name="race")

    def p10(i: int | None) -> float | None:
        return timings[i].p10_ms if i is not None and timings[i].ok else None

    measured: Measured = {n: (p10(f), p10(p)) for n, (f, p) in slots.items()}
    figures = untimed(measured) if untimed is not None else {}
    race = decide_race(key, {n: (ms if ms is not None else figures.get(n), ptq_ms) for n, (ms, ptq_ms) in measured.items()},
                       bound)
    race.seconds = round(time.monotonic() - started, 3)
    atomic_write_json(path, race.to_dict(), indent=1)
    return race


def decide_race(key: str, measured: dict[str, tuple[float | None, float | None]], bound: float = GAIN_BOUND) -> Race:
    """The race from each runtime's (float, PTQ) p10 latencies (PTQ None: the race of the floats, before
    quantize): the leader is the runtime with the lowest best; every runtime whose best reachable latency
    (its best over ``bound``) is out of the leader's reach is dropped."""
    entries = []
    bests = {name: min((t for t in pair if t is not None), default=None) for name, pair in measured.items()}
    timed = {n: b for n, b in bests.items() if b is not None}
    if not timed:
        return Race(key, [RaceEntry(n, p, f, None) for n, (f, p) in measured.items()])
    leader = min(timed, key=timed.get)
    lead = timed[leader]
    for name, (float_ms, ptq_ms) in measured.items():
        best = bests[name]
        if best is None:
            entries.append(RaceEntry(name, ptq_ms, float_ms, None, False, "not timed: kept"))
            continue
        dropped = name != leader and out_of_reach(best, lead, bound)
        what = "its best" if ptq_ms is not None else "its float"
        why = (f"best reachable {reachable(best, bound):.3f} ms ({what} {best:.3f} ms / {bound}) is over "
               f"{TIE_MARGIN} x {leader}'s {lead:.3f} ms") if dropped else ""
        entries.append(RaceEntry(name, ptq_ms, float_ms, reachable(best, bound), dropped, why))
    return Race(key, entries, leader)


def still_in_reach(race: Race, runtime: str, leader_gain: float) -> tuple[bool, str]:
    """Whether ``runtime`` is still in reach of the leader once the leader's autotune made it ``leader_gain``
    times faster than its race latency (its own PTQ-to-shipped ratio); why not, where it is not."""
    lead, entry = race.entry(race.leader), race.entry(runtime)
    if lead is None or entry is None or lead.best_ms is None or entry.best_ms is None or leader_gain <= 1.0:
        return True, ""
    tuned = lead.best_ms / leader_gain
    if out_of_reach(entry.best_ms, tuned):
        return False, (f"best reachable {reachable(entry.best_ms):.3f} ms is over {TIE_MARGIN} x {race.leader}'s "
                       f"tuned {tuned:.3f} ms (its race {lead.best_ms:.3f} ms / its autotune's gain {leader_gain:.2f}x)")
    return True, ""


def race_line(top: Path) -> str:
    """The races ``top``'s run kept (autotune/float_race.json, autotune/race.json) in one line, "" where
    none ran."""
    lines = [describe(Race.from_dict(read_json(top / name, name)), when)
             for name, when in ((FLOAT_RACE, "before quantize"), (LEAD_RACE, "after the leader's PTQ"),
                                (RACE, "after PTQ")) if (top / name).exists()]
    return "; ".join(lines)


def describe(race: Race, when: str = "after PTQ") -> str:
    """One line: each runtime's race figures, the dropped ones with why."""
    parts = []
    for e in race.entries:
        figures = ", ".join(f"{k} {v:.3f} ms" for k, v in (("PTQ", e.ptq_ms), ("float", e.float_ms)) if v is not None)
        state = f"dropped: {e.why}" if e.dropped else ("leader" if e.runtime == race.leader else "kept")
        parts.append(f"{e.runtime} ({figures}; {state})")
    return f"race {when}: " + "; ".join(parts)


def racing(cfg: DictConfig, runs: list[RuntimeRun]) -> bool:
    """Whether the runtimes race (``pipeline.app.race``): not where every one is to be tuned
    (`backend.tune_all`), where only those tuned before are compared (`backend.tuned_only`), or alone."""
    return not (bool(cfg.backend.get("tune_all", False)) or bool(cfg.backend.get("tuned_only", False))
                or len(runs) < 2)


def race_floats(cfg: DictConfig, top: Path, runs: list[RuntimeRun], each: EachRuntime) -> list[RuntimeRun]:
    """The runtimes to quantize: those whose float as deployed, over the int8 ceiling, stays in reach of the
    fastest float (every one where they do not race); the others are left out with the figures."""
    if bool(cfg.backend.get("tuned_only", False)):  # tune-rechoose: what never quantized is not quantized now
        done = [r for r in runs if (Manifest(r.results_dir).entry("quantize") or {}).get("status") == "done"]
        each.left_out.update({r.name: "never quantized (tune-rechoose quantizes nothing)" for r in runs if r not in done})
        return done
    race = run_float_race(top, runs, cfg) if racing(cfg, runs) else None
    if race is None:
        (top / FLOAT_RACE).unlink(missing_ok=True)  # no race this time: none is reported
        return runs
    log.info("auto: %s", describe(race, "before quantize"))
    kept = []
    for run in runs:
        entry = race.entry(run.name)
        if entry is not None and entry.dropped:
            each.left_out[run.name] = f"not quantized: out of reach before quantize ({entry.why})"
        else:
            kept.append(run)

    def fastest_float(r: RuntimeRun) -> float:
        entry = race.entry(r.name)
        return entry.float_ms if entry is not None and entry.float_ms is not None else float("inf")

    return sorted(kept, key=fastest_float)  # the fastest float quantizes first (quantize_racing)


def quantize_racing(cfg: DictConfig, top: Path, runs: list[RuntimeRun], each: EachRuntime
                    ) -> tuple[list[RuntimeRun], Race | None]:
    """Quantize in each of ``runs`` (the fastest float first, as ``race_floats`` orders them) that stays in
    reach: once the first one has quantized, the others' floats race its PTQ model (``run_lead_race``) and
    a runtime out of reach is left out, not quantized. Every runtime where they do not race. The runtimes
    that quantized, and the race after the leader's PTQ where it ran (the race after PTQ takes the floats
    it settled). A runtime quantized in the race judges the other CPU kinds only once it is tuned
    (``kinds_deferred``): the race after PTQ may drop it."""
    if bool(cfg.backend.get("tuned_only", False)):  # tune-rechoose: the race that dropped a runtime stands
        return each.run(runs, "quantize"), None
    if not racing(cfg, runs):
        (top / LEAD_RACE).unlink(missing_ok=True)  # no race this time: none is reported
        return each.run(runs, "quantize"), None
    lead, others = runs[0], runs[1:]
    if not each.one(lead, "quantize"):
        (top / LEAD_RACE).unlink(missing_ok=True)
        return each.run(others, "quantize"), None
    race = run_lead_race(top, lead, others, cfg)
    if race is None:
        (top / LEAD_RACE).unlink(missing_ok=True)
        return [lead, *each.run(others, "quantize")], None
    log.info("auto: %s", describe(race, "after the leader's PTQ"))
    kept = [lead]
    for run in others:
        entry = race.entry(run.name)
        if entry is not None and entry.dropped:
            log.info("auto: %s not quantized: %s", run.name, entry.why)
            each.left_out[run.name] = f"not quantized: out of reach of {lead.name}'s PTQ model ({entry.why})"
            continue
        with kinds_deferred(why) if (why := _deferred_kinds(cfg, run)) else contextlib.nullcontext():
            if each.one(run, "quantize"):
                kept.append(run)
    return kept, race


def _deferred_kinds(cfg: DictConfig, run: RuntimeRun) -> str:
    """Why ``run``'s quantize leaves the CPU kinds that take a run of their own unjudged: where autotune runs
    next, the race after PTQ may drop it, and autotune judges what a tuned runtime ships; "" (judge them
    all) where this run ends at quantize: its PTQ model may ship."""
    if "autotune" not in ordered_stages(cfg):
        return ""
    return f"judged once {run.name} is tuned: backend=auto's race after PTQ may drop it"


def tune_racing(cfg: DictConfig, top: Path, runs: list[RuntimeRun], each: EachRuntime,
                lead_race: Race | None = None) -> list[RuntimeRun]:
    """Autotune in each runtime that stays in the race (``pipeline.app.race``; ``lead_race``: the race after
    the leader's PTQ, whose settled floats are not timed again): the leader first, then each one still in
    reach of its tuned latency; every runtime where `backend.tune_all` is set or the race cannot run; under
    `backend.tuned_only` (tune-rechoose) only the runtimes tuned before. The runtimes that take part in the
    choice."""
    if bool(cfg.backend.get("tuned_only", False)):
        tuned = [r for r in runs if (Manifest(r.results_dir).entry("autotune") or {}).get("status") == "done"]
        for r in runs:
            if r not in tuned:
                each.left_out[r.name] = "never tuned (tune-rechoose tunes nothing)"
        return [r for r in tuned if each.one(r, "autotune")]  # up to date: skipped, nothing tuned
    race = run_race(top, runs, cfg, lead_race) if racing(cfg, runs) else None
    if race is None:
        (top / RACE).unlink(missing_ok=True)  # no race this time: none is reported
        return each.run(runs, "autotune")
    log.info("auto: %s", describe(race))

    def rank(r: RuntimeRun) -> tuple[bool, float]:  # the leader first, then by their best latency
        entry = race.entry(r.name)
        return r.name != race.leader, (entry.best_ms if entry is not None and entry.best_ms is not None else 0.0)

    order = sorted(runs, key=rank)
    kept: list[RuntimeRun] = []
    gain = 1.0
    for run in order:
        entry = race.entry(run.name)
        reach, why = (not entry.dropped, entry.why) if entry is not None else (True, "")
        if reach and kept and run.name != race.leader:
            reach, why = still_in_reach(race, run.name, gain)
        if not reach:
            log.info("auto: %s not tuned: %s", run.name, why)
            each.left_out[run.name] = f"not tuned: out of reach after PTQ ({why})"
            continue
        if each.one(run, "autotune"):
            kept.append(run)
            if run.name == race.leader:
                gain = tuned_gain(run)
    return kept


def tuned_gain(run: RuntimeRun) -> float:
    """How much faster the runtime's shipped deployment ran than the better of its PTQ model and float, in
    its own autotune's final comparison (1.0 where it did not measure both)."""
    manifest = Manifest(run.results_dir)
    m = autotune_metrics(manifest.metrics("autotune"), manifest.entry_name("autotune"))
    if m is None:
        return 1.0
    best = min((t for t in (m.ptq_ms, m.baseline_ms) if t), default=None)
    return best / m.final_ms if best and m.final_ms else 1.0


__all__ = ["race_floats", "racing", "tune_racing", "FLOAT_RACE", "STAGE_RACES", "GAIN_BOUND", "INT8_CEILING", "RACE", "run_float_race", "settled_floats", "TIE_MARGIN", "Race", "RaceEntry", "decide_race", "describe", "float_ratios", "out_of_reach",
           "race_line", "reachable", "run_race", "still_in_reach"]
