"""The evaluate stage's metric functions: padding, degenerate inputs, and the report/headline text."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from pipeline.accuracy.metrics import (
    ModelScores,
    agreement_per_sample,
    cosine_similarities,
    json_safe,
    snr_db,
    snr_from_energies,
    topk_hits,
)


def test_topk_ignores_padding_rows():
    logits = np.array([[0.9, 0.1, 0.0], [0.05, 0.8, 0.15], [0.2, 0.3, 0.5], [0.9, 0.1, 0.0]], np.float32)
    labels = np.array([0, 2, 2, 0])
    assert topk_hits(logits, labels, 1) == 3
    # the 4th row is a padded copy: it must not count
    assert topk_hits(logits, labels, 1, valid=3) == 2
    assert topk_hits(logits, labels, 2, valid=3) == 3
    assert topk_hits(logits, labels, 3, valid=1) == 1
    with pytest.raises(ValueError, match="top-5 needs at least 5 classes"):
        topk_hits(logits, labels, 5)


def prediction_agreement(reference, test, valid=None):
    agree, compared = agreement_per_sample(reference, test, reference.shape[0] if valid is None else valid)
    return int(agree.sum()), int(compared.sum())


def test_agreement_over_valid_samples_and_positions():
    ref = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    test = np.array([[0.9, 0.1], [0.7, 0.3], [0.0, 1.0]])
    assert prediction_agreement(ref, test) == (1, 3)
    assert prediction_agreement(ref, test, valid=1) == (1, 1)
    # [N, seq, classes]: one prediction per position, counted per sample
    seq = np.zeros((2, 3, 4))
    seq[..., 0] = 1.0
    other = seq.copy()
    other[1, 2] = [0, 0, 1, 0]
    assert prediction_agreement(seq, other) == (5, 6)
    assert prediction_agreement(seq, other, valid=1) == (3, 3)
    agree, compared = agreement_per_sample(seq, other, 2)
    assert agree.tolist() == [3, 2] and compared.tolist() == [3, 3]
    # integer outputs are class ids already; a single float per sample has no argmax
    assert prediction_agreement(np.array([1, 2, 3]), np.array([1, 0, 3])) == (2, 3)
    assert prediction_agreement(np.array([0.5, 0.2]), np.array([0.5, 0.1])) == (0, 0)


def test_cosine_per_sample_with_zero_vectors():
    ref = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [3.0, 4.0]])
    test = np.array([[2.0, 0.0], [-1.0, -1.0], [0.0, 0.0], [1.0, 0.0], [9.0, 9.0]])
    cos = cosine_similarities(ref, test, valid=4)
    np.testing.assert_allclose(cos, [1.0, -1.0, 1.0, 0.0])
    assert cosine_similarities(np.ones((2, 3, 4)), np.ones((2, 3, 4))).shape == (2,)


def test_snr_known_value_and_identical_outputs():
    ref = np.ones((4, 25), np.float32)
    assert snr_db(ref, ref + 0.1) == pytest.approx(20.0, abs=1e-4)
    # padding rows with large errors are ignored
    noisy = ref + 0.1
    noisy[3] += 100
    assert snr_db(ref, noisy, valid=3) == pytest.approx(20.0, abs=1e-4)
    assert snr_db(ref, ref) == math.inf
    assert snr_db(np.zeros(3), np.zeros(3)) == math.inf
    assert snr_from_energies(0.0, 1.0) == -math.inf
    assert math.isnan(snr_from_energies(math.nan, 1.0))
    safe = json_safe({"snr_db": math.inf, "per": [math.nan, 3.5], "n": 2})
    assert safe == {"snr_db": None, "per": [None, 3.5], "n": 2}
    json.dumps(safe, allow_nan=False)


def test_model_scores_accumulate_across_padded_batches():
    rng = np.random.default_rng(0)
    s = ModelScores(top_k=5)
    ref_s = ModelScores(top_k=5)
    total_agree = 0
    for valid in (8, 8, 3):
        ref = rng.standard_normal((8, 10)).astype(np.float32)
        out = ref + rng.standard_normal((8, 10)).astype(np.float32) * 0.3
        labels = rng.integers(0, 10, 8)
        s.update([ref, ref[:, :2]], [out, ref[:, :2]], labels, valid)
        ref_s.update([ref, ref[:, :2]], [ref, ref[:, :2]], labels, valid)
        total_agree += int(np.sum(np.argmax(ref[:valid], 1) == np.argmax(out[:valid], 1)))
    r, f = s.result(), ref_s.result()
    assert r["samples"] == 19 and r["top1"] is not None and r["top5"] is not None
    assert r["agreement"] == pytest.approx(total_agree / 19)
    assert 0.5 < r["cosine"] < 1.0 and math.isfinite(r["snr_db"])
    # second output is identical: its own SNR is infinite, the total is not
    assert r["snr_db_per_output"][1] == math.inf and not r["identical_outputs"]
    assert f["agreement"] == 1.0 and f["cosine"] == pytest.approx(1.0) and f["snr_db"] == math.inf
    assert f["identical_outputs"]


def test_model_scores_without_labels_or_enough_classes():
    s = ModelScores(top_k=5)
    x = np.eye(3, dtype=np.float32)
    s.update([x], [x], None, 3)
    assert s.result()["top1"] is None and s.result()["top5"] is None and s.result()["agreement"] == 1.0
    s = ModelScores(top_k=5)
    s.update([x], [x], np.array([0, 1, 1]), 3)
    r = s.result()
    assert r["top1"] == pytest.approx(2 / 3) and r["top5"] is None
    # top_k=1 must not shadow top1
    s = ModelScores(top_k=1)
    s.update([x], [x], np.array([0, 1, 2]), 3)
    assert s.result()["top1"] == 1.0 and "top5" not in s.result()


def _small_metrics() -> dict:
    """evaluate's metrics.json of a float and a PTQ model (the autotuned one identical to PTQ)."""
    lat = {"median": 2.0, "p10": 1.9, "p90": 2.2, "min": 1.8, "samples": 50}
    return {
        "baseline": "FP32 float model on onnxruntime", "top_k": 5, "model_name": "m",
        "data": {"source": "digits", "samples": 10, "batches": 1, "batch_size": 16, "labelled": True},
        "latency": {"rounds": 5, "runs_per_round": 10, "warmup_runs": 10},
        "models": {
            "float": {"label": "float", "file": "export/model.onnx", "top1": 0.97, "top5": 1.0, "agreement": 1.0,
                      "cosine": 1.0, "snr_db": math.inf, "identical_outputs": True, "latency_ms": lat,
                      "speedup": 1.0, "speedup_p10": 1.0},
            "ptq": {"label": "PTQ", "file": "quantize/quantized_model.onnx", "top1": 0.968, "top5": 1.0,
                    "agreement": 0.99, "cosine": 0.999, "snr_db": 25.3, "identical_outputs": False,
                    "latency_ms": {**lat, "median": 1.0, "p10": 0.95}, "speedup": 2.0, "speedup_p10": 2.0},
        },
        "duplicates": [{"model": "autotuned", "file": "autotune/optimized_final.onnx", "identical_to": "ptq"}],
        "reproduce": {"full": "tune stages=[export,evaluate]", "evaluate_only": "tune stages=[evaluate]"},
    }


