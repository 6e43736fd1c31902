"""Loop and Scan bodies as standalone graphs, so the main graph's tools work inside them.

A body reads tensors of the graphs around it by name (outer-scope references). ``body_views`` gives
each Loop/Scan body as a model of its own: its inputs are the body's inputs plus the activations it
reads from outside, its initializers the body's plus the outer initializers it reads, so GraphIndex,
the placement rules and apply_plan treat it as a main graph (a weight of the enclosing graph is
quantized where the body uses it). The outer activations are marked in the view's metadata
(``OUTER_SCOPE_KEY``): they are calibrated in the graph that makes them, and unlike a graph's inputs
they do not count as quantized sources for placement (ORT's pass-through rule would otherwise
quantize all of x on every iteration to feed the Gather of x[t]). ``put_back`` returns an edited view
to its node; what it reads from outside stays an outer-scope reference. Views of views reach nested
bodies at any depth.

``thread_out`` makes body tensors observable for calibration (ONNX Runtime returns main-graph
tensors only): each one becomes an extra scan output of its body, stacked over the iterations by
its node (and by every enclosing Loop/Scan) into an extra output of the main graph.

Plans, rules and calibration.json name body nodes and tensors as they are in the model: ONNX keeps
names unique along a body's scope chain, and ``unique_names`` renames what sibling bodies share.
If bodies stay float: an If on fixed inputs is specialized away at export, and a branch of an If on
data would be calibrated on the samples that happen to take it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

from pipeline.graph.index import OUTER_SCOPE_KEY, GraphIndex
from pipeline.graph.model import outer_reads, subgraphs, tensor_elem_types
from pipeline.graph.shapes import infer_shapes

QUANTIZED_BODIES = ("Loop", "Scan")


def body(node: onnx.NodeProto) -> onnx.GraphProto:
    """The body of a Loop or Scan node."""
    return next(a.g for a in node.attribute if a.name == "body")


@dataclass(frozen=True)
class BodyView:
    """A Loop/Scan ``node`` of an enclosing model and its body as the standalone ``model``; ``outer``:
    the names the body reads from outside (inputs or initializers of ``model`` only)."""

    node: onnx.NodeProto
    model: onnx.ModelProto
    outer: frozenset[str]


def body_views(model: onnx.ModelProto) -> list[BodyView]:
    """A view of the body of every Loop/Scan node of ``model``'s graph (not of nested ones: take the
    views of a view for those)."""
    nodes = [n for n in model.graph.node if n.op_type in QUANTIZED_BODIES]
    if not nodes:
        return []
    g = GraphIndex(model)
    types = tensor_elem_types(model)
    infos = {vi.name: vi for vi in [*model.graph.input, *model.graph.value_info, *model.graph.output]}
    return [_view(model, n, g, types, infos) for n in nodes]


def _view(model: onnx.ModelProto, node: onnx.NodeProto, g: GraphIndex, types: dict[str, int],
          infos: dict[str, onnx.ValueInfoProto]) -> BodyView:
    graph = onnx.GraphProto()
    graph.CopyFrom(body(node))
    outer = sorted(outer_reads(graph))
    activations = []
    for t in outer:
        if t in g.inits:
            graph.initializer.append(g.inits[t])
            continue
        if t in infos and t not in g.constants:
            graph.input.append(infos[t])
        else:  # a constant made by a node, or an untyped tensor: never a Q/DQ candidate in the body
            graph.input.append(helper.make_tensor_value_info(t, 0 if t in g.constants else types.get(t, 0), None))
        if g.is_activation(t):
            activations.append(t)
    view = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    view.functions.extend(model.functions)
    view.metadata_props.add(key=OUTER_SCOPE_KEY, value=json.dumps(activations))
    typed = {vi.name for vi in [*graph.input, *graph.value_info, *graph.output]}
    if any(o and o not in typed for n in graph.node for o in n.output):
        # element types of the body's tensors (an exporter may not have written them)
        view = infer_shapes(view)
    return BodyView(node, view, frozenset(outer))


def walk_views(model: onnx.ModelProto) -> Iterator[BodyView]:
    """Views of every Loop/Scan body of ``model``, nested ones included (depth first)."""
    for v in body_views(model):
        yield v
        yield from walk_views(v.model)


def put_back(view: BodyView, edited: onnx.ModelProto) -> None:
    """Make ``edited`` (the view's model after changes to its nodes and initializers) the body of
    ``view.node`` (in place); the outer initializers it still reads stay outer-scope references."""
    b = body(view.node)
    del b.node[:]
    b.node.extend(edited.graph.node)
    del b.initializer[:]
    b.initializer.extend(i for i in edited.graph.initializer if i.name not in view.outer)


def fresh_name(taken: set[str], name: str) -> str:
    """``name``, or ``name_1``, ``name_2``, ... if taken; the result is added to ``taken``."""
    base, k = name, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def all_names(graph: onnx.GraphProto) -> set[str]:
    """Every value and node name of a graph and its subgraphs."""
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {o.name for o in graph.output}
    for n in graph.node:
        names.update(n.output)
        names.add(n.name)
        for sub in subgraphs(n):
            names |= all_names(sub)
    return names - {""}


def thread_out(model: onnx.ModelProto, tensors: Iterable[str]) -> tuple[onnx.ModelProto, dict[str, tuple[str, int]]]:
    """A copy of ``model`` in which each of ``tensors`` defined inside a Loop/Scan body (at any depth)
    is also an output of the main graph, stacked over iterations: tensor -> (main-graph output, number
    of leading iteration axes). Tensors of the main graph are not in the mapping."""
    if not any(n.op_type in QUANTIZED_BODIES for n in model.graph.node):
        return model, {}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    taken = all_names(out.graph)
    found = _thread(out.graph, set(tensors), taken)
    for name, _ in found.values():
        out.graph.output.append(helper.make_empty_tensor_value_info(name))
    return out, found


def _thread(graph: onnx.GraphProto, wanted: set[str], taken: set[str]) -> dict[str, tuple[str, int]]:
    found: dict[str, tuple[str, int]] = {}
    for node in graph.node:
        if node.op_type not in QUANTIZED_BODIES:
            continue
        b = body(node)
        inner = _thread(b, wanted, taken)
        defined = [i.name for i in b.input] + [o for n in b.node for o in n.output]
        here = {t: (t, 0) for t in defined if t in wanted} | inner
        if not here:
            continue
        types = {vi.name: vi.type.tensor_type.elem_type for vi in [*b.input, *b.value_info, *b.output]}
        # a Loop has one output per body output but the condition, a Scan one per body output; trailing
        # optional outputs may be left out, and the new scan outputs come after all of them
        expected = len(b.output) - (1 if node.op_type == "Loop" else 0)
        node.output.extend([""] * (expected - len(node.output)))
        for t, (src, axes) in here.items():
            mid = fresh_name(taken, f"{t}__calibration")
            b.node.append(helper.make_node("Identity", [src], [mid], name=fresh_name(taken, f"{mid}/Identity")))
            b.output.append(helper.make_tensor_value_info(mid, types.get(src) or TensorProto.FLOAT, None))
            node.output.append(fresh_name(taken, f"{t}__stacked"))
            found[t] = (node.output[-1], axes + 1)
        if node.op_type == "Scan":
            for attr in node.attribute:
                if attr.name in ("scan_output_axes", "scan_output_directions"):
                    attr.ints.extend([0] * len(here))
    return found


def unique_names(model: onnx.ModelProto) -> int:
    """Name every node inside a Loop/Scan body, and rename the values a body defines that another
    graph of the model defines too (sibling bodies may repeat names), so that node and tensor names
    are unique across the model (in place, float-exact). Returns how many names were given or changed."""
    g = model.graph
    values = {i.name for i in g.input} | {i.name for i in g.initializer} | {o for n in g.node for o in n.output}
    nodes = {n.name for n in g.node}
    return sum(_unique_in(body(n), values, nodes, n.name or n.op_type) for n in g.node
               if n.op_type in QUANTIZED_BODIES)


def _unique_in(graph: onnx.GraphProto, values: set[str], nodes: set[str], prefix: str) -> int:
    defined = list(dict.fromkeys([*(i.name for i in graph.input), *(i.name for i in graph.initializer),
                                  *(o for n in graph.node for o in n.output if o)]))
    mine = set(defined)
    rename = {}
    for t in defined:
        if t in values:
            rename[t] = fresh_name(values | mine, f"{prefix}/{t}")
            mine.add(rename[t])
    if rename:
        _rename(graph, rename)
    values.update(rename.get(t, t) for t in defined)
    changed = len(rename)
    for k, n in enumerate(graph.node):
        if not n.name or n.name in nodes:
            n.name = fresh_name(nodes, f"{prefix}/{n.name or f'{n.op_type}_{k}'}")
            changed += 1
        nodes.add(n.name)
    for n in graph.node:
        if n.op_type in QUANTIZED_BODIES:
            changed += _unique_in(body(n), values, nodes, n.name)
    return changed


def _rename(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Rename values everywhere in ``graph`` and its subgraphs (they cannot redefine a name in scope)."""
    for vi in [*graph.input, *graph.output, *graph.value_info, *graph.initializer]:
        vi.name = mapping.get(vi.name, vi.name)
    for n in graph.node:
        for i, t in enumerate(n.input):
            n.input[i] = mapping.get(t, t)
        for i, t in enumerate(n.output):
            n.output[i] = mapping.get(t, t)
        for sub in subgraphs(n):
            _rename(sub, mapping)
