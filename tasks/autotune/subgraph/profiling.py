"""Subgraph mode, phases 1 and 2: the fusion groups as regions of one autotuner, grouped by reuse
key, and each key's heuristic schemes measured side by side on its extracted subgraph."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.artifacts import atomic_write_json
from pipeline.backends import Backend
from pipeline.errors import first_line
from pipeline.graph.index import weight_inputs
from pipeline.graph.model import WEIGHTED_OPS, save_model
from pipeline.quant.placement import too_small
from tasks.autotune.benchmark import ProfiledTiming, compare_profiled
from tasks.autotune.progress import OnProgress, Progress
from tasks.autotune.region.autotuner import QDQAutotunerBase
from tasks.autotune.region.insertion_points import InsertionPoint
from tasks.autotune.region.region import Region, RegionType
from tasks.autotune.region.scheme import InsertionScheme, rank_by_ratio
from tasks.autotune.subgraph.extractor import extract_subgraph, reuse_key, tensor_infos
from tasks.autotune.subgraph.fusion_grouping import FusionGroup
from tasks.autotune.subgraph.records import MIN_LOCAL_GAIN, PTQ, SCHEMES, GroupResult, SubgraphCache
from tasks.autotune.tune_setup import TuneSetup

log = logging.getLogger("tune.autotune")

PHASE2 = "phase 2: groups"


@dataclass
class GroupSet:
    """Phase 1 as the later phases see it: one autotuner whose LEAF regions are the fusion groups,
    and the groups with something to quantize by reuse key (instances in graph order)."""

    fusion_groups: list[FusionGroup]
    tuner: QDQAutotunerBase
    active: list[Region]
    by_key: dict[str, list[Region]]
    infos: dict[str, Any]  # boundary tensor -> shape/type, for extraction
    names: list[str]  # the model's node names

    @classmethod
    def build(cls, setup: TuneSetup, groups: list[FusionGroup], shapes: dict[str, list[int]] | None) -> GroupSet:
        model = setup.model
        # one autotuner over the fusion groups: its regions' boundaries are the extractor's, so a group
        # and its subgraph have the same pattern signature and the same pattern-relative points
        tuner = QDQAutotunerBase(model)
        regions = []
        for k, fg in enumerate(groups):
            ins, outs = tuner.index.boundaries(fg.region.nodes)
            regions.append(Region(k, RegionType.LEAF, 1, nodes=list(fg.region.nodes), inputs=ins, outputs=outs))
        tuner.initialize(setup.config, None, setup.calibration, regions=regions)
        active = [r for r in tuner.regions if r.id not in tuner.skipped_regions
                  and tuner.pattern_schemes[tuner.patterns[r.id].signature].candidates]
        infos = tensor_infos(model, sorted({t for r in active for t in (*r.inputs, *r.outputs)}), shapes)
        by_key: dict[str, list[Region]] = {}
        for r in active:
            key = reuse_key(tuner.patterns[r.id].signature, model, tuner.orders[r.id], infos, r.inputs)
            by_key.setdefault(key, []).append(r)
        log.info("subgraph mode: %d fusion groups, %d with something to quantize, %d distinct (measured once "
                 "each)", len(groups), len(active), len(by_key))
        return cls(groups, tuner, active, by_key, infos, [n.name for n in model.graph.node])

    def first_id(self, key: str) -> int:
        return self.by_key[key][0].id


def heuristic_schemes(tuner: QDQAutotunerBase, region: Region) -> dict[str, InsertionScheme]:
    """The phase-2 schemes of a group, as pattern-relative points (duplicates dropped, first name wins).

    preferred: the runtime's fused form (the placement's candidate points: DQ -> op -> Q for ORT,
    quantized inputs of weighted ops and residual Adds for TensorRT); full: every float input and
    output of every node of the group; weights_only: the weighted ops' weights alone;
    activations_only: the preferred form's activations (and those of weighted ops), weights float.
    """
    sig = tuner.patterns[region.id].signature
    order = tuner.orders[region.id]
    g, nodes = tuner.index, tuner.model.graph.node
    cands = tuner.pattern_schemes[sig].candidates
    placed = {p.index for p in cands}
    quant = "fp8" if tuner.config.default_quant_type == "fp8" else "int8"
    full: set[InsertionPoint] = set()
    acts: set[InsertionPoint] = set()
    weights: set[InsertionPoint] = set()
    for k, idx in enumerate(order):
        node = nodes[idx]
        weighted = node.op_type in WEIGHTED_OPS and bool(weight_inputs(g, node)) and \
            not too_small(g, node, "fp8_e4m3fn" if quant == "fp8" else "int8")
        d = tuner.dtypes_of(node.name)
        if d is None or d.activations == "native":
            continue
        core = k in placed or weighted
        for s, t in enumerate(node.input):
            if g.is_activation(t):
                full.add(InsertionPoint("node_input", k, s))
                if core:
                    acts.add(InsertionPoint("activation_input", k, s))
        if node.output and g.is_activation(node.output[0]):
            full.add(InsertionPoint("node_output", k))
            if core:
                acts.add(InsertionPoint("node_output", k))
        if weighted:
            weights.add(InsertionPoint("weight", k))
    out: dict[str, InsertionScheme] = {}
    seen: set[str] = set()
    for name, pts in (("none", set()), ("preferred", set(cands)), ("full", full), ("weights_only", weights),
                      ("activations_only", acts)):
        s = InsertionScheme(frozenset(pts))
        if s.key not in seen:
            seen.add(s.key)
            out[name] = s
    return out


def ranked_schemes(profile: dict[str, Any]) -> list[str]:
    """A profile's ({"schemes": ..., "metric": ...}) schemes that beat "none" locally by
    MIN_LOCAL_GAIN, best first; schemes within MIN_LOCAL_GAIN of the best count as tied and keep the
    SCHEMES order (the runtime's preferred form first)."""
    metric = "compute_ratio" if profile.get("metric") == "compute" else "total_ratio"
    good = {n: t[metric] for n, t in profile["schemes"].items()
            if n != "none" and t.get("ok") and t.get(metric) is not None and t[metric] < 1.0 - MIN_LOCAL_GAIN}
    return rank_by_ratio(good, good.__getitem__, SCHEMES.index, tie_band=MIN_LOCAL_GAIN)


def profile_groups(setup: TuneSetup, gs: GroupSet, cache: SubgraphCache,
                   ptq_regions: dict[int, InsertionScheme] | None, on_progress: OnProgress | None) -> None:
    """Phase 2: every reuse key not yet in ``cache`` measured on its subgraph and recorded."""
    todo = [k for k in gs.by_key if k not in cache.groups]
    backend = setup.backend.for_subgraphs() if todo else setup.backend
    if on_progress:
        on_progress(Progress(PHASE2, len(gs.by_key) - len(todo), len(gs.by_key)))
    for key in todo:
        instances = gs.by_key[key]
        # measured on the instance with the most nodes the rules quantize: one whose nodes the quantize
        # stage left float would measure schemes that do nothing for the other instances
        rep = max(instances, key=lambda r: sum(_quantizable(gs.tuner, gs.names[i]) for i in gs.tuner.orders[r.id]))
        rec = _profile_key(setup, gs, backend, rep, ptq_regions)
        rec.instances = [r.id for r in instances]
        cache.put_group(key, rec)
        atomic_write_json(setup.out / "logs" / f"group_{rep.id}.json", rec.to_dict(), indent=1)
        log.info("group %d (%s; %d instance%s): %s", rep.id, "+".join(rec.fused_ops) or rec.nodes[0],
                 len(instances), "" if len(instances) == 1 else "s",
                 f"{rec.winner} {rec.local_gain:.2f}x on its subgraph ({rec.metric} time)"
                 if rec.winner != "none" else "no scheme beats float on its subgraph")
        if on_progress:
            on_progress(Progress(PHASE2, len(gs.by_key) - len(todo) + todo.index(key) + 1, len(gs.by_key)))


def _profile_key(setup: TuneSetup, gs: GroupSet, backend: Backend, rep: Region,
                 ptq_regions: dict[int, InsertionScheme] | None) -> GroupResult:
    """The result of one reuse key, measured on its representative ``rep``."""
    tuner = gs.tuner
    schemes = heuristic_schemes(tuner, rep)
    ptq_form = "preferred"  # without quantize's model, the PTQ placement is every group's preferred form
    if ptq_regions is not None:
        mine = ptq_regions.get(rep.id, InsertionScheme())
        ptq_form = next((n for n, sc in schemes.items() if sc.key == mine.key), PTQ)
        if ptq_form == PTQ:
            schemes[PTQ] = mine
    rec = GroupResult([], [gs.names[i] for i in tuner.orders[rep.id]], list(gs.fusion_groups[rep.id].fused_ops),
                      tuner.patterns[rep.id].signature, {}, ptq_form=ptq_form,
                      subgraph=f"subgraphs/group_{rep.id}.onnx")
    sub, sub_region = extract_subgraph(tuner.index, rep.nodes, gs.infos, f"group_{rep.id}")
    save_model(sub, setup.out / rec.subgraph)
    sub_tuner = QDQAutotunerBase(sub)
    sub_tuner.initialize(setup.config, None, setup.calibration, regions=[sub_region])
    if sub_tuner.patterns[0].op_types != tuner.patterns[rep.id].op_types:
        profile: dict[str, Any] = {"schemes": {"none": {"ok": True, "points": "none"}}, "metric": "total",
                                   "error": "the extracted subgraph orders its nodes differently; left float"}
    else:
        runs = setup.runs
        profile = _profile_group(backend, sub_tuner, schemes, runs.warmup_runs, runs.timing_runs, runs.rounds)
    rec.schemes, rec.metric, rec.error = profile["schemes"], profile["metric"], profile.get("error")
    rec.ranked = ranked_schemes(profile)
    rec.winner = rec.ranked[0] if rec.ranked else "none"
    ratio = rec.ratio(rec.winner)
    rec.local_gain = (1.0 / ratio) if rec.winner != "none" and ratio else 1.0
    return rec


def _profile_group(backend: Backend, sub_tuner: QDQAutotunerBase, schemes: dict[str, InsertionScheme],
                   warmup_runs: int, timing_runs: int, rounds: int) -> dict[str, Any]:
    """Measure every scheme of one subgraph side by side (``none`` first, the reference)."""
    with tempfile.TemporaryDirectory(prefix="qdq-tune-subgraph-") as tmp:
        paths, built, results = [], [], {}
        for name, scheme in schemes.items():
            try:
                m = sub_tuner.export_model(assignment={0: scheme}, check=False)
            except Exception as exc:  # noqa: BLE001 - an unbuildable scheme is a failed measurement
                results[name] = {"ok": False, "error": f"export failed: {first_line(exc)}", "points": scheme.key}
                continue
            p = Path(tmp) / f"{name}.onnx"
            save_model(m, p, share_weights=True)
            paths.append(p)
            built.append(name)
        timings = compare_profiled(backend, paths, rounds, max(2, timing_runs // max(rounds, 1)), warmup_runs) \
            if paths else []
    for name, t in zip(built, timings, strict=True):
        results[name] = {**t.to_dict(), "points": schemes[name].key}
    if "none" not in built or not results["none"].get("ok"):
        base = results.get("none", {})
        return {"schemes": results, "metric": "total",
                "error": f"the float subgraph could not be measured: {base.get('error')}"}
    compute = all(ProfiledTiming.from_dict(results[n]).compute_ratio is not None
                  for n in built if results[n].get("ok"))
    return {"schemes": results, "metric": "compute" if compute else "total"}


def _quantizable(tuner: QDQAutotunerBase, node: str) -> bool:
    d = tuner.dtypes_of(node)
    return d is not None and d.activations != "native"
