"""Readers for what trtexec writes: its performance summary, --exportTimes, --exportProfile and
--exportOutput JSON, and the error lines of a failed run's log.

trtexec writes its JSON with C++ streams, so ``loads_lenient`` accepts the bare nan/inf it prints
(also for --exportLayerInfo, which ``common.parse_layer_info`` then normalizes).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from pipeline.backends.base import Timing

_NUM = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|inf|nan))"
_STAT = re.compile(r"(min|max|mean|median|percentile\(([\d.]+)%\)) = " + _NUM + " ms")
_METRIC_LINE = re.compile(r"\b(Latency|End-to-End Host Latency|Enqueue Time|H2D Latency|GPU Compute Time|"
                          r"D2H Latency): (min = .*)$")
_THROUGHPUT = re.compile(r"Throughput: " + _NUM + " qps")
_QUERIES = re.compile(r"Timing trace has (\d+) queries over " + _NUM + " s")


@dataclass(frozen=True)
class TimeStats:
    """One line of trtexec's performance summary, in ms: the statistics it printed (None where it printed
    none; 8.x prints one percentile, 10.x several)."""

    min: float | None = None
    max: float | None = None
    mean: float | None = None
    median: float | None = None
    percentiles: dict[float, float] = field(default_factory=dict)  # percent -> ms

    @classmethod
    def parse(cls, text: str) -> TimeStats:
        """The statistics of one line's ``min = 0.41 ms, max = ..., percentile(90%) = 0.45 ms`` part."""
        named: dict[str, float] = {}
        percentiles: dict[float, float] = {}
        for s in _STAT.finditer(text):
            if s[2]:
                percentiles[float(s[2])] = float(s[3])
            else:
                named[s[1]] = float(s[3])
        return cls(**named, percentiles=percentiles)


@dataclass
class TrtexecSummary:
    """Numbers from trtexec's "=== Performance summary ===": each timed quantity's statistics (``times``:
    "GPU Compute Time", "Latency", ... -> TimeStats), the throughput and how many queries were timed."""

    times: dict[str, TimeStats] = field(default_factory=dict)
    throughput_qps: float | None = None
    queries: int | None = None

    def stats(self, prefer: tuple[str, ...] = ("GPU Compute Time", "Latency")) -> tuple[str, TimeStats] | None:
        for name in prefer:
            if name in self.times:
                return name, self.times[name]
        return None


def parse_summary(text: str) -> TrtexecSummary:
    """Parse trtexec's performance summary (10.x prints several percentiles per line, 8.x one).

    Each line reads ``[date] [I] GPU Compute Time: min = 0.41 ms, max = 0.52 ms, mean = 0.43 ms,
    median = 0.43 ms, percentile(90%) = 0.45 ms, percentile(95%) = 0.46 ms, percentile(99%) = 0.5 ms``.
    """
    out = TrtexecSummary()
    # a log without the header (a trimmed copy) is read whole; otherwise only the summary counts
    in_summary = "=== Performance summary ===" not in text
    for line in text.splitlines():
        if "=== Performance summary ===" in line:
            in_summary = True
            continue
        m = _QUERIES.search(line)
        if m:
            out.queries = int(m[1])
            continue
        if not in_summary:
            continue
        m = _METRIC_LINE.search(line)
        if m:
            out.times[m[1]] = TimeStats.parse(m[2])
            continue
        m = _THROUGHPUT.search(line)
        if m:
            out.throughput_qps = float(m[1])
    return out


def timing_from_summary(summary: TrtexecSummary, log_path: str | None = None) -> Timing | None:
    """A Timing from the summary; p10 falls back to the minimum when trtexec did not report it."""
    found = summary.stats()
    if found is None:
        return None
    _, s = found
    nan = float("nan")

    def ms(v: float | None) -> float:
        return nan if v is None else v

    return Timing(median_ms=ms(s.median), p10_ms=ms(s.percentiles.get(10.0, s.min)),
                  p90_ms=ms(s.percentiles.get(90.0)), mean_ms=ms(s.mean), min_ms=ms(s.min),
                  n=summary.queries or 0, backend="trtexec", log_path=log_path)


def loads_lenient(text: str) -> Any:
    """json.loads for trtexec's files: C++ stream output writes nan/inf as bare words, which JSON does not allow."""
    text = re.sub(r"([:\[,]\s*)(-?)(nan|inf)\b",
                  lambda m: f'{m[1]}{m[2]}{"NaN" if m[3] == "nan" else "Infinity"}', text)
    return json.loads(text)


