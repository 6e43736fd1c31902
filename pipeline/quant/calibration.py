"""The calibration record: per-tensor statistics from the quantize stage's calibration.json and what
else it decided, read back for every model that is quantized from it.

``TensorStats`` is one tensor's statistics, ``QuantizeDecisions`` the stage's other decisions (weight
storage, nodes left float, CPU and accuracy facts); both refuse a table with unknown or missing keys.
``Calibration`` turns statistics into activation scales (a default scale where there are none, if
allowed), searches weight scales the way calibration chose (memoized: autotune quantizes the same
weights for every candidate), and carries the measured bias corrections and the plans of Loop/Scan
bodies. ``load_calibration`` reads one from calibration.json; ``quantize_decisions`` reads the
decisions.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.artifacts import read_json
from pipeline.errors import StageError, StateError
from pipeline.quant.plan import QDQPlan
from pipeline.quant.qmath import (
    QTYPES,
    WEIGHT_SEARCHES,
    QuantParams,
    quantized_values,
    range_params,
    weight_params,
)
from pipeline.values import enum_value


class MissingCalibration(StageError):
    """A tensor to quantize has no statistics and the Calibration has no fallback scale."""

    def __init__(self, tensor: str):
        super().__init__(f"no calibration statistics for tensor '{tensor}'; re-run the quantize stage "
                         f"(stages=[quantize,...]) so calibration.json covers it")
        self.tensor = tensor


def check_keys(table: Any, required: Iterable[str], allowed: Iterable[str]) -> None:
    """ValueError (one line) naming the unknown and the missing keys of ``table``."""
    if not isinstance(table, Mapping):
        raise ValueError(f"is a {type(table).__name__}, expected a table")
    allowed = set(allowed)
    unknown = sorted(str(k) for k in table if k not in allowed)
    missing = [k for k in required if k not in table]
    problems = []
    if unknown:
        problems.append(f"unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")
    if missing:
        problems.append(f"missing key(s) {', '.join(missing)}")
    if problems:
        raise ValueError("; ".join(problems))


# auto's whole-model range candidate that keeps each tensor's own lowest-MSE clip
PER_TENSOR = "per_tensor"


@dataclass(frozen=True, kw_only=True)
class TensorStats:
    """One tensor's calibration statistics (``pipeline.calibrate.collect``; calibration.json's ``tensors``).

    ``threshold`` is the algorithm's clipping magnitude; mse and auto add ``thresholds`` per storage
    dtype, which win over it, auto ``chosen`` (the algorithm that won, per dtype) and, before its
    whole-model range choice, ``candidates``. ``scales`` are the scale and zero point per dtype that
    calibration.json records beside them (under each dtype's name). Read by attribute; a range choice
    is a ``dataclasses.replace``.
    """

    min: float
    max: float
    absmax: float
    channel_ratio: float | None = None  # largest channel's absmax over the median one's
    thresholds: dict[str, float] | None = None
    threshold: float
    chosen: dict[str, str] | None = None
    candidates: dict[str, dict[str, float]] | None = None
    algorithm: str
    samples: int | None = None  # statistics made by hand count none; calibration.json's always do
    scales: dict[str, dict[str, float]] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k in STATS_KEYS if (v := getattr(self, k)) is not None}
        out.update(self.scales or {})
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], written: bool = False) -> TensorStats:
        """The record of ``d`` (ValueError naming its unknown or missing keys); ``written``: a table of
        calibration.json, which always counts its samples."""
        if isinstance(d, TensorStats):
            return d
        check_keys(d, (*_REQUIRED_STATS, *(("samples",) if written else ())), (*STATS_KEYS, *QTYPES))
        scales = {dt: d[dt] for dt in QTYPES if dt in d}
        return cls(**{k: d[k] for k in STATS_KEYS if k in d}, scales=scales or None)

    def with_scales(self) -> TensorStats:
        """The record with the scale and zero point of every storage dtype it has a range for
        (calibration.json's): all of them, or those of ``thresholds`` where calibration searched per dtype."""
        scales = {}
        for dt in QTYPES if self.thresholds is None else [d for d in QTYPES if d in self.thresholds]:
            p = self.params(dt)
            scales[dt] = {"scale": float(p.scale), "zero_point": float(p.zero_point)}
        return replace(self, scales=scales)

    def params(self, dtype: str) -> QuantParams:
        """The scale and zero point of ``dtype``: its own threshold where calibration searched one per
        dtype (the best clip differs between symmetric int8 and asymmetric uint8), else ``threshold``."""
        per_dtype = self.thresholds or {}
        if per_dtype and dtype not in per_dtype:  # calibration searched other dtypes: never a silent int8 clip
            raise ValueError(f"no {dtype} range was calibrated (ranges for {', '.join(per_dtype)}): re-run the "
                             f"quantize stage with {dtype} in quantize.layers or autotune.quant_type")
        return range_params(dtype, self.min, self.max, per_dtype.get(dtype, self.threshold),
                            max_algorithm=self.algorithm == "max")

    def clipped_by(self, method: str) -> TensorStats:
        """The record of an ``auto`` calibration with its range clipped by ``method`` (one of its
        ``candidates``), or by its own per-tensor choice (``per_tensor``); the candidates are dropped."""
        if method == PER_TENSOR or not self.candidates:
            return replace(self, candidates=None)
        thresholds = dict(self.candidates[method])
        return replace(self, thresholds=thresholds, threshold=thresholds["int8"], chosen=None, candidates=None)


# the statistics' own keys, in calibration.json's order (each dtype's scales follow them)
STATS_KEYS = tuple(f.name for f in fields(TensorStats) if f.name != "scales")
_REQUIRED_STATS = ("min", "max", "absmax", "threshold", "algorithm")


def stats_table(tensors: Mapping[str, Mapping[str, Any]] | None, written: bool = False) -> dict[str, TensorStats]:
    """Tensor name -> TensorStats of a table of statistics (ValueError naming a tensor whose keys are
    wrong; ``written``: see ``TensorStats.from_dict``)."""
    out = {}
    for name, s in (tensors or {}).items():
        try:
            out[name] = TensorStats.from_dict(s, written)
        except ValueError as exc:
            raise ValueError(f"tensors[{name!r}]: {exc}") from None
    return out


class WeightCache:
    """What a run has computed of its weights, shared by every Calibration of the run: ``params`` maps
    (weight name, digest, shape, axis, dtype, reduced, search) to the searched scales (the mse search
    costs far more than the digest, and even absmax and quantizing cost twice its time), and ``values``
    the same key to the values quantized as stored, while they total at most QUANTIZED_CACHE_BYTES (each
    placement the quantize stage checks stores every weight again; past the bound, a large model's
    weights are quantized each time instead of held)."""

    def __init__(self) -> None:
        self.params: dict[tuple, QuantParams] = {}
        self.values: dict[tuple, np.ndarray] = {}
        self.held = 0  # bytes in ``values``
        self._lock = threading.Lock()  # apply_plan quantizes weights in threads, and the search ahead
        self._searching: dict[tuple, threading.Event] = {}  # keys a thread is searching now

    def searched(self, key: tuple, search: Callable[[], QuantParams]) -> QuantParams:
        """The scales of ``key``: cached, or searched by ``search`` once. A key another thread is searching
        is waited for, not searched again (the quantize stage searches a placement's weights ahead,
        while calibration runs, and its first model takes them as they come)."""
        with self._lock:
            if key in self.params:
                return self.params[key]
            running = self._searching.get(key)
            if running is None:
                self._searching[key] = threading.Event()
        if running is not None:
            running.wait()
            with self._lock:
                if key in self.params:
                    return self.params[key]
            return self.searched(key, search)  # the thread searching it failed: search it here
        try:
            p = search()
            with self._lock:
                self.params[key] = p
            return p
        finally:
            with self._lock:
                self._searching.pop(key).set()

    def keep(self, key: tuple, q: np.ndarray) -> None:
        with self._lock:
            if key not in self.values and self.held + q.nbytes <= QUANTIZED_CACHE_BYTES:
                q.setflags(write=False)  # shared by every model built from it
                self.values[key] = q
                self.held += q.nbytes


QUANTIZED_CACHE_BYTES = 256 * 2**20


def _digest(values: np.ndarray) -> tuple[int, int]:
    """Two checksums of a weight's values (the cache's key is also its name and shape): its CRC-32 and the
    wrapping sum of its 64-bit words, a few times faster than a cryptographic hash (a placement digests
    every weight it stores)."""
    data = np.ascontiguousarray(values, np.float32).reshape(-1).view(np.uint8)
    words = data[:data.size // 8 * 8].view(np.uint64)
    return zlib.crc32(data), int(words.sum(dtype=np.uint64))


class Calibration:
    """Per-tensor statistics from calibration.json (or a default scale where there are none), and how
    weight scales are searched (``weight_clip``: "max" or "mse").

    Without an explicit ``weight_clip`` it follows the statistics' algorithm (see ``weight_clip_for``),
    so statistics straight from calibration get the weights that calibration.json records.
    ``bodies`` are the plans of Loop/Scan bodies the quantize stage chose; apply_plan places them with
    a plan that has none of its own (autotune's, which tunes the main graph). Copies made for other
    statistics of the same weights share ``weight_cache``.
    """

    def __init__(self, tensors: Mapping[str, Mapping[str, Any]] | None = None, default_scale: float | None = None,
                 default_zero_point: float = 0.0, weight_clip: str | None = None,
                 bias_corrections: dict[str, list[float]] | None = None, bodies: dict[str, QDQPlan] | None = None):
        self.tensors = stats_table(tensors)
        self.bodies = dict(bodies or {})
        # bias initializer -> mean output shift per channel that quantizing its node adds (measured by
        # the quantize stage's bias correction); apply_plan subtracts it where the plan quantizes the node
        self.bias_corrections = dict(bias_corrections or {})
        self.default_scale = default_scale
        self.default_zero_point = default_zero_point
        self.defaulted: set[str] = set()
        if weight_clip is None:
            algorithms = {s.algorithm for s in self.tensors.values()}
            weight_clip = "mse" if any(self.weight_clip_for(a) == "mse" for a in algorithms) else "max"
        if weight_clip not in WEIGHT_SEARCHES:
            raise ValueError(f"weight_clip={weight_clip!r}: expected one of {', '.join(WEIGHT_SEARCHES)}")
        self.weight_clip = weight_clip
        # autotune applies a plan to the same weights for every candidate, and the quantize stage's
        # candidates (ranges, transforms) share one cache: the weights do not depend on the activations
        self.weight_cache = WeightCache()

    @staticmethod
    def weight_clip_for(algorithm: str | None) -> str:
        """The weight scale search that goes with an activation calibration algorithm."""
        return "mse" if algorithm in ("mse", "auto") else "max"

    def weight_params(self, name: str, values: np.ndarray, axis: int | None, dtype: str,
                      reduced: bool = False) -> QuantParams:
        """``weight_params`` with this calibration's weight search (memoized)."""
        return self.quantized_weight(name, values, axis, dtype, reduced, values_too=False)[0]

    def quantized_weight(self, name: str, values: np.ndarray, axis: int | None, dtype: str, reduced: bool = False,
                         values_too: bool = True) -> tuple[QuantParams, np.ndarray | None]:
        """The weight's scales (``weight_params`` with this calibration's search) and, with ``values_too``,
        its values quantized in their storage type (``quantized_values``; read-only where cached).
        Memoized by name and a digest of the values: see WeightCache."""
        key = (name, _digest(values), values.shape, axis, dtype, bool(reduced), self.weight_clip)
        cache = self.weight_cache
        p = cache.searched(key, lambda: weight_params(values, axis, dtype, reduced, self.weight_clip))
        if not values_too:
            return p, None
        q = cache.values.get(key)
        if q is None:
            q = quantized_values(values, p)
            cache.keep(key, q)
        return p, q

    def with_aliases(self, aliases: dict[str, str]) -> Calibration:
        """A copy where each ``tensor`` takes the statistics of its ``source``."""
        c = Calibration(dict(self.tensors), self.default_scale, self.default_zero_point, self.weight_clip,
                        self.bias_corrections, self.bodies)
        c.defaulted = self.defaulted
        c.weight_cache = self.weight_cache
        for t, src in aliases.items():
            c.alias(t, src)
        return c

    def missing_dtypes(self, dtypes: Iterable[str]) -> list[str]:
        """Those of ``dtypes`` some tensor has no range for: statistics searched per dtype
        (``thresholds``, mse and auto) hold the dtypes their run could store only."""
        searched = [set(s.thresholds) for s in self.tensors.values() if s.thresholds]
        return [dt for dt in dtypes if any(dt not in have for have in searched)]

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
        return stats.params(dtype)


def load_calibration(path: str | Path, default_scale: float | None = None,
                     default_zero_point: float = 0.0) -> Calibration:
    """The Calibration of a quantize/calibration.json (StateError if the file is not one, or a tensor's
    statistics have unknown or missing keys); its ``weight_clip`` (absent before mse weights existed:
    "max") decides how weight scales are searched."""
    doc = read_json(path, "calibration file")
    if not isinstance(doc, dict) or not isinstance(doc.get("tensors"), dict):
        raise StateError(f"calibration file {path} has no 'tensors' table; re-run the quantize stage")
    try:
        tensors = stats_table(doc["tensors"], written=True)
    except ValueError as exc:
        raise StateError(f"calibration file {path}: {exc}; re-run the quantize stage") from None
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
    return Calibration(tensors, default_scale, default_zero_point, clip, corrections, bodies)


def activation_dtypes(cfg: Any) -> tuple[str, ...]:
    """The activation storage dtypes a run can quantize to, which calibration searches ranges for:
    int8 and uint8 always (either convention, and the one ``threshold``), and the fp8 formats that
    quantize.layers or autotune.quant_type name."""
    wanted = {"int8", "uint8"}
    wanted.update(enum_value(rule.activations.dtype) for rule in cfg.quantize.layers)
    if cfg.autotune.quant_type is not None and enum_value(cfg.autotune.quant_type) == "fp8":
        wanted.add("fp8_e4m3fn")
    return tuple(dt for dt in QTYPES if dt in wanted)