def test_headline_and_report_text():
    from pipeline.accuracy.metrics import json_safe
    from pipeline.errors import StateError
    from pipeline.records.evaluate import EvaluateMetrics
    from tasks.evaluate.report import markdown
    from tasks.evaluate.stage import headline

    metrics = _small_metrics()
    record = EvaluateMetrics.from_dict(metrics)
    assert headline(record) == "float 97.0% 2 ms | ptq 96.8% 2.00x (p10 2.00x)"
    text = markdown(record)
    assert "| PTQ | `quantize/quantized_model.onnx` | 96.80% | 100.00% | 99.00% | 0.99900 | 25.3 |" in text
    assert "byte-identical to the PTQ model" in text and "FP32 float model on onnxruntime" in text
    # the record is metrics.json: what it writes reads back as the same record, and the report is the same
    written = json.loads(json.dumps(json_safe(record.to_dict())))
    again = EvaluateMetrics.from_dict(written)
    assert json_safe(again.to_dict()) == written and markdown(again) == text
    assert record.models["ptq"].latency_ms.p10 == 0.95 and record.duplicates[0].identical_to == "ptq"
    with pytest.raises(StateError, match=r"^evaluate/metrics.json has an unknown layout \(KeyError: 'models'\)"):
        EvaluateMetrics.from_dict({k: v for k, v in metrics.items() if k != "models"})


