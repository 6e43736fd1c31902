"""ONNX graph helpers shared by every stage: loading with clear errors, input specs, static shapes,
content hashes, topological order and tensor-type lookups."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pipeline.artifacts import atomic_output, sha256_bytes
from pipeline.errors import InputError


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    # exclusive upper bound for integer inputs used as indices (e.g. token ids into an embedding)
    int_high: int | None = None

    @property
    def batch(self) -> int:
        return self.shape[0] if self.shape else 1


def check_onnx_path(path: str | os.PathLike, what: str = "model") -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise InputError(f"{what} file {p} does not exist; give the path of an existing .onnx file")
    if p.is_dir():
        raise InputError(f"{what} path {p} is a folder; give the path of an .onnx file")
    if p.suffix.lower() != ".onnx":
        raise InputError(f"{what} file {p} is not an ONNX file (name must end in .onnx)")
    return p


def load_model(path: str | os.PathLike, what: str = "model", check: bool = True) -> onnx.ModelProto:
    """Load and check an ONNX file, turning every failure into an InputError naming the file."""
    p = check_onnx_path(path, what)
    try:
        model = onnx.load(str(p))
    except Exception as exc:  # noqa: BLE001 - protobuf raises several types for garbage
        raise InputError(f"{what} file {p} could not be read as ONNX ({type(exc).__name__}: {exc})") from None
    if check:
        try:
            onnx.checker.check_model(model if model.ByteSize() < 2**31 - 1 else str(p))
        except onnx.checker.ValidationError as exc:
            first = str(exc).strip().splitlines()[0]
            raise InputError(f"{what} file {p} fails onnx.checker: {first}") from None
    return model


def save_model(model: onnx.ModelProto, path: str | os.PathLike, external_data: bool = False) -> Path:
    """Atomically write an ONNX model (external data for > 2 GB models or when asked)."""
    target = Path(path)
    if external_data or model.ByteSize() > 2**31 - 1:
        data_name = target.name + ".data"
        with atomic_output(target) as tmp:
            onnx.save_model(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name, size_threshold=1024)
            # onnx writes the data next to tmp under data_name; it is already at its final place
        return target
    with atomic_output(target) as tmp:
        tmp.write_bytes(model.SerializeToString())
    return target


def model_hash(model: onnx.ModelProto | bytes | str | os.PathLike) -> str:
    if isinstance(model, onnx.ModelProto):
        data = model.SerializeToString(deterministic=True)
    elif isinstance(model, bytes):
        data = model
    else:
        data = Path(model).read_bytes()
    return sha256_bytes(data)


def _dims(vi: onnx.ValueInfoProto) -> list[int | str]:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return []
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def dynamic_inputs(model: onnx.ModelProto) -> dict[str, list[int | str]]:
    """Inputs with at least one non-static dim, with their dims."""
    out = {}
    for vi in graph_inputs(model):
        dims = _dims(vi)
        if not vi.type.tensor_type.HasField("shape") or any(not isinstance(d, int) or d <= 0 for d in dims):
            out[vi.name] = dims
    return out


def fix_input_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]], source: str) -> onnx.ModelProto:
    """Make every graph input static, using ``shapes`` for the dynamic ones; re-infer shapes."""
    names = {vi.name for vi in graph_inputs(model)}
    unknown = sorted(set(shapes) - names)
    if unknown:
        raise InputError(f"model.input_shapes names {unknown}, but {source} has inputs {sorted(names)}")
    dyn = dynamic_inputs(model)
    still = {k: v for k, v in dyn.items() if k not in shapes}
    if still:
        hint = ",".join(f"{k}: [{', '.join(str(d) if isinstance(d, int) and d > 0 else 'N' for d in v)}]"
                        for k, v in still.items())
        raise InputError(
            f"{source} has dynamic input dims {still}; static shapes are needed: pass "
            f"model.input_shapes='{{{hint}}}' with numbers for every N"
        )
    for vi in graph_inputs(model):
        if vi.name not in shapes:
            continue
        want = [int(d) for d in shapes[vi.name]]
        dims = _dims(vi)
        if dims and len(dims) != len(want):
            raise InputError(f"model.input_shapes.{vi.name}={want} has rank {len(want)}, "
                             f"but {source} declares rank {len(dims)} ({dims})")
        for d, (cur, new) in enumerate(zip(dims, want, strict=False)):
            if isinstance(cur, int) and cur > 0 and cur != new:
                raise InputError(f"model.input_shapes.{vi.name}[{d}]={new} conflicts with the static "
                                 f"dim {cur} in {source}")
        shape = vi.type.tensor_type.shape
        del shape.dim[:]
        for n in want:
            shape.dim.add().dim_value = n
    # intermediate value_info may carry stale symbolic dims; drop and re-infer
    del model.graph.value_info[:]
    for out in model.graph.output:
        for d in out.type.tensor_type.shape.dim:
            if not d.HasField("dim_value"):
                d.Clear()
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - shape inference is best effort for custom ops
        return model


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    """Static input specs; integer inputs feeding a Gather get the table size as their upper bound."""
    dyn = dynamic_inputs(model)
    if dyn:
        raise InputError(f"model has dynamic input dims {dyn}; fix them with model.input_shapes")
    inits = {i.name: i for i in model.graph.initializer}
    specs = []
    for vi in graph_inputs(model):
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        high = None
        if np.issubdtype(dtype, np.integer):
            for node in model.graph.node:
                if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == vi.name \
                        and node.input[0] in inits:
                    table = inits[node.input[0]]
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    high = int(table.dims[axis])
                    break
        specs.append(InputSpec(vi.name, tuple(int(d) for d in _dims(vi)), np.dtype(dtype), high))
    return specs


def output_names(model: onnx.ModelProto) -> list[str]:
    return [o.name for o in model.graph.output]


def initializer_map(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {i.name: i for i in model.graph.initializer}


def initializer_array(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    return None


def tensor_elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor whose type is known (inputs, outputs, value_info, initializers)."""
    types: dict[str, int] = {}
    for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        if vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for init in model.graph.initializer:
        types[init.name] = init.data_type
    return types


