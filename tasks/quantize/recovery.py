"""Recovery of the quantize stage: which nodes stay float so the PTQ model meets the accuracy budget.

First the element-wise nodes on tensors with outlier channels, then the fewest most sensitive nodes
(each left float alone, ranked by the output error that remains), then a float set grown greedily
from the most sensitive ones (nodes whose errors interact), then stretches of the graph. Every
candidate is judged by a ``Checker`` (accuracy), usually one whose budget keeps a margin.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import onnx

from pipeline.accuracy.budget import AccuracyVerdict
from pipeline.graph.bodies import QUANTIZED_BODIES
from pipeline.graph.model import WEIGHTED_OPS, iter_nodes
from pipeline.quant.calibration import TensorStats
from tasks.quantize.accuracy import Candidate, Checker

log = logging.getLogger("tune.quantize")


def outlier_units(model: onnx.ModelProto, stats: dict[str, TensorStats], units: list[str], threshold: float
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
        worst = max((_ratio(stats.get(t)), t) for t in [*node.input, *node.output] if t)
        if worst[0] >= threshold:
            out[name] = f"outlier channels on {worst[1]} (max/median channel {worst[0]:.0f}x)"
    return out


def _ratio(stats: TensorStats | None) -> float:
    return (stats.channel_ratio or 0.0) if stats is not None else 0.0


@dataclass
class Closest:
    """The float set, of those recovery checked, whose model came closest to the budget (lowest held-out
    error): where no set meets the budget with recovery's margin, the one that may still meet the
    budget itself."""

    float_nodes: frozenset[str] = frozenset()
    candidate: Candidate | None = None

    def note(self, float_nodes: set[str], c: Candidate) -> None:
        if c.scored and (self.candidate is None or c.verdict.error < self.candidate.verdict.error):
            self.float_nodes, self.candidate = frozenset(float_nodes), c


def rank_sensitivity(units: list[str], build: Callable[[set[str]], onnx.ModelProto], checker: Checker,
                     progress: Callable | None = None, closest: Closest | None = None) -> list[dict[str, Any]]:
    """Leave one node float at a time; rank by the output error that remains (lowest first: the
    node whose quantization costs most)."""
    closest = closest if closest is not None else Closest()
    ranking = []
    it = progress(units) if progress is not None else units
    # each node's model is built and loaded by the runtime while the one before runs (check_each)
    checked = checker.check_each((build({name}), f"sensitivity_{k % 2}") for k, name in enumerate(units))
    for name, c in zip(it, checked, strict=True):
        if hasattr(it, "set_postfix_str"):
            it.set_postfix_str(name, refresh=False)  # the node left float now
        closest.note({name}, c)
        err = c.verdict.error if c.scored else math.inf
        ranking.append({"node": name, "error_without": err,
                        "snr_db_without": c.verdict.snr_db if c.verdict else None, "error": c.error})
    ranking.sort(key=lambda r: (r["error_without"], r["node"]))
    return ranking


def recover(ranking: list[dict[str, Any]], build: Callable[[set[str]], onnx.ModelProto], checker: Checker,
            max_nodes: int, closest: Closest | None = None) -> tuple[list[str], Candidate | None]:
    """Fewest most sensitive nodes to leave float so the model meets the budget (binary search over
    the ranking's prefixes: the error falls as more nodes stay float). Returns ([], None) if even
    ``max_nodes`` float nodes miss it."""
    order = [r["node"] for r in ranking]
    lo, hi = 1, min(max_nodes, len(order))
    best: tuple[list[str], Candidate] | None = None
    while lo <= hi:
        k = (lo + hi) // 2
        c = checker.check(build(set(order[:k])), f"recovery_{k}")
        if closest is not None:
            closest.note(set(order[:k]), c)
        if c.scored and c.verdict.ok:
            best = (order[:k], c)
            hi = k - 1
        else:
            lo = k + 1
    return best if best is not None else ([], None)


GREEDY_CANDIDATES, GREEDY_STEPS = 8, 4


def greedy_recovery(ranking: list[dict[str, Any]], build: Callable[[set[str]], onnx.ModelProto], checker: Checker,
                    max_nodes: int, closest: Closest | None = None
                    ) -> tuple[list[str], Candidate | None, list[dict[str, Any]]]:
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
            if closest is not None:
                closest.note({*chosen, n}, c)
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
                   max_nodes: int, closest: Closest | None = None
                   ) -> tuple[list[str], Candidate | None, list[dict[str, Any]]]:
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
            if closest is not None:
                closest.note(set(stretch), c)
            v = c.verdict
            profile.append({"float": f"{where} {k} of {n}", "nodes": k, "error": c.error,
                            "accuracy": v.what if v else None, "snr_db": v.snr_db if v else None,
                            "ok": bool(c.scored and v.ok)})
            if profile[-1]["ok"]:
                return list(stretch), c, profile
    return [], None, profile


@dataclass(frozen=True)
class MissedBudget:
    """The full placement recovery starts from, which misses the budget: its quantized nodes (the units
    recovery may leave float), its verdict, and the element-wise nodes on tensors with outlier channels
    (recovery's first candidates, with the reason)."""

    units: list[str]
    verdict: AccuracyVerdict
    outliers: dict[str, str]


def recover_budget(model: onnx.ModelProto, start: MissedBudget, placed: Callable[[set[str]], onnx.ModelProto],
                   checker: Checker, max_float: int, progress: bool, fallback: Checker | None = None
                   ) -> tuple[list[str], Candidate | None, dict[str, Any]]:
    """(nodes to leave float, the candidate that meets the budget or None, what was tried): first the
    element-wise nodes on tensors with outlier channels (cheap float ops; the weighted ops around them
    keep int8), then the fewest most sensitive nodes, then stretches of the graph. Where no float set
    meets ``checker``'s budget (recovery's, with its margin), the closest set tried is judged by
    ``fallback`` (the budget itself) and kept if it meets that."""
    from pipeline.progress import progress_bar

    units, verdict, outliers = start.units, start.verdict, start.outliers

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
    closest = Closest()
    if recovered is None:
        rest = [n for n in units if n not in base]

        def with_base(s: set[str]) -> onnx.ModelProto:
            return placed(set(s) | set(base))

        def bar(it):
            return progress_bar(progress, iterable=it, total=len(rest), desc="quantize: sensitivity", unit="node")

        ranking = rank_sensitivity(rest, with_base, checker, bar, closest)
        float_nodes, recovered = recover(ranking, with_base, checker, limit, closest)
        if recovered is None:  # culprits that only matter together
            float_nodes, recovered, greedy = greedy_recovery(ranking, with_base, checker, limit, closest)
        if recovered is None:  # no few culprits: the error is made along a stretch of the graph
            in_order = [n for n in ops if n in set(rest)]
            float_nodes, recovered, blocks = block_recovery(in_order, with_base, checker, limit, closest)
            for b in blocks:
                log.info("quantize:   with the %s quantized nodes float: %s", b["float"], b["accuracy"] or b["error"])
        if recovered is None and fallback is not None and closest.candidate is not None \
                and closest.candidate.verdict.error < verdict.error:
            c = fallback.check(with_base(set(closest.float_nodes)), "closest")
            if c.scored and c.verdict.ok:
                log.warning("quantize: no float set meets the budget with recovery's margin; the closest "
                            "(%d nodes) meets the budget itself: %s", len(closest.float_nodes), c.verdict.what)
                float_nodes, recovered = sorted(closest.float_nodes), c
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