# --------------------------------------------------------------------------- interleaved timing of prepared models


class _FakePrepared:
    def __init__(self, ms: float, fail_after: int | None = None, log: list[str] | None = None, name: str = ""):
        self.ms, self.fail_after, self.calls, self.log, self.name = ms, fail_after, 0, log, name
        self.closed = False

    def time_runs(self, n: int) -> list[float]:
        self.calls += 1
        if self.log is not None:
            self.log.append(self.name)
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("device lost")
        return [self.ms] * n

    def close(self) -> None:
        self.closed = True


def test_compare_prepared_rotates_and_fails_only_the_broken_model():
    from pipeline.backends.timing import TimingPlan, compare_prepared

    order: list[str] = []
    a, b, c = (_FakePrepared(5.0, log=order, name="a"), _FakePrepared(6.0, fail_after=3, log=order, name="b"),
               _FakePrepared(7.0, log=order, name="c"))
    ta, tb, tc = compare_prepared("fake", [a, b, c], TimingPlan(3, 4, 0))
    assert ta.ok and tc.ok and ta.n == 12 and tc.median_ms == 7.0
    assert not tb.ok and "device lost" in tb.error
    # one warm-up run each (a b c), then each round starts one model later: a b c | b c a | c a (b has
    # dropped out); each block is a settle call and a timed one
    assert order[:3] == ["a", "b", "c"]
    firsts = [order[i] for i in range(3, len(order), 2)]
    assert firsts[:3] == ["a", "b", "c"] and not any(m.closed for m in (a, b, c))  # the caller closes them


def test_only_the_block_after_a_spinning_model_waits_for_its_threads():
    """A model whose worker threads spin on after its runs (settle_seconds) makes the next model wait
    that long before its block; a model that follows one that does not spin is timed after its settle
    runs only."""
    from pipeline.backends.timing import TimingPlan, time_interleaved

    class Sleepy(_FakePrepared):  # each call takes real time, so a pause is a count of settle calls
        def time_runs(self, n: int) -> list[float]:
            time.sleep(0.002)
            return super().time_runs(n)

    order: list[str] = []
    spin, a, b = (Sleepy(1.0, log=order, name=n) for n in ("spin", "a", "b"))
    spin.settle_runs, spin.settle_seconds = 2, 0.04
    blocks, errors = time_interleaved([spin, a, b], TimingPlan(3, 2, min_block_ms=0.0))
    assert errors == [None] * 3 and all(len(bl) == 3 for bl in blocks)
    # after the warm-up (spin a b), every block is its settle calls, then one timed call
    calls, runs = [], order[3:]
    while runs:
        name, k = runs[0], 1
        while k < len(runs) and runs[k] == name:
            k += 1
        calls.append((name, k - 1))  # settle calls before the timed one
        runs = runs[k:]
    after_spin = [c for (prev, _), (_, c) in zip(calls, calls[1:], strict=False) if prev == "spin"]
    others = [c for (prev, _), (_, c) in zip([("b", 0), *calls[:-1]], calls, strict=True) if prev != "spin"]
    assert after_spin and all(c >= 5 for c in after_spin)  # 40 ms of calls that take 2 ms or more
    assert others and all(c == 2 for c in others)  # the settle runs, no pause


