"""Accuracy decisions of the quantize stage: which weight storage this CPU computes exactly, and which
nodes stay float so the PTQ model meets the accuracy budget.

``Checker`` runs candidate models on the held-out calibration batches with the ONNX Runtime backend:
fused kernels for ORT placements (what will be deployed), plain Q/DQ math for TensorRT placements
(TensorRT's integer kernels are exact; its numbers cannot be measured on this machine).
"""

from __future__ import annotations

import logging
import math
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from pipeline.accuracy import AccuracyBudget, AccuracyVerdict, FidelityResult, Holdout
from pipeline.bodies import QUANTIZED_BODIES, walk_views
from pipeline.config import enum_value
from pipeline.errors import StageError, first_line
from pipeline.graph import WEIGHTED_OPS, iter_nodes
from pipeline.graph_index import GraphIndex
from pipeline.placement import PASS_THROUGH_OPS

log = logging.getLogger("tune.quantize")

# an exact weight storage that is more accurate wins unless the faster one is faster by more than this
ACCURACY_BAND = 1.10


@dataclass
class Candidate:
    """A quantized model checked on the holdout: loads, runs, kernel fidelity, accuracy verdict."""

    name: str
    path: Path
    verdict: AccuracyVerdict | None = None
    fidelity: FidelityResult | None = None
    latency_p10_ms: float | None = None
    error: str | None = None

    @property
    def usable(self) -> bool:
        return self.error is None and (self.fidelity is None or self.fidelity.ok)

    @property
    def scored(self) -> bool:
        """It ran and was judged: ``verdict`` holds the budget's verdict."""
        return self.error is None and self.verdict is not None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "error": self.error, "latency_p10_ms": self.latency_p10_ms,
                "fidelity": self.fidelity.to_dict() if self.fidelity else None,
                "accuracy": self.verdict.to_dict() if self.verdict else None}


@dataclass
class Checker:
    backend: Any  # an OnnxRuntimeBackend
    holdout: Holdout
    budget: AccuracyBudget
    fused: bool  # run with the backend's fused kernels (ORT placement) or as plain Q/DQ math
    workdir: Path

    def write(self, model: onnx.ModelProto, name: str) -> Path:
        path = self.workdir / f"{name}.onnx"
        path.write_bytes(model.SerializeToString())
        return path

    def runs(self, model: onnx.ModelProto) -> str | None:
        """None if the model loads and runs on a holdout batch with the fused kernels and as plain Q/DQ
        math (the fidelity reference), else the runtime's first error line."""
        path = self.write(model, "runs")
        for prepare in (self.backend.prepare, self.backend.prepare_reference):
            try:
                with prepare(path) as pm:
                    pm.run(self.holdout.feeds[0])
            except Exception as exc:  # noqa: BLE001 - the runtime's own error types
                return first_line(exc)
        return None

    def check(self, model: onnx.ModelProto, name: str, fidelity: bool = False) -> Candidate:
        """Load and run ``model`` on the holdout; never raises for a model the runtime rejects."""
        from pipeline.accuracy import kernel_fidelity

        c = Candidate(name, self.write(model, name))
        try:
            pm = self.backend.prepare(c.path) if self.fused else self.backend.prepare_reference(c.path)
        except Exception as exc:  # noqa: BLE001 - a model the runtime cannot load is a rejected candidate
            c.error = f"{self.backend.name} cannot load it: {first_line(exc)}"
            return c
        try:
            outputs = self.holdout.outputs(pm)
            c.verdict = self.holdout.judge(outputs, self.budget)
            if fidelity and self.fused:
                c.fidelity = kernel_fidelity(self.backend, c.path, self.holdout.feeds, prepared=pm,
                                             float_outputs=self.holdout.reference)
        except Exception as exc:  # noqa: BLE001 - a model that fails to run is a rejected candidate
            c.error = f"{self.backend.name} cannot run it: {first_line(exc)}"
        finally:
            pm.close()
        return c


