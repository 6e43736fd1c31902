"""Where the shipped model's error comes from: each quantized node's own contribution to the judged
metric, measured by running the float graph with only that node quantized (its Q/DQ chains and
scales from the shipped model) on the first evaluation batches, and the calibration ranges of the
worst few nodes' activations. Writes evaluate/sensitivity.json, sensitivity.png and ranges.png.

The contribution is the noise-to-signal ratio the node adds on the judged outputs (10^(-SNR/10)):
noise from different nodes adds up roughly, so the bars read as shares of the whole model's error.
With a custom metric it is the metric's drop from the float score instead.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from pipeline.accuracy.budget import AccuracyBudget, CustomMetric
from pipeline.accuracy.holdout import by_name, class_outputs, labels_of
from pipeline.accuracy.metrics import ModelScores, json_safe
from pipeline.accuracy.sensitivity import (
    clip_range,
    float_tensor,
    only_node_quantized,
    plot_node_sensitivity,
    plot_ranges,
    quantized_inputs,
)
from pipeline.artifacts import atomic_write_json
from pipeline.backends.onnxruntime.session import inference_session, ort_session_options
from pipeline.errors import first_line
from pipeline.progress import work_bar

log = logging.getLogger("tune.evaluate")

RANGE_PLOTS = 4  # activations of the worst nodes drawn in ranges.png


@dataclass(frozen=True)
class ShippedModel:
    """The quantized model whose error is analysed: which one it is (``label``), its graph, and the
    nodes the quantize stage left float."""

    label: str
    model: onnx.ModelProto
    left_float: list[str]


def analyse(cfg: Any, float_model: onnx.ModelProto, shipped: ShippedModel, batches: list[Any], out_dir: Path,
            max_nodes: int, plot: bool = True) -> tuple[dict[str, Path], dict[str, Any]]:
    """Measure, record and (``plot``) chart each quantized node's contribution for ``shipped`` on
    ``batches``; returns the artifacts written and the record (none for a model without Q/DQ)."""
    qmodel, label, left_float = shipped.model, shipped.label, shipped.left_float
    inputs = quantized_inputs(qmodel)
    ops = {n.name: n.op_type for n in float_model.graph.node}
    every = [n for n in inputs if n in ops]
    nodes = every[:max_nodes]
    if not nodes:
        return {}, {}
    if len(every) > len(nodes):
        log.info("evaluate: sensitivity of the first %d of %d quantized nodes (evaluate.sensitivity.max_nodes)",
                 len(nodes), len(every))
    budget = AccuracyBudget.from_config(cfg)
    metric = CustomMetric.from_config(cfg)
    judge = _Judge(float_model, batches, budget, metric, class_outputs(cfg, float_model))
    rows = []
    with work_bar(len(nodes), "evaluate: sensitivity", unit="node") as bar:
        for name in nodes:
            bar.set_postfix_str(name)
            try:
                row = judge.contribution(only_node_quantized(float_model, qmodel, name, inputs[name]))
            except Exception as exc:  # noqa: BLE001 - a variant ORT rejects is reported, not fatal
                log.debug("sensitivity of %s failed", name, exc_info=True)
                row = {"error": first_line(exc), "nsr": 0.0, "label": "could not run"}
            rows.append({"node": name, "op_type": ops[name], **row})
            bar.update(1)
    whole = judge.contribution(qmodel)
    # the user's metric ranks when it tells the nodes apart; a coarse one (top-1 on a few batches) often
    # does not, and then the output error does
    by_drop = any(r.get("drop", 0.0) > 0 for r in rows)
    unit = f"drop of {metric.name}" if by_drop else "noise / signal on the judged outputs"
    for r in rows:
        r["value"] = r.get("drop", 0.0) if by_drop else r.get("nsr", 0.0)
    rows.sort(key=lambda r: (-r["value"], -r.get("nsr", 0.0)))
    doc = {"model": label, "measure": f"each node quantized alone ({unit})",
           "batches": len(batches), "whole_model": whole, "left_float": left_float, "nodes": rows,
           "quantized_nodes": len(every)}
    artifacts = {"evaluate/sensitivity.json": atomic_write_json(out_dir / "sensitivity.json", json_safe(doc))}
    if not plot:
        return artifacts, doc
    title = (f"{label} model: each quantized node quantized alone, {unit}\n(the whole model: {whole['label']}; "
             f"red: the three largest contributions)")
    artifacts["evaluate/sensitivity.png"] = plot_node_sensitivity(rows, out_dir / "sensitivity.png", title, unit,
                                                                  left_float)
    items = _range_items(float_model, qmodel, inputs, [r["node"] for r in rows[:RANGE_PLOTS]], batches)
    if items:
        artifacts["evaluate/ranges.png"] = plot_ranges(items, out_dir / "ranges.png")
    return artifacts, doc


class _Judge:
    """Runs a model on the batches and says how far its judged outputs are from the float model's."""

    def __init__(self, float_model: onnx.ModelProto, batches: list[Any], budget: AccuracyBudget,
                 metric: CustomMetric | None, classes: list[str] | None):
        self.batches, self.budget, self.metric, self.classes = batches, budget, metric, classes
        self.names = [o.name for o in float_model.graph.output]
        self.reference = self._run(float_model)
        self.named_ref = [by_name(r, self.names, b.valid) for r, b in zip(self.reference, batches, strict=True)]
        self.labels = labels_of([b.labels for b in batches], [b.valid for b in batches])
        self.float_score = self.metric(self.named_ref, self.named_ref, self.labels) if self._custom else None

    @property
    def _custom(self) -> bool:
        return self.metric is not None and self.budget.metric == "custom"

    def _run(self, model: onnx.ModelProto) -> list[list[np.ndarray]]:
        sess = inference_session(model, ort_session_options("disable", threads=1))
        return [[np.asarray(o) for o in sess.run(None, b.feeds)] for b in self.batches]

    def contribution(self, model: onnx.ModelProto) -> dict[str, Any]:
        """The noise-to-signal ratio of the judged outputs (``nsr``, ``snr_db``) and, with a custom
        metric, its score and drop from the float score."""
        outputs = self._run(model)
        s = ModelScores(top_k=1, output_names=self.names, class_outputs=self.classes, keep_samples=False)
        for ref, out, b in zip(self.reference, outputs, self.batches, strict=True):
            s.update(ref, out, b.labels, b.valid)
        plain = self.budget if not self._custom else replace(self.budget, metric="snr")
        snr = plain.judge(s.scores(), None).snr_db
        nsr = 0.0 if snr is None or snr == math.inf else 10 ** (-snr / 10)
        row = {"nsr": nsr, "snr_db": snr, "label": "exact" if nsr == 0 else f"{snr:.1f} dB"}
        if self._custom:
            named = [by_name(o, self.names, b.valid) for o, b in zip(outputs, self.batches, strict=True)]
            score = self.metric(named, self.named_ref, self.labels)
            row.update(score=score, drop=self.float_score - score,
                       label=f"{self.metric.name} {score:.4g}, {row['label']}")
        return row


