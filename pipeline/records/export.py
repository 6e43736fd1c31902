"""export's manifest metrics as one record: the exported graph (opset, nodes, input shapes), how it was made
(from the user's ONNX file: folding, control flow, specialization; from a torch module: training and the
ORT-vs-torch check) and the headline built from them.

The export stage builds one ``ExportMetrics`` and hands the manifest its ``to_dict``; a reader takes it back
through ``ExportMetrics.from_dict``. The JSON layout is the flat one manifest.json always had: the parts a
run did not make are left out, not written as null.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from pipeline.errors import record_layout


@dataclass(frozen=True)
class Folding:
    """What export folded in the user's graph: Constant nodes into initializers (those that were weights of
    Conv/Gemm/MatMul), nodes the folding removed, BatchNormalization nodes into their Convs."""

    constant_nodes: int = 0
    constant_weights: int = 0
    nodes_removed: int = 0
    batchnorm: int = 0


@dataclass(frozen=True)
class ControlFlow:
    """The If/Loop/Scan nodes of the main graph and what their bodies hold (``pipeline.graph.model.control_flow``)."""

    control_nodes: int
    nodes: int  # inside the bodies, counted recursively
    weighted_inside: int
    weighted_outside: int


@dataclass(frozen=True)
class Specialization:
    """model.fixed_inputs: the values the graph was specialized on, the If nodes replaced by their taken
    branch, and the check that the outputs equal the original's."""

    fixed_inputs: dict[str, Any]  # input name -> its value as a (nested) list
    ifs_inlined: list[dict[str, Any]]
    checked_batches: int
    max_abs_diff: float


@dataclass(frozen=True)
class Training:
    """The built-in digits model's training, or the record of the cached weights reused (``weights_cached``)."""

    train_seconds: float
    torch_test_top1: float  # of the float torch module on the test split
    weights_cached: bool | None = None


@dataclass(frozen=True)
class Verification:
    """The exported graph run in ONNX Runtime against the torch module (export.verify)."""

    max_abs_diff: float
    verify_tolerance: float
    output_max_abs: float


# the parts written as an object under their own key, and those written flat into the entry (their fields are
# its keys), in manifest.json's order
_NESTED = (("folded", Folding), ("control_flow", ControlFlow), ("specialized", Specialization))
_FLAT = (("training", Training), ("verification", Verification))


def _part(kind: type, d: Mapping[str, Any]) -> Any:
    """The ``kind`` record of ``d``'s keys that are its fields."""
    if not isinstance(d, Mapping):
        raise TypeError(f"{kind.__name__} is a {type(d).__name__}, not an object")
    return kind(**{f.name: d[f.name] for f in fields(kind) if f.name in d})


@dataclass(frozen=True)
class ExportMetrics:
    """manifest.json's ``stages.export.metrics``: the exported graph and how it was made."""

    opset: int
    nodes: int
    inputs: dict[str, list[Any]]  # input name -> shape (dims or their names)
    headline: str = ""
    source: str | None = None  # model=onnx: the user's file
    folded: Folding | None = None  # model=onnx
    control_flow: ControlFlow | None = None  # model=onnx
    specialized: Specialization | None = None  # model=onnx with model.fixed_inputs
    training: Training | None = None  # digits_cnn
    verification: Verification | None = None  # a torch module with export.verify

    def headline_for(self, model_name: str) -> str:
        """The one-line summary of this export of ``model_name`` (model.name)."""
        out = f"{model_name}: {self.nodes} nodes, opset {self.opset}"
        if self.verification is not None:
            out += f", ORT vs torch max |diff| {self.verification.max_abs_diff:.2e}"
        if self.training is not None:
            out += f", float top-1 {100 * self.training.torch_test_top1:.2f}%"
        folded = self.folded or Folding()
        if folded.constant_nodes:
            out += f", folded {folded.constant_nodes} Constant nodes into initializers ({folded.constant_weights} weights)"
        if folded.batchnorm:
            out += f", {folded.batchnorm} BatchNormalization folded into Conv"
        spec = self.specialized
        if spec is not None:
            out += (f", specialized on {spec.fixed_inputs} ({len(spec.ifs_inlined)} If nodes inlined, outputs equal "
                    f"on {spec.checked_batches} batches)")
        if self.control_flow is not None and self.control_flow.nodes:
            out += (f", {self.control_flow.nodes} nodes inside If/Loop/Scan bodies (Loop/Scan bodies are quantized, If "
                    f"bodies stay float: model.fixed_inputs can specialize them)")
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.source is not None:
            out["source"] = self.source
        for key, _ in _NESTED:
            if (part := getattr(self, key)) is not None:
                out[key] = asdict(part)
        for key, _ in _FLAT:
            if (part := getattr(self, key)) is not None:
                out.update({k: v for k, v in asdict(part).items() if v is not None})
        return out | {"opset": self.opset, "nodes": self.nodes, "inputs": dict(self.inputs), "headline": self.headline}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "manifest.json's export entry") -> ExportMetrics:
        """The record of export's manifest metrics (keys an older or newer writer added are left out); a layout
        no writer made is a one-line StateError naming ``where``."""
        with record_layout(where, "export"):
            if not isinstance(d, Mapping):
                raise TypeError(f"not an object but {type(d).__name__}")
            flat = {key: _part(kind, d) for key, kind in _FLAT if fields(kind)[0].name in d}
            nested = {key: _part(kind, d[key]) for key, kind in _NESTED if d.get(key) is not None}
            return cls(opset=int(d["opset"]), nodes=int(d["nodes"]), inputs=dict(d["inputs"]),
                       headline=str(d.get("headline", "")), source=d.get("source"), **nested, **flat)


__all__ = ["ControlFlow", "ExportMetrics", "Folding", "Specialization", "Training", "Verification"]
