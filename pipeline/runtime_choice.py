"""What ``backend=auto`` compared and chose: autotune/runtime_choice.json, as typed records.

``pipeline.app.auto`` writes it; evaluate reads it (an optional input) to show every runtime beside the
one that ships. Each row is one runtime: what its own autotune shipped, its p10 latency and its own
float's in auto's final interleaved run, and (where evaluate ran in that runtime's results_dir) the
accuracy and speed of its models on the evaluation data (``pipeline.records.evaluate.runtime_evaluation``
makes it from that runtime's metrics.json).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.errors import StateError, first_line

CHOICE = "autotune/runtime_choice.json"


@dataclass(frozen=True)
class ModelSummary:
    """One model of a runtime's evaluation: its accuracy in words, its speedup over that runtime's
    float baseline (ratio of p10s), and whether it misses the accuracy budget."""

    key: str  # evaluate's metrics key: float, float_fp32, float_default, ptq, autotuned
    label: str
    accuracy: str | None  # e.g. "top-1 97.0%", "agreement 99.1%"; None where nothing was scored
    speedup_p10: float | None = None
    over_budget: bool = False


@dataclass(frozen=True)
class RuntimeEvaluation:
    """A runtime's evaluate run, as the top-level report shows it (``report``: its report.md, relative
    to the top-level results_dir)."""

    baseline: str
    shipped: str | None
    models: list[ModelSummary]
    report: str

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RuntimeEvaluation:
        return cls(**{**d, "models": [ModelSummary(**m) for m in d["models"]]})


SHIPPED, FLOAT = "shipped", "float"  # Contender.what: a runtime's own shipped model, or its float as deployed


@dataclass(frozen=True)
class Contender:
    """One deployment the final comparison can ship: a runtime's shipped model (with its shipped settings)
    or its float baseline as deployed (``what``: SHIPPED or FLOAT), and its p10 latency there."""

    runtime: str
    what: str
    label: str  # "tuned", "ptq", "float" (what the runtime's own autotune shipped) or e.g. "BF16 float"
    p10_ms: float
    # a float: the 95% interval of its latency over its runtime's shipped model's (per-round ratios)
    interval: tuple[float, float] | None = None
    # a float that ran faster than its runtime's shipped model, but not clearly: that model's p10, which it
    # ranks just behind (None: it ranks by its own p10)
    rank_ms: float | None = None

    def describe(self) -> str:
        return f"{self.runtime} ({self.label})"

    @property
    def rank(self) -> float:
        return self.p10_ms if self.rank_ms is None else self.rank_ms

    @property
    def held_back(self) -> bool:
        """A float that ran faster than its runtime's shipped model here, but not clearly (its interval
        reaches 1): it does not displace that model."""
        return self.rank_ms is not None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Contender:
        interval = d.get("interval")
        return cls(**{**d, "interval": tuple(interval) if interval is not None else None})


@dataclass(frozen=True)
class RuntimeRow:
    """One runtime in the final comparison: what it ships and how fast it and its own float ran."""

    runtime: str
    shipped: str  # "tuned", "ptq" or "float": what its own autotune shipped
    float_precision: str  # the precision its float runs in (its baseline)
    accuracy: str  # its autotune's verdict on the shipped model
    p10_ms: float | None = None  # the shipped model with its shipped settings
    float_p10_ms: float | None = None  # its own float model, as deployed
    error: str | None = None  # why it was not timed
    evaluation: RuntimeEvaluation | None = None  # its evaluate run (runtimes that did not ship)
    evaluation_error: str | None = None  # why its evaluate run failed

    def speedup(self, reference_ms: float) -> float | None:
        return reference_ms / self.p10_ms if self.p10_ms else None

    def contenders(self, float_is_shipped: bool, float_is_reference: bool,
                   float_interval: tuple[float, float] | None = None) -> list[Contender]:
        """What of this runtime can ship, as timed: its shipped model, and its float as deployed (within the
        budget by construction: the FP32 reference itself, or a lower precision its autotune held to the
        budget), unless that float is its shipped deployment or the reference float (one timing, one entry).
        The float ranks by its own latency only where ``float_interval`` (its latency over the shipped
        model's, 95%) lies below 1; else just behind the shipped model, which its autotune chose."""
        out = []
        if self.p10_ms is not None:
            # a shipped float that is not the float baseline's deployment differs from it by its tuned settings
            label = "float, tuned settings" if self.shipped == "float" and not float_is_shipped else self.shipped
            out.append(Contender(self.runtime, SHIPPED, label, self.p10_ms))
        if self.float_p10_ms is not None and not float_is_shipped and not float_is_reference:
            if self.p10_ms is None:  # its shipped model did not run: nothing to hold the float back
                float_interval = None
            held = (self.p10_ms is not None and self.float_p10_ms < self.p10_ms
                    and (float_interval is None or float_interval[1] >= 1.0))
            out.append(Contender(self.runtime, FLOAT, f"{self.float_precision} float", self.float_p10_ms,
                                 float_interval, self.p10_ms if held else None))
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RuntimeRow:
        ev = d.get("evaluation")
        return cls(**{**d, "evaluation": RuntimeEvaluation.from_dict(ev) if ev is not None else None})


@dataclass
class RuntimeChoice:
    """What backend=auto compared and chose (autotune/runtime_choice.json)."""

    key: str  # fingerprint of the models, settings and runtime sections compared
    reference: str  # e.g. "onnxruntime FP32 float"
    reference_p10_ms: float
    winner: str
    rows: list[RuntimeRow]
    left_out: dict[str, str] = field(default_factory=dict)  # runtime -> why it did not take part
    headline: str = ""
    # every deployment that could ship, in rank order (``Contender.rank``; the first ships); files from before
    # it hold none
    contenders: list[Contender] = field(default_factory=list)
    race: str = ""  # the race after PTQ in one line, where one ran (pipeline.app.race)

    @property
    def ships(self) -> str:
        """SHIPPED (the winner's own shipped model) or FLOAT (its float as deployed, clearly faster here)."""
        return self.contenders[0].what if self.contenders else SHIPPED

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = CHOICE, fix: str = "delete it to compare again"
                  ) -> RuntimeChoice:
        """The choice ``d`` holds; a StateError naming ``where`` it was read from and ``fix`` if its layout
        is not one."""
        try:
            return cls(**{**d, "rows": [RuntimeRow.from_dict(r) for r in d["rows"]],
                          "contenders": [Contender.from_dict(c) for c in d.get("contenders", [])]})
        except (TypeError, KeyError, AttributeError, ValueError) as exc:
            raise StateError(f"{where} has an unknown layout ({first_line(exc)}); {fix}") from None

    def row(self, runtime: str) -> RuntimeRow:
        return next(r for r in self.rows if r.runtime == runtime)