def topological_sort(model: onnx.ModelProto) -> None:
    """Sort graph nodes in place so every input is produced before use (stable for sorted graphs)."""
    graph = model.graph
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    producers: dict[str, int] = {}
    for idx, node in enumerate(graph.node):
        for o in node.output:
            producers[o] = idx
    nodes = list(graph.node)
    done = [False] * len(nodes)
    order: list[int] = []

    def ready(n: onnx.NodeProto) -> bool:
        return all(i in available or i not in producers for i in n.input)

    progress = True
    while progress:
        progress = False
        for idx, node in enumerate(nodes):
            if not done[idx] and ready(node):
                done[idx] = True
                order.append(idx)
                available.update(node.output)
                progress = True
    if len(order) != len(nodes):
        bad = [nodes[i].name for i in range(len(nodes)) if not done[i]][:5]
        raise ValueError(f"graph has a cycle or dangling inputs near nodes {bad}")
    sorted_nodes = [nodes[i] for i in order]
    del graph.node[:]
    graph.node.extend(sorted_nodes)


def ensure_node_names(model: onnx.ModelProto) -> None:
    """Give every unnamed node a unique, stable name (op type + index)."""
    seen: set[str] = set()
    for idx, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            base = node.name or f"{node.op_type}_{idx}"
            name, k = base, 0
            while name in seen:
                k += 1
                name = f"{base}_{k}"
            node.name = name
        seen.add(node.name)


def opset_version(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return 0


def has_qdq(model: onnx.ModelProto) -> bool:
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)


def fold_constant_identities(model: onnx.ModelProto) -> int:
    """Bypass Identity nodes whose input is an initializer (exporters use them to share
    deduplicated weights), so every weight and bias is visible as an initializer. Returns count."""
    inits = {i.name for i in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    alias: dict[str, str] = {}
    keep = []
    for node in model.graph.node:
        src = alias.get(node.input[0], node.input[0]) if node.input else ""
        if node.op_type == "Identity" and src in inits and node.output[0] not in outputs:
            alias[node.output[0]] = src
        else:
            keep.append(node)
    if not alias:
        return 0
    for node in keep:
        for i, name in enumerate(node.input):
            if name in alias:
                node.input[i] = alias[name]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    return len(alias)
