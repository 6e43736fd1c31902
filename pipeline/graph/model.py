"""ONNX graph helpers shared by every stage: loading with clear errors, input specs, static shapes,
content hashes, topological order, tensor-type lookups and what control-flow bodies read."""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import os
import tempfile
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnx
from onnx import helper

from pipeline.artifacts import atomic_output, check_onnx_path, sha256_bytes, sha256_file
from pipeline.errors import InputError, first_line
from pipeline.graph import weights
from pipeline.graph.shapes import infer_shapes
from pipeline.graph.weights import fits_one_proto, save_external, without_initializers

H = TypeVar("H", bound=Hashable)


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




def load_model(path: str | os.PathLike, what: str = "model", check: bool = True) -> onnx.ModelProto:
    """Load and check an ONNX file, turning every failure into an InputError naming the file."""
    from onnx.external_data_helper import uses_external_data

    p = check_onnx_path(path, what)
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf raises several types for garbage
        raise InputError(f"{what} file {p} could not be read as ONNX ({type(exc).__name__}: {exc})") from None
    external = any(uses_external_data(t) for t, _ in weights.all_tensors(model.graph))
    if check:
        try:
            weights.check_model(model)
        except onnx.checker.ValidationError as exc:
            first = str(exc).strip().splitlines()[0]
            raise InputError(f"{what} file {p} fails onnx.checker: {first}") from None
    if external:
        try:
            weights.attach(model, p.parent)
        except (OSError, KeyError, ValueError) as exc:
            raise InputError(f"{what} file {p}: its external data cannot be read ({first_line(exc)}); keep the "
                             f"data files its tensors name beside it") from None
    return model


EXTERNAL_FROM = 64 * 2**20  # models with more weight bytes are written with external data


@contextlib.contextmanager
def staged_model(target: Path) -> Iterator[Path]:
    """A path to write ``target`` and its ``<name>.data`` at, in a private folder beside it; when the
    block ends without an error both are synced and renamed into place, data first (atomic, like
    atomic_output, for a model with external data)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as tmpdir:
        staged = Path(tmpdir) / target.name
        yield staged
        for produced in (staged.with_name(target.name + ".data"), staged):
            if produced.exists():
                with open(produced, "rb+") as fh:
                    os.fsync(fh.fileno())
                os.chmod(produced, 0o644)
                os.replace(produced, target.parent / produced.name)


def save_model(model: onnx.ModelProto, path: str | os.PathLike, external_data: bool = False,
               share_weights: bool = False) -> Path:
    """Atomically write an ONNX model; with external data when asked, past EXTERNAL_FROM bytes of
    weights or when some stay on disk (pipeline.graph.weights): the next stage then reads them one at a time.
    ``share_weights`` (working files, never artifacts): tensors on disk stay references to hard links
    of their data files beside ``path`` instead of being copied.

    With external data, both files are written in a private temporary folder next to the target and
    renamed into place (data first), and the caller's model keeps its weights in memory.
    """
    target = Path(path)
    if share_weights and weights.has_lazy(model) and fits_one_proto(model) and not external_data:
        return write_model_bytes(model.SerializeToString(), target, share_weights=True)
    if external_data or weights.has_lazy(model) or not fits_one_proto(model) \
            or weights.stored_bytes(model) > EXTERNAL_FROM:
        with staged_model(target) as staged:
            save_external(model, staged, data_name=target.name + ".data")
        return target
    with atomic_output(target) as tmp:
        tmp.write_bytes(model.SerializeToString())
    return target


def write_model_bytes(data: bytes, path: str | os.PathLike, share_weights: bool = False) -> Path:
    """Atomically write a serialized model. One that reads tensors from pipeline.graph.weights' folder is
    written with its own external data, or (``share_weights``, working files) with hard links of
    those data files beside it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if weights.referenced(data) and not (share_weights and weights.share_into(data, target.parent)):
        return save_model(onnx.load_from_string(data), target)
    with atomic_output(target) as tmp:
        tmp.write_bytes(data)
    return target


def model_bytes(path: str | os.PathLike) -> bytes:
    """A model file's serialization, complete on its own: with external data, the proto whose large
    tensors refer to pipeline.graph.weights' folder (ONNX Runtime and write_model_bytes resolve them)."""
    from pipeline.artifacts import external_data_files

    if not external_data_files(path):
        return Path(path).read_bytes()
    return load_model(path, check=False).SerializeToString()


