"""From a region assignment to a QDQPlan: which tensors get Q/DQ for which consumers, which weights
are quantized, and where ONNX Runtime gets an int32 bias."""

from __future__ import annotations

from typing import Any

import onnx

from pipeline.graph.index import GraphIndex, through_shape_ops, weight_inputs
from pipeline.graph.model import WEIGHTED_OPS
from pipeline.quant.placement import (
    PLACEMENTS,
    NodeDtypes,
    act_dtype,
    input_dtype,
    int32_bias,
    pass_through_aliases,
    too_small,
    weight_q,
)
from pipeline.quant.plan import ActivationQ, QDQPlan
from tasks.autotune.region.insertion_points import InsertionPoint, resolve
from tasks.autotune.region.region import Region
from tasks.autotune.region.scheme import InsertionScheme


class PlanBuilder:
    """build_plan of QDQAutotunerBase (a mixin: it reads the autotuner's regions, graph and dtypes)."""

    model: onnx.ModelProto
    index: GraphIndex
    regions: list[Region]
    orders: dict[int, list[int]]
    config: Any
    _dtypes: dict[str, NodeDtypes]

    def build_plan(self, assignment: dict[int, InsertionScheme]) -> QDQPlan:
        plan = QDQPlan()
        g = self.index
        weight_nodes: set[str] = set()
        weights_only: set[str] = set()  # their activations stay float: no int32 bias for them
        act: dict[tuple[str, str], set[tuple[str, int]] | None] = {}
        for r in self.regions:
            scheme = assignment.get(r.id)
            if scheme is None:
                continue
            order = self.orders[r.id]
            for p in scheme.points:
                rp = resolve(p, r, order, self.model, g)
                if rp is None:
                    continue
                if rp.tensor is None:
                    weights_only.add(rp.weight_node)
                    continue
                dtype = self._dtype_for(p, rp, r, order)
                if dtype is None:
                    continue
                key = (rp.tensor, dtype)
                if rp.consumers is None or act.get(key, set()) is None:
                    act[key] = None
                else:
                    act.setdefault(key, set()).update(rp.consumers)  # type: ignore[union-attr]
                if rp.weight_node:
                    weight_nodes.add(rp.weight_node)
                if rp.consumers:
                    for name, _ in rp.consumers:
                        plan.node_rules[name] = self._dtypes[name].rule if name in self._dtypes else "autotune"
        for (tensor, dtype), who in sorted(act.items(), key=lambda kv: kv[0]):
            plan.activations.append(ActivationQ(tensor, dtype, None if who is None else tuple(sorted(who))))
        outputs_q = {t for (t, _), who in act.items() if who is None}
        kind = PLACEMENTS[self.config.placement]
        if kind.reshaped_reads:
            weight_nodes |= self._reshaped_reads(act)
        weights_only -= weight_nodes
        for name in sorted(weight_nodes | weights_only):
            node = g.nodes[name]
            d = self._dtypes.get(name)
            if d is None or d.weights == "native":
                continue
            for i in weight_inputs(g, node):
                plan.weights.append(weight_q(node, i, g.weight_shape(node.input[i]), d.weights,
                                             weight_range=self.config.weight_range))
            if (kind.int32_bias and d.weights == "int8" and node.op_type in ("MatMul", "Gemm")
                    and name not in weights_only and g.tail(node) not in outputs_q):
                b = int32_bias(g, node, act_dtype(d, self.config.activation_type))
                if b is not None:
                    plan.biases.append(b)  # float-output QGemm (see pipeline.quant.placement.int32_bias)
        plan.aliases.update(pass_through_aliases(g, plan))
        return plan

    def _reshaped_reads(self, act: dict[tuple[str, str], set[tuple[str, int]] | None]) -> set[str]:
        """Weighted nodes that read a quantized tensor through shape-only ops (a classifier head's
        pooled features through Flatten): OpenVINO moves the DequantizeLinear through the reshape to
        the node, which runs int8 only with its weights quantized too."""
        readers: dict[str, set[tuple[str, int]] | None] = {}
        for (tensor, _), who in act.items():
            seen = readers.get(tensor, set())
            readers[tensor] = None if who is None or seen is None else seen | who
        return {name for name, (source, reader) in self._reshaping_readers().items()
                if source in readers and (readers[source] is None or reader in readers[source])}

    def _reshaping_readers(self) -> dict[str, tuple[str, tuple[str, int]]]:
        """Node -> (the tensor its activation reshapes, that tensor's reader) for the weighted nodes
        whose rule quantizes their weights and that read through shape-only ops; the graph is walked
        once per rule set, not once per candidate plan."""
        cached = getattr(self, "_reshaping_cache", None)
        if cached is not None and cached[0] is self._dtypes:
            return cached[1]
        g = self.index
        found = {}
        for name, node in g.nodes.items():
            d = self._dtypes.get(name)
            if (node.op_type not in WEIGHTED_OPS or not weight_inputs(g, node) or d is None or d.weights == "native"
                    or too_small(g, node, d.weights)):
                continue
            source, reader = through_shape_ops(g, node.input[0])
            if reader is not None:
                found[name] = (source, reader)
        self._reshaping_cache = (self._dtypes, found)
        return found

    def _dtype_for(self, p: InsertionPoint, rp, region: Region, order: list[int]) -> str | None:
        """Storage dtype at a point: the consumer's rule for an input, the producer's for an output."""
        if p.kind == "node_output":
            name: str | None = self.model.graph.node[order[p.index]].name
        elif rp.consumers:
            name = rp.consumers[0][0]
        else:
            prod = self.index.producer.get(rp.tensor)
            name = prod.name if prod is not None else None
            if name not in self._dtypes:
                cons = self.index.consumers.get(rp.tensor, [])
                name = cons[0][0].name if cons else None
        d = self._dtypes.get(name) if name else None
        if d is None or d.activations == "native":
            return None
        if p.kind != "node_output" and rp.consumers:  # stored as its consumer's placement rule says
            return input_dtype(PLACEMENTS[self.config.placement], self.index.nodes[name], d, self.config.activation_type)
        return act_dtype(d, self.config.activation_type)
