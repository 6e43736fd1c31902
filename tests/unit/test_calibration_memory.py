"""Calibration streams: 10x more batches must not raise peak memory by more than 20%."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import models

SCRIPT = r"""
import json, resource, sys
import numpy as np, onnx
from pipeline.data.adapters import Batch
from pipeline.calibrate.collect import CalibrationMethod, collect
model = onnx.load(sys.argv[1])
n = int(sys.argv[2])
def batches():
    rng = np.random.default_rng(0)
    for _ in range(n):
        yield Batch({"input": rng.standard_normal((8, 3, 64, 64)).astype(np.float32)}, None, 8)
stats = collect(model, batches, CalibrationMethod(sys.argv[3], 99.9, 2048), 1, lambda it, d: it)
print(json.dumps({"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "tensors": len(stats),
                  "samples": next(iter(stats.values())).samples}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["entropy", "mse", "auto"])
def test_peak_memory_does_not_grow_with_batches(tmp_path, algorithm):
    path = models.save(models.conv_chain(batch=8, channels=32, size=64), tmp_path, "big")

    def run(n: int) -> dict:
        out = subprocess.run([sys.executable, "-c", SCRIPT, str(path), str(n), algorithm], capture_output=True, text=True,
                             check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    small, large = run(4), run(40)
    assert large["samples"] == 10 * small["samples"]
    # every batch exposes ~16 MB of activations: keeping them would add > 0.5 GB
    assert large["maxrss_kb"] <= 1.2 * small["maxrss_kb"], (small, large)


@pytest.mark.parametrize("algorithm", ["minmax", "entropy"])
def test_scales_do_not_depend_on_the_batch_size(algorithm):
    """The same 64 samples in batches of 4 and of 16: identical minmax ranges, entropy thresholds within
    2% (ranges come from a first pass, histograms are fixed-range: the grouping changes nothing)."""
    import numpy as np

    from pipeline.calibrate.collect import CalibrationMethod, collect
    from pipeline.data.adapters import Batch

    model = models.with_dynamic_batch(models.conv_chain(channels=16, size=24))
    data = np.random.default_rng(0).standard_normal((64, 3, 24, 24)).astype(np.float32)

    def run(size: int) -> dict:
        def batches():
            for i in range(0, 64, size):
                yield Batch({"input": data[i:i + size]}, None, size)
        return collect(model, batches, CalibrationMethod(algorithm, 99.9, 2048), 1, lambda it, d: it)

    small, large = run(4), run(16)
    assert small.keys() == large.keys() and small
    for t in small:
        assert (small[t].min, small[t].max) == (large[t].min, large[t].max), t
        assert small[t].samples == large[t].samples == 64
        assert small[t].threshold == pytest.approx(large[t].threshold, rel=0.02), t


def test_observation_groups_fit_the_budget():
    from pipeline.graph.memory import observation_groups

    sizes = {"a": 40, "b": 40, "c": 30, "d": 100}
    assert observation_groups(["a", "b", "c", "d"], sizes, None) == [["a", "b", "c", "d"]]
    assert observation_groups(["a", "b", "c", "d"], sizes, 80) == [["a", "b"], ["c"], ["d"]]
    # unknown sizes count as the largest known one
    assert observation_groups(["a", "x", "b"], sizes, 120) == [["a"], ["x"], ["b"]]


@pytest.mark.parametrize("algorithm", ["minmax", "entropy"])
def test_a_memory_bound_splits_the_pass_and_changes_no_statistic(algorithm):
    """With max_bytes just above the weights, the tensors are observed a few at a time: the model runs
    several times per batch, and every statistic is what one pass over all tensors gives."""
    import numpy as np

    from pipeline.calibrate.collect import ActivationRunner, CalibrationMethod, candidate_tensors, collect
    from pipeline.data.adapters import Batch
    from pipeline.graph.memory import tensor_nbytes, weights_nbytes

    model = models.conv_chain(channels=16, size=24)
    data = np.random.default_rng(0).standard_normal((16, 3, 24, 24)).astype(np.float32)

    def batches():
        for i in range(0, 16, 2):
            yield Batch({"input": data[i:i + 2]}, None, 2)

    sizes = tensor_nbytes(model)
    tensors = candidate_tensors(model)
    assert all(t in sizes for t in tensors)  # every activation sized from the graph alone
    bound = 2 * weights_nbytes(model) + 2 * max(sizes[t] for t in tensors)
    assert len(ActivationRunner(model, tensors, 1, bound).groups) > 2
    free = collect(model, batches, CalibrationMethod(algorithm, 99.9, 2048), 1, lambda it, d: it)
    bounded = collect(model, batches,
                      CalibrationMethod(algorithm, 99.9, 2048), 1, lambda it, d: it, max_bytes=bound)
    assert free == bounded


@pytest.mark.parametrize("model_fn", [models.transformer_layer, lambda: models.conv_chain(batch=2)])
def test_apply_plan_quantizes_weights_from_the_source_without_copying_them(model_fn, monkeypatch):
    """apply_plan copies the model without the float weights it stores quantized (they are read from
    the source model): the result is byte-identical to quantizing a full copy, and the source is
    untouched."""
    from pipeline.calibrate.collect import CalibrationMethod, collect
    from pipeline.data.adapters import Batch, synthetic_batches
    from pipeline.graph.model import input_specs, model_hash
    from pipeline.quant import qdq
    from pipeline.quant.calibration import Calibration
    from pipeline.quant.placement import onnxruntime_plan, resolve_rules

    model = model_fn()
    feeds = [f for f, _ in synthetic_batches(input_specs(model), 4, 0)]
    stats = collect(model, lambda: iter([Batch(f, None, 1) for f in feeds]),
                    CalibrationMethod("minmax", 99.99, 2048), 1, lambda it, d: it)
    rules = resolve_rules(model, [{"module_name": "*", "weights": {"dtype": "int8"}, "activations": {"dtype": "int8"}}])
    plan = onnxruntime_plan(model, rules, "uint8")
    source = model_hash(model)
    spared, sources = qdq._copy_sparing_weights(model, plan)
    assert sources and all(not t.raw_data for t in spared.graph.initializer if t.name in sources)
    lean = qdq.apply_plan(model, plan, Calibration(stats))
    full_copy = qdq._copy_sparing_weights
    monkeypatch.setattr(qdq, "_copy_sparing_weights", lambda m, p: full_copy(m, qdq.QDQPlan()))
    whole = qdq.apply_plan(model, plan, Calibration(stats))
    assert model_hash(lean) == model_hash(whole) and model_hash(model) == source