def copy_model(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy a model file with its external data (renamed after ``dst``)."""
    from pipeline.artifacts import atomic_write_bytes, external_data_files

    if not external_data_files(src):
        return atomic_write_bytes(dst, Path(src).read_bytes())
    return save_model(load_model(src, check=False), dst)


def remove_model(path: str | os.PathLike) -> None:
    """Delete a model file and the external data file save_model wrote for it, if any."""
    p = Path(path)
    p.unlink(missing_ok=True)
    p.with_name(p.name + ".data").unlink(missing_ok=True)


def model_hash(model: onnx.ModelProto | bytes | str | os.PathLike) -> str:
    """sha256 of a model: a proto's serialization (past 2 GB, of its parts in turn), bytes, or a file
    with its external data."""
    if isinstance(model, onnx.ModelProto) and (weights.has_lazy(model) or not fits_one_proto(model)):

        h = hashlib.sha256()
        rest = without_initializers(model)
        h.update(rest.SerializeToString(deterministic=True))
        for t in model.graph.initializer:
            if weights.is_lazy(t):  # its content, not the link's name (which differs between runs)
                h.update(onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims).SerializeToString())
                h.update(weights.digest(t).encode())
            else:
                h.update(t.SerializeToString(deterministic=True))
        return h.hexdigest()
    if isinstance(model, onnx.ModelProto):
        data = model.SerializeToString(deterministic=True)
    elif isinstance(model, bytes):
        data = model
    else:
        return sha256_file(model)
    return sha256_bytes(data)


def value_dims(vi: onnx.ValueInfoProto) -> list[int | str]:
    """Dims of a graph value: an int per fixed dim, the dim_param (or "?") per symbolic one; [] without a shape."""
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
        dims = value_dims(vi)
        if not vi.type.tensor_type.HasField("shape") or any(not isinstance(d, int) or d <= 0 for d in dims):
            out[vi.name] = dims
    return out


# metadata key holding model.input_shapes for a model whose graph inputs stay dynamic
SHAPES_KEY = "qdq_tune.input_shapes"


def recorded_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    """The input shapes stored with a model that keeps dynamic dims (see record_input_shapes)."""

    for p in model.metadata_props:
        if p.key == SHAPES_KEY:
            return {k: [int(d) for d in v] for k, v in json.loads(p.value).items()}
    return {}


def record_input_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> onnx.ModelProto:
    """``model`` keeping its dynamic dims, with ``shapes`` stored in its metadata for ``input_specs`` (a
    model.keep_dynamic_shapes model, or one whose static form ONNX Runtime rejects: see the export
    stage); element types of intermediate tensors re-inferred, symbolic dims stay symbolic."""

    kept = [p for p in model.metadata_props if p.key != SHAPES_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=SHAPES_KEY, value=json.dumps({k: list(v) for k, v in shapes.items()}))
    return infer_shapes(model)


def fix_input_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]], source: str) -> onnx.ModelProto:
    """Make every graph input static, using ``shapes`` for the dynamic ones (InputError naming the
    ``source`` file for a missing, unknown or conflicting shape); re-infer shapes."""
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
        dims = value_dims(vi)
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
    return infer_shapes(model)


def input_specs(model: onnx.ModelProto, shapes: dict[str, list[int]] | None = None) -> list[InputSpec]:
    """Static input specs; integer inputs feeding a Gather get the table size as their upper bound.
    ``shapes`` gives the shape of inputs whose dims are dynamic in the model (an optimization profile)."""
    shapes = {**recorded_shapes(model), **(shapes or {})}
    dyn = {k: v for k, v in dynamic_inputs(model).items() if k not in shapes}
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
        shape = shapes.get(vi.name) or value_dims(vi)
        specs.append(InputSpec(vi.name, tuple(int(d) for d in shape), np.dtype(dtype), high))
    return specs


def output_names(model: onnx.ModelProto) -> list[str]:
    return [o.name for o in model.graph.output]


def tensor_elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor whose type is known (inputs, outputs, value_info, initializers)."""
    types: dict[str, int] = {}
    for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        if vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for init in model.graph.initializer:
        types[init.name] = init.data_type
    return types


def topological_order(items: Sequence[H], deps: Callable[[H], Iterable[H]],
                      key: Callable[[H], Any] | None = None) -> list[H]:
    """``items`` (distinct) ordered so each comes after the items it depends on (Kahn's algorithm).

    ``deps(item)`` names what ``item`` depends on; an item itself and names not in ``items`` are
    ignored. Of the items ready at a step the one with the smallest ``key`` comes first, ties (and
    every choice without ``key``) by position in ``items``, so the order is deterministic and ready
    items keep their given relative order. With a cycle, the items on it and after it are missing
    from the result: compare lengths.
    """
    pos = {item: p for p, item in enumerate(items)}
    users: list[list[int]] = [[] for _ in items]
    indeg = [0] * len(items)
    for p, item in enumerate(items):
        ds = {pos[d] for d in deps(item) if d in pos} - {p}
        indeg[p] = len(ds)
        for d in ds:
            users[d].append(p)
    rank = [key(item) for item in items] if key is not None else [0] * len(items)
    ready = [(rank[p], p) for p in range(len(items)) if indeg[p] == 0]
    heapq.heapify(ready)
    order: list[H] = []
    while ready:
        _, p = heapq.heappop(ready)
        order.append(items[p])
        for u in users[p]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, (rank[u], u))
    return order


