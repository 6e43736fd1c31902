"""Recovery of the quantize stage: which nodes stay float so the PTQ model meets the accuracy budget.

First the element-wise nodes on tensors with outlier channels, then the fewest most sensitive nodes
(each left float alone, ranked by the output error that remains), then a float set grown greedily
from the most sensitive ones (nodes whose errors interact), then stretches of the graph. Every
candidate is judged by a ``Checker`` (accuracy), usually one whose budget keeps a margin.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import onnx

from pipeline.accuracy.budget import AccuracyVerdict
from pipeline.graph.bodies import QUANTIZED_BODIES
from pipeline.graph.model import WEIGHTED_OPS, iter_nodes
from pipeline.quant.calibration import TensorStats
from tasks.quantize.checker import Candidate, Checker

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


# the checks recovery may still make after its allowance was last found not over: the one under way, the one
# check_each has built ahead, and the closest float set judged by the budget itself
TAIL_CHECKS = 3


@dataclass
class Allowance:
    """Recovery's time allowance and its progress bar: each check counts on the bar (whose total is the checks
    planned so far, so its ETA is the time left); once ``deadline`` (``time.monotonic()``; None: no limit)
    would pass before TAIL_CHECKS more checks end (as long as the checks so far took on average),
    recovery's searches check nothing new and it keeps the best float set found."""

    deadline: float | None = None
    bar: Any = None
    seconds: float | None = None  # the allowance itself (None: no limit)
    checks: int = 0  # the checks counted so far
    started: float = field(default_factory=time.monotonic)

    def over(self) -> bool:
        if self.deadline is None:
            return False
        now = time.monotonic()
        return now + TAIL_CHECKS * ((now - self.started) / self.checks if self.checks else 0.0) > self.deadline

    def plan(self, checks: int) -> None:
        if self.bar is not None:
            self.bar.total = (self.bar.total or 0) + checks
            self.bar.refresh()

    def tick(self, name: str) -> None:
        self.checks += 1
        if self.bar is not None:
            self.bar.set_postfix_str(name, refresh=False)  # what was just checked
            self.bar.update(1)


# recovery may always take this long, however quick calibration and placement were
MIN_ALLOWANCE_S = 5.0


@contextmanager
def recovery_allowance(cfg: Any, before_s: float) -> Iterator[Allowance]:
    """Recovery's allowance: accuracy.recovery_time_factor times the ``before_s`` seconds calibration and
    placement took (at least MIN_ALLOWANCE_S; factor 0: no limit), with its progress bar (cfg.progress)."""
    from pipeline.progress import progress_bar

    factor = float(cfg.accuracy.recovery_time_factor)
    seconds = max(MIN_ALLOWANCE_S, factor * before_s) if factor > 0 else None
    if seconds is not None:
        log.info("quantize: recovery takes at most %.0f s (accuracy.recovery_time_factor=%g x the %.0f s "
                 "calibration and placement took, at least %.0f s)", seconds, factor, before_s, MIN_ALLOWANCE_S)
    with progress_bar(bool(cfg.progress), total=0, desc="quantize: recovery", unit="check") as bar:
        yield Allowance(time.monotonic() + seconds if seconds is not None else None, bar,
                        round(seconds, 1) if seconds is not None else None)


def _error(c: Candidate) -> float:
    return c.verdict.error if c.scored else math.inf


def _row(node: str, c: Candidate | None) -> dict[str, Any]:
    if c is None:
        return {"node": node, "error_without": math.inf, "snr_db_without": None,
                "error": "not checked: recovery's time allowance ran out"}
    return {"node": node, "error_without": _error(c), "snr_db_without": c.verdict.snr_db if c.verdict else None,
            "error": c.error}


def _without_each(sets: list[tuple[str, frozenset[str]]], build: Callable[[set[str]], onnx.ModelProto],
                  checker: Checker, allowance: Allowance, closest: Closest, stop_when_met: bool
                  ) -> list[Candidate | None]:
    """Each (label, nodes) set left float in turn, checked; None for the sets not checked (the allowance
    ran out, or ``stop_when_met`` and an earlier set met the budget)."""
    out: list[Candidate | None] = []

    def models():  # each model is built while the one before runs (check_each)
        for k, (_, nodes) in enumerate(sets):
            if allowance.over():
                return
            yield build(set(nodes)), f"sensitivity_{k % 2}"

    checked = checker.check_each(models())
    try:
        for label, nodes in sets:
            c = next(checked, None)
            if c is None:
                break
            allowance.tick(label)
            closest.note(set(nodes), c)
            out.append(c)
            if stop_when_met and c.scored and c.verdict.ok:
                break
    finally:
        checked.close()  # a model built ahead is closed
    return out + [None] * (len(sets) - len(out))