def headline(choice: RuntimeChoice) -> str:
    """e.g. 'ships openvino (tuned): 2.10x the onnxruntime FP32 float (p10), 1.26x the next; openvino (BF16
    float) 1.67x; onnxruntime (tuned) 1.26x'."""
    ref = choice.reference_p10_ms
    best, *rest = choice.contenders
    text = f"ships {best.describe()}: {ref / best.p10_ms:.2f}x the {choice.reference}"
    nxt = next((c for c in rest if not c.held_back), None)  # the margin: over the next not held back
    if nxt is not None:
        text += f", {nxt.p10_ms / best.p10_ms:.2f}x the next"
    others = [f"{c.describe()} {ref / c.p10_ms:.2f}x" + (_held_back(c) if c.held_back else "") for c in rest]
    others += [f"{r.runtime} not timed ({r.error})" for r in choice.rows if r.p10_ms is None]
    others += [f"{k} left out ({v})" for k, v in choice.left_out.items()]
    return text + (f"; {'; '.join(others)}" if others else "")


def _held_back(c: Contender) -> str:
    low, high = c.interval or (0.0, float("inf"))
    return (f" (not clearly faster than {c.runtime}'s shipped model: {low:.2f}-{high:.2f}x its latency, 95%;"
            f" a tie goes to the model its autotune chose)")
