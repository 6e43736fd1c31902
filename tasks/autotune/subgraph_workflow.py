"""Subgraph mode: tune Q/DQ per fusion group on extracted subgraphs, then validate on the full model.

Phase 1 (fusion_grouping): the runtime's own fusion groups become LEAF regions of one
QDQAutotunerBase, so schemes, insertion and calibrated scales are region mode's.

Phase 2: groups with the same structure, boundary shapes and weight shapes share a reuse key and are
measured once, on a standalone subgraph (``subgraphs/``), on the instance with the most nodes the
rules quantize. Each gets the heuristic schemes (no Q/DQ, full Q/DQ, weights only, activations only,
the runtime's preferred fused form) and its form in the PTQ placement where that is none of them,
measured side by side in interleaved rounds, compared by the time of the group's own compute layers where the
runtime profiles layers (ORT's profiler, trtexec --exportProfile; edge reformats/transposes and the
Q of an input or DQ of an output left out), else by total subgraph latency.

Phase 3: ``optimized_raw.onnx`` applies every group's local winner. Incremental validation measures
full-model steps, each a paired measurement of a candidate against the current model on the
held-out accuracy budget, sequential (it ends once the ratio is clearly above or below the keep
threshold), kept only if it meets the budget and is faster by more than its noise:

- start: the PTQ placement (quantize's model; without one, every group in its preferred form)
  against the float model. Within budget and faster, phase 3 starts from it and pass 1 tests only
  the groups whose local result says they should change (a scheme, float included, beat the group's
  PTQ form on its subgraph); else from the float model, and pass 1 tests every local winner.
- pass 1 applies its groups in ONE step (largest expected gain first). A step that is rejected
  because it is slower or over the budget is bisected (group testing: k bad groups among n cost
  O(k log n) steps, not n): the first half is tested, and if all of it is kept, the second half's
  step is the parent's very model, so its verdict is known without measuring. A single group over
  the budget falls back to its next locally faster scheme (accuracy verdicts are deterministic).
  A step that is neither faster nor slower is rejected whole: its groups do not pay together.
- pass 2 retries the same way, in graph order: from the float model, every group not kept (without
  a local winner: its preferred form), since a data-movement group or a lone conversion only pays
  once its neighbours are quantized; from the PTQ placement, what pass 1 rejected, if it kept
  anything (else the same steps would measure the same models).

``autotune_cache.json`` holds every phase-2 result and phase-3 step (a bisected step lists its
children, a known one the step it is known from), written atomically after each: a killed run
replays the recorded steps and resumes where it stopped without measuring anything twice. The kept
steps form a chain of paired measurements from the float model to the tuned one (each step names
its two models by content hash), which the final guard reuses instead of measuring again.
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

from pipeline.artifacts import atomic_write_bytes, atomic_write_json
from pipeline.backends import Backend
from pipeline.calibration import Calibration
from pipeline.errors import StateError, first_line
from pipeline.graph import WEIGHTED_OPS, load_model, model_hash, save_model
from pipeline.graph_index import weight_inputs
from pipeline.placement import too_small
from tasks.autotune.autotuner import Config, QDQAutotunerBase
from tasks.autotune.benchmark import PairedBenchmark, ProfiledTiming, compare_profiled, ratio_interval
from tasks.autotune.fusion_grouping import FusionGroup
from tasks.autotune.insertion_points import InsertionPoint
from tasks.autotune.region import Region, RegionType
from tasks.autotune.scheme import InsertionScheme, Measurement
from tasks.autotune.state_file import SUBGRAPH_CACHE, check_state, resume_or_set_aside
from tasks.autotune.subgraph_extractor import extract_subgraph, reuse_key, tensor_infos

log = logging.getLogger("tune.autotune")

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
    steps: list[dict[str, Any]] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)  # full-model steps per phase, and why
    step_report: list[dict[str, Any]] = field(default_factory=list)  # one row per phase-3 step


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
        """One per profiled group (phase 2) and one per measured validation step (phase 3)."""
        return len(self.groups) + sum(1 for st in self.steps if st["measured"])


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
    float_model: Path | None = None,
    ptq_model: Path | None = None,
) -> SubgraphResult:
    """Phases 2 and 3 over ``groups`` (phase 1's); ``float_model`` is the model speedups are against
    (default: ``model`` itself), ``ptq_model`` quantize's model, phase 3's start when it pays."""
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
    if resume_or_set_aside(cache.load, cache.path, SUBGRAPH_CACHE, own=True):
        log.info("resuming from %s: %d/%d groups profiled, %d validation steps done", cache.path,
                 sum(k in cache.groups for k in by_key), len(by_key), len(cache.steps))
    names = [n.name for n in model.graph.node]

    # the PTQ placement region by region (quantize's model as the groups' points express it): phase 2
    # measures each group's PTQ form too, and phase 3 may start from it
    ptq_regions = tuner.baseline_assignment(load_model(ptq_model)) if ptq_model is not None else None

    # ---------------------------------------------------------------- phase 2
    todo = [k for k in by_key if k not in cache.groups]
    sub_backend = backend.for_subgraphs() if todo else backend
    if on_progress:
        on_progress("phase 2: groups", len(by_key) - len(todo), len(by_key))
    for key in todo:
        # measured on the instance with the most nodes the rules quantize: one whose nodes the quantize
        # stage left float would measure schemes that do nothing for the other instances
        rep = max(by_key[key], key=lambda r: sum(_quantizable(tuner, names[i]) for i in tuner.orders[r.id]))
        schemes = heuristic_schemes(tuner, rep)
        ptq_form = "preferred"  # without quantize's model, the PTQ placement is every group's preferred form
        if ptq_regions is not None:
            mine = ptq_regions.get(rep.id, InsertionScheme())
            ptq_form = next((n for n, sc in schemes.items() if sc.key == mine.key), PTQ)
            if ptq_form == PTQ:
                schemes[PTQ] = mine
        rec: dict[str, Any] = {
            "instances": [r.id for r in by_key[key]], "nodes": [names[i] for i in tuner.orders[rep.id]],
            "fused_ops": list(groups[rep.id].fused_ops), "pattern": tuner.patterns[rep.id].signature,
            "schemes": {}, "metric": "total", "ptq_form": ptq_form,
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

    if ptq_regions is None:
        ptq_regions = {r.id: scheme_of(k, "preferred") for k, rs in by_key.items() for r in rs
                       if cache.groups[k]["schemes"].get("preferred", {}).get("ok")}

    def assign(chosen: dict[str, str]) -> dict[int, InsertionScheme]:
        out: dict[int, InsertionScheme] = {}
        for k, n in chosen.items():
            for r in by_key[k]:
                s = ptq_regions.get(r.id) if n == PTQ else scheme_of(k, n)
                if s is not None and len(s):
                    out[r.id] = s
        return out

    raw = {k: cache.groups[k]["winner"] for k in by_key if cache.groups[k]["winner"] != "none"}
    raw_assignment = assign(raw)
    save_model(tuner.export_model(assignment=raw_assignment), out / "optimized_raw.onnx")

    # ---------------------------------------------------------------- phase 3
    def gain(k: str, scheme: str, current: str = "none") -> float:
        """Expected saving (ms, all instances) of ``scheme`` over ``current`` on the group's subgraph."""
        rec = cache.groups[k]
        metric = "compute_ms" if rec["metric"] == "compute" else "total_ms"
        base, win = rec["schemes"].get(current, {}).get(metric), rec["schemes"].get(scheme, {}).get(metric)
        return (base - win) * len(rec["instances"]) if base is not None and win is not None else 0.0

    chosen: dict[str, str] = {}
    tuned: bytes | None = None
    phases: list[dict[str, Any]] = []
    if incremental_validation and by_key:
        models = _Models(tuner, assign, ptq_model, float_model)
        full = _FullModel(backend, warmup_runs, timing_runs, rounds, accuracy, out / "validation_current.onnx")
        phase = _Phase3(cache, lambda a, b: full.measure(models.data(a), models.sha(a), models.data(b)), models.sha,
                        lambda st: _log_step(st, by_key, logs, on_progress))
        try:
            chosen, phases = _validate(phase, cache, by_key, models,
                                       {k: PTQ for k in by_key} if ptq_regions else {}, gain)
            tuned = models.data(chosen)
        finally:
            full.close()
        if on_progress:
            on_progress("phase 3: validation", len(cache.steps), len(cache.steps))
    elif raw:
        chosen = dict(raw)
    assignment = assign(chosen)

    report = []
    for key, regions in sorted(by_key.items(), key=lambda kv: kv[1][0].id):
        rec = cache.groups[key]
        steps = [st for st in cache.steps if st["pass"] > 0 and key in st["changes"]]
        measured = [st for st in steps if st["measured"]]
        state = chosen.get(key)
        kept = state is not None and state != PTQ and incremental_validation
        report.append({
            "group": regions[0].id, "instances": len(regions), "nodes": rec["nodes"], "fused_ops": rec["fused_ops"],
            "scheme": rec["winner"], "local_gain": rec["local_gain"], "metric": rec["metric"],
            "validation": ("kept" if kept else "rejected" if steps else "PTQ placement" if state == PTQ else
                           "not validated" if rec["winner"] != "none" and not incremental_validation else "-"),
            "kept_scheme": state if kept else None,
            "full_model_ratio": measured[-1]["ratio"] if measured else None,
            "step": steps[-1]["index"] if steps else None,
            "reason": _step_note(steps[-1]) if steps else rec.get("error"),
        })
    step_report = [{"step": st["index"], "phase": PASSES[st["pass"]], "parent": st["parent"],
                    "groups": "PTQ placement" if st["pass"] == 0 else
                    ", ".join(str(i) for i in sorted(by_key[k][0].id for k in st["changes"])),
                    "measured": st["measured"], "outcome": st["outcome"], "reason": st["reason"]}
                   for st in cache.steps]
    return SubgraphResult(tuner, len(active), len(by_key), assignment, raw_assignment,
                          cache.measurements, sum(1 for st in cache.steps if st["measured"]), report, tuned,
                          list(cache.steps), phases, step_report)


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


def _quantizable(tuner: QDQAutotunerBase, node: str) -> bool:
    d = tuner.dtypes_of(node)
    return d is not None and d.activations != "native"


def _plan_key(plan: Any) -> tuple:
    """What a plan changes in the model (its Q/DQ, weights and biases; not its notes)."""
    return tuple(plan.activations), tuple(plan.weights), tuple(plan.biases)


class _Models:
    """The model of each phase-3 state (reuse key -> scheme name, PTQ for the PTQ placement), as bytes.

    The empty state is the float model the speedups are against and the PTQ state is quantize's own
    model file, so the guard finds the very files it compares among the measured steps. (Where the
    groups' points cannot express all of quantize's placement, e.g. a Gemm too small to tune, only the
    start model has that part: the next step measures its loss along with the step's changes.)
    """

    def __init__(self, tuner: QDQAutotunerBase, assign: Callable[[dict[str, str]], dict[int, InsertionScheme]],
                 ptq_model: Path | None, float_model: Path | None):
        self.tuner, self.assign = tuner, assign
        self.ptq_model, self.float_model = ptq_model, float_model
        self._data: dict[frozenset, bytes] = {}
        self._shas: dict[frozenset, str] = {}
        self._plans: dict[frozenset, tuple] = {}

    def data(self, state: dict[str, str]) -> bytes:
        key = frozenset(state.items())
        if key not in self._data:
            if len(self._data) >= 3:  # the current model and a candidate or two: large models are large
                self._data.pop(next(iter(self._data)))
            self._data[key] = self._build(state)
        return self._data[key]

    def _build(self, state: dict[str, str]) -> bytes:
        if not state and self.float_model is not None:
            return Path(self.float_model).read_bytes()
        if state and self.ptq_model is not None and set(state.values()) == {PTQ}:
            return Path(self.ptq_model).read_bytes()
        return self.tuner.export_model(assignment=self.assign(state), check=False).SerializeToString()

    def sha(self, state: dict[str, str]) -> str:
        key = frozenset(state.items())
        if key not in self._shas:
            self._shas[key] = model_hash(self.data(state))
        return self._shas[key]

    def plan(self, state: dict[str, str]) -> tuple:
        key = frozenset(state.items())
        if key not in self._plans:
            self._plans[key] = _plan_key(self.tuner.build_plan(self.assign(state)))
        return self._plans[key]

    def changes(self, state: dict[str, str], key: str, scheme: str) -> bool:
        """Whether giving ``key`` ``scheme`` changes the model of ``state`` at all."""
        return self.plan({**state, key: scheme}) != self.plan(state)


class _FullModel:
    """Full-model paired measurements: the current model stays loaded as the live reference until a
    step changes it."""

    def __init__(self, backend: Backend, warmup_runs: int, timing_runs: int, rounds: int,
                 accuracy: Callable[[Any], Any] | None, path: Path):
        self.args = (warmup_runs, timing_runs, rounds, accuracy)
        self.backend, self.path = backend, path
        self.bench: PairedBenchmark | None = None
        self.reference: str | None = None

    def measure(self, reference: bytes, sha: str, candidate: bytes) -> Measurement:
        """``candidate`` paired with ``reference`` (whose content hash is ``sha``)."""
        if self.bench is None or self.reference != sha:
            self.close()
            atomic_write_bytes(self.path, reference)
            self.bench = PairedBenchmark(self.backend, self.path, *self.args)
            self.reference = sha
        return self.bench.measure(candidate, use_cache=False, stop_at=1.0 - MIN_STEP_GAIN)

    def close(self) -> None:
        if self.bench is not None:
            self.bench.close()
            self.bench = None
        self.path.unlink(missing_ok=True)


def _outcome(m: Measurement) -> tuple[str, str]:
    """(kept | slower | neutral | over_budget | failed, why) of one measured step."""
    if m.over_budget:
        return "over_budget", f"rejected: {m.error}"
    if not m.ok:
        return "failed", f"rejected: measurement failed ({m.error})"
    margin = max(MIN_STEP_GAIN, m.noise)
    low, high = ratio_interval(m.round_ratios)
    how = f"{len(m.round_ratios)} rounds, 95% interval {low:.3f}-{high:.3f}"
    if m.decided == "below" or (m.decided is None and m.ratio < 1.0 - margin):
        return "kept", f"kept: full model {1.0 / m.ratio:.3f}x faster ({how})"
    if m.ratio > 1.0 + margin:
        return "slower", f"rejected: full model {m.ratio:.3f}x of the current latency, slower ({how})"
    return "neutral", (f"rejected: full model {m.ratio:.3f}x of the current latency, no gain "
                       f"(needs < {1.0 - margin:.3f}; {how})")


class _Phase3:
    """The full-model steps of phase 3 and the group test over them.

    ``measure(before, after)`` pairs the model of state ``after`` with that of ``before`` (states map
    reuse keys to scheme names); ``sha(state)`` names a state's model. Steps already in the cache are
    replayed in order (each must be the step this run takes next), new ones are measured, recorded
    and saved one by one.
    """

    def __init__(self, cache: SubgraphCache, measure: Callable[[dict[str, str], dict[str, str]], Measurement],
                 sha: Callable[[dict[str, str]], str], on_step: Callable[[dict[str, Any]], None] | None = None,
                 fallback: Callable[[str, str], str | None] | None = None):
        self.cache, self.measure, self.sha, self.on_step = cache, measure, sha, on_step
        # a group's next scheme to try after ``scheme`` missed the budget alone (None: none left)
        self.fallback = fallback or (lambda key, scheme: None)
        self.chosen: dict[str, str] = {}
        self.over_budget: set[str] = set()  # keys whose every scheme tried alone missed the budget
        self._next = 0  # replay cursor

    @property
    def steps(self) -> list[dict[str, Any]]:
        return self.cache.steps

    def step(self, pass_: int, changes: dict[str, str], parent: dict[str, Any] | None = None,
             known: dict[str, Any] | None = None) -> dict[str, Any]:
        """Apply ``changes`` to the current model in one step (``known``: a rejected step whose candidate
        is this very model, so this one is rejected alike without measuring)."""
        where = parent["index"] if parent is not None else None
        if self._next < len(self.steps):
            rec = self.steps[self._next]
            if (rec.get("pass"), rec.get("changes"), rec.get("parent")) != (pass_, changes, where):
                raise StateError(f"autotune cache {self.cache.path}: its phase-3 step {self._next} is not the step "
                                 f"this run takes next (made by another qdq-tune?); delete it to tune afresh")
        else:
            rec = {"index": len(self.steps), "pass": pass_, "changes": changes, "parent": where, "children": []}
            if known is not None:
                source = self.steps[known["index"] if known["known_from"] is None else known["known_from"]]
                rec.update(measured=False, known_from=source["index"], outcome=source["outcome"],
                           over_budget=source["over_budget"], ratio=None, interval=None, rounds=0,
                           reason=f"{source['reason']} (the same model as step {source['index']}: not measured)")
            else:
                before, after = dict(self.chosen), {**self.chosen, **changes}
                m = self.measure(before, after)
                outcome, reason = _outcome(m)
                rec.update(measured=True, known_from=None, outcome=outcome, over_budget=m.over_budget,
                           ratio=m.ratio if m.ok else None,
                           interval=list(ratio_interval(m.round_ratios)) if m.ok else None,
                           rounds=len(m.round_ratios), round_ratios=list(m.round_ratios),
                           latency_ms=m.latency_ms if m.ok else None,
                           reference_ms=m.reference_ms if m.ok else None, noise=m.noise, accuracy=m.accuracy,
                           reference_sha=self.sha(before), candidate_sha=self.sha(after), reason=reason)
            rec["kept"] = rec["outcome"] == "kept"
            self.steps.append(rec)
            if parent is not None:
                parent["children"].append(rec["index"])
            self.cache.save()
            if self.on_step is not None:
                self.on_step(rec)
        self._next += 1
        if rec["kept"]:
            self.chosen.update(changes)
        return rec

    def test(self, items: list[tuple[str, str]], pass_: int, parent: dict[str, Any] | None = None,
             known: dict[str, Any] | None = None) -> dict[str, str]:
        """Group test of ``items`` (key, scheme): all in one step; a step rejected as slower, over the
        budget or failed is split in halves, and when the first half is kept whole, the second
        half's step is its parent's model again (known, not measured). A single group over the
        budget falls back to ``fallback(key, scheme)``. Returns the items kept."""
        step = self.step(pass_, dict(items), parent, known)
        if step["kept"]:
            return dict(items)
        kept: dict[str, str] = {}
        if len(items) > 1 and step["outcome"] in BISECT:
            half = (len(items) + 1) // 2
            first = self.test(items[:half], pass_, step)
            kept.update(first)
            kept.update(self.test(items[half:], pass_, step, step if first == dict(items[:half]) else None))
        elif len(items) == 1 and step["outcome"] == "over_budget":
            key, scheme = items[0]
            nxt = self.fallback(key, scheme)
            if nxt is None:
                self.over_budget.add(key)
            else:
                kept.update(self.test([(key, nxt)], pass_, step))
        return kept


def _validate(phase: _Phase3, cache: SubgraphCache, by_key: dict[str, list[Region]], models: _Models,
              ptq_state: dict[str, str], gain: Callable[..., float]) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Start, pass 1 and pass 2 (see the module docstring); the chosen state and the phase summary."""
    groups = cache.groups
    alternatives: dict[str, list[str]] = {}  # per key, the schemes pass 1 may try, best first

    def fallback(key: str, scheme: str) -> str | None:
        later = alternatives.get(key, [])
        later = later[later.index(scheme) + 1:] if scheme in later else []
        return next((n for n in later if models.changes(phase.chosen, key, n)), None)

    phase.fallback = fallback
    if ptq_state:
        phase.step(0, ptq_state)
    start = "ptq" if ptq_state and phase.chosen == ptq_state else "float"

    items1 = []
    if start == "ptq":
        # only the groups whose local result says they should change: a scheme (float included) beat
        # the group's PTQ form on its subgraph
        for k in by_key:
            rec = groups[k]
            metric = "compute_ratio" if rec["metric"] == "compute" else "total_ratio"
            ratios = {n: t[metric] for n, t in rec["schemes"].items() if t.get("ok") and t.get(metric) is not None}
            base = ratios.get(rec.get("ptq_form", "preferred"))
            if base is None:
                continue
            better = sorted((n for n in ratios if ratios[n] < base * (1.0 - MIN_LOCAL_GAIN)),
                            key=lambda n: (ratios[n], SCHEMES.index(n)))
            alternatives[k] = better
            target = next((n for n in better if models.changes(phase.chosen, k, n)), None)
            if target is not None:
                items1.append((k, target))
        items1.sort(key=lambda kv: (-gain(kv[0], kv[1], groups[kv[0]].get("ptq_form", "preferred")), kv[0]))
    else:
        alternatives = {k: list(groups[k]["ranked"]) for k in by_key}
        items1 = sorted(((k, groups[k]["winner"]) for k in by_key if groups[k]["winner"] != "none"),
                        key=lambda kv: (-gain(kv[0], kv[1]), kv[0]))
    kept1 = phase.test(items1, 1) if items1 else {}

    items2 = []
    if start == "ptq":
        # in context: what pass 1 rejected, once something else was kept
        items2 = [(k, n) for k, n in items1 if kept1 and k not in kept1 and k not in phase.over_budget
                  and models.changes(phase.chosen, k, n)]
        items2.sort(key=lambda kv: by_key[kv[0]][0].id)
    else:
        for k in sorted(by_key, key=lambda k: by_key[k][0].id):
            rec = groups[k]
            pick = rec["ranked"][0] if rec["ranked"] else (
                "preferred" if rec["schemes"].get("preferred", {}).get("ok") else None)
            if k in kept1 or k in phase.over_budget or pick is None or not models.changes(phase.chosen, k, pick):
                continue
            if not kept1 and (k, pick) in items1:
                continue  # pass 1 changed nothing: the same step would measure the same models
            items2.append((k, pick))
    if items2:
        phase.test(items2, 2)
    idle = None if items2 else (
        "pass 1 kept nothing: the same steps would measure the same models" if start == "ptq" and not kept1
        else "nothing left to retry")
    return phase.chosen, _phases(phase.steps, start, len(items1), len(items2), idle)


def _phases(steps: list[dict[str, Any]], start: str, n1: int, n2: int, idle: str | None) -> list[dict[str, Any]]:
    """Full-model steps per phase, and why they were taken (``idle``: why pass 2 had nothing to test)."""
    out = []
    for pass_, what in ((0, "the PTQ placement against the float model"),
                        (1, f"{n1} group{'s' if n1 != 1 else ''} "
                            + ("whose local result beats their PTQ form" if start == "ptq"
                               else "with a local winner")),
                        (2, f"{n2} group{'s' if n2 != 1 else ''} not kept, retried in context")):
        st = [s for s in steps if s["pass"] == pass_]
        measured = [s for s in st if s["measured"]]
        bisected = [s for s in st if s["children"] and len(s["changes"]) > 1]
        kept = sum(len(s["changes"]) for s in st if s["kept"]) if pass_ else None
        if pass_ == 0:
            why = (f"{what}: {st[0]['reason']}; phase 3 starts from "
                   f"{'it' if start == 'ptq' else 'the float model'}") if st else "no PTQ placement to start from"
        elif not st:
            why = idle if pass_ == 2 and idle else f"{what}: nothing to test"
        else:
            why = (f"{what}: {len(measured)} measured step{'s' if len(measured) != 1 else ''}"
                   + (f" ({len(bisected)} bisected" + (f", {len(st) - len(measured)} known from their parent"
                                                        if len(st) > len(measured) else "") + ")" if bisected else "")
                   + f"; {kept} group{'s' if kept != 1 else ''} kept")
        out.append({"phase": PASSES[pass_], "steps": len(measured), "known": len(st) - len(measured), "why": why})
    return out


def _step_note(step: dict[str, Any]) -> str:
    n = len(step["changes"])
    return f"step {step['index']}{f' ({n} groups together)' if n > 1 else ''}: {step['reason']}"


def _log_step(step: dict[str, Any], by_key: dict[str, list[Region]], logs: Path,
              on_progress: Callable[[str, int, int], None] | None) -> None:
    atomic_write_json(logs / f"validation_step_{step['index']}.json", step, indent=1)
    ids = sorted(by_key[k][0].id for k in step["changes"] if k in by_key)
    what = ("the PTQ placement" if step["pass"] == 0 else
            f"group{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids[:6]))}{' ...' if len(ids) > 6 else ''}"
            f" ({', '.join(sorted(set(step['changes'].values())))})")
    log.info("validation %s, step %d: %s%s -> %s", PASSES[step["pass"]], step["index"], what,
             f" [bisecting step {step['parent']}]" if step["parent"] is not None else "", step["reason"])
    if on_progress:
        on_progress("phase 3: validation", step["index"] + 1, step["index"] + 2)
