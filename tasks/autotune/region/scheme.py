"""Insertion schemes, the per-pattern record of every scheme measured, and the one ranking of
measured things by latency ratio."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tasks.autotune.region.insertion_points import InsertionPoint

T = TypeVar("T")


def rank_by_ratio(items: Iterable[T], ratio: Callable[[T], float], tie_break: Callable[[T], Any],
                  tie_band: float = 0.0) -> list[T]:
    """``items`` best first by latency ``ratio`` (lower is faster). Those within ``tie_band``
    (relative) of the best count as tied with it and go by ``tie_break`` alone, so a preferred form
    is not displaced by noise; the rest go by ratio, then ``tie_break``.

    Args:
        items: what is ranked (measured schemes, scheme names, ...).
        ratio: an item's latency ratio.
        tie_break: the order among equal (or tied) ratios.
        tie_band: how far above the best ratio, as a fraction of it, still counts as tied.
    """
    ratios = [(item, ratio(item)) for item in items]
    if not ratios:
        return []
    best = min(r for _, r in ratios)
    tie = best * (1.0 + tie_band)
    ranked = sorted(ratios, key=lambda ir: (best if ir[1] <= tie else ir[1], tie_break(ir[0])))
    return [item for item, _ in ranked]


@dataclass(frozen=True)
class InsertionScheme:
    """A set of pattern-relative insertion points (a frozen set: order never matters)."""

    points: frozenset[InsertionPoint] = frozenset()

    @property
    def key(self) -> str:
        return ";".join(sorted(p.key for p in self.points)) or "none"

    @classmethod
    def from_keys(cls, keys: list[str] | str) -> InsertionScheme:
        if isinstance(keys, str):
            keys = [] if keys in ("", "none") else keys.split(";")
        return cls(frozenset(InsertionPoint.from_key(k) for k in keys))

    def distance(self, other: InsertionScheme) -> int:
        """Number of points in one scheme but not the other."""
        return len(self.points ^ other.points)

    def __len__(self) -> int:
        return len(self.points)


@dataclass
class Measurement:
    """One measured scheme. ``ratio`` = candidate / live baseline latency in the same paired run
    (lower is better); ``ok=False`` keeps the error and log path instead of a fake latency."""

    latency_ms: float
    ratio: float
    reference_ms: float
    ok: bool = True
    error: str | None = None
    log_path: str | None = None
    remeasure: bool = False
    # the accuracy verdict on the held-out batches (AccuracyVerdict.to_dict()); a candidate over the
    # budget is a failed measurement (ok=False) that keeps its verdict
    accuracy: dict[str, Any] | None = None
    # median absolute deviation of the per-round ratios: the measurement's own noise
    noise: float = 0.0
    round_ratios: tuple[float, ...] = ()
    # a sequential measurement's end: "below"/"above" when the ratio's interval ended clearly on that
    # side of the keep threshold, None when it ran to its cap (or had no threshold)
    decided: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"latency_ms": self.latency_ms, "ratio": self.ratio, "reference_ms": self.reference_ms,
                "ok": self.ok, "error": self.error, "log_path": self.log_path, "remeasure": self.remeasure,
                "accuracy": self.accuracy, "noise": self.noise, "round_ratios": list(self.round_ratios),
                "decided": self.decided}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        return cls(float(d["latency_ms"]), float(d["ratio"]), float(d["reference_ms"]), bool(d.get("ok", True)),
                   d.get("error"), d.get("log_path"), bool(d.get("remeasure", False)), d.get("accuracy"),
                   float(d.get("noise") or 0.0), tuple(d.get("round_ratios") or ()), d.get("decided"))

    @property
    def over_budget(self) -> bool:
        return self.accuracy is not None and not self.accuracy.get("ok", True)

    @classmethod
    def failed(cls, error: str, log_path: str | None = None) -> Measurement:
        return cls(math.nan, math.nan, math.nan, False, error, log_path)


# where a scheme came from, in words a user reads in the log
ORIGINS = {"seed:baseline": "the quantize stage's placement", "seed:none": "no Q/DQ",
           "seed:all": "every insertion point", "seed:cache": "from the pattern cache",
           "toggle": "one point toggled from the best", "mutation": "a mutation of the best"}


@dataclass
class SchemeRecord:
    scheme: InsertionScheme
    origin: str  # seed:baseline / seed:none / seed:all / seed:cache / toggle / mutation
    measurements: list[Measurement] = field(default_factory=list)

    def describe(self, candidates: int) -> str:
        """What the scheme quantizes, in words: 'no Q/DQ (float)' or '3 of 8 insertion points (a
        mutation of the best)'."""
        if not self.scheme.points:
            return "no Q/DQ (float)"
        return f"{len(self.scheme)} of {candidates} insertion points ({ORIGINS.get(self.origin, self.origin)})"

    @property
    def ok(self) -> bool:
        return any(m.ok for m in self.measurements)

    @property
    def ratio(self) -> float:
        """Best estimate: the re-measurement when there is one, else the search measurement."""
        good = [m for m in self.measurements if m.ok]
        if not good:
            return math.inf
        re = [m for m in good if m.remeasure]
        use = re or good
        return sum(m.ratio for m in use) / len(use)

    @property
    def latency_ms(self) -> float:
        good = [m for m in self.measurements if m.ok]
        return min((m.latency_ms for m in good), default=math.nan)

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": self.scheme.key, "origin": self.origin,
                "measurements": [m.to_dict() for m in self.measurements]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SchemeRecord:
        return cls(InsertionScheme.from_keys(d["scheme"]), d.get("origin", "?"),
                   [Measurement.from_dict(m) for m in d.get("measurements", [])])