def rank_sensitivity(units: list[str], build: Callable[[set[str]], onnx.ModelProto], checker: Checker,
                     allowance: Allowance | None = None, closest: Closest | None = None) -> list[dict[str, Any]]:
    """Leave one node float at a time; rank by the output error that remains (lowest first: the node whose
    quantization costs most). Once one node left float meets the budget, the others are not checked."""
    allowance = allowance if allowance is not None else Allowance()
    checked = _without_each([(n, frozenset({n})) for n in units], build, checker, allowance,
                            closest if closest is not None else Closest(), stop_when_met=True)
    ranking = [_row(n, c) for n, c in zip(units, checked, strict=True)]
    ranking.sort(key=lambda r: (r["error_without"], r["node"]))
    return ranking


# past RANK_ALONE quantized nodes, the ranking starts from STRETCHES stretches of the graph and ranks node by
# node only the REFINED stretches whose float lowers the error most
RANK_ALONE, STRETCHES, REFINED = 24, 12, 3


def stretches(in_order: list[str], count: int) -> list[list[str]]:
    """``in_order`` (graph order) cut into at most ``count`` stretches of consecutive nodes of equal length."""
    size = max(1, math.ceil(len(in_order) / count))
    return [in_order[i:i + size] for i in range(0, len(in_order), size)]


