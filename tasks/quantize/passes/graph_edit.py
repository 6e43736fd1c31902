"""The graph editor the float-exact transforms (``_equalization``, ``_smoothing``) share.

``Editor`` holds a private copy of a model whose constants are edited as float64 arrays and written
back once, in their original element types; ``attr`` reads a node attribute with a default.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pipeline.graph import weights
from pipeline.graph.model import topological_sort

Use = tuple[int, int]  # (index in graph.node, input index)


class Editor:
    """A private copy of a model whose constants are edited as float64 arrays and written back once.

    ``set_const`` rewrites a constant for some of its readers: in place when they are all its readers
    (and the shape is unchanged), else as a new initializer those readers are rewired to, so a weight
    shared with a node that is not being rescaled keeps its values for that node.
    """

    def __init__(self, model: onnx.ModelProto, copy: bool = True):
        # the copy is made at the first edit: a transform that finds nothing to change costs no second
        # copy of the weights (copy=False: read-only lookups, no edit may be made)
        self.model = model
        self._copy_pending = copy
        self.graph = self.model.graph
        self.inits = {i.name: i for i in self.graph.initializer}
        self.outputs = {o.name for o in self.graph.output}
        self._arrays: dict[str, np.ndarray] = {}
        self._dtypes: dict[str, np.dtype] = {}
        self._new: set[str] = set()
        self._dirty: set[str] = set()
        self._replaced: set[str] = set()
        self._nodes_added = False
        self._names = set(self.inits) | {n.name for n in self.graph.node}
        self._names |= {t for n in self.graph.node for t in (*n.input, *n.output)}
        self._names |= {v.name for v in (*self.graph.input, *self.graph.output, *self.graph.value_info)}
        self._index: tuple[dict[str, list[Use]], dict[str, int]] | None = None

    # ---- lookups
    def _lookups(self) -> tuple[dict[str, list[Use]], dict[str, int]]:
        if self._index is None:
            uses: dict[str, list[Use]] = defaultdict(list)
            producer: dict[str, int] = {}
            for i, n in enumerate(self.graph.node):
                for j, t in enumerate(n.input):
                    if t:
                        uses[t].append((i, j))
                for o in n.output:
                    if o:
                        producer[o] = i
            self._index = (uses, producer)
        return self._index

    def uses(self, tensor: str) -> list[Use]:
        return list(self._lookups()[0].get(tensor, ()))

    def producer(self, tensor: str) -> int | None:
        return self._lookups()[1].get(tensor)

    def node(self, i: int) -> onnx.NodeProto:
        return self.graph.node[i]

    def is_const(self, name: str) -> bool:
        return bool(name) and name in self.inits

    def array(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            a = weights.array(self.inits[name])
            self._dtypes[name] = a.dtype
            self._arrays[name] = a.astype(np.float64)
        return self._arrays[name]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._arrays:
            return self._arrays[name].shape
        return tuple(int(d) for d in self.inits[name].dims)

    def dtype(self, name: str) -> np.dtype:
        """Element type of constant ``name`` as ``array`` read it (float32 for one not read yet)."""
        return self._dtypes.get(name, np.dtype(np.float32))

    def is_float_const(self, name: str) -> bool:
        return self.is_const(name) and self.inits[name].data_type in (
            onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16)

    def unique(self, base: str) -> str:
        name, k = base, 1
        while name in self._names:
            name, k = f"{base}_{k}", k + 1
        self._names.add(name)
        return name

    # ---- edits
    def _own(self) -> None:
        if self._copy_pending:
            self._copy_pending = False
            own = onnx.ModelProto()
            own.CopyFrom(self.model)
            self.model, self.graph = own, own.graph
            self.inits = {i.name: i for i in self.graph.initializer}

    def set_const(self, name: str, values: np.ndarray, readers: Sequence[Use]) -> str:
        """Give ``readers`` (which all read ``name``) the constant ``values``; returns its name."""
        self._own()
        self.array(name)
        mine = set(readers)
        if (set(self.uses(name)) <= mine and values.shape == self._arrays[name].shape
                and name not in self.outputs):
            self._arrays[name] = values
            self._dirty.add(name)
            return name
        new = self.unique(f"{name}_scaled")
        self._arrays[new] = values
        self._dtypes[new] = self._dtypes[name]
        self._new.add(new)
        self._dirty.add(new)
        self._replaced.add(name)
        for i, j in readers:
            self.graph.node[i].input[j] = new
        self._index = None
        return new

    def add_node(self, node: onnx.NodeProto, consts: Mapping[str, np.ndarray], dtype: np.dtype) -> None:
        self._own()
        for name, values in consts.items():
            self._arrays[name] = values
            self._dtypes[name] = np.dtype(dtype)
            self._new.add(name)
            self._dirty.add(name)
        self.graph.node.append(node)
        self._nodes_added = True
        self._index = None

    def rewire(self, readers: Iterable[Use], tensor: str) -> None:
        self._own()
        for i, j in readers:
            self.graph.node[i].input[j] = tensor
        self._index = None

    def finish(self) -> onnx.ModelProto:
        for name in self._dirty:
            t = numpy_helper.from_array(self._arrays[name].astype(self._dtypes[name]), name)
            if name in self._new:
                self.graph.initializer.append(t)
                self.inits[name] = self.graph.initializer[-1]
            else:
                self.inits[name].CopyFrom(t)
        orphans = {n for n in self._replaced if not self.uses(n) and n not in self.outputs}
        if orphans:
            keep = [i for i in self.graph.initializer if i.name not in orphans]
            del self.graph.initializer[:]
            self.graph.initializer.extend(keep)
            # old-IR models list initializers as graph inputs too
            inputs = [v for v in self.graph.input if v.name not in orphans]
            del self.graph.input[:]
            self.graph.input.extend(inputs)
        if self._nodes_added:
            topological_sort(self.model)
        return self.model


def attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    """Value of attribute ``name`` of ``node``, else ``default``."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


