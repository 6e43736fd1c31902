"""The calibration record: per-tensor statistics from the quantize stage's calibration.json and what
else it decided, read back for every model that is quantized from it.

``Calibration`` turns statistics into activation scales (a default scale where there are none, if
allowed), searches weight scales the way calibration chose (memoized: autotune quantizes the same
weights for every candidate), and carries the measured bias corrections and the plans of Loop/Scan
bodies. ``load_calibration`` reads one from calibration.json; ``quantize_decisions`` reads the
stage's other decisions (weight storage, nodes left float, CPU and accuracy facts).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.artifacts import read_json
from pipeline.errors import StageError, StateError
from pipeline.quant.plan import QDQPlan
from pipeline.quant.qmath import WEIGHT_SEARCHES, QuantParams, activation_params, weight_params


class MissingCalibration(StageError):
    """A tensor to quantize has no statistics and the Calibration has no fallback scale."""

    def __init__(self, tensor: str):
        super().__init__(f"no calibration statistics for tensor '{tensor}'; re-run the quantize stage "
                         f"(stages=[quantize,...]) so calibration.json covers it")
        self.tensor = tensor


class Calibration:
    """Per-tensor statistics from calibration.json (or a default scale where there are none), and how
    weight scales are searched (``weight_clip``: "max" or "mse").

    Without an explicit ``weight_clip`` it follows the statistics' algorithm (see ``weight_clip_for``),
    so statistics straight from calibration get the weights that calibration.json records.
    ``bodies`` are the plans of Loop/Scan bodies the quantize stage chose; apply_plan places them with
    a plan that has none of its own (autotune's, which tunes the main graph).
    """

    def __init__(self, tensors: dict[str, dict[str, Any]] | None = None, default_scale: float | None = None,
                 default_zero_point: float = 0.0, weight_clip: str | None = None,
                 bias_corrections: dict[str, list[float]] | None = None, bodies: dict[str, QDQPlan] | None = None,
                 weight_cache: dict[tuple, QuantParams] | None = None):
        self.tensors = tensors or {}
        self.bodies = dict(bodies or {})
        # bias initializer -> mean output shift per channel that quantizing its node adds (measured by
        # the quantize stage's bias correction); apply_plan subtracts it where the plan quantizes the node
        self.bias_corrections = dict(bias_corrections or {})
        self.default_scale = default_scale
        self.default_zero_point = default_zero_point
        self.defaulted: set[str] = set()
        if weight_clip is None:
            algorithms = {s.get("algorithm") for s in self.tensors.values() if isinstance(s, dict)}
            weight_clip = "mse" if any(self.weight_clip_for(a) == "mse" for a in algorithms) else "max"
        if weight_clip not in WEIGHT_SEARCHES:
            raise ValueError(f"weight_clip={weight_clip!r}: expected one of {', '.join(WEIGHT_SEARCHES)}")
        self.weight_clip = weight_clip
        # (weight name, digest, axis, dtype, reduced, search) -> scales: the mse search is far costlier than
        # the hash, autotune applies a plan to the same weights for every candidate, and the quantize
        # stage's candidates (ranges, transforms) share one ``weight_cache``: the weights' scales do not
        # depend on the activation statistics
        self._weights: dict[tuple, QuantParams] = weight_cache if weight_cache is not None else {}

    @staticmethod
    def weight_clip_for(algorithm: str | None) -> str:
        """The weight scale search that goes with an activation calibration algorithm."""
        return "mse" if algorithm in ("mse", "auto") else "max"

    def weight_params(self, name: str, values: np.ndarray, axis: int | None, dtype: str,
                      reduced: bool = False) -> QuantParams:
        """``weight_params`` with this calibration's weight search (memoized for the mse search)."""
        if self.weight_clip == "max":
            return weight_params(values, axis, dtype, reduced)

        digest = hashlib.blake2b(np.ascontiguousarray(values, np.float32).data, digest_size=16).hexdigest()
        key = (name, digest, values.shape, axis, dtype, bool(reduced), self.weight_clip)
        if key not in self._weights:
            self._weights[key] = weight_params(values, axis, dtype, reduced, self.weight_clip)
        return self._weights[key]

    def with_aliases(self, aliases: dict[str, str]) -> Calibration:
        """A copy where each ``tensor`` takes the statistics of its ``source``."""
        c = Calibration(dict(self.tensors), self.default_scale, self.default_zero_point, self.weight_clip,
                        self.bias_corrections, self.bodies)
        c.defaulted = self.defaulted
        c._weights = self._weights
        for t, src in aliases.items():
            c.alias(t, src)
        return c

    def alias(self, tensor: str, source: str) -> None:
        """Give ``tensor`` the statistics of ``source`` (data-movement ops must keep their input's scale)."""
        if source in self.tensors:
            self.tensors[tensor] = self.tensors[source]

    def params(self, tensor: str, dtype: str) -> QuantParams:
        stats = self.tensors.get(tensor)
        if stats is None:
            if self.default_scale is None:
                raise MissingCalibration(tensor)
            self.defaulted.add(tensor)
            zp = self.default_zero_point if dtype in ("int8", "uint8") else 0.0
            return QuantParams.scalar(dtype, self.default_scale, zp)
        return activation_params(stats, dtype)


def load_calibration(path: str | Path, default_scale: float | None = None,
                     default_zero_point: float = 0.0) -> Calibration:
    """The Calibration of a quantize/calibration.json (StateError if the file is not one); its
    ``weight_clip`` (absent before mse weights existed: "max") decides how weight scales are searched."""
    doc = read_json(path, "calibration file")
    if not isinstance(doc, dict) or not isinstance(doc.get("tensors"), dict):
        raise StateError(f"calibration file {path} has no 'tensors' table; re-run the quantize stage")
    clip = doc.get("weight_clip", "max")
    if clip not in WEIGHT_SEARCHES:
        raise StateError(f"calibration file {path}: weight_clip={clip!r}, expected one of "
                         f"{', '.join(WEIGHT_SEARCHES)}; re-run the quantize stage")
    corrections = doc.get("bias_corrections") or {}
    if not isinstance(corrections, dict):
        raise StateError(f"calibration file {path}: bias_corrections is not a table; re-run the quantize stage")
    try:
        bodies = {k: QDQPlan.from_dict(v) for k, v in (doc.get("bodies") or {}).items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise StateError(f"calibration file {path}: bodies is not a table of plans ({exc}); re-run the quantize "
                         f"stage") from None
    return Calibration(doc["tensors"], default_scale, default_zero_point, clip, corrections, bodies)


def quantize_decisions(path: str | Path | None) -> dict[str, Any]:
    """The quantize stage's decisions in calibration.json (weight storage, nodes left float, CPU and
    accuracy facts); defaults for a file written before they existed or when there is none."""
    doc = read_json(path, "calibration file") if path is not None else {}
    d = doc.get("decisions") if isinstance(doc, dict) else None
    d = dict(d) if isinstance(d, dict) else {}
    d.setdefault("weight_range", "full")
    d.setdefault("float_nodes", [])
    d.setdefault("all_float", False)  # recovery left every quantizable node float
    return d