_NODE_IN_ERROR = re.compile(r"Node \(([^)]+)\)|Name:'([^']+)'|In Node, \(\"([^\"]+)\"")


def culprits(error: str, qmodel: onnx.ModelProto, originals: set[str]) -> set[str]:
    """The original nodes behind the node an ONNX Runtime error names: the node itself, or the
    consumers of an inserted Q/DQ node, plus the quantized weighted ops feeding such a consumer (a
    bias Add belongs to its MatMul's fused group). A node inside a Loop/Scan body is traced in its body."""
    m = _NODE_IN_ERROR.search(error)
    name = next((g for g in m.groups() if g), None) if m else None
    if name is None:
        return set()
    if name in originals:
        return {name}
    g = next((GraphIndex(v) for v in (qmodel, *(b.model for b in walk_views(qmodel)))
              if any(n.name == name for n in v.graph.node)), None)
    if g is None:
        return set()
    found: set[str] = set()
    frontier, seen = [name], set()
    while frontier:
        cur = frontier.pop()
        if cur in seen or cur not in g.nodes:
            continue
        seen.add(cur)
        for t in g.nodes[cur].output:
            for c, _ in g.consumers.get(t, []):
                if c.name in originals:
                    found.add(c.name)
                elif c.op_type in ("QuantizeLinear", "DequantizeLinear"):
                    frontier.append(c.name)
    for c in list(found):
        if g.nodes[c].op_type not in WEIGHTED_OPS:
            found |= {p.name for t in g.nodes[c].input if (p := g.producer.get(t)) is not None
                      and p.name in originals and p.op_type in WEIGHTED_OPS}
    return found


def runnable(build: Callable[[set[str]], onnx.ModelProto], checker: Checker, originals: set[str],
             max_rounds: int = 8) -> set[str]:
    """Nodes to leave float so that the quantized model loads and runs, both with the fused kernels
    and as plain Q/DQ math; each one is logged with the runtime's reason."""
    skip: set[str] = set()
    for _ in range(max_rounds):
        model = build(skip)
        error = checker.runs(model)
        if error is None:
            return skip
        found = culprits(error, model, originals) - skip
        if not found:
            raise StageError(f"quantize: the quantized model does not run in {checker.backend.name} ({error}) and "
                             f"the failing node could not be left float; add it to quantize.skip_names")
        log.warning("quantize: %s left float: %s cannot run its quantized form (%s)", ", ".join(sorted(found)),
                    checker.backend.name, error)
        skip |= found
    raise StageError(f"quantize: the quantized model still does not run after leaving {len(skip)} nodes float "
                     f"({', '.join(sorted(skip))}); add the failing nodes to quantize.skip_names")


def temp_workdir(parent: Path) -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix=".checks.", dir=parent)


def localize(units: list[str], fails: Callable[[set[str]], bool], max_checks: int | None = None) -> list[str]:
    """The units responsible for a failure, by group testing: ``fails(S)`` tells whether the model with
    only the units in S quantized fails; a failing set is split in halves until single units remain
    (O(k log n) checks for k culprits among n). Past ``max_checks`` the failing sets left are returned
    whole (a fault that every part shows is the model's, not a node's)."""
    budget = max_checks if max_checks is not None else 8 + 4 * max(1, len(units)).bit_length()
    found: list[str] = []
    pending = [list(units)]
    checks = 0
    while pending:
        group = pending.pop(0)
        if len(group) == 1 or checks >= budget:
            found.extend(group)
            continue
        half = len(group) // 2
        for part in (group[:half], group[half:]):
            checks += 1
            if fails(set(part)):
                pending.append(part)
    return found


