"""A paired full-model step: a candidate model timed against its reference model in paired rounds
and judged on the holdout, with both models' content hashes. Subgraph mode's phase 3 records one per
change it tries (kept in ``autotune_cache.json``); the final guard reuses the steps that already
measured the models it compares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PairedStep:
    """One step: ``changes`` (subgraph mode: reuse key -> scheme) applied to the model of the steps
    kept before it, measured paired against that model, or ``known_from`` a rejected step whose
    candidate was this very model."""

    index: int
    pass_: int  # 0: the PTQ placement against the float model; 1, 2: the passes
    changes: dict[str, str]
    parent: int | None  # the step this one bisects
    children: list[int] = field(default_factory=list)
    measured: bool = False
    known_from: int | None = None
    outcome: str = ""  # kept | slower | neutral | over_budget | failed
    over_budget: bool = False
    ratio: float | None = None
    interval: list[float] | None = None
    rounds: int = 0
    reason: str = ""
    # a measured step's paired measurement (a known step has none of these)
    round_ratios: list[float] | None = None
    latency_ms: float | None = None
    reference_ms: float | None = None
    noise: float | None = None
    accuracy: dict[str, Any] | None = None
    reference_sha: str | None = None
    candidate_sha: str | None = None

    @property
    def kept(self) -> bool:
        return self.outcome == "kept"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index, "pass": self.pass_, "changes": self.changes,
                             "parent": self.parent, "children": list(self.children), "measured": self.measured,
                             "known_from": self.known_from, "outcome": self.outcome,
                             "over_budget": self.over_budget, "ratio": self.ratio, "interval": self.interval,
                             "rounds": self.rounds}
        if self.measured:
            d.update(round_ratios=self.round_ratios, latency_ms=self.latency_ms, reference_ms=self.reference_ms,
                     noise=self.noise, accuracy=self.accuracy, reference_sha=self.reference_sha,
                     candidate_sha=self.candidate_sha)
        d.update(reason=self.reason, kept=self.kept)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PairedStep:
        return cls(d["index"], d["pass"], dict(d["changes"]), d["parent"], list(d["children"]), d["measured"],
                   d.get("known_from"), d["outcome"], d.get("over_budget", False), d.get("ratio"),
                   d.get("interval"), d.get("rounds", 0), d.get("reason", ""), d.get("round_ratios"),
                   d.get("latency_ms"), d.get("reference_ms"), d.get("noise"), d.get("accuracy"),
                   d.get("reference_sha"), d.get("candidate_sha"))