@dataclass(frozen=True)
class ConstEdit:
    """Divide constant input ``index`` of node ``node`` by s along ``axis`` (-1: the last axis,
    broadcasting a size-1 or scalar constant up to K)."""

    node: int
    index: int
    axis: int = -1


def _fits_last_axis(ed: Editor, name: str, k: int | None) -> bool:
    shape = ed.shape(name)
    return k is None or len(shape) == 0 or shape[-1] in (1, k)


def absorber(ed: Editor, tensor: str, k: int | None) -> tuple[str, list[ConstEdit]] | None:
    """How the producer of ``tensor`` can output tensor / s exactly (op label, constant edits); s has
    ``k`` channels on the last axis, or is one scalar when ``k`` is None."""
    i = ed.producer(tensor)
    if i is None:
        return None
    node = ed.node(i)
    if node.output[0] != tensor:
        return None
    op, ins = node.op_type, list(node.input)
    consts = [j for j, t in enumerate(ins) if ed.is_float_const(t)]
    edits: list[ConstEdit]
    if op == "LayerNormalization":
        edits = [ConstEdit(i, j) for j in (1, 2) if j < len(ins) and ins[j]]
        if any(e.index not in consts for e in edits):
            return None
    elif op == "Mul" and len(ins) == 2 and len(consts) == 1 and not _erf_gelu_tail(ed, ins[1 - consts[0]]):
        edits = [ConstEdit(i, consts[0])]
    elif op == "MatMul" and consts == [1] and (k is None or ed.shape(ins[1])[-1:] == (k,)):
        edits = [ConstEdit(i, 1)]
    elif op == "Gemm" and 1 in consts and 0 not in consts:
        axis = 0 if attr(node, "transB", 0) else 1
        if (k is not None and ed.shape(ins[1])[axis] != k) or (len(ins) > 2 and ins[2] and 2 not in consts):
            return None
        edits = [ConstEdit(i, 1, axis)] + ([ConstEdit(i, 2)] if len(ins) > 2 and ins[2] else [])
    elif op == "Add" and len(ins) == 2 and len(consts) == 1:
        inner_t = ins[1 - consts[0]]
        if inner_t in ed.outputs or ed.uses(inner_t) != [(i, 1 - consts[0])]:
            return None
        inner = absorber(ed, inner_t, k)
        if inner is None:
            return None
        return f"{inner[0]}+Add", [*inner[1], ConstEdit(i, consts[0])]
    else:
        return None
    if any(e.axis == -1 and not _fits_last_axis(ed, ins[e.index], k) for e in edits):
        return None
    return op, edits


def _erf_gelu_tail(ed: Editor, tensor: str) -> bool:
    """Whether a Mul by a constant reading ``tensor`` completes an erf GELU, x * (erf(x / c) + 1) * 0.5:
    such a Mul absorbs nothing, because runtimes recognize the GELU by its constants (OpenVINO fuses
    it, with a per-channel Mul and a Q after it, into the MatMul before it; ONNX Runtime into one
    Gelu kernel) and a rescaled constant leaves five float ops running on their own."""
    i = ed.producer(tensor)
    if i is None or ed.node(i).op_type != "Mul":
        return False
    for t in ed.node(i).input:
        j = ed.producer(t)
        if j is not None and ed.node(j).op_type == "Add":
            if any((k := ed.producer(u)) is not None and ed.node(k).op_type == "Erf" for u in ed.node(j).input):
                return True
    return False


def divide_along(values: np.ndarray, s: np.ndarray, axis: int) -> np.ndarray:
    if axis == -1:
        return values / s
    shape = [1] * values.ndim
    shape[axis] = -1
    return values / s.reshape(shape)


__all__ = ["ConstEdit", "Editor", "Use", "absorber", "attr", "divide_along"]