def choose_weight_range(build: Callable[..., onnx.ModelProto], checker: Checker, requested: str,
                        saturates: bool | None, measure: Callable[[list[Path]], list[float | None]],
                        units: list[str] | None = None) -> tuple[str, str, list[Candidate], list[str]]:
    """(weight range, why, candidates checked, culprit nodes to leave float) for an ORT placement.

    ``build(weight_range, float_nodes)`` places the model. ``auto``: full range where the fused kernels
    agree with the Q/DQ reference and the CPU has int8 dot-product instructions. Where they disagree on
    a CPU whose u8 x s8 kernels are not known to saturate, the disagreement is first localized to the
    quantized ``units`` responsible (group testing on models with only some units quantized): a few
    culprits stay float and the rest keeps full-range weights; only a fault most units show (or any on
    a saturating CPU) switches the whole model to the fastest exact storage that meets the budget
    (else the most accurate exact one). A forced value is checked and reported, not changed.
    """
    if requested != "auto":
        cand = checker.check(build(requested), f"weights_{requested}", fidelity=True)
        return requested, f"quantize.weight_range={requested}", [cand], []
    full = checker.check(build("full"), "weights_full", fidelity=True)
    if full.usable and not saturates:
        return "full", "fused kernels agree with the Q/DQ reference", [full], []
    why = ("this CPU's u8s8 kernels saturate (AVX2 without VNNI)" if saturates else
           f"this CPU's fused kernels disagree with the Q/DQ reference ({full.fidelity.reason if full.fidelity else full.error})")
    if not saturates and full.error is None and units:
        everything = set(units)

        def fails(quantized: set[str]) -> bool:
            c = checker.check(build("full", everything - quantized), "fidelity_localize", fidelity=True)
            return c.error is None and c.fidelity is not None and not c.fidelity.ok

        culprits = localize(list(units), fails)
        if culprits and len(culprits) * 2 <= len(units):
            fixed = checker.check(build("full", set(culprits)), "weights_full", fidelity=True)
            if fixed.usable:
                log.warning("quantize: %s; localized to %d node(s) left float: %s", why, len(culprits),
                            ", ".join(culprits))
                return "full", (f"full-range int8 weights; {len(culprits)} node(s) whose fused kernels disagree "
                                f"with the Q/DQ reference left float: {', '.join(culprits)}"), [fixed], culprits
        if saturates is False and not culprits:
            # exact kernels and no node to blame: what differs is the model's own quantization noise
            log.warning("quantize: %s, but no node is responsible on its own; keeping full-range weights on a CPU "
                        "whose u8s8 kernels are exact", why)
            return "full", f"full-range int8 weights ({why}; no culprit node: not a kernel fault)", [full], []
        if culprits:
            why += f"; {len(culprits)} of {len(units)} quantized nodes show it"
    variants = [checker.check(build(v), f"weights_{v}", fidelity=True) for v in ("reduced", "uint8")]
    exact = [c for c in variants if c.usable]
    if not exact:
        raise StageError(f"quantize: no int8 weight storage runs exactly on this CPU ({why}; "
                         + "; ".join(f"{c.name}: {c.error or c.fidelity.reason}" for c in variants)
                         + "); use backend=tensorrt or quantize=none")
    for c, t in zip(exact, measure([c.path for c in exact]), strict=True):
        c.latency_p10_ms = t
    within = [c for c in exact if c.scored and c.verdict.ok]
    if within:
        # the fastest within the budget, unless the most accurate is within ACCURACY_BAND of its speed:
        # 7-bit weights cost ~3-6 dB of output SNR, worth it only for a clear speed gain
        fastest = min(within, key=lambda c: c.latency_p10_ms if c.latency_p10_ms is not None else math.inf)
        accurate = min(within, key=lambda c: c.verdict.error)
        slow, fast = accurate.latency_p10_ms, fastest.latency_p10_ms
        best = accurate if slow is not None and fast is not None and slow <= fast * ACCURACY_BAND else fastest
        rule = (f"most accurate exact variant within {ACCURACY_BAND - 1:.0%} of the fastest" if best is accurate
                else "fastest exact variant within the budget")
    else:
        best = min(exact, key=lambda c: c.verdict.error if c.verdict else math.inf)
        rule = "most accurate exact variant; none meets the budget"
    choice = best.name.removeprefix("weights_")
    desc = {"reduced": "weights use 7-bit range", "uint8": "weights stored as uint8 (U8U8 kernels)"}[choice]
    timing = ", ".join(f"{c.name.removeprefix('weights_')} {c.latency_p10_ms:.3f} ms" for c in exact
                       if c.latency_p10_ms is not None)
    snr = ", ".join(f"{c.name.removeprefix('weights_')} {c.verdict.what}" for c in exact if c.scored)
    return choice, f"{desc}: {why} ({rule}; p10 {timing}; {snr})", [full, *variants], []


