"""Verdicts with their uncertainty: the confidence bound every budget check passes on, the holdout's
size, and the warning when the data is too small for a trustworthy verdict."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pipeline.accuracy.budget import AccuracyBudget
from pipeline.accuracy.confidence import bound
from pipeline.accuracy.holdout import Holdout, HoldoutSplit
from pipeline.accuracy.metrics import ModelScores
from tests.helpers import compose


def _embedding_scores(copies: int) -> ModelScores:
    """Scores of an embedding output whose per-sample cosine with the float one spreads around 0.993:
    the same 8 samples ``copies`` times (the same mean and spread, more samples)."""
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((8, 64))
    noise = rng.standard_normal((8, 64))
    scale = np.sqrt(2 * (1 - 0.993)) * np.linspace(0.2, 1.8, 8)[:, None]  # uneven error per sample
    out = ref + noise / np.linalg.norm(noise, axis=1, keepdims=True) * np.linalg.norm(ref, axis=1, keepdims=True) * scale
    s = ModelScores(top_k=1, output_names=["embedding"])
    s.update([np.tile(ref, (copies, 1)).astype(np.float32)], [np.tile(out, (copies, 1)).astype(np.float32)], None,
             8 * copies)
    return s


def test_a_verdict_on_few_samples_is_stricter_than_on_many():
    budget = AccuracyBudget(metric="cosine", min_cosine=0.99)
    few = budget.judge(_embedding_scores(1).scores(), None, where="held-out samples")
    many = budget.judge(_embedding_scores(100).scores(), None, where="held-out samples")
    assert few.cosine == pytest.approx(many.cosine) and few.spread == pytest.approx(many.spread)
    assert few.bound < many.bound < many.cosine
    assert "95% lower bound" in many.what and "800 held-out samples" in many.what and "sd " in many.what
    floor = AccuracyBudget(metric="cosine", min_cosine=(few.bound + many.bound) / 2)
    assert not floor.judge(_embedding_scores(1).scores(), None).ok
    assert floor.judge(_embedding_scores(100).scores(), None).ok
    # at confidence 0.5 the bound is about the mean itself
    median = AccuracyBudget(metric="cosine", min_cosine=few.cosine - 1e-4, confidence=0.5)
    assert median.judge(_embedding_scores(1).scores(), None).ok


def test_snr_and_top1_verdicts_pass_on_their_bounds():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((40, 10)).astype(np.float32)
    out = ref + 0.001 * rng.standard_normal(ref.shape).astype(np.float32)
    labels = np.argmax(ref, axis=1)
    s = ModelScores(top_k=1)
    s.update([ref], [out], labels, 40)
    v = AccuracyBudget(metric="snr", min_snr_db=20).judge(s.scores(), None)
    assert v.ok and v.bound <= v.snr_db and "lower bound" in v.what
    # two flipped predictions of 40 correct ones: the drop is 5 points, its upper bound more
    flipped = out.copy()
    flipped[:2] = np.eye(10)[(labels[:2] + 1) % 10] * 100
    s = ModelScores(top_k=1)
    s.update([ref], [flipped], labels, 40)
    scores = s.scores()
    v = AccuracyBudget(metric="top1", max_drop=6).judge(scores, 1.0)
    assert v.top1_drop == pytest.approx(5.0) and v.bound > 5.0 and not v.ok and "upper bound" in v.what


def test_bound_is_seeded_and_needs_two_samples():
    x = np.linspace(0.98, 1.0, 10)
    a = bound(lambda idx: x[idx].mean(axis=1), 10, 0.95)
    assert a == bound(lambda idx: x[idx].mean(axis=1), 10, 0.95) and a < x.mean()
    assert bound(lambda idx: x[idx].mean(axis=1), 1, 0.95) == x[0]


@pytest.mark.parametrize("seen, cal, expect", [
    (100, 16, (16, 32)),   # enough data: 32 held out after calibration's 16
    (200, 16, (16, 50)),   # a quarter of the data when that is more
    (40, 16, (16, 24)),    # short: calibration keeps its batches, the rest is held out
    (20, 16, (10, 10)),    # shorter: calibration gives up batches down to half the data
    (4, 16, (2, 2)),
])
def test_holdout_split_sizes(seen, cal, expect):
    cfg = compose(["model.batch_size=1", f"quantize.calibration.batches={cal}"])
    split = HoldoutSplit.plan(cfg, seen, 1)
    assert (split.calibration_batches, split.holdout_batches) == expect and not split.overlap
    assert split.calibration_batches + split.holdout_batches <= seen


def test_holdout_split_caps_and_explicit_batches():
    cfg = compose(["model.batch_size=32"])
    reach = HoldoutSplit.reach(cfg, 32)
    assert HoldoutSplit.plan(cfg, reach, 32).holdout_batches == 16  # 512 samples at most
    explicit = compose(["model.batch_size=1", "accuracy.holdout_batches=5", "quantize.calibration.batches=16"])
    split = HoldoutSplit.plan(explicit, 100, 1)
    assert (split.holdout_batches, split.calibration_batches) == (5, 16)
    assert HoldoutSplit.plan(explicit, 1, 1).overlap


def test_small_data_warns_once_and_calibration_never_sees_the_holdout(caplog):
    from pipeline.graph.model import input_specs
    from tests import models

    cfg = compose(["model=onnx", "model.onnx_path=x.onnx", "data=synthetic", "data.num_samples=4",
                   "quantize.calibration.batches=16"])
    specs = input_specs(models.conv_chain(batch=1))
    with caplog.at_level(logging.WARNING, logger="tune.accuracy"):
        holdout = Holdout.from_config(cfg, specs)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "only 2 held-out samples" in lines[0] and "give it at least 48 (16 x 1 to calibrate" in lines[0]
    assert holdout.split.calibration_batches == 2 and holdout.samples == 2
    assert "calibration batches 2..3" in holdout.source


class _Noisy:
    """A prepared model that adds seeded noise of ``scale`` to its input (output 'y')."""

    output_names = ["y"]

    def __init__(self, scale: float):
        self.scale, self.rng = scale, np.random.default_rng(3)

    def run(self, feeds):
        return [feeds["x"] + self.scale * self.rng.standard_normal(feeds["x"].shape).astype(np.float32)]


def _error(outputs, reference, labels):
    """Minus the mean absolute error (higher is better): one number per call."""
    return -float(np.mean([np.abs(o["y"] - r["y"]).mean() for o, r in zip(outputs, reference, strict=True)]))


def _error_per_sample(outputs, reference, labels):
    return np.concatenate([-np.abs(o["y"] - r["y"]).mean(axis=1) for o, r in zip(outputs, reference, strict=True)])


@pytest.mark.parametrize("fn", [_error, _error_per_sample])
def test_custom_metric_drop_has_an_upper_bound(fn):
    from pipeline.accuracy.budget import CustomMetric

    calls = []

    def counted(*args):
        calls.append(1)
        return fn(*args)

    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((4, 8)).astype(np.float32)} for _ in range(6)]
    budget = AccuracyBudget(metric="custom", max_drop=1.0, custom_metric="m.err")
    holdout = Holdout(feeds, [None] * 6, [4] * 6, budget=budget, metric=CustomMetric("m.err", counted))
    holdout.set_reference(_Noisy(0.0))
    v = holdout.score(_Noisy(0.1), budget)
    drop = v.custom_float - v.custom
    assert v.ok and drop > 0 and v.bound > drop and "95% upper bound" in v.what and "24 held-out samples" in v.what
    tight = AccuracyBudget(metric="custom", max_drop=(drop + v.bound) / 2, custom_metric="m.err")
    assert not holdout.score(_Noisy(0.1), tight).ok
    per_call = fn is _error
    # one call per model, plus (one number per call) 24 resamples of each; the float model's are kept
    assert len(calls) == (1 + 1 + 24 + 24 + 1 + 24 if per_call else 3)


def test_evaluate_knows_when_its_data_is_unseen(tmp_path):
    from tasks.evaluate.verdicts import unseen_data

    assert unseen_data(compose([])) is None  # digits: the test split
    same = compose(["model=onnx", "model.onnx_path=x.onnx", "data=npz", f"data.path={tmp_path}"])
    assert "data.eval_path" in unseen_data(same)
    other = compose(["model=onnx", "model.onnx_path=x.onnx", "data=npz", f"data.path={tmp_path}",
                     f"data.eval_path={tmp_path / 'eval'}"])
    assert unseen_data(other) is None


def test_a_broken_promise_is_one_line_naming_both_verdicts():
    from pipeline.accuracy.budget import AccuracyVerdict
    from tasks.evaluate.verdicts import Promise

    held = AccuracyVerdict(True, "cosine", "cosine 0.9931 (95% lower bound 0.9912, 32 held-out samples; min 0.99)")
    missed = AccuracyVerdict(False, "cosine", "cosine 0.9890 on output 'e' (64 evaluation samples; min 0.99)")
    record, flag = Promise("autotuned", held).check(missed, 64, "autotuned")
    assert not record.evaluation_ok and record.holdout.what == held.what
    assert flag.count("\n") == 0 and "passed the holdout (cosine 0.9931" in flag and "64 evaluation samples" in flag
    assert Promise("autotuned", held).check(held, 64, "autotuned")[1] is None
    assert Promise("ptq", None).check(missed, 64, "PTQ")[1] is None  # nothing was promised