WIN_MARGIN = 0.02


@dataclass
class PatternSchemes:
    """Everything tried for one pattern: the candidate points, every scheme with its measurements,
    and the committed best."""

    pattern: str
    candidates: list[InsertionPoint] = field(default_factory=list)
    records: list[SchemeRecord] = field(default_factory=list)
    baseline_scheme: InsertionScheme | None = None
    incumbent: InsertionScheme | None = None  # what the finalists dueled against
    best: InsertionScheme | None = None
    done: bool = False
    generation_attempts: int = 0

    @property
    def best_scheme(self) -> SchemeRecord | None:
        """Best by ratio; once finalists dueled the incumbent, only they and the incumbent compete (a
        scheme measured once would win on its lucky draw), and a challenger must beat the incumbent
        by WIN_MARGIN."""
        good = [r for r in self.records if r.ok]
        inc = self.find(self.incumbent) if self.incumbent is not None else None
        finalists = [r for r in good if any(m.remeasure and m.ok for m in r.measurements)]
        if inc is not None and inc.ok and inc not in finalists:
            finalists.append(inc)
        pool = finalists or good
        if not pool:
            return None
        best = min(pool, key=lambda r: (r.ratio, r.scheme.key))
        if inc is not None and inc in pool and best is not inc and best.ratio > inc.ratio * (1 - WIN_MARGIN):
            return inc  # a challenger must win its duel clearly, not by noise
        return best

    def find(self, scheme: InsertionScheme) -> SchemeRecord | None:
        for r in self.records:
            if r.scheme == scheme:
                return r
        return None

    @property
    def num_measured(self) -> int:
        return sum(1 for r in self.records if r.measurements)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pattern": self.pattern,
            "candidates": [p.key for p in self.candidates],
            "baseline_scheme": None if self.baseline_scheme is None else self.baseline_scheme.key,
            "incumbent": None if self.incumbent is None else self.incumbent.key,
            "best": None if self.best is None else self.best.key,
            "done": self.done,
            "generation_attempts": self.generation_attempts,
            "records": [r.to_dict() for r in self.records],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PatternSchemes:
        ps = cls(d["pattern"], [InsertionPoint.from_key(k) for k in d.get("candidates", [])])
        ps.records = [SchemeRecord.from_dict(r) for r in d.get("records", [])]
        ps.baseline_scheme = None if d.get("baseline_scheme") is None else InsertionScheme.from_keys(d["baseline_scheme"])
        ps.best = None if d.get("best") is None else InsertionScheme.from_keys(d["best"])
        ps.incumbent = None if d.get("incumbent") is None else InsertionScheme.from_keys(d["incumbent"])
        ps.done = bool(d.get("done", False))
        ps.generation_attempts = int(d.get("generation_attempts", 0))
        return ps
