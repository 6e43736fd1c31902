"""The quantize stage's accuracy checks: candidate models judged on the held-out batches, the nodes the
runtime cannot run quantized, and which weight storage this CPU computes exactly.

``Checker`` runs candidate models on the held-out calibration batches: on the runtime's own fused
kernels for ONNX Runtime and OpenVINO placements (what will be deployed), as plain Q/DQ math on ONNX
Runtime for TensorRT placements (TensorRT's integer kernels are exact; its numbers cannot be measured
on this machine). Which nodes
stay float to meet the budget is recovery's; the decisions that use both are _decide's.
"""

from __future__ import annotations

import contextvars
import logging
import math
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import onnx

from pipeline.accuracy.budget import AccuracyBudget, AccuracyVerdict
from pipeline.accuracy.decisions import StorageCheck
from pipeline.accuracy.fidelity import FidelityResult
from pipeline.accuracy.holdout import Holdout
from pipeline.backends.base import Backend
from pipeline.errors import StageError, first_line
from pipeline.graph.bodies import walk_views
from pipeline.graph.index import GraphIndex
from pipeline.graph.model import WEIGHTED_OPS, save_model
from pipeline.quant.plan import WeightVariant
from pipeline.values import enum_value

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

    def record(self) -> StorageCheck:
        """What calibration.json keeps of the check (its model file is gone after the stage)."""
        return StorageCheck(self.name, self.error, self.latency_p10_ms, self.fidelity, self.verdict)


@dataclass
class Checker:
    backend: Backend  # ONNX Runtime, or OpenVINO for its placement
    holdout: Holdout
    budget: AccuracyBudget
    fused: bool  # run with the backend's fused kernels (ORT placement) or as plain Q/DQ math
    workdir: Path

    def write(self, model: onnx.ModelProto, name: str) -> Path:
        return save_model(model, self.workdir / f"{name}.onnx", share_weights=True)

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
        return self._judge(*self._load(model, name), fidelity)

    def check_each(self, models: Iterable[tuple[onnx.ModelProto, str]]) -> Iterator[Candidate]:
        """``check`` of each (model, name) in turn, each model written and built by the runtime in a
        worker thread while the one before runs on the holdout: a runtime's build (OpenVINO's compile,
        ONNX Runtime's session) releases the GIL and is most of a check's time on small models. Names
        must differ from one model to the next (their files are written side by side)."""
        it = iter(models)
        with ThreadPoolExecutor(1, thread_name_prefix="qdq-tune-check") as pool:
            item = next(it, None)
            # the worker runs in this run's context (its threads, progress, weights folder: ContextVars)
            pending = pool.submit(contextvars.copy_context().run, self._load, *item) if item is not None else None
            try:
                while pending is not None:
                    item = next(it, None)  # built here (Python) while the worker builds the runtime's model
                    loaded = pending.result()
                    pending = pool.submit(contextvars.copy_context().run, self._load, *item) \
                        if item is not None else None
                    yield self._judge(*loaded)
            finally:  # a caller that stops early: the model loaded ahead is closed
                if pending is not None and (ahead := pending.result()[1]) is not None:
                    ahead.close()

    def _load(self, model: onnx.ModelProto, name: str) -> tuple[Candidate, Any]:
        """(the candidate, its prepared model or None where the runtime cannot load it)."""
        c = Candidate(name, self.write(model, name))
        try:
            return c, self.backend.prepare(c.path) if self.fused else self.backend.prepare_reference(c.path)
        except Exception as exc:  # noqa: BLE001 - a model the runtime cannot load is a rejected candidate
            c.error = f"{self.backend.name} cannot load it: {first_line(exc)}"
            return c, None

    def _judge(self, c: Candidate, pm: Any, fidelity: bool = False) -> Candidate:
        from pipeline.accuracy.fidelity import kernel_fidelity

        if pm is None:
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


@dataclass(frozen=True)
class WeightStorage:
    """The weight storage chosen for a placement: ``chosen`` is the checked candidate of the placement
    that will be written, ``checked`` every candidate tried (calibration.json's ``variants``)."""

    weight_range: WeightVariant
    reason: str
    chosen: Candidate
    checked: list[Candidate]
    culprits: list[str] = field(default_factory=list)  # left float: their fused kernels disagree


def choose_weight_range(build: Callable[..., onnx.ModelProto], checker: Checker, requested: str,
                        saturates: bool | None, measure: Callable[[list[Path]], list[float | None]],
                        units: list[str] | None = None) -> WeightStorage:
    """The weight storage of an ORT placement, with the culprit nodes to leave float.

    ``build(weight_range, float_nodes)`` places the model. ``auto``: full range where the fused kernels
    agree with the Q/DQ reference and the CPU has int8 dot-product instructions. Where they disagree on
    a CPU whose u8 x s8 kernels are not known to saturate, the disagreement is first localized to the
    quantized ``units`` responsible (group testing on models with only some units quantized): a few
    culprits stay float and the rest keeps full-range weights; only a fault most units show (or any on
    a saturating CPU) switches the whole model to the fastest exact storage that meets the budget
    (else the most accurate exact one). A forced value is checked and reported, not changed.
    """
    if requested != "auto":
        forced = WeightVariant.of(requested)
        cand = checker.check(build(forced), forced.candidate, fidelity=True)
        return WeightStorage(forced, f"quantize.weight_range={forced}", cand, [cand])
    full = checker.check(build(WeightVariant.full), WeightVariant.full.candidate, fidelity=True)
    if full.usable and not saturates:
        return WeightStorage(WeightVariant.full, "fused kernels agree with the Q/DQ reference", full, [full])
    why = ("u8s8 kernels saturate (AVX2 without VNNI) on a CPU it must run on" if saturates else
           f"this CPU's fused kernels disagree with the Q/DQ reference ({full.fidelity.reason if full.fidelity else full.error})")
    if not saturates and full.error is None and units:
        kept, why = _localized(build, checker, full, why, saturates, units)
        if kept is not None:
            return kept
    return _exact_storage(build, checker, full, why, measure)


