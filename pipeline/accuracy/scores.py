"""A model's scores against the float model, whole and per output: what ``ModelScores`` accumulated,
what every accuracy verdict reads, and (``to_dict``) what evaluate's metrics.json holds per model.
A leaf: imports nothing of ours."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pipeline.accuracy.confidence import SampleScores

# the per-output lists of the to_dict form, one entry per model output
_PER_OUTPUT = ("output_names", "snr_db_per_output", "cosine_per_output", "float_outputs", "agreement_per_output",
               "decisive_agreement_per_output", "decisive_samples_per_output")


@dataclass(frozen=True)
class OutputScores:
    """One output of a model against the float model's same output."""

    name: str | None = None  # None: the model's outputs are not named
    snr_db: float | None = None
    cosine: float | None = None  # mean over the samples; None for an output that is not float
    is_float: bool = True
    # top-1 agreement with the float model, on every sample and on the decisive ones (a clear float
    # top-1); None for an output that does not hold class scores
    agreement: float | None = None
    decisive_agreement: float | None = None
    decisive_samples: int | None = None
    judged: bool = True  # False: accuracy.outputs / per_output leave this output to another metric

    def label(self, index: int) -> str | int:
        """The output's name, or its index when the model's outputs are not named."""
        return self.name if self.name is not None else index


@dataclass(frozen=True)
class Scores:
    """A model's scores against the float model; a score that does not apply is None. SNR may be +inf."""

    samples: int | None = None
    top1: float | None = None  # accuracy against the labels, on the first class output
    top_k: int = 1
    topk: float | None = None  # top-``top_k`` accuracy (top_k > 1 only)
    agreement: float | None = None  # top-1 agreement with the float model, on the first class output
    cosine: float | None = None  # of the first output
    snr_db: float | None = None  # over every output
    decisive_agreement: float | None = None
    # None: scores that never counted decisive samples, whose plain agreement is judged instead
    decisive_samples: int | None = None
    identical_outputs: bool = False
    outputs: tuple[OutputScores, ...] = ()
    class_outputs: tuple[str | int, ...] = ()  # the outputs agreement was counted on, the labels' first
    # the per-sample values these scores sum up; None for scores read back from metrics.json
    per_sample: SampleScores | None = field(default=None, compare=False, repr=False)

    def index_of(self, label: str | int) -> int:
        """The position of output ``label`` (its name, or its index when outputs are not named)."""
        return label if isinstance(label, int) else (self.output_names or []).index(label)

    @property
    def first_class(self) -> int | None:
        """The position of the first judged class output (the one top-1 and agreement are counted on)."""
        for c in self.class_outputs:
            i = self.index_of(c)
            if i < len(self.outputs) and self.outputs[i].judged:
                return i
        return 0 if not self.outputs else None

    @property
    def output_names(self) -> list[str] | None:
        """Every output's name, or None when the outputs are not named."""
        if not self.outputs or any(o.name is None for o in self.outputs):
            return None
        return [o.name for o in self.outputs]

    def any_judged(self) -> bool:
        """Whether a float output is left for the default metric (True without per-output scores)."""
        return not self.outputs or any(o.is_float and o.judged for o in self.outputs)

    def restricted(self, keep: Sequence[bool]) -> Scores:
        """These scores with only the outputs flagged in ``keep`` judged; agreement is that of the first
        kept class output (None when no kept output holds class scores) and top-1 is dropped when the
        first class output, on which it is counted, is not kept."""
        names = self.output_names or []
        classes = [names.index(c) for c in self.class_outputs if c in names]
        kept = [i for i in classes if keep[i]]
        first = self.outputs[kept[0]] if kept else OutputScores()
        outputs = tuple(replace(o, judged=o.judged and k) for o, k in zip(self.outputs, keep, strict=False))
        return replace(self, outputs=outputs, top1=None if classes and not keep[classes[0]] else self.top1,
                       agreement=first.agreement, decisive_agreement=first.decisive_agreement,
                       decisive_samples=first.decisive_samples)

    def only(self, index: int) -> Scores:
        """These scores with only output ``index`` judged."""
        return self.restricted([j == index for j in range(len(self.outputs))])

    def worst(self, attr: str) -> tuple[float | None, str | int | None, int]:
        """(lowest ``attr`` (snr_db or cosine) over the judged float outputs, that output's name or
        index, number of outputs judged); the whole model's value when no output has one."""
        if not self.outputs:
            return getattr(self, attr), None, 1
        judged = [(v, o.label(i)) for i, o in enumerate(self.outputs)
                  if o.is_float and o.judged and (v := getattr(o, attr)) is not None
                  and not (isinstance(v, float) and math.isnan(v))]
        if not judged:
            return getattr(self, attr), None, 0
        v, n = min(judged, key=lambda x: x[0])
        return v, n, len(judged)

    def to_dict(self) -> dict[str, Any]:
        """The per-model scores of metrics.json, per-output values as parallel lists (+inf kept: the
        writer makes it JSON-safe)."""
        outs = self.outputs
        out: dict[str, Any] = {"samples": self.samples, "top1": self.top1}
        if self.top_k > 1:
            out[f"top{self.top_k}"] = self.topk
        out.update({
            "agreement": self.agreement, "cosine": self.cosine, "snr_db": self.snr_db,
            "snr_db_per_output": [o.snr_db for o in outs], "cosine_per_output": [o.cosine for o in outs],
            "float_outputs": [o.is_float for o in outs], "decisive_agreement": self.decisive_agreement,
            "decisive_samples": self.decisive_samples, "identical_outputs": self.identical_outputs,
        })
        if self.output_names:
            out["output_names"] = self.output_names
        out.update({
            "agreement_per_output": [o.agreement for o in outs],
            "decisive_agreement_per_output": [o.decisive_agreement for o in outs],
            "decisive_samples_per_output": [o.decisive_samples for o in outs],
            "class_outputs": list(self.class_outputs),
        })
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Scores:
        """Scores from their ``to_dict`` form; a key left out is a score not taken."""
        lists = {k: list(d.get(k) or []) for k in _PER_OUTPUT}

        def at(key: str, i: int, default: Any = None) -> Any:
            return lists[key][i] if i < len(lists[key]) else default

        outputs = tuple(OutputScores(name=at("output_names", i), snr_db=at("snr_db_per_output", i),
                                     cosine=at("cosine_per_output", i), is_float=bool(at("float_outputs", i, True)),
                                     agreement=at("agreement_per_output", i),
                                     decisive_agreement=at("decisive_agreement_per_output", i),
                                     decisive_samples=at("decisive_samples_per_output", i))
                        for i in range(max(map(len, lists.values()))))
        top_k = next((int(k[3:]) for k in d if k.startswith("top") and k[3:].isdigit() and k != "top1"), 1)
        return cls(samples=d.get("samples"), top1=d.get("top1"), top_k=top_k,
                   topk=d.get(f"top{top_k}") if top_k > 1 else None, agreement=d.get("agreement"),
                   cosine=d.get("cosine"), snr_db=d.get("snr_db"), decisive_agreement=d.get("decisive_agreement"),
                   decisive_samples=d.get("decisive_samples"), identical_outputs=bool(d.get("identical_outputs")),
                   outputs=outputs, class_outputs=tuple(d.get("class_outputs") or ()))