def topological_sort(model: onnx.ModelProto) -> None:
    """Sort graph nodes in place so every input is produced before use, the tensors a node's bodies
    read from the graph included (stable: ready nodes keep their current relative order)."""
    graph = model.graph
    nodes = list(graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    reads = [[*nodes[i].input, *implicit_inputs(nodes[i])] for i in range(len(nodes))]
    order = topological_order(range(len(nodes)), lambda i: (producer[t] for t in reads[i] if t in producer))
    if len(order) != len(nodes):
        done = set(order)
        bad = [nodes[i].name for i in range(len(nodes)) if i not in done][:5]
        raise ValueError(f"graph has a cycle near nodes {bad}")
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)


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
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in iter_nodes(model.graph))


WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


CONTROL_FLOW_OPS = ("If", "Loop", "Scan")


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs a node holds as attributes (an If's branches, a Loop's or Scan's body)."""
    out: list[onnx.GraphProto] = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            out.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            out.extend(attr.graphs)
    return out


def outer_reads(graph: onnx.GraphProto) -> set[str]:
    """Names a (sub)graph reads from the graphs around it (outer-scope references), its own
    subgraphs' included: ONNX Runtime's implicit inputs of the node that holds it."""
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    defined.update(o for n in graph.node for o in n.output)
    reads = {o.name for o in graph.output}
    for n in graph.node:
        reads.update(n.input)
        reads |= implicit_inputs(n)
    return reads - defined - {""}


def implicit_inputs(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs read from the graph the node is in (or further out)."""
    return set().union(*(outer_reads(g) for g in subgraphs(node)))


def graph_reads(graph: onnx.GraphProto) -> set[str]:
    """Every name a graph's nodes read, through their subgraphs' outer-scope references too, and its
    outputs: what an initializer must be one of to be still in use."""
    return {t for n in graph.node for t in (*n.input, *implicit_inputs(n)) if t} | {o.name for o in graph.output}


def iter_nodes(graph: onnx.GraphProto, into: Iterable[str] = CONTROL_FLOW_OPS) -> Iterator[onnx.NodeProto]:
    """The graph's nodes, each followed (depth first) by the nodes of its subgraphs when its op type is
    one of ``into``."""
    into = tuple(into)
    for n in graph.node:
        yield n
        if n.op_type in into:
            for g in subgraphs(n):
                yield from iter_nodes(g, into)


def control_flow(model: onnx.ModelProto) -> dict[str, int]:
    """If/Loop/Scan nodes of the main graph and what their bodies hold (counted recursively); the
    quantize stage quantizes inside Loop/Scan bodies (``pipeline.graph.bodies``), If bodies stay float."""
    control = [n for n in model.graph.node if n.op_type in CONTROL_FLOW_OPS]
    inside = [b for n in control for g in subgraphs(n) for b in iter_nodes(g)]
    return {"control_nodes": len(control), "nodes": len(inside),
            "weighted_inside": sum(1 for n in inside if n.op_type in (*WEIGHTED_OPS, "LSTM", "GRU", "RNN")),
            "weighted_outside": sum(1 for n in model.graph.node if n.op_type in WEIGHTED_OPS)}