def outlier_units(model: onnx.ModelProto, stats: dict[str, dict], units: list[str], threshold: float
                  ) -> dict[str, str]:
    """Quantized nodes other than weighted ops (Add, Mul, Concat, ...) that read or write a tensor with
    outlier channels (``channel_ratio`` >= ``threshold``), with the reason: one per-tensor scale spans
    the outliers and leaves the other channels a level or two. Left float, they cost little (element-
    wise ops), and the weighted ops around them keep int8 with float outputs."""
    if threshold <= 0:
        return {}
    nodes = {n.name: n for n in iter_nodes(model.graph, QUANTIZED_BODIES)}
    out = {}
    for name in units:
        node = nodes.get(name)
        if node is None or node.op_type in WEIGHTED_OPS:
            continue
        worst = max(((stats.get(t) or {}).get("channel_ratio", 0.0), t) for t in [*node.input, *node.output] if t)
        if worst[0] >= threshold:
            out[name] = f"outlier channels on {worst[1]} (max/median channel {worst[0]:.0f}x)"
    return out


def rank_sensitivity(units: list[str], build: Callable[[set[str]], onnx.ModelProto], checker: Checker,
                     progress: Callable | None = None) -> list[dict[str, Any]]:
    """Leave one node float at a time; rank by the output error that remains (lowest first: the
    node whose quantization costs most)."""
    ranking = []
    it = progress(units) if progress is not None else units
    for name in it:
        c = checker.check(build({name}), "sensitivity")
        err = c.verdict.error if c.scored else math.inf
        ranking.append({"node": name, "error_without": err,
                        "snr_db_without": c.verdict.snr_db if c.verdict else None, "error": c.error})
    ranking.sort(key=lambda r: (r["error_without"], r["node"]))
    return ranking


def recover(ranking: list[dict[str, Any]], build: Callable[[set[str]], onnx.ModelProto], checker: Checker,
            max_nodes: int) -> tuple[list[str], Candidate | None]:
    """Fewest most sensitive nodes to leave float so the model meets the budget (binary search over
    the ranking's prefixes: the error falls as more nodes stay float). Returns ([], None) if even
    ``max_nodes`` float nodes miss it."""
    order = [r["node"] for r in ranking]
    lo, hi = 1, min(max_nodes, len(order))
    best: tuple[list[str], Candidate] | None = None
    while lo <= hi:
        k = (lo + hi) // 2
        c = checker.check(build(set(order[:k])), f"recovery_{k}")
        if c.scored and c.verdict.ok:
            best = (order[:k], c)
            hi = k - 1
        else:
            lo = k + 1
    return best if best is not None else ([], None)


GREEDY_CANDIDATES, GREEDY_STEPS = 8, 4