def _localized(build: Callable[..., onnx.ModelProto], checker: Checker, full: Candidate, why: str,
               saturates: bool | None, units: list[str]) -> tuple[WeightStorage | None, str]:
    """(full-range weights with the culprits among ``units`` left float, or None; ``why`` completed):
    the fused kernels' disagreement with the Q/DQ reference localized by group testing."""
    everything = set(units)

    def fails(quantized: set[str]) -> bool:
        c = checker.check(build(WeightVariant.full, everything - quantized), "fidelity_localize", fidelity=True)
        return c.error is None and c.fidelity is not None and not c.fidelity.ok

    culprits = localize(list(units), fails)
    if culprits and len(culprits) * 2 <= len(units):
        fixed = checker.check(build(WeightVariant.full, set(culprits)), WeightVariant.full.candidate, fidelity=True)
        if fixed.usable:
            log.warning("quantize: %s; localized to %d node(s) left float: %s", why, len(culprits),
                        ", ".join(culprits))
            return WeightStorage(WeightVariant.full, (f"full-range int8 weights; {len(culprits)} node(s) whose fused kernels "
                                          f"disagree with the Q/DQ reference left float: {', '.join(culprits)}"),
                                 fixed, [fixed], culprits), why
    if saturates is False and not culprits:
        # exact kernels and no node to blame: what differs is the model's own quantization noise
        log.warning("quantize: %s, but no node is responsible on its own; keeping full-range weights on a CPU "
                    "whose u8s8 kernels are exact", why)
        return WeightStorage(WeightVariant.full, f"full-range int8 weights ({why}; no culprit node: not a kernel fault)",
                             full, [full]), why
    if culprits:
        why += f"; {len(culprits)} of {len(units)} quantized nodes show it"
    return None, why


def _exact_storage(build: Callable[..., onnx.ModelProto], checker: Checker, full: Candidate, why: str,
                   measure: Callable[[list[Path]], list[float | None]]) -> WeightStorage:
    """The fastest exact weight storage (7-bit or uint8) within the budget, else the most accurate one."""
    exact_variants = (WeightVariant.reduced, WeightVariant.uint8)
    variants = [checker.check(build(v), v.candidate, fidelity=True) for v in exact_variants]
    exact = [(v, c) for v, c in zip(exact_variants, variants, strict=True) if c.usable]
    if not exact:
        raise StageError(f"quantize: no int8 weight storage runs exactly on this CPU ({why}; "
                         + "; ".join(f"{c.name}: {c.error or c.fidelity.reason}" for c in variants)
                         + "); use backend=tensorrt or quantize=none")
    for (_, c), t in zip(exact, measure([c.path for _, c in exact]), strict=True):
        c.latency_p10_ms = t
    within = [c for _, c in exact if c.scored and c.verdict.ok]
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
        best = min((c for _, c in exact), key=lambda c: c.verdict.error if c.verdict else math.inf)
        rule = "most accurate exact variant; none meets the budget"
    choice = next(v for v, c in exact if c is best)
    desc = {WeightVariant.reduced: "weights use 7-bit range",
            WeightVariant.uint8: "weights stored as uint8 (U8U8 kernels)"}[choice]
    timing = ", ".join(f"{v} {c.latency_p10_ms:.3f} ms" for v, c in exact if c.latency_p10_ms is not None)
    snr = ", ".join(f"{v} {c.verdict.what}" for v, c in exact if c.scored)
    return WeightStorage(choice, f"{desc}: {why} ({rule}; p10 {timing}; {snr})", best, [full, *variants])


def start_range(requested: Any, saturates: bool = False) -> WeightVariant:
    """The weight storage candidates are first built with (the transforms' and ranges' held-out errors
    are measured on it): ``quantize.weight_range``; auto starts from full range, or from uint8 where
    the fused kernels that will run the model saturate with full-range int8 weights (``saturates``),
    since errors measured through saturated sums would choose ranges and transforms for the fault."""
    if enum_value(requested) != "auto":
        return WeightVariant.of(requested)
    return WeightVariant.uint8 if saturates else WeightVariant.full


def recovery_checker(checker: Checker, cfg: Any) -> Checker:
    """``checker`` with the budget accuracy.recovery_margin_db inside itself, for recovery's searches."""

    return replace(checker, budget=checker.budget.tightened(float(cfg.accuracy.recovery_margin_db)))
