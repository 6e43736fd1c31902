"""What to quantize: a ``QDQPlan`` names the activation tensors (for all or some of their consumers),
the weights (per output channel) and, where a runtime needs them, the int32 biases to quantize, the
rule behind each quantized node, the nodes a rule left float and why, the tensors that must share
their source's scale, and the plans of Loop/Scan bodies. Placement (``pipeline.quant.placement``) and the
autotuner build plans; ``pipeline.quant.qdq.apply_plan`` writes them into a model; calibration.json stores
the bodies' plans (``to_dict`` / ``from_dict``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pipeline.values import enum_value

Consumer = tuple[str, int]  # (node name, input index)


class WeightVariant(str, Enum):
    """How int8 weights are stored: the weight storage quantize decides (calibration.json's
    ``decisions.weight_range``) and autotune follows. Formats as its value."""

    full = "full"  # int8 in [-127, 127]
    reduced = "reduced"  # int8 in [-64, 64]: exact in u8 x s8 kernels without VNNI
    uint8 = "uint8"  # uint8 with zero point 128: U8U8 kernels, exact on every CPU

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def candidate(self) -> str:
        """The name of quantize's candidate model with this storage (its file, its log lines)."""
        return f"weights_{self.value}"

    @classmethod
    def of(cls, value: object) -> WeightVariant:
        """The variant named ``value`` (a string, a config enum), or a ValueError listing them."""
        try:
            return cls(enum_value(value))
        except ValueError:
            raise ValueError(f"weight_range {enum_value(value)!r}: choose one of "
                             f"{', '.join(v.value for v in cls)}") from None

    @classmethod
    def start(cls, requested: object, saturates: bool = False) -> WeightVariant:
        """The storage quantize's candidates are first built with (the transforms' and ranges' held-out
        errors are measured on it): ``quantize.weight_range``; auto starts from full range, or from uint8
        where the fused kernels that will run the model saturate with full-range int8 weights
        (``saturates``), since errors measured through saturated sums would choose ranges and transforms
        for the fault."""
        return cls.of(requested) if enum_value(requested) != "auto" else cls.uint8 if saturates else cls.full


@dataclass(frozen=True)
class ActivationQ:
    """Quantize activation ``tensor`` as ``dtype`` for ``consumers`` (None: every consumer)."""

    tensor: str
    dtype: str
    consumers: tuple[Consumer, ...] | None = None


@dataclass(frozen=True)
class WeightQ:
    """Weight input ``input_index`` of ``node`` stored as ``dtype`` (per-channel along ``axis``);
    ``reduced``: 7-bit int8 (see pipeline.quant.qmath.REDUCED_QMAX)."""

    node: str
    input_index: int
    dtype: str
    axis: int | None
    reduced: bool = False


@dataclass(frozen=True)
class BiasQ:
    """int32 bias at ``node``'s input ``input_index`` (a Gemm's C or a bias Add's constant), with
    scale = scale of ``activation`` x per-channel scales of weight input ``weight_index`` of
    ``weight_node``."""

    node: str
    input_index: int
    activation: str
    activation_dtype: str
    weight_node: str
    weight_index: int


@dataclass
class QDQPlan:
    activations: list[ActivationQ] = field(default_factory=list)
    weights: list[WeightQ] = field(default_factory=list)
    biases: list[BiasQ] = field(default_factory=list)
    # node name -> rule description, for logs and tests
    node_rules: dict[str, str] = field(default_factory=dict)
    # node name -> why a node its rule would quantize was left float
    skipped: dict[str, str] = field(default_factory=dict)
    # tensor -> tensor whose scale it must share (outputs of quantized data-movement ops)
    aliases: dict[str, str] = field(default_factory=dict)
    # Loop/Scan node -> the plan of its body, which sees the body as a graph of its own (pipeline.graph.bodies)
    bodies: dict[str, QDQPlan] = field(default_factory=dict)

    def walk(self) -> Iterator[QDQPlan]:
        """This plan and the plans of its bodies, nested ones included."""
        yield self
        for p in self.bodies.values():
            yield from p.walk()

    def quantized_nodes(self) -> dict[str, str]:
        """node_rules of this plan and of every body plan."""
        return {k: v for p in self.walk() for k, v in p.node_rules.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"activations": [[a.tensor, a.dtype, None if a.consumers is None else [list(c) for c in a.consumers]]
                                for a in self.activations],
                "weights": [[w.node, w.input_index, w.dtype, w.axis, w.reduced] for w in self.weights],
                "biases": [[b.node, b.input_index, b.activation, b.activation_dtype, b.weight_node, b.weight_index]
                           for b in self.biases],
                "node_rules": dict(self.node_rules), "aliases": dict(self.aliases),
                "bodies": {k: p.to_dict() for k, p in self.bodies.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QDQPlan:
        return cls([ActivationQ(t, dt, None if c is None else tuple((n, int(i)) for n, i in c))
                    for t, dt, c in d.get("activations", [])],
                   [WeightQ(n, int(i), dt, axis, bool(r)) for n, i, dt, axis, r in d.get("weights", [])],
                   [BiasQ(*b) for b in d.get("biases", [])], dict(d.get("node_rules", {})), {},
                   dict(d.get("aliases", {})), {k: cls.from_dict(v) for k, v in d.get("bodies", {}).items()})
