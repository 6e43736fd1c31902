"""Which nodes of a quantized model are to blame: the nodes an ONNX Runtime error names (``culprits``),
the nodes to leave float so the model runs at all (``runnable``), and group testing for a fault some
nodes show (``localize``)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import onnx

from pipeline.errors import StageError
from pipeline.graph.bodies import walk_views
from pipeline.graph.index import GraphIndex
from pipeline.graph.model import WEIGHTED_OPS
from tasks.quantize.checker import Checker

log = logging.getLogger("tune.quantize")

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
             max_rounds: int = 8) -> tuple[set[str], onnx.ModelProto]:
    """(nodes to leave float so that the quantized model loads and runs, both with the fused kernels
    and as plain Q/DQ math, each one logged with the runtime's reason; the model built without them,
    which ``checker`` checks next without writing and preparing it again)."""
    skip: set[str] = set()
    for _ in range(max_rounds):
        model = build(skip)
        error = checker.runs(model)
        if error is None:
            return skip, model
        found = culprits(error, model, originals) - skip
        if not found:
            raise StageError(f"quantize: the quantized model does not run in {checker.backend.name} ({error}) and "
                             f"the failing node could not be left float; add it to quantize.skip_names")
        log.warning("quantize: %s left float: %s cannot run its quantized form (%s)", ", ".join(sorted(found)),
                    checker.backend.name, error)
        skip |= found
    raise StageError(f"quantize: the quantized model still does not run after leaving {len(skip)} nodes float "
                     f"({', '.join(sorted(skip))}); add the failing nodes to quantize.skip_names")


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