def greedy_recovery(ranking: list[dict[str, Any]], build: Callable[[set[str]], onnx.ModelProto], checker: Checker,
                    max_nodes: int) -> tuple[list[str], Candidate | None, list[dict[str, Any]]]:
    """Nodes whose errors interact: a node that barely matters alone can matter a lot once another is
    float (a VAD's first encoder conv, after its STFT conv). Grow the float set one node at a time, each
    step adding whichever of the GREEDY_CANDIDATES most sensitive nodes lowers the error most with the
    set so far, until the budget is met (at most GREEDY_STEPS nodes). Returns (float nodes, candidate
    or None, the steps)."""
    pool = [r["node"] for r in ranking[:GREEDY_CANDIDATES]]
    chosen = pool[:1]  # the ranking's first is the best single node already
    steps: list[dict[str, Any]] = []
    for _ in range(1, min(GREEDY_STEPS, max_nodes, len(pool))):
        best: tuple[float, str, Candidate] | None = None
        for n in pool:
            if n in chosen:
                continue
            c = checker.check(build({*chosen, n}), "greedy")
            err = c.verdict.error if c.scored else math.inf
            if best is None or err < best[0]:
                best = (err, n, c)
        if best is None or not math.isfinite(best[0]):
            break
        chosen.append(best[1])
        v = best[2].verdict
        steps.append({"float": list(chosen), "accuracy": v.what if v else None, "ok": bool(v is not None and v.ok)})
        log.info("quantize:   with %d nodes float (greedy, + %s): %s", len(chosen), best[1], v.what if v else None)
        if steps[-1]["ok"]:
            return _prune(chosen, best[2], build, checker, steps)
    return [], None, steps


def _prune(chosen: list[str], met: Candidate, build: Callable[[set[str]], onnx.ModelProto], checker: Checker,
           steps: list[dict[str, Any]]) -> tuple[list[str], Candidate, list[dict[str, Any]]]:
    """Drop from a float set that meets the budget each earlier pick the later ones made unnecessary."""
    keep = list(chosen)
    for n in chosen[-2::-1]:
        trial = [m for m in keep if m != n]
        c = checker.check(build(set(trial)), "greedy_prune")
        if c.scored and c.verdict.ok:
            keep, met = trial, c
            steps.append({"float": list(keep), "accuracy": c.verdict.what, "ok": True, "dropped": n})
            log.info("quantize:   %s no longer needed float: %s", n, c.verdict.what)
    return keep, met, steps


BLOCK_FRACTIONS = (0.1, 0.25, 0.4, 0.5)


def block_recovery(order: list[str], build: Callable[[set[str]], onnx.ModelProto], checker: Checker,
                   max_nodes: int) -> tuple[list[str], Candidate | None, list[dict[str, Any]]]:
    """Where node-by-node ranking finds no few culprits, the error is made along a stretch of the
    graph: leave float the first or the last 10%, 25%, ... of the quantized nodes (graph order) and
    keep the smallest stretch that meets the budget. Returns (float nodes, candidate, profile); the
    profile (the error with each stretch float) is the evidence of where the error is made."""
    profile: list[dict[str, Any]] = []
    n = len(order)
    for frac in BLOCK_FRACTIONS:
        k = max(1, math.ceil(frac * n))
        if k > max_nodes:
            break
        for where, stretch in (("first", order[:k]), ("last", order[n - k:])):
            c = checker.check(build(set(stretch)), f"block_{where}_{k}")
            v = c.verdict
            profile.append({"float": f"{where} {k} of {n}", "nodes": k, "error": c.error,
                            "accuracy": v.what if v else None, "snr_db": v.snr_db if v else None,
                            "ok": bool(c.scored and v.ok)})
            if profile[-1]["ok"]:
                return list(stretch), c, profile
    return [], None, profile


def start_range(requested: Any) -> str:
    """The weight storage candidates are first built with: ``quantize.weight_range``, auto starting
    from full range."""
    r = enum_value(requested)
    return "full" if r == "auto" else r