def _range_items(float_model: onnx.ModelProto, qmodel: onnx.ModelProto, inputs: dict[str, list], nodes: list[str],
                 batches: list[Any]) -> list[dict[str, Any]]:
    """For the activations the given nodes read through a per-tensor Q node: their values on the
    batches (from the float model) and the range the Q node represents."""
    wanted = []
    for node in nodes:
        for qi in inputs[node]:
            if qi.q is None:
                continue
            rng = clip_range(qmodel, qi.q)
            tensor = float_tensor(float_model, qmodel, qi.q.input[0])
            if rng is not None and tensor is not None:
                wanted.append((tensor, node, rng))
    if not wanted:
        return []
    tensors = sorted({t for t, _, _ in wanted})
    sess = inference_session(float_model, ort_session_options("disable", threads=1), extra_outputs=tensors)
    values: dict[str, list[np.ndarray]] = {t: [] for t in tensors}
    for b in batches:
        for t, v in zip(tensors, sess.run(tensors, b.feeds), strict=True):
            values[t].append(np.asarray(v, dtype=np.float32).ravel())
    return [{"tensor": t, "node": node, "values": np.concatenate(values[t]), "lo": lo, "hi": hi, "dtype": dt}
            for t, node, (lo, hi, dt) in wanted[:RANGE_PLOTS]]
