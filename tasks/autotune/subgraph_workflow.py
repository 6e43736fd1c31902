"""Subgraph mode: tune Q/DQ per fusion group on extracted subgraphs, then validate on the full model.

Phase 1 (fusion_grouping): the runtime's own fusion groups become LEAF regions of one
QDQAutotunerBase, so schemes, insertion and calibrated scales are region mode's.

Phase 2: groups with the same structure, boundary shapes and weight shapes share a reuse key and are
measured once, on a standalone subgraph (``subgraphs/``). Each gets the heuristic schemes (no Q/DQ,
full Q/DQ, weights only, activations only, the runtime's preferred fused form), measured side by
side in interleaved rounds, compared by the time of the group's own compute layers where the
runtime profiles layers (ORT's profiler, trtexec --exportProfile; edge reformats/transposes and the
Q of an input or DQ of an output left out), else by total subgraph latency.

Phase 3: ``optimized_raw.onnx`` applies every group's local winner. Incremental validation starts
from the float model and applies winners one reuse key at a time (largest expected gain first),
each in a paired measurement against the current model on the held-out accuracy budget: a step is
kept only if it meets the budget and is faster by more than the measurement's noise. A step over
the budget falls back to the group's next locally faster scheme (accuracy verdicts are
deterministic, so a resumed run takes the same path).

``autotune_cache.json`` holds every phase-2 result and phase-3 step, written atomically after each
measurement: a killed run resumes where it stopped without measuring anything twice.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from pipeline.artifacts import atomic_write_json
from pipeline.backends import Backend
from pipeline.errors import first_line
from pipeline.graph import model_hash, save_model
from pipeline.placement import WEIGHTED_OPS, too_small, weight_inputs
from pipeline.qdq import Calibration
from tasks.autotune.autotuner import Config, QDQAutotunerBase
from tasks.autotune.benchmark import PairedBenchmark, ProfiledTiming, compare_profiled
from tasks.autotune.fusion_grouping import FusionGroup
from tasks.autotune.insertion_points import InsertionPoint
from tasks.autotune.region import Region, RegionType
from tasks.autotune.scheme import InsertionScheme, Measurement
from tasks.autotune.state_file import SUBGRAPH_CACHE, check_state
from tasks.autotune.subgraph_extractor import extract_subgraph, reuse_key, tensor_infos

log = logging.getLogger("tune.autotune")

CACHE_VERSION = 1
# heuristic schemes, in the order they are listed (and win ties)
SCHEMES = ("none", "preferred", "full", "weights_only", "activations_only")
# a scheme must beat "none" on its subgraph by this much to be a candidate for the full model
MIN_LOCAL_GAIN = 0.03
# a phase-3 step is kept only if the full model gets faster by more than this, or by more than the
# measurement's own noise (median absolute deviation of its per-round ratios) if that is larger
MIN_STEP_GAIN = 0.01


@dataclass
class SubgraphResult:
    """What the workflow hands back to the stage."""

    tuner: QDQAutotunerBase
    groups: int  # fusion groups with something to quantize
    keys: int  # distinct groups measured in phase 2
    assignment: dict[int, InsertionScheme]  # validated (or raw) region id -> scheme
    raw_assignment: dict[int, InsertionScheme]
    measurements: int  # phase-2 subgraph comparisons + phase-3 full-model measurements
    full_model_measurements: int  # phase-3 steps
    report: list[dict[str, Any]] = field(default_factory=list)


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


class SubgraphCache:
    """autotune_cache.json: phase-2 results per reuse key and the phase-3 steps, saved atomically."""

    def __init__(self, path: Path, model_sha: str, context: str | None):
        self.path = path
        self.doc: dict[str, Any] = {"version": CACHE_VERSION, "mode": "subgraph", "model_sha256": model_sha,
                                    "context": context, "groups": {}, "phase3": {"steps": []}}

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
        check_state(doc, self.path, SUBGRAPH_CACHE, version=CACHE_VERSION, model_sha=self.doc["model_sha256"],
                    context=self.doc["context"])
        self.doc = doc
        return True

    def save(self) -> None:
        self.doc["measurements"] = self.measurements  # recorded for readers of the file
        atomic_write_json(self.path, self.doc, indent=1)

    @property
    def groups(self) -> dict[str, Any]:
        return self.doc["groups"]

    @property
    def steps(self) -> list[dict[str, Any]]:
        return self.doc["phase3"]["steps"]

    @property
    def measurements(self) -> int:
        """One per profiled group (phase 2) and one per validation step (phase 3)."""
        return len(self.groups) + len(self.steps)


def _ranked(rec: dict[str, Any]) -> list[str]:
    """A group's schemes that beat "none" locally by MIN_LOCAL_GAIN, best first; schemes within
    MIN_LOCAL_GAIN of the best count as tied and keep the SCHEMES order (the runtime's preferred
    form first)."""
    metric = "compute_ratio" if rec.get("metric") == "compute" else "total_ratio"
    good = {n: t[metric] for n, t in rec["schemes"].items()
            if n != "none" and t.get("ok") and t.get(metric) is not None and t[metric] < 1.0 - MIN_LOCAL_GAIN}
    if not good:
        return []
    tie = min(good.values()) * (1.0 + MIN_LOCAL_GAIN)

    def rank(n: str) -> tuple[float, int]:
        return (0.0 if good[n] <= tie else good[n]), SCHEMES.index(n)

    return sorted(good, key=rank)


def subgraph_autotuning_workflow(
    model: onnx.ModelProto,
    output_dir: Path,
    backend: Backend,
    groups: list[FusionGroup],
    config: Config,
    calibration: Calibration,
    warmup_runs: int,
    timing_runs: int,
    rounds: int,
    accuracy: Callable[[Any], Any] | None,
    shapes: dict[str, list[int]] | None = None,
    incremental_validation: bool = True,
    context: str | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> SubgraphResult:
    out = Path(output_dir)
    logs, subgraphs = out / "logs", out / "subgraphs"
    logs.mkdir(parents=True, exist_ok=True)
    subgraphs.mkdir(parents=True, exist_ok=True)

    # one autotuner over the fusion groups: its regions' boundaries are the extractor's, so a group
    # and its subgraph have the same pattern signature and the same pattern-relative points
    tuner = QDQAutotunerBase(model)
    regions = []
    for k, fg in enumerate(groups):
        ins, outs = tuner.index.boundaries(fg.region.nodes)
        regions.append(Region(k, RegionType.LEAF, 1, nodes=list(fg.region.nodes), inputs=ins, outputs=outs))
    tuner.initialize(config, None, calibration, regions=regions)
    active = [r for r in tuner.regions if r.id not in tuner.skipped_regions
              and tuner.pattern_schemes[tuner.patterns[r.id].signature].candidates]
    infos = tensor_infos(model, sorted({t for r in active for t in (*r.inputs, *r.outputs)}), shapes)
    by_key: dict[str, list[Region]] = {}
    for r in active:
        key = reuse_key(tuner.patterns[r.id].signature, model, tuner.orders[r.id], infos, r.inputs)
        by_key.setdefault(key, []).append(r)
    log.info("subgraph mode: %d fusion groups, %d with something to quantize, %d distinct (measured once each)",
             len(groups), len(active), len(by_key))

    cache = SubgraphCache(out / "autotune_cache.json", model_hash(model), context)
    if cache.load():
        log.info("resuming from %s: %d/%d groups profiled, %d validation steps done", cache.path,
                 sum(k in cache.groups for k in by_key), len(by_key), len(cache.steps))
    names = [n.name for n in model.graph.node]

    # ---------------------------------------------------------------- phase 2
    todo = [k for k in by_key if k not in cache.groups]
    sub_backend = backend.for_subgraphs() if todo else backend
    if on_progress:
        on_progress("phase 2: groups", len(by_key) - len(todo), len(by_key))
    for key in todo:
        rep = by_key[key][0]
        schemes = heuristic_schemes(tuner, rep)
        rec: dict[str, Any] = {
            "instances": [r.id for r in by_key[key]], "nodes": [names[i] for i in tuner.orders[rep.id]],
            "fused_ops": list(groups[rep.id].fused_ops), "pattern": tuner.patterns[rep.id].signature,
            "schemes": {}, "metric": "total",
        }
        sub, sub_region = extract_subgraph(tuner.index, rep.nodes, infos, f"group_{rep.id}")
        rec["subgraph"] = f"subgraphs/group_{rep.id}.onnx"
        save_model(sub, out / rec["subgraph"])
        sub_tuner = QDQAutotunerBase(sub)
        sub_tuner.initialize(config, None, calibration, regions=[sub_region])
        if sub_tuner.patterns[0].op_types != tuner.patterns[rep.id].op_types:
            rec["schemes"] = {"none": {"ok": True, "points": "none"}}
            rec["error"] = "the extracted subgraph orders its nodes differently; left float"
        else:
            rec.update(_profile_group(sub_backend, sub_tuner, schemes, warmup_runs, timing_runs, rounds))
        rec["ranked"] = _ranked(rec)
        rec["winner"] = rec["ranked"][0] if rec["ranked"] else "none"
        w = rec["schemes"].get(rec["winner"], {})
        ratio = w.get("compute_ratio" if rec["metric"] == "compute" else "total_ratio")
        rec["local_gain"] = (1.0 / ratio) if rec["winner"] != "none" and ratio else 1.0
        cache.groups[key] = rec
        cache.save()
        atomic_write_json(logs / f"group_{rep.id}.json", rec, indent=1)
        log.info("group %d (%s; %d instance%s): %s", rep.id, "+".join(rec["fused_ops"]) or rec["nodes"][0],
                 len(by_key[key]), "" if len(by_key[key]) == 1 else "s",
                 f"{rec['winner']} {rec['local_gain']:.2f}x on its subgraph ({rec['metric']} time)"
                 if rec["winner"] != "none" else "no scheme beats float on its subgraph")
        if on_progress:
            on_progress("phase 2: groups", len(by_key) - len(todo) + todo.index(key) + 1, len(by_key))

    def scheme_of(key: str, name: str) -> InsertionScheme:
        return InsertionScheme.from_keys(cache.groups[key]["schemes"][name]["points"])

    def assign(chosen: dict[str, str]) -> dict[int, InsertionScheme]:
        return {r.id: scheme_of(k, n) for k, n in chosen.items() for r in by_key[k]}

    raw = {k: cache.groups[k]["winner"] for k in by_key if cache.groups[k]["winner"] != "none"}
    raw_assignment = assign(raw)
    save_model(tuner.export_model(assignment=raw_assignment), out / "optimized_raw.onnx")

    # ---------------------------------------------------------------- phase 3
    def gain(k: str) -> float:
        rec = cache.groups[k]
        metric = "compute_ms" if rec["metric"] == "compute" else "total_ms"
        base, win = rec["schemes"]["none"].get(metric), rec["schemes"][rec["winner"]].get(metric)
        return (base - win) * len(rec["instances"]) if base is not None and win is not None else 0.0

    order = sorted(raw, key=lambda k: (-gain(k), k))
    chosen: dict[str, str] = {}
    if incremental_validation and order:
        chosen = _validate(cache, order, by_key, tuner, assign, backend, warmup_runs, timing_runs, rounds,
                           accuracy, out, logs, on_progress)
    elif order:
        chosen = dict(raw)
    assignment = assign(chosen)

    report = []
    for key, regions in sorted(by_key.items(), key=lambda kv: kv[1][0].id):
        rec = cache.groups[key]
        steps = [st for st in cache.steps if st["key"] == key]
        report.append({
            "group": regions[0].id, "instances": len(regions), "nodes": rec["nodes"], "fused_ops": rec["fused_ops"],
            "scheme": rec["winner"], "local_gain": rec["local_gain"], "metric": rec["metric"],
            "validation": ("kept" if key in chosen else "rejected" if steps else
                           "not validated" if rec["winner"] != "none" and not incremental_validation else "-"),
            "kept_scheme": chosen.get(key), "full_model_ratio": steps[-1]["ratio"] if steps else None,
            "reason": steps[-1]["reason"] if steps else rec.get("error"),
        })
    return SubgraphResult(tuner, len(active), len(by_key), assignment, raw_assignment,
                          cache.measurements, len(cache.steps), report)


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
            save_model(m, p)
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


def _attempts(cache: SubgraphCache, order: list[str], keys: list[str]) -> list[tuple[int, str, list[str]]]:
    """Pass 1: the local winners, largest expected gain first, each with its next locally faster
    schemes as fallbacks for a step over the accuracy budget. Pass 2, in context: every group not
    kept, in graph order, once more with its winner (or, with no local winner, its preferred form):
    a data-movement group or a lone conversion only pays once its neighbours are quantized."""
    first = [(1, k, list(cache.groups[k]["ranked"])) for k in order]
    second = []
    for k in keys:
        rec = cache.groups[k]
        ranked = rec["ranked"]
        pick = ranked[0] if ranked else ("preferred" if rec["schemes"].get("preferred", {}).get("ok") else None)
        if pick is not None:
            second.append((2, k, [pick]))
    return first + second


def _validate(cache: SubgraphCache, order: list[str], by_key: dict[str, list[Region]], tuner: QDQAutotunerBase,
              assign: Callable[[dict[str, str]], dict[int, InsertionScheme]], backend: Backend, warmup_runs: int,
              timing_runs: int, rounds: int, accuracy: Callable[[Any], Any] | None, out: Path, logs: Path,
              on_progress: Callable[[str, int, int], None] | None) -> dict[str, str]:
    """Apply the groups' schemes one reuse key at a time, keeping each step that pays on the full model."""
    chosen: dict[str, str] = {}
    over_budget: set[str] = set()  # keys whose every pass-1 scheme missed the budget: not retried
    done = {(s.get("pass", 1), s["key"], s["scheme"]): s for s in cache.steps}
    current = out / "validation_current.onnx"
    bench: PairedBenchmark | None = None
    attempts = _attempts(cache, order, list(by_key))
    try:
        for n, (pass_, key, schemes) in enumerate(attempts):
            if on_progress:
                on_progress("phase 3: validation", n, len(attempts))
            if key in chosen or (pass_ == 2 and key in over_budget):
                continue
            for name in schemes:
                step = done.get((pass_, key, name))
                if step is None:
                    if bench is None:
                        save_model(tuner.export_model(assignment=assign(chosen)), current)
                        bench = PairedBenchmark(backend, current, warmup_runs, timing_runs, rounds, accuracy)
                    trial = {**chosen, key: name}
                    data = tuner.export_model(assignment=assign(trial), check=False).SerializeToString()
                    m = bench.measure(data, use_cache=False)
                    step = {**_step_record(key, name, m, len(cache.steps)), "pass": pass_}
                    cache.steps.append(step)
                    cache.save()
                    atomic_write_json(logs / f"validation_step_{step['index']}.json", step, indent=1)
                    log.info("validation pass %d, step %d: group %d %s -> %s", pass_, step["index"] + 1,
                             by_key[key][0].id, name, step["reason"])
                if step["kept"]:
                    chosen[key] = name
                    if bench is not None:
                        bench.close()
                        bench = None  # the next step is measured against the model with this one kept
                    break
                if not step["over_budget"]:
                    break  # slower on the full model: the group's other schemes are slower locally too
            else:
                if pass_ == 1:
                    over_budget.add(key)
        if on_progress:
            on_progress("phase 3: validation", len(attempts), len(attempts))
    finally:
        if bench is not None:
            bench.close()
        current.unlink(missing_ok=True)
    return chosen


def _step_record(key: str, scheme: str, m: Measurement, index: int) -> dict[str, Any]:
    margin = max(MIN_STEP_GAIN, m.noise)
    kept = m.ok and m.ratio < 1.0 - margin
    if m.over_budget:
        reason = f"rejected: {m.error}"
    elif not m.ok:
        reason = f"rejected: measurement failed ({m.error})"
    elif kept:
        reason = f"kept: full model {1.0 / m.ratio:.3f}x faster (noise margin {margin:.3f})"
    else:
        reason = f"rejected: full model {m.ratio:.3f}x of the current latency (needs < {1.0 - margin:.3f})"
    return {"index": index, "key": key, "scheme": scheme, "kept": kept, "over_budget": bool(m.over_budget),
            "ratio": m.ratio if m.ok else None, "latency_ms": m.latency_ms if m.ok else None,
            "reference_ms": m.reference_ms if m.ok else None, "noise": m.noise, "accuracy": m.accuracy,
            "reason": reason}

