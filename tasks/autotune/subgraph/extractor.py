"""Standalone ONNX models of fusion groups (subgraph mode, phase 2).

Boundary shapes come from one run of the float model in ONNX Runtime with the boundary tensors
added as outputs, at the model's static shapes or, for a dynamic-shape model, at the opt shapes
(``model.input_shapes`` recorded at export, else the backend's optimization profile). A run gives
the exact shape and element type of every tensor, also where shape inference stops (custom ops,
control flow, data-dependent Reshapes). Extracted subgraphs keep the original tensor and node
names, so calibrated ranges and node rules apply to them unchanged, and get static shapes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pipeline.errors import StageError, first_line
from pipeline.graph import weights
from pipeline.graph.index import GraphIndex
from pipeline.graph.model import graph_inputs, input_specs
from tasks.autotune.region.region import Region, RegionType


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    elem_type: int


def tensor_infos(model: onnx.ModelProto, tensors: list[str], shapes: dict[str, list[int]] | None = None
                 ) -> dict[str, TensorInfo]:
    """Shape and element type of each tensor in one ORT run of ``model`` on seeded inputs."""
    from pipeline.backends.onnxruntime.session import inference_session, ort_session_options
    from pipeline.data.adapters import fixed_feeds

    specs = input_specs(model, shapes)
    inputs = {vi.name for vi in graph_inputs(model)}
    feeds = fixed_feeds(specs)
    try:
        sess = inference_session(model, ort_session_options("disable"), extra_outputs=[t for t in tensors if t not in inputs])
        names = [o.name for o in sess.get_outputs()]
        values = dict(zip(names, sess.run(names, feeds), strict=True))
    except Exception as exc:  # noqa: BLE001 - ORT's errors are generic
        raise StageError(f"autotune: cannot run the float model to read subgraph boundary shapes: "
                         f"{first_line(exc)}") from None
    values.update(feeds)
    out = {}
    for t in tensors:
        v = np.asarray(values[t])
        out[t] = TensorInfo(tuple(int(d) for d in v.shape), helper.np_dtype_to_tensor_dtype(v.dtype))
    return out


def extract_subgraph(index: GraphIndex, nodes: list[int], infos: dict[str, TensorInfo],
                     name: str) -> tuple[onnx.ModelProto, Region]:
    """The nodes of ``index.model`` as a model of their own (static boundary shapes from ``infos``),
    and the LEAF region covering it. Constant-node outputs it reads become initializers; other
    inputs are graph inputs."""
    model = index.model
    g = model.graph
    ins, outs = index.boundaries(nodes)
    sub_nodes = [g.node[i] for i in sorted(nodes)]
    used = {t for n in sub_nodes for t in n.input if t}
    initializers = [index.inits[t] for t in sorted(used) if t in index.inits]
    graph_ins = []
    for t in ins:
        p = index.producer.get(t)
        value = next((a.t for a in p.attribute if a.name == "value"), None) if p is not None and \
            p.op_type == "Constant" else None
        if value is not None:
            arr = weights.array(value)
            initializers.append(numpy_helper.from_array(arr, t))
            continue
        info = infos[t]
        graph_ins.append(helper.make_tensor_value_info(t, info.elem_type, list(info.shape)))
    graph_outs = [helper.make_tensor_value_info(t, infos[t].elem_type, list(infos[t].shape)) for t in outs]
    graph = helper.make_graph(sub_nodes, name, graph_ins, graph_outs, initializers)
    sub = helper.make_model(graph, opset_imports=list(model.opset_import), producer_name="qdq-tune")
    sub.ir_version = model.ir_version
    sub.functions.extend(model.functions)
    # element types of the tensors inside (GraphIndex tells activations by their float type)
    known = {vi.name: vi for vi in model.graph.value_info}
    sub.graph.value_info.extend(known[o] for n in sub_nodes for o in n.output if o in known and o not in outs)
    try:
        sub = onnx.shape_inference.infer_shapes(sub)
    except Exception:  # noqa: BLE001 - best effort (custom ops); the copied value_info stands
        pass
    consts = {v.name for v in initializers}
    region = Region(0, RegionType.LEAF, 1, nodes=list(range(len(sub_nodes))),
                    inputs=[t for t in ins if t not in consts], outputs=outs)
    return sub, region


def reuse_key(signature: str, model: onnx.ModelProto, order: list[int], infos: dict[str, TensorInfo],
              inputs: list[str]) -> str:
    """Groups measured once for all: same structure (signature), same boundary input shapes and the
    same weight shapes, node by node in canonical order."""
    inits = {i.name: tuple(i.dims) for i in model.graph.initializer}
    weight_shapes = [[inits.get(t) for t in model.graph.node[i].input] for i in order]
    text = json.dumps([signature, sorted(list(infos[t].shape) for t in inputs if t in infos), weight_shapes],
                      default=list)
    return hashlib.sha256(text.encode()).hexdigest()[:16]