def test_every_block_lasts_long_enough_for_the_fastest_model():
    """Blocks of a few runs of a 0.05 ms model time the switch between models, not the model: every
    block of an interleaved timing has the runs the fastest model needs to fill MIN_BLOCK_MS."""
    from pipeline.backends.timing import MAX_BLOCK_RUNS, MIN_BLOCK_MS, TimingPlan, time_interleaved

    fast, slow = _FakePrepared(0.05), _FakePrepared(3.0)
    blocks, errors = time_interleaved([fast, slow], TimingPlan(3, 6, warmup_runs=2))
    assert errors == [None, None] and [len(b) for bl in blocks for b in bl] == [round(MIN_BLOCK_MS / 0.05)] * 6
    blocks, _ = time_interleaved([_FakePrepared(30.0), slow], TimingPlan(2, 6))  # long enough already
    assert [len(b) for bl in blocks for b in bl] == [6] * 4
    blocks, _ = time_interleaved([_FakePrepared(1e-6)], TimingPlan(1, 6))
    assert len(blocks[0][0]) == MAX_BLOCK_RUNS
    blocks, _ = time_interleaved([fast], TimingPlan(1, 6, min_block_ms=0.0))  # asked not to
    assert len(blocks[0][0]) == 6
    from pipeline.app.scope import run_scope

    with run_scope(min_block_ms=2.0):  # a run's backend.min_block_ms
        blocks, _ = time_interleaved([fast], TimingPlan(1, 6))
    assert len(blocks[0][0]) == 40
    blocks, _ = time_interleaved([fast], TimingPlan(1, 6))  # and back after the run
    assert len(blocks[0][0]) == round(MIN_BLOCK_MS / 0.05)


def test_compare_interleaved_closes_what_it_prepared_on_interrupt(tmp_path):
    from pipeline.backends.base import Timing
    from pipeline.backends.timing import TimingPlan, compare_interleaved

    made: list[_FakePrepared] = []

    class Backend:
        name, timing_runs, warmup_runs = "fake", 10, 0

        def prepare(self, path):
            if str(path) == "bad":
                raise ValueError("cannot load")
            if str(path) == "stop":
                raise KeyboardInterrupt
            made.append(_FakePrepared(1.0))
            return made[-1]

    ok, bad = compare_interleaved(Backend(), ["good", "bad"], TimingPlan(2, 1))
    assert isinstance(ok, Timing) and ok.ok and not bad.ok and "cannot load" in bad.error
    with pytest.raises(KeyboardInterrupt):
        compare_interleaved(Backend(), ["good", "stop"], TimingPlan(2, 1))
    assert len(made) == 2 and all(m.closed for m in made)


def test_the_shipped_model_is_named_as_autotune_names_it(tmp_path):
    """evaluate names what ships as autotune does: a byte copy of the float or PTQ model is that model,
    a quantized-looking file without Q/DQ is the float model, and a float-only run names none."""
    import onnx

    from pipeline.records.evaluate import Duplicate
    from tasks.evaluate.stage import EvaluatedModel, EvaluationPlan, shipped_model
    from tests import models
    from tests.helpers import qdq_conv_chain

    flt = models.save(models.conv_chain(), tmp_path, "float")
    q = tmp_path / "ptq.onnx"
    onnx.save(qdq_conv_chain(), str(q))

    def plan(entries, duplicates=()):
        evaluated = [EvaluatedModel(k, k, f"{k}.onnx", p, sha) for k, p, sha in entries]
        return EvaluationPlan(evaluated, list(duplicates), [], "FP32", None)

    assert shipped_model(plan([("float", flt, "a")])) is None
    assert shipped_model(plan([("float", flt, "a"), ("ptq", q, "b")])) == "ptq"
    assert shipped_model(plan([("float", flt, "a"), ("ptq", q, "b"), ("autotuned", q, "b")])) == "ptq"
    assert shipped_model(plan([("float", flt, "a"), ("ptq", q, "b"), ("autotuned", q, "c")])) == "autotuned"
    assert shipped_model(plan([("float", flt, "a"), ("ptq", q, "b")],
                         [Duplicate("autotuned", "x", "float")])) == "float"
    assert shipped_model(plan([("float", flt, "a"), ("autotuned", flt, "c")])) == "float"  # no Q/DQ in it


def test_report_says_where_full_range_weights_stop_being_exact():
    """Full-range int8 weights chosen on a CPU with exact u8 x s8 kernels may lose accuracy where those kernels
    saturate: the report says so, and how to tune for such a target; quantized for a saturating CPU, it does not."""
    from dataclasses import replace

    from pipeline.quant.cpu import CpuFacts
    from pipeline.records.evaluate import EvaluateMetrics, MachineSummary, QuantizationSummary
    from tasks.evaluate.report import markdown

    record = EvaluateMetrics.from_dict(_small_metrics())
    vnni = CpuFacts("x86_64", brand="Xeon", flags=("avx2", "avx512_vnni"), u8s8_saturates=False)
    full = QuantizationSummary(weight_range="full", weight_range_reason="fused kernels agree with the Q/DQ reference")
    text = markdown(replace(record, machine=MachineSummary(vnni, "Xeon"), quantization=full))
    assert "exact on CPUs with VNNI or AMX only" in text and "target.cpus=[avx2]" in text
    avx2 = replace(vnni, flags=("avx2",), u8s8_saturates=True)
    reduced = replace(full, weight_range="reduced")
    for machine, q in ((MachineSummary(avx2, "EPYC"), full), (MachineSummary(vnni, "Xeon"), reduced)):
        assert "VNNI or AMX only" not in markdown(replace(record, machine=machine, quantization=q))


