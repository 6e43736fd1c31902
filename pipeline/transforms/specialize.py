"""Specialize a model on inputs the user fixes (``model.fixed_inputs``): the If nodes those inputs (and
the static shapes) decide are replaced by their taken branch.

Voice-activity detectors and streaming audio models put all their compute inside an If on a scalar
such as the sample rate, and inside that, small Ifs on shapes. With the scalar fixed and the shapes
static every condition is a constant: the fixed input becomes an initializer, constant folding
(onnx-graphsurgeon, without its subgraph flattening, which drops branch outputs fed by nested Ifs)
turns the conditions into initializers, and each If whose condition is an initializer is inlined,
until none is left to decide. The other branch is not in the deployed model. The export stage checks
the specialized model against the original on the calibration feeds before writing it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pipeline.errors import InputError
from pipeline.graph import weights
from pipeline.graph.shapes import infer_shapes
from pipeline.transforms.folding import fold_graph

log = logging.getLogger("tune.export")

METADATA_KEY = "qdq_tune.fixed_inputs"
# fold / inline rounds: each round inlines the Ifs decided so far, which exposes the next level
MAX_ROUNDS = 16


def fixed_arrays(model: onnx.ModelProto, fixed: Mapping[str, Any], source: str) -> dict[str, np.ndarray]:
    """``model.fixed_inputs`` as arrays of each input's element type and declared rank; InputError (one
    line) for a name the model does not have or a value that does not fit the input."""
    inputs = {i.name: i for i in model.graph.input}
    out = {}
    for name, value in fixed.items():
        vi = inputs.get(name)
        if vi is None:
            raise InputError(f"model.fixed_inputs names '{name}', but {source} has inputs {sorted(inputs)}")
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        try:
            arr = np.asarray(value, dtype=dtype)
        except (TypeError, ValueError):
            raise InputError(f"model.fixed_inputs.{name}={value!r} is not a {np.dtype(dtype).name} value") from None
        dims = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.HasField("shape") and (
                len(dims) != arr.ndim or any(d is not None and d != s for d, s in zip(dims, arr.shape, strict=True))):
            raise InputError(f"model.fixed_inputs.{name} has shape {list(arr.shape)}, but {source} declares "
                             f"{[d if d is not None else 'N' for d in dims]}")
        out[name] = arr
    return out


def describe(fixed: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """JSON form of fixed values (for metadata, the manifest and messages)."""
    return {k: v.tolist() for k, v in fixed.items()}


def recorded_fixed_inputs(model: onnx.ModelProto) -> dict[str, Any]:
    """The fixed values a specialized model was made for (its metadata), {} for any other model."""
    for p in model.metadata_props:
        if p.key == METADATA_KEY:
            return json.loads(p.value)
    return {}


def bind_inputs(model: onnx.ModelProto, fixed: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` whose ``fixed`` inputs are initializers holding those values (recorded in
    its metadata), so nothing can feed them."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = [i for i in out.graph.input if i.name not in fixed]
    del out.graph.input[:]
    out.graph.input.extend(keep)
    out.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in fixed.items())
    props = [p for p in out.metadata_props if p.key != METADATA_KEY]
    del out.metadata_props[:]
    out.metadata_props.extend(props)
    out.metadata_props.add(key=METADATA_KEY, value=json.dumps(describe(fixed)))
    return out


def _graph_names(graph: onnx.GraphProto) -> set[str]:
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    for n in graph.node:
        names.update(n.output)
        for a in n.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                names |= _graph_names(g)
    return names


def _inline_decided_ifs(model: onnx.ModelProto) -> list[dict[str, str]]:
    """Replace (in place) every main-graph If whose condition is an initializer by its taken branch;
    the branch's outputs reach the If's outputs through Identity nodes. Returns what was inlined."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    inlined = []
    nodes: list[onnx.NodeProto] = []
    for node in g.node:
        cond = inits.get(node.input[0]) if node.op_type == "If" and node.input else None
        if cond is None:
            nodes.append(node)
            continue
        value = weights.array(cond)
        if value.size != 1:
            nodes.append(node)
            continue
        taken = "then_branch" if bool(value.reshape(-1)[0]) else "else_branch"
        branch = next(a.g for a in node.attribute if a.name == taken)
        outer = _graph_names(g) - _graph_names(branch)
        clash = {o for n in branch.node for o in n.output} & outer
        if clash:  # a branch tensor shadows an outer name: leave this If as it is
            log.debug("If %s not inlined: its %s reuses the names %s", node.name, taken, sorted(clash)[:3])
            nodes.append(node)
            continue
        nodes.extend(branch.node)
        g.initializer.extend(branch.initializer)
        for i, (src, dst) in enumerate(zip(branch.output, node.output, strict=True)):
            if dst:
                nodes.append(helper.make_node("Identity", [src.name], [dst], name=f"{node.name}/{taken}/out{i}"))
        inlined.append({"node": node.name, "branch": taken.replace("_branch", "")})
    if inlined:
        del g.node[:]
        g.node.extend(nodes)
    return inlined


def _fold(model: onnx.ModelProto) -> onnx.ModelProto:
    return fold_graph(infer_shapes(model), flatten_subgraphs=False)


def specialize(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[dict[str, str]]]:
    """Fold and inline decided Ifs until none is left (``model``'s fixed inputs already bound and its
    input shapes static). Returns the model and the Ifs inlined, outermost first."""
    inlined: list[dict[str, str]] = []
    for _ in range(MAX_ROUNDS):
        model = _fold(model)
        done = _inline_decided_ifs(model)
        if not done:
            break
        inlined += done
    return model, inlined