def rank_nodes(in_order: list[str], build: Callable[[set[str]], onnx.ModelProto], checker: Checker,
               allowance: Allowance, closest: Closest) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the ranking recovery searches, the stretches measured): each node alone where there are at most
    RANK_ALONE. Else each of STRETCHES stretches of consecutive nodes (graph order: the nodes a runtime
    fuses sit side by side) is left float in turn, the nodes of the REFINED stretches whose float lowered the
    error most are ranked one by one, and the nodes of the other stretches follow in their stretches'
    order, unranked (``error_without`` None)."""
    if len(in_order) <= RANK_ALONE:
        allowance.plan(len(in_order))
        return rank_sensitivity(in_order, build, checker, allowance, closest), []
    parts = stretches(in_order, STRETCHES)
    allowance.plan(len(parts))
    labels = [f"nodes {k * len(parts[0]) + 1}-{k * len(parts[0]) + len(p)} of {len(in_order)}"
              for k, p in enumerate(parts)]
    checked = _without_each([(lb, frozenset(p)) for lb, p in zip(labels, parts, strict=True)], build, checker,
                            allowance, closest, stop_when_met=False)
    measured = [{**_row(lb, c), "nodes": len(p)} for lb, p, c in zip(labels, parts, checked, strict=True)]
    order = sorted(range(len(parts)), key=lambda k: measured[k]["error_without"])
    refined = [n for k in order[:REFINED] if math.isfinite(measured[k]["error_without"]) for n in parts[k]]
    allowance.plan(len(refined))
    ranking = rank_sensitivity(refined, build, checker, allowance, closest)
    ranked = set(refined)
    ranking += [{"node": n, "error_without": None, "snr_db_without": None, "error": None,
                 "stretch": measured[k]["node"]} for k in order for n in parts[k] if n not in ranked]
    return ranking, measured


def recover(ranking: list[dict[str, Any]], build: Callable[[set[str]], onnx.ModelProto], checker: Checker,
            max_nodes: int, closest: Closest | None = None, allowance: Allowance | None = None
            ) -> tuple[list[str], Candidate | None]:
    """Fewest most sensitive nodes to leave float so the model meets the budget (binary search over
    the ranking's prefixes: the error falls as more nodes stay float). Returns ([], None) if even
    ``max_nodes`` float nodes miss it."""
    allowance = allowance if allowance is not None else Allowance()
    order = [r["node"] for r in ranking]
    lo, hi = 1, min(max_nodes, len(order))
    if hi >= lo:
        allowance.plan(math.ceil(math.log2(hi - lo + 2)))
    best: tuple[list[str], Candidate] | None = None
    while lo <= hi and not allowance.over():
        k = (lo + hi) // 2
        c = checker.check(build(set(order[:k])), f"recovery_{k}")
        allowance.tick(f"the first {k} float")
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
                    max_nodes: int, closest: Closest | None = None, allowance: Allowance | None = None
                    ) -> tuple[list[str], Candidate | None, list[dict[str, Any]]]:
    """Nodes whose errors interact: a node that barely matters alone can matter a lot once another is
    float (a VAD's first encoder conv, after its STFT conv). Grow the float set one node at a time, each
    step adding whichever of the GREEDY_CANDIDATES most sensitive nodes lowers the error most with the
    set so far, until the budget is met (at most GREEDY_STEPS nodes). Returns (float nodes, candidate
    or None, the steps)."""
    allowance = allowance if allowance is not None else Allowance()
    pool = [r["node"] for r in ranking[:GREEDY_CANDIDATES]]
    chosen = pool[:1]  # the ranking's first is the best single node already
    steps: list[dict[str, Any]] = []
    rounds = range(1, min(GREEDY_STEPS, max_nodes, len(pool)))
    allowance.plan(sum(len(pool) - k for k in rounds))
    for _ in rounds:
        best: tuple[float, str, Candidate] | None = None
        for n in pool:
            if n in chosen or allowance.over():
                continue
            c = checker.check(build({*chosen, n}), "greedy")
            allowance.tick(f"+ {n}")
            if closest is not None:
                closest.note({*chosen, n}, c)
            if best is None or _error(c) < best[0]:
                best = (_error(c), n, c)
        if best is None or not math.isfinite(best[0]):
            break
        chosen.append(best[1])
        v = best[2].verdict
        steps.append({"float": list(chosen), "accuracy": v.what if v else None, "ok": bool(v is not None and v.ok)})
        log.info("quantize:   with %d nodes float (greedy, + %s): %s", len(chosen), best[1], v.what if v else None)
        if steps[-1]["ok"]:
            return _prune(chosen, best[2], build, checker, steps, allowance)
    return [], None, steps


def _prune(chosen: list[str], met: Candidate, build: Callable[[set[str]], onnx.ModelProto], checker: Checker,
           steps: list[dict[str, Any]], allowance: Allowance) -> tuple[list[str], Candidate, list[dict[str, Any]]]:
    """Drop from a float set that meets the budget each earlier pick the later ones made unnecessary."""
    keep = list(chosen)
    for n in chosen[-2::-1]:
        trial = [m for m in keep if m != n]
        c = checker.check(build(set(trial)), "greedy_prune")
        allowance.tick(f"- {n}")
        if c.scored and c.verdict.ok:
            keep, met = trial, c
            steps.append({"float": list(keep), "accuracy": c.verdict.what, "ok": True, "dropped": n})
            log.info("quantize:   %s no longer needed float: %s", n, c.verdict.what)
    return keep, met, steps


BLOCK_FRACTIONS = (0.1, 0.25, 0.4, 0.5)


def block_recovery(order: list[str], build: Callable[[set[str]], onnx.ModelProto], checker: Checker,
                   max_nodes: int, closest: Closest | None = None, allowance: Allowance | None = None
                   ) -> tuple[list[str], Candidate | None, list[dict[str, Any]]]:
    """Where node-by-node ranking finds no few culprits, the error is made along a stretch of the
    graph: leave float the first or the last 10%, 25%, ... of the quantized nodes (graph order) and
    keep the smallest stretch that meets the budget. Returns (float nodes, candidate, profile); the
    profile (the error with each stretch float) is the evidence of where the error is made."""
    allowance = allowance if allowance is not None else Allowance()
    profile: list[dict[str, Any]] = []
    n = len(order)
    sizes = [k for k in (max(1, math.ceil(frac * n)) for frac in BLOCK_FRACTIONS) if k <= max_nodes]
    allowance.plan(2 * len(sizes))
    for k in sizes:
        for where, stretch in (("first", order[:k]), ("last", order[n - k:])):
            if allowance.over():
                return [], None, profile
            c = checker.check(build(set(stretch)), f"block_{where}_{k}")
            allowance.tick(f"{where} {k} float")
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


@dataclass
class Recovery:
    """What recovery tried and found: the float nodes, the candidate that meets the budget (None: none
    did), and the report sensitivity.json keeps."""

    float_nodes: list[str]
    candidate: Candidate | None
    report: dict[str, Any]


METHOD = ("element-wise nodes on tensors with outlier channels first (outlier_nodes); then each node left float "
          f"alone, ranked by the output error that remains (lowest first; past {RANK_ALONE} nodes, {STRETCHES} "
          f"stretches of the graph first and node by node only in the {REFINED} whose float helps most); if no "
          "prefix of that ranking meets the budget, a float set grown greedily from the most sensitive nodes "
          "(greedy); then stretches of the graph (blocks); all within recovery's time allowance")


def recover_budget(model: onnx.ModelProto, start: MissedBudget, placed: Callable[[set[str]], onnx.ModelProto],
                   checker: Checker, max_float: int, allowance: Allowance, fallback: Checker | None = None
                   ) -> Recovery:
    """Recovery from ``start``: first the element-wise nodes on tensors with outlier channels (cheap float
    ops; the weighted ops around them keep int8), then the fewest most sensitive nodes, then stretches of
    the graph, each judged by ``checker`` (recovery's budget, with its margin) within ``allowance``. Where
    no float set meets it, the closest set tried is judged by ``fallback`` (the budget itself) and kept if
    it meets that."""
    ops = {n.name: n.op_type for n in iter_nodes(model.graph, QUANTIZED_BODIES)}
    base = {n: why for n, why in start.outliers.items() if n in start.units}
    report: dict[str, Any] = {"method": METHOD, "outlier_nodes": {}, "ranking": [], "stretches": [], "greedy": [],
                              "blocks": []}
    if base:
        allowance.plan(1)
        c = checker.check(placed(set(base)), "outliers")
        allowance.tick("outlier nodes float")
        log.warning("quantize: %d element-wise node(s) on tensors with outlier channels left float: %s",
                    len(base), c.verdict.what if c.verdict else c.error)
        if c.scored and c.verdict.error < start.verdict.error:
            report["outlier_nodes"] = base
            if c.verdict.ok:
                return _recovered(Recovery(sorted(base), c, report), len(start.units))
        else:
            base = {}
    rest = [n for n in ops if n in set(start.units) and n not in base]  # graph order

    def with_base(s: set[str]) -> onnx.ModelProto:
        return placed(set(s) | set(base))

    found = _search(rest, with_base, checker, max(1, max_float - len(base)), allowance, report)
    if found.candidate is None and fallback is not None:
        found = _closest(found, with_base, fallback, start.verdict)
    float_nodes = sorted(base) + found.float_nodes if found.candidate is not None else []
    for r in report["ranking"]:
        r["op_type"] = ops.get(r["node"])
        r["left_float"] = r["node"] in float_nodes
    return _recovered(Recovery(float_nodes, found.candidate, report), len(start.units), max_float)


@dataclass
class _Found:
    float_nodes: list[str]
    candidate: Candidate | None
    closest: Closest


def _search(rest: list[str], build: Callable[[set[str]], onnx.ModelProto], checker: Checker, limit: int,
            allowance: Allowance, report: dict[str, Any]) -> _Found:
    """The fewest nodes of ``rest`` (graph order) to leave float: the ranking's shortest prefix, else a set
    grown greedily, else a stretch of the graph (``report`` gets what each tried)."""
    closest = Closest()
    report["ranking"], report["stretches"] = rank_nodes(rest, build, checker, allowance, closest)
    float_nodes, found = recover(report["ranking"], build, checker, limit, closest, allowance)
    if found is None:  # culprits that only matter together
        float_nodes, found, report["greedy"] = greedy_recovery(report["ranking"], build, checker, limit, closest,
                                                               allowance)
    if found is None:  # no few culprits: the error is made along a stretch of the graph
        float_nodes, found, report["blocks"] = block_recovery(rest, build, checker, limit, closest, allowance)
        for b in report["blocks"]:
            log.info("quantize:   with the %s quantized nodes float: %s", b["float"], b["accuracy"] or b["error"])
    if allowance.over():
        log.warning("quantize: recovery's time allowance ran out (accuracy.recovery_time_factor); it keeps the "
                    "best float set it found")
    return _Found(float_nodes, found, closest)


def _closest(found: _Found, build: Callable[[set[str]], onnx.ModelProto], fallback: Checker,
             full: AccuracyVerdict) -> _Found:
    """Where no set met recovery's budget: the closest set tried, kept if it meets the budget itself."""
    near = found.closest
    if near.candidate is None or near.candidate.verdict.error >= full.error:
        return found
    c = fallback.check(build(set(near.float_nodes)), "closest")
    if not (c.scored and c.verdict.ok):
        return found
    log.warning("quantize: no float set meets the budget with recovery's margin; the closest (%d nodes) meets "
                "the budget itself: %s", len(near.float_nodes), c.verdict.what)
    return _Found(sorted(near.float_nodes), c, near)


def _recovered(found: Recovery, units: int, limit: int | None = None) -> Recovery:
    if found.candidate is not None:
        log.warning("quantize: leaving %d of %d quantized nodes float to meet the budget (%s): %s",
                    len(found.float_nodes), units, found.candidate.verdict.what, ", ".join(found.float_nodes))
    else:
        log.warning("quantize: even %d float nodes do not bring the PTQ model within the accuracy budget; "
                    "writing the full placement (autotune will ship the best model that meets it)", limit or units)
    return found