class _AlternatingPrepared(_FakePrepared):
    """Its timed blocks (calls of at least 6 runs: not warm-up or settle runs) take ``ms`` times each of
    ``factors`` in turn."""

    def __init__(self, ms: float, factors: tuple[float, ...] = (1.0,)):
        super().__init__(ms)
        self.factors, self.blocks = factors, 0

    def time_runs(self, n: int) -> list[float]:
        if n < 6:
            return [self.ms] * n
        self.blocks += 1
        return [self.ms * self.factors[(self.blocks - 1) % len(self.factors)]] * n


def test_an_undecided_duel_goes_on_while_its_rounds_are_cheap():
    """The float-precision check's duel: a clear ratio ends it after MIN_ROUNDS rounds; one whose rounds
    read 0.87x and 1.07x in turn (0.965x on average, never clear of 0.97) goes on to CHEAP_ROUNDS rounds
    for a tenth-of-a-millisecond model, and stops at its 12 rounds for a slow one."""
    from pipeline.backends.ratios import CHEAP_ROUNDS, MIN_ROUNDS
    from pipeline.backends.timing import TimingPlan, time_interleaved

    def rounds(ms: float, factors: tuple[float, ...]) -> int:
        blocks, errors = time_interleaved([_AlternatingPrepared(ms), _AlternatingPrepared(ms, factors)],
                                          TimingPlan.duel(0.97, 12, 6, 2))
        assert errors == [None, None]
        return len(blocks[0])

    assert rounds(0.1, (0.5, 0.55)) == MIN_ROUNDS  # clearly below
    assert rounds(0.1, (0.87, 1.07)) == CHEAP_ROUNDS  # 64 rounds of 2 x 10 ms blocks are cheap
    assert rounds(100.0, (0.87, 1.07)) == 12  # 12 rounds of 2 x 6 runs already took 14 s


def test_the_final_comparison_ends_early_only_behind_a_clear_leader():
    """backend=auto's comparison (``clear_leader``): once one deployment is clearly faster than every
    other after MIN_ROUNDS rounds that were not cheap, more rounds would not change the choice; a near
    tie with any one of them (a float against its runtime's shipped model) takes every round, as do
    cheap rounds; one that dropped out is not waited for."""
    from pipeline.backends.ratios import MIN_ROUNDS, clear_leader
    from pipeline.backends.timing import TimingPlan, time_interleaved

    def rounds(*models: _FakePrepared) -> int:
        blocks, _ = time_interleaved(list(models), TimingPlan(8, 6, min_block_ms=0.0, until=clear_leader))
        return max(len(b) for b in blocks)

    def clear(ms: float) -> int:  # the second model leads the others by 1.5x and 2x
        return rounds(_AlternatingPrepared(2 * ms, (1.0, 0.97)), _AlternatingPrepared(ms, (1.0, 1.02)),
                      _AlternatingPrepared(1.5 * ms, (1.0, 1.03)))

    assert clear(100.0) == MIN_ROUNDS and clear(1.0) == 8  # 3 rounds of 6 runs at 100-200 ms: 8 s
    # the leader and one other alternate 0.95x / 1.06x: never clear, all 8 rounds
    assert rounds(_AlternatingPrepared(200.0), _AlternatingPrepared(100.0, (0.95, 1.06)),
                  _AlternatingPrepared(100.0)) == 8
    assert rounds(_AlternatingPrepared(200.0), _FakePrepared(100.0, fail_after=2),
                  _AlternatingPrepared(100.0)) == MIN_ROUNDS
    assert not clear_leader([[[1e3]] * 2, [[2e3]] * 2]) and not clear_leader([[[1e3]] * 5])  # too few rounds; alone