_PROFILE_RECORD = re.compile(r'"name"\s*:\s*"(?P<name>.*)"\s*,\s*"timeMs"\s*:\s*' + _NUM +
                             r'\s*,\s*"averageMs"\s*:\s*' + _NUM + r'(?:\s*,\s*"medianMs"\s*:\s*' + _NUM +
                             r')?\s*,\s*"percentage"\s*:\s*' + _NUM)


def parse_profile(text: str) -> dict[str, Any]:
    """Parse --exportProfile JSON: ``[{"count": N}, {"name", "timeMs", "averageMs", "medianMs", "percentage"}, ...]``.

    The leading ``{"count": N}`` record (iterations profiled) is not a layer. trtexec does not escape
    layer names, so a name holding a quote breaks JSON: then each record is read line by line.
    """
    try:
        records = loads_lenient(text)
    except json.JSONDecodeError:
        records = []
        for line in text.splitlines():
            m = re.search(r'"count"\s*:\s*(\d+)', line)
            if m and '"name"' not in line:
                records.append({"count": int(m[1])})
                continue
            m = _PROFILE_RECORD.search(line)
            if m:
                rec = {"name": m["name"], "timeMs": float(m[2]), "averageMs": float(m[3]),
                       "percentage": float(m[5])}
                if m[4] is not None:
                    rec["medianMs"] = float(m[4])
                records.append(rec)
    count = None
    layers = []
    for rec in records if isinstance(records, list) else []:
        if not isinstance(rec, dict):
            continue
        if "name" not in rec:
            count = rec.get("count", count)
            continue
        layers.append(rec)
    return {"count": count, "layers": layers}


def parse_times(text: str, warmup_ms: float = 0.0, key: str = "computeMs") -> list[float]:
    """Per-iteration times from --exportTimes JSON.

    10.x leaves warm-up iterations out; older versions include them, recognizable by a compute
    start before the warm-up time (trtexec's own rule), so those are dropped here too.
    """
    records = [r for r in loads_lenient(text) if isinstance(r, dict) and key in r]
    timed = [r for r in records if r.get("startComputeMs", warmup_ms) >= warmup_ms]
    # nothing after the warm-up means the clock starts elsewhere: then every record is a timed run
    return [float(r[key]) for r in (timed or records)]


def parse_outputs(text: str, dtypes: dict[str, np.dtype] | None = None) -> dict[str, np.ndarray]:
    """--exportOutput JSON: ``[{"name", "dimensions": "2x10", "values": [...]}, ...]``.

    Each output takes its element type from ``dtypes`` (the ONNX graph's outputs), so integer
    outputs (ArgMax ids) stay integers; outputs not listed there are float32.
    """
    dtypes = dtypes or {}
    out = {}
    for rec in loads_lenient(text):
        dims = [int(d) for d in str(rec.get("dimensions", "")).split("x") if d]
        dtype = dtypes.get(rec["name"], np.dtype(np.float32))
        values = np.asarray(rec.get("values", []), dtype=np.float64)
        if np.issubdtype(dtype, np.integer) or dtype == np.bool_:
            values = np.rint(values)
        out[rec["name"]] = values.astype(dtype).reshape(dims)
    return out


def output_dtypes(model: onnx.ModelProto) -> dict[str, np.dtype]:
    """Element type of every graph output whose type the model declares."""
    from onnx import helper

    return {o.name: np.dtype(helper.tensor_dtype_to_np_dtype(o.type.tensor_type.elem_type))
            for o in model.graph.output if o.type.tensor_type.elem_type}


def error_lines(text: str, limit: int = 3) -> str:
    """Up to ``limit`` error lines of a trtexec log, without their prefixes (else its last lines), joined by " | "."""
    errs = [ln.split("] ", 2)[-1].strip() for ln in text.splitlines() if "[E]" in ln or "ERROR" in ln]
    errs = [e for e in errs if e] or [ln.strip() for ln in text.strip().splitlines()[-limit:]]
    return " | ".join(errs[:limit])


__all__ = ["TrtexecSummary", "error_lines", "loads_lenient", "output_dtypes", "parse_outputs", "parse_profile",
           "parse_summary", "parse_times", "timing_from_summary"]