def decide(cfg: Any, model: onnx.ModelProto, checker: Checker, kind: str,
           build: Callable[..., tuple[Any, onnx.ModelProto]],
           fix_bias: Callable[..., tuple[dict, Any]] | None = None, outliers: dict[str, str] | None = None
           ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Weight storage, kernel-fidelity culprits, float nodes and bias correction of the quantize stage's
    model, decided on ``checker``'s held-out batches. ``build(weight_range, float_nodes)`` places the
    model; ``fix_bias`` tries bias correction on the final placement; ``outliers`` are the element-wise
    nodes on tensors with outlier channels, recovery's first candidates."""
    from pipeline.backends.base import compare_interleaved
    from pipeline.cpu import cpu_facts, describe

    q, a = cfg.quantize, cfg.accuracy
    backend, holdout, budget = checker.backend, checker.holdout, checker.budget
    facts = cpu_facts()
    requested = enum_value(q.weight_range)

    def measure(paths: list[Path]) -> list[float | None]:
        timings = compare_interleaved(backend, paths, rounds=4, runs_per_round=max(2, backend.timing_runs // 8),
                                      warmup_runs=backend.warmup_runs)
        return [t.p10_ms if t.ok else None for t in timings]

    ops = {n.name: n.op_type for n in iter_nodes(model.graph, QUANTIZED_BODIES)}
    start = start_range(requested)
    unsupported = runnable(lambda s: build(start, s)[1], checker, set(ops))

    def placed(wr: str, float_nodes: set[str] = frozenset()) -> onnx.ModelProto:
        """The quantized model with the nodes the runtime cannot run quantized left float."""
        return build(wr, set(float_nodes) | unsupported)[1]

    culprits: list[str] = []
    if kind == "onnxruntime":
        units = [n for n in build(start, unsupported)[0].quantized_nodes()
                 if ops.get(n) not in (None, *PASS_THROUGH_OPS)]
        weight_range, why, checked, culprits = choose_weight_range(
            placed, checker, requested, facts["u8s8_saturates"], measure, units)
        chosen = next(c for c in checked if c.name == f"weights_{weight_range}")
        unsupported |= set(culprits)
    else:
        weight_range = start_range(requested)
        why = ("TensorRT placement: full-range int8 (TensorRT's integer kernels do not saturate)"
               if requested == "auto" else f"quantize.weight_range={requested}")
        chosen = checker.check(placed(weight_range), f"weights_{weight_range}")
        checked = [chosen]
    if chosen.error is not None:
        raise StageError(f"quantize: the quantized model is not written because {chosen.error}")
    if weight_range == "full":
        log.info("quantize: full-range int8 weights on %s (%s)", describe(facts), why)
    else:
        log.warning("quantize: %s [%s]", why, describe(facts))
    verdict = chosen.verdict
    final = chosen  # the candidate of the placement that will be written
    float_nodes: list[str] = []
    sensitivity = None
    if verdict is not None and not verdict.ok and budget.enabled and bool(a.recovery):
        plan, _ = build(weight_range, unsupported)
        units = [n for n in plan.quantized_nodes() if ops.get(n) not in PASS_THROUGH_OPS]
        log.warning("quantize: the PTQ model misses the accuracy budget on %d held-out samples (%s); "
                    "ranking %d quantized nodes by their contribution to the output error",
                    holdout.samples, verdict.what, len(units))
        float_nodes, recovered, report = recover_budget(
            model, units, lambda s: placed(weight_range, s), recovery_checker(checker, cfg), verdict,
            outliers or {}, math.floor(float(a.max_float_fraction) * len(units)), bool(cfg.progress))
        if recovered is not None:  # judged again by the budget itself (recovery aimed inside it)
            recovered = checker.check(placed(weight_range, set(float_nodes)), "recovered")
            verdict, final = recovered.verdict, recovered
        sensitivity = {
            "budget": budget.describe(), "holdout": holdout.source, "samples": holdout.samples,
            "full_placement": chosen.verdict.to_dict() if chosen.verdict else None, **report,
            "float_nodes": float_nodes, "met": recovered is not None,
            "accuracy": verdict.to_dict() if verdict else None,
        }
    bias = None
    if fix_bias is not None and final.verdict is not None:
        bias, corrected = fix_bias(weight_range, unsupported | set(float_nodes), checker, final)
        if corrected is not None:
            verdict = corrected.verdict
    decisions = {
        "weight_range": weight_range, "weight_range_reason": why, "cpu": facts,
        "unsupported_nodes": sorted(unsupported - set(culprits)),
        "fidelity_culprits": culprits,
        "bias_correction": bias,
        "kernel_fidelity": chosen.fidelity.to_dict() if chosen.fidelity else None,
        "variants": [c.to_dict() for c in checked],
        "budget": budget.describe(), "holdout": holdout.source, "holdout_samples": holdout.samples,
        "accuracy": verdict.to_dict() if verdict else None,
        "float_nodes": sorted(set(float_nodes) | unsupported),
    }
    return decisions, sensitivity


def recovery_checker(checker: Checker, cfg: Any) -> Checker:
    """``checker`` with the budget accuracy.recovery_margin_db inside itself, for recovery's searches."""
    from dataclasses import replace

    return replace(checker, budget=checker.budget.tightened(float(cfg.accuracy.recovery_margin_db)))


def recover_budget(model: onnx.ModelProto, units: list[str], placed: Callable[[set[str]], onnx.ModelProto],
                   checker: Checker, verdict: AccuracyVerdict, outliers: dict[str, str], max_float: int,
                   progress: bool) -> tuple[list[str], Candidate | None, dict[str, Any]]:
    """(nodes to leave float, the candidate that meets the budget or None, what was tried): first the
    element-wise nodes on tensors with outlier channels (cheap float ops; the weighted ops around them
    keep int8), then the fewest most sensitive nodes, then stretches of the graph."""
    from pipeline.progress import progress_bar

    ops = {n.name: n.op_type for n in iter_nodes(model.graph, QUANTIZED_BODIES)}
    base = {n: why for n, why in outliers.items() if n in units}
    recovered: Candidate | None = None
    blocks: list[dict[str, Any]] = []
    greedy: list[dict[str, Any]] = []
    ranking: list[dict[str, Any]] = []
    if base:
        c = checker.check(placed(set(base)), "outliers")
        log.warning("quantize: %d element-wise node(s) on tensors with outlier channels left float: %s",
                    len(base), c.verdict.what if c.verdict else c.error)
        if c.scored and c.verdict.error < verdict.error:
            recovered = c if c.verdict.ok else None
        else:
            base = {}
    float_nodes: list[str] = sorted(base) if recovered is not None else []
    limit = max(1, max_float - len(base))
    if recovered is None:
        rest = [n for n in units if n not in base]

        def with_base(s: set[str]) -> onnx.ModelProto:
            return placed(set(s) | set(base))

        def bar(it):
            return progress_bar(progress, iterable=it, total=len(rest), desc="quantize: sensitivity", unit="node")

        ranking = rank_sensitivity(rest, with_base, checker, bar)
        float_nodes, recovered = recover(ranking, with_base, checker, limit)
        if recovered is None:  # culprits that only matter together
            float_nodes, recovered, greedy = greedy_recovery(ranking, with_base, checker, limit)
        if recovered is None:  # no few culprits: the error is made along a stretch of the graph
            in_order = [n for n in ops if n in set(rest)]
            float_nodes, recovered, blocks = block_recovery(in_order, with_base, checker, limit)
            for b in blocks:
                log.info("quantize:   with the %s quantized nodes float: %s", b["float"], b["accuracy"] or b["error"])
        float_nodes = sorted(base) + float_nodes if recovered is not None else []
        for r in ranking:
            r["op_type"] = ops.get(r["node"])
            r["left_float"] = r["node"] in float_nodes
    if recovered is not None:
        log.warning("quantize: leaving %d of %d quantized nodes float to meet the budget (%s): %s",
                    len(float_nodes), len(units), recovered.verdict.what, ", ".join(float_nodes))
    else:
        log.warning("quantize: even %d float nodes do not bring the PTQ model within the accuracy budget; "
                    "writing the full placement (autotune will ship the best model that meets it)", limit + len(base))
    report = {"method": "element-wise nodes on tensors with outlier channels first (outlier_nodes); then each node "
                        "left float alone, ranked by the output error that remains (lowest first); if no prefix "
                        "of that ranking meets the budget, a float set grown greedily from the most sensitive "
                        "nodes (greedy); then stretches of the graph (blocks)",
              "outlier_nodes": base, "ranking": ranking, "greedy": greedy, "blocks": blocks}
    return float_nodes, recovered, report

