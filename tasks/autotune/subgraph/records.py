"""Subgraph mode's records and their file, ``autotune_cache.json``.

A ``GroupResult`` is one reuse key's phase-2 result, a ``PairedStep`` (tasks/autotune/paired_step.py)
one phase-3 full-model step. The cache keeps the document as it is on disk (a ``StateDocument``:
``groups`` and ``steps`` are its JSON tables, so a resumed run writes back exactly what it read) and
converts at the boundary: ``to_dict`` gives the very keys, in the very order, that the file has
always had.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.artifacts import atomic_write_json
from pipeline.errors import first_line
from tasks.autotune.paired_step import PairedStep
from tasks.autotune.region.scheme import InsertionScheme
from tasks.autotune.state_file import SUBGRAPH_CACHE, StateDocument, StateHeader

CACHE_VERSION = 2
# heuristic schemes, in the order they are listed (and win ties), and the group's form in the PTQ
# placement where it is none of them
SCHEMES = ("none", "preferred", "full", "weights_only", "activations_only", "ptq")
# a scheme must beat "none" on its subgraph by this much to be a candidate for the full model
MIN_LOCAL_GAIN = 0.03
# a phase-3 step is kept only if the full model gets faster by more than this (the sequential
# measurement's keep threshold), or, when its interval never clears the threshold, by more than the
# measurement's own noise (median absolute deviation of its per-round ratios) if that is larger
MIN_STEP_GAIN = 0.01
# the scheme name standing for "as the PTQ placement has it" (per region, from quantize's model)
PTQ = SCHEMES[-1]
# outcomes of a rejected step that are worth bisecting: something in it hurts
BISECT = ("slower", "over_budget", "failed")
PASSES = {0: "start", 1: "pass 1", 2: "pass 2"}


@dataclass
class GroupResult:
    """Phase 2's result for one reuse key (measured on its representative instance)."""

    instances: list[int]  # region ids of every group with this reuse key
    nodes: list[str]  # the representative's nodes, in pattern order
    fused_ops: list[str]
    pattern: str
    # scheme name -> ProfiledTiming.to_dict() and its "points" (or ok=False and the error)
    schemes: dict[str, dict[str, Any]]
    metric: str = "total"  # compute: the group's own layers decide; total: subgraph latency
    ptq_form: str = "preferred"  # the scheme that is the group's form in the PTQ placement
    subgraph: str = ""  # the extracted subgraph, relative to the autotune folder
    error: str | None = None
    ranked: list[str] = field(default_factory=list)  # schemes that beat "none" locally, best first
    winner: str = "none"
    local_gain: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"instances": self.instances, "nodes": self.nodes, "fused_ops": self.fused_ops,
                             "pattern": self.pattern, "schemes": self.schemes, "metric": self.metric,
                             "ptq_form": self.ptq_form, "subgraph": self.subgraph}
        if self.error is not None:
            d["error"] = self.error
        d.update(ranked=self.ranked, winner=self.winner, local_gain=self.local_gain)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GroupResult:
        return cls(list(d["instances"]), list(d["nodes"]), list(d["fused_ops"]), d["pattern"], d["schemes"],
                   d.get("metric", "total"), d.get("ptq_form", "preferred"), d.get("subgraph", ""), d.get("error"),
                   list(d["ranked"]), d["winner"], float(d["local_gain"]))

    def ratio(self, scheme: str) -> float | None:
        """``scheme``'s time over "none" by the group's metric (None: not measured)."""
        return self.schemes.get(scheme, {}).get("compute_ratio" if self.metric == "compute" else "total_ratio")

    def ms(self, scheme: str) -> float | None:
        return self.schemes.get(scheme, {}).get("compute_ms" if self.metric == "compute" else "total_ms")

    def ok(self, scheme: str) -> bool:
        return bool(self.schemes.get(scheme, {}).get("ok"))

    def ok_ratios(self) -> dict[str, float]:
        """Every scheme measured by the group's metric, and its ratio."""
        return {n: r for n in self.schemes if self.ok(n) and (r := self.ratio(n)) is not None}

    def points(self, scheme: str) -> InsertionScheme:
        return InsertionScheme.from_keys(self.schemes[scheme]["points"])


class SubgraphCache:
    """autotune_cache.json: phase-2 results per reuse key and the phase-3 steps, saved atomically."""

    def __init__(self, path: Path, model_sha: str, context: str | None):
        self.path = path
        self.document = StateDocument(StateHeader.of(CACHE_VERSION, model_sha, context, mode="subgraph"),
                                      {"groups": {}, "phase3": {"steps": []}})

    def load(self) -> bool:
        if not self.path.exists():
            return False
        try:
            doc = json.loads(self.path.read_text())
            phase3 = doc.get("phase3", {}) if isinstance(doc, dict) else None
            if not isinstance(doc, dict) or not isinstance(doc.get("groups"), dict) or \
                    not isinstance(phase3, dict) or not isinstance(phase3.get("steps"), list):
                raise ValueError("no 'groups' table or 'phase3' steps")
        except (ValueError, OSError) as exc:
            raise SUBGRAPH_CACHE.corrupt(self.path, first_line(exc)) from None
        self.document = StateDocument.resume(doc, self.path, SUBGRAPH_CACHE, self.document.header)
        return True

    @property
    def doc(self) -> dict[str, Any]:
        """The file's document, as written."""
        return self.document.to_dict()

    def save(self) -> None:
        self.document.body["measurements"] = self.measurements  # recorded for readers of the file
        atomic_write_json(self.path, self.doc, indent=1)

    @property
    def groups(self) -> dict[str, Any]:
        """The file's groups table (reuse key -> GroupResult.to_dict())."""
        return self.document.body["groups"]

    @property
    def steps(self) -> list[dict[str, Any]]:
        """The file's phase-3 steps (PairedStep.to_dict() each)."""
        return self.document.body["phase3"]["steps"]

    def group(self, key: str) -> GroupResult:
        return GroupResult.from_dict(self.groups[key])

    def put_group(self, key: str, result: GroupResult) -> None:
        self.groups[key] = result.to_dict()
        self.save()

    def step(self, index: int) -> PairedStep:
        return PairedStep.from_dict(self.steps[index])

    def step_records(self) -> list[PairedStep]:
        return [PairedStep.from_dict(d) for d in self.steps]

    def add_step(self, step: PairedStep, parent: PairedStep | None) -> None:
        """Record a new step (and its parent's new child) and save."""
        self.steps.append(step.to_dict())
        if parent is not None:
            parent.children.append(step.index)
            self.steps[parent.index]["children"] = list(parent.children)
        self.save()

    @property
    def measurements(self) -> int:
        """One per profiled group (phase 2) and one per measured validation step (phase 3)."""
        return len(self.groups) + sum(1 for st in self.steps if st["measured"])
