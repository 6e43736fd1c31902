"""Subgraph mode's driver: phase 1's groups in, phases 2 and 3 run over the shared ``TuneSetup``,
a ``SubgraphResult`` out (see the package docstring for the phases)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pipeline.graph.model import load_model, model_hash, recorded_shapes, save_model
from tasks.autotune.paired_step import PairedStep
from tasks.autotune.progress import OnProgress
from tasks.autotune.region.autotuner import QDQAutotunerBase
from tasks.autotune.region.scheme import InsertionScheme
from tasks.autotune.state_file import SUBGRAPH_CACHE, resume_or_set_aside
from tasks.autotune.subgraph.fusion_grouping import FusionGroup
from tasks.autotune.subgraph.profiling import GroupSet, profile_groups
from tasks.autotune.subgraph.records import SubgraphCache
from tasks.autotune.subgraph.report import group_rows, step_rows
from tasks.autotune.subgraph.validation import Assignments, validate
from tasks.autotune.tune_setup import TuneSetup

log = logging.getLogger("tune.autotune")


@dataclass
class SubgraphResult:
    """What the workflow hands back to the stage."""

    tuner: QDQAutotunerBase
    groups: int  # fusion groups with something to quantize
    keys: int  # distinct groups measured in phase 2
    assignment: dict[int, InsertionScheme]  # validated (or raw) region id -> scheme
    raw_assignment: dict[int, InsertionScheme]
    measurements: int  # phase-2 subgraph comparisons + phase-3 full-model measurements
    full_model_measurements: int  # phase-3 steps measured (steps known from their parent excluded)
    report: list[dict[str, Any]] = field(default_factory=list)
    tuned: bytes | None = None  # the tuned model, byte for byte the one phase 3 measured
    # every phase-3 step; the kept ones chain paired measurements from the float model to ``tuned``
    steps: list[PairedStep] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)  # full-model steps per phase, and why
    step_report: list[dict[str, Any]] = field(default_factory=list)  # one row per phase-3 step


def subgraph_autotuning_workflow(setup: TuneSetup, groups: list[FusionGroup], context: str | None,
                                 incremental_validation: bool = True,
                                 on_progress: OnProgress | None = None) -> SubgraphResult:
    """Phases 2 and 3 over ``groups`` (phase 1's) of ``setup.model``; speedups are against
    ``setup.baseline_path``, and quantize's model is phase 3's start when it pays. ``context``
    fingerprints what the cache must have been made with to be resumed."""
    out = setup.out
    for sub in ("logs", "subgraphs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    gs = GroupSet.build(setup, groups, {**setup.backend.opt_shapes(), **recorded_shapes(setup.model)})
    cache = SubgraphCache(out / "autotune_cache.json", model_hash(setup.model), context)
    if resume_or_set_aside(cache.load, cache.path, SUBGRAPH_CACHE, own=True):
        log.info("resuming from %s: %d/%d groups profiled, %d validation steps done", cache.path,
                 sum(k in cache.groups for k in gs.by_key), len(gs.by_key), len(cache.steps))
    # the PTQ placement region by region (quantize's model as the groups' points express it): phase 2
    # measures each group's PTQ form too, and phase 3 may start from it
    ptq = gs.tuner.baseline_assignment(load_model(setup.ptq_model)) if setup.ptq_model is not None else None
    profile_groups(setup, gs, cache, ptq, on_progress)
    results = {k: cache.group(k) for k in gs.by_key}
    assign = Assignments(gs, results, ptq)
    raw = {k: rec.winner for k, rec in results.items() if rec.winner != "none"}
    raw_assignment = assign(raw)
    save_model(gs.tuner.export_model(assignment=raw_assignment), out / "optimized_raw.onnx")

    chosen: dict[str, str] = {}
    tuned: bytes | None = None
    phases: list[dict[str, Any]] = []
    if incremental_validation and gs.by_key:
        chosen, tuned, phases = validate(setup, gs, results, assign, cache, on_progress)
    elif raw:
        chosen = dict(raw)
    steps = cache.step_records()
    measured = sum(1 for st in steps if st.measured)
    return SubgraphResult(gs.tuner, len(gs.active), len(gs.by_key), assign(chosen), raw_assignment,
                          cache.measurements, measured, group_rows(gs, results, steps, chosen, incremental_validation),
                          tuned, steps, phases, step_rows(gs, steps))
