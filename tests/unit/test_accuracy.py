"""The accuracy machinery: budget verdicts, the kernel-fidelity check and the weight-storage fallback."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from pipeline.accuracy.budget import AccuracyBudget
from pipeline.accuracy.fidelity import kernel_fidelity
from pipeline.accuracy.holdout import Holdout
from pipeline.accuracy.scores import Scores
from pipeline.backends.onnxruntime.backend import OnnxRuntimeBackend, OrtPrepared
from pipeline.calibrate.collect import CalibrationMethod, collect
from pipeline.data.adapters import Batch, synthetic_batches
from pipeline.errors import ConfigError
from pipeline.graph.model import input_specs
from pipeline.quant.calibration import Calibration
from pipeline.quant.cpu import cpu_facts
from pipeline.quant.placement import onnxruntime_plan, resolve_rules
from pipeline.quant.qdq import apply_plan
from tasks.quantize import checker as checking
from tasks.quantize import culprits, weight_storage
from tests import models
from tests.helpers import openvino_backend, ort_backend, qemu_haswell, run_emulated, saturating_model


# ------------------------------------------------------------------ budget verdicts
def test_budget_uses_top1_with_labels_and_snr_plus_agreement_without():
    b = AccuracyBudget()
    assert b.judge(Scores.from_dict({"top1": 0.965, "agreement": 0.9, "snr_db": 5.0}), 0.97).ok  # 0.5 points: labels decide
    v = b.judge(Scores.from_dict({"top1": 0.95, "agreement": 1.0, "snr_db": 40.0}), 0.97)
    assert not v.ok and v.metric == "top1" and "2.00 points" in v.what
    # class scores without labels: SNR AND agreement (on the decisive samples), never one for the other
    assert b.judge(Scores.from_dict({"top1": None, "agreement": 0.995, "snr_db": 30.0}), None).ok
    assert not b.judge(Scores.from_dict({"top1": None, "agreement": 0.95, "snr_db": 30.0}), None).ok
    assert not b.judge(Scores.from_dict({"top1": None, "agreement": 1.0, "snr_db": 12.0}), None).ok
    # near-tied scores (no decisive sample) leave SNR to decide
    tied = {"agreement": 0.6, "decisive_agreement": None, "decisive_samples": 0, "snr_db": 30.0}
    v = b.judge(Scores.from_dict(tied), None)
    assert v.ok and v.metric == "snr_and_agreement" and "no decisive samples" in v.what
    # no class scores: SNR alone
    assert b.judge(Scores.from_dict({"agreement": None, "snr_db": 25.0}), None).ok
    assert not b.judge(Scores.from_dict({"agreement": None, "snr_db": 15.0}), None).ok
    cos = AccuracyBudget(metric="cosine", min_cosine=0.99)
    assert cos.judge(Scores.from_dict({"cosine": 0.995}), None).ok and not cos.judge(Scores.from_dict({"cosine": 0.98}), None).ok
    assert AccuracyBudget(enabled=False).judge(Scores.from_dict({"agreement": None, "snr_db": 1.0}), None).ok


def test_embedding_under_budget_is_rejected_even_with_full_argmax_agreement():
    """An embedding [N, 512] whose argmax never moves but whose values carry 0.19 relative error
    (SNR 14.4 dB): agreement says nothing about an embedding, so it misses the budget; the verdict
    names the output it judged. Each output of a two-output model is held to the budget on its own."""
    from pipeline.accuracy.metrics import ModelScores

    rng = np.random.default_rng(0)
    ref = rng.standard_normal((16, 512)).astype(np.float32)
    ref[:, 7] += 40.0  # one dominant channel: the argmax never changes
    noise = rng.standard_normal(ref.shape).astype(np.float32)
    out = ref + noise * (0.19 * np.linalg.norm(ref) / np.linalg.norm(noise))
    s = ModelScores(top_k=1)
    s.update([ref], [out], None, 16)
    r = s.result()
    r["output_names"] = ["embedding"]
    assert r["agreement"] == 1.0 and r["decisive_agreement"] == 1.0
    v = AccuracyBudget().judge(Scores.from_dict(r), None)
    assert not v.ok and v.output == "output 'embedding'" and "SNR 14.4 dB on output 'embedding'" in v.what
    # two outputs: a clean first output does not hide a noisy second one
    s2 = ModelScores(top_k=1)
    s2.update([ref, ref], [ref.copy(), out], None, 16)
    r2 = s2.result()
    v2 = AccuracyBudget().judge(Scores.from_dict(r2), None)
    assert r2["snr_db"] > 14.4 and not v2.ok and "on output 1" in v2.what and "worst of 2 outputs" in v2.what
    vc = AccuracyBudget(metric="cosine", min_cosine=0.99).judge(Scores.from_dict(r2), None)
    assert not vc.ok and vc.cosine < 0.99 and "output 1" in vc.what


def test_a_probability_map_is_judged_by_snr_not_by_an_argmax_over_columns():
    """A detector's [N, 1, H, W] map has no classes: no agreement is computed, SNR alone decides."""
    from pipeline.accuracy.metrics import ModelScores

    rng = np.random.default_rng(0)
    ref = rng.random((1, 1, 48, 64)).astype(np.float32)
    s = ModelScores(top_k=1)
    s.update([ref], [ref + 0.01 * rng.standard_normal(ref.shape).astype(np.float32)], None, 1)
    r = s.result()
    assert r["agreement"] is None and r["decisive_samples"] == 0
    v = AccuracyBudget().judge(Scores.from_dict(r), None)
    assert v.ok and v.metric == "snr"


def _two_outputs(snr_noise: float = 0.19) -> dict:
    """Scores of a model with a clean 'pooled' [N, 64] output and a noisy 'tokens' [N, 8, 64] one."""
    from pipeline.accuracy.metrics import ModelScores

    rng = np.random.default_rng(1)
    tokens = rng.standard_normal((16, 8, 64)).astype(np.float32)
    pooled = tokens.mean(axis=1)
    noise = rng.standard_normal(tokens.shape).astype(np.float32)
    noisy = tokens + noise * (snr_noise * np.linalg.norm(tokens) / np.linalg.norm(noise))
    s = ModelScores(top_k=1, output_names=["tokens", "pooled"], class_outputs=[])
    s.update([tokens, pooled], [noisy, pooled * 1.0001], None, 16)
    return s.result()


def test_accuracy_outputs_judges_only_the_outputs_that_matter_and_a_failure_names_the_passing_ones():
    r = _two_outputs()
    assert r["class_outputs"] == [] and r["agreement"] is None  # declared: no class scores
    v = AccuracyBudget().judge(Scores.from_dict(r), None)
    assert not v.ok and v.output == "output 'tokens'" and v.passing == ("pooled",)
    assert "accuracy.outputs=[pooled]" in v.hint
    only = AccuracyBudget(outputs=("pooled",)).judge(Scores.from_dict(r), None)
    assert only.ok and "output 'pooled'" in only.what and "tokens" not in only.what
    assert "judged on 'pooled'" in AccuracyBudget(outputs=("pooled",)).describe()
    with pytest.raises(ConfigError, match=r"accuracy.outputs: the model has no output 'nope'; its outputs are "
                                          r"tokens, pooled"):
        AccuracyBudget(outputs=("nope",)).check_outputs(["tokens", "pooled"])


def test_per_output_metrics_replace_the_default_one_for_their_outputs():
    r = _two_outputs(snr_noise=0.05)  # tokens: 26 dB, cosine ~0.9988
    strict = AccuracyBudget(min_snr_db=30.0)
    assert not strict.judge(Scores.from_dict(r), None).ok
    mixed = AccuracyBudget(min_snr_db=30.0, min_cosine=0.998, per_output=(("tokens", "cosine"),))
    v = mixed.judge(Scores.from_dict(r), None)
    assert v.ok and "cosine" in v.what and "output 'tokens'" in v.what and "output 'pooled'" in v.what
    assert not AccuracyBudget(min_cosine=0.9999, per_output=(("tokens", "cosine"),)).judge(Scores.from_dict(r), None).ok


def test_class_outputs_by_declaration_not_by_shape():
    """A [N, 64] ReLU feature output looks like class scores; declared otherwise it is judged by SNR
    alone, and a declared class output on a second position gets the agreement."""
    from pipeline.accuracy.metrics import ModelScores

    rng = np.random.default_rng(2)
    feats = np.maximum(rng.standard_normal((32, 64)), 0).astype(np.float32)
    logits = rng.standard_normal((32, 10)).astype(np.float32) * 5
    out_feats = feats + 0.02 * rng.standard_normal(feats.shape).astype(np.float32)
    guessed = ModelScores(top_k=1, output_names=["features", "logits"])
    declared = ModelScores(top_k=1, output_names=["features", "logits"], class_outputs=["logits"])
    for s in (guessed, declared):
        s.update([feats, logits], [out_feats, logits], None, 32)
    g, d = guessed.result(), declared.result()
    assert g["class_outputs"] == ["features"] and d["class_outputs"] == ["logits"]
    assert d["agreement"] == 1.0 and d["agreement_per_output"][0] is None
    assert "agreement" in AccuracyBudget().judge(Scores.from_dict(d), None).what


def test_custom_metric_budget_is_the_drop_of_the_users_score():
    from pipeline.accuracy.budget import CustomScore

    r = Scores.from_dict(_two_outputs())
    b = AccuracyBudget(metric="custom", max_drop=0.5, custom_metric="my.recall")
    ok, bad = b.judge(r, None, custom=CustomScore(0.90, 0.895)), b.judge(r, None, custom=CustomScore(0.90, 0.30))
    assert ok.ok and ok.custom == 0.895 and ok.custom_float == 0.90 and "recall 0.895 (float 0.9" in ok.what
    assert not bad.ok
    # the drop's upper confidence bound decides, not the drop
    unsure = b.judge(r, None, custom=CustomScore(0.90, 0.895, drop_bound=0.6))
    assert not unsure.ok and unsure.bound == 0.6
    rel = AccuracyBudget(metric="custom", max_drop=1.0, relative=True, custom_metric="my.recall")
    assert rel.judge(r, None, custom=CustomScore(0.90, 0.8955)).ok
    assert not rel.judge(r, None, custom=CustomScore(0.90, 0.88)).ok


def test_custom_metric_that_raises_or_returns_nan_is_one_line():
    from pipeline.accuracy.budget import CustomMetric
    from pipeline.errors import InputError

    def boom(outputs, reference, labels):
        raise KeyError("boxes")

    with pytest.raises(InputError, match=r"^accuracy.custom_metric=m.boom raised KeyError: 'boxes'; fix the function"):
        CustomMetric("m.boom", boom)([], [], None)
    with pytest.raises(InputError, match="returned NaN"):
        CustomMetric("m.nan", lambda o, r, labels: float("nan"))([], [], None)
    with pytest.raises(InputError, match="returned str, not a number"):
        CustomMetric("m.s", lambda o, r, labels: "high")([], [], None)


# ------------------------------------------------------------------ kernel fidelity


_SATURATION_SCRIPT = """
import sys, json
sys.path.insert(0, {root!r})
import numpy as np
from tests.helpers import openvino_backend, ort_backend, saturating_model
from pipeline.accuracy.fidelity import kernel_fidelity
from pipeline.quant.cpu import cpu_facts
path = {path!r}
feeds = [{{"x": np.ones((1, 16, 8, 8), np.float32)}}]
r = kernel_fidelity(ort_backend(), path, feeds)
ov = kernel_fidelity(openvino_backend(), path, feeds)
print(json.dumps({{"ok": r.ok, "snr": r.snr_db, "ov_ok": ov.ok, "ov_snr": ov.snr_db,
                  "saturates": cpu_facts().u8s8_saturates}}))
"""


@pytest.mark.parametrize("backend", [ort_backend, openvino_backend], ids=["onnxruntime", "openvino"])
def test_fidelity_check_on_a_graph_that_saturates_u8s8_without_vnni(tmp_path, backend):
    """MLAS's (ONNX Runtime) and oneDNN's (OpenVINO) u8 x s8 kernels saturate without VNNI alike."""
    path = tmp_path / "saturate.onnx"
    onnx.save(saturating_model(), str(path))
    r = kernel_fidelity(backend(), path, [{"x": np.ones((1, 16, 8, 8), np.float32)}])
    assert r.checked
    if cpu_facts().u8s8_saturates:
        assert not r.ok and "disagree" in r.reason
    else:  # VNNI or AMX: the fused kernels are exact
        assert r.ok and (r.snr_db == math.inf or r.snr_db > 60)



def test_pinned_cpu_flags_decide_as_that_cpu_kind(monkeypatch):
    """QDQ_TUNE_CPU_FLAGS pins the facts the tool decides from; unset, the CPU's own (CPUID) come back."""
    from pipeline.errors import InputError
    from pipeline.quant.cpu import PIN_ENV, CpuFacts

    real = cpu_facts()
    if real.arch not in ("x86_64", "amd64"):
        pytest.skip("the pinned flags are x86's")
    monkeypatch.setenv(PIN_ENV, "avx2")
    avx2 = cpu_facts()
    assert avx2.u8s8_saturates is True and avx2.flags == ("avx2",) and avx2.pinned
    assert "pinned by QDQ_TUNE_CPU_FLAGS" in avx2.describe() and avx2.brand == real.brand
    monkeypatch.setenv(PIN_ENV, "avx2,avx512f avx512bw avx512_vnni")
    assert cpu_facts().u8s8_saturates is False
    assert CpuFacts.from_dict(cpu_facts().to_dict()) == cpu_facts()
    monkeypatch.setenv(PIN_ENV, "avx2,sse9")
    with pytest.raises(InputError, match=r"QDQ_TUNE_CPU_FLAGS='avx2,sse9': unknown CPU flag\(s\) sse9; allowed: avx2"):
        cpu_facts()
    monkeypatch.delenv(PIN_ENV)
    assert cpu_facts() == real and not real.pinned and real.source == "cpuid"


@pytest.mark.slow
@pytest.mark.extra("qemu-user (apt-get install qemu-user)")
def test_fidelity_check_fires_on_an_emulated_avx2_cpu(tmp_path):
    prefix = qemu_haswell()
    if prefix is None:
        pytest.skip("needs qemu-user (apt-get install qemu-user) on x86_64 to emulate an AVX2 CPU without VNNI")
    path = tmp_path / "saturate.onnx"
    onnx.save(saturating_model(), str(path))
    root = str(Path(__file__).resolve().parents[2])
    proc = run_emulated(prefix, ["-c", _SATURATION_SCRIPT.format(root=root, path=str(path))], timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["saturates"] is True  # archspec reads CPUID: the emulated CPU, not the host
    assert got["ok"] is False and got["snr"] < 20
    assert got["ov_ok"] is False and got["ov_snr"] < 20  # OpenVINO's oneDNN kernels saturate there too


# ------------------------------------------------------------------ fallback chosen when kernels disagree
class ExactKernelsBackend(OnnxRuntimeBackend):
    """ORT whose "fused" run is the plain Q/DQ math: the exact integer kernels of a CPU with VNNI, on
    any CPU (on AVX2 without VNNI the real u8 x s8 kernels saturate). For tests of decision logic;
    the real kernels are tested per CPU kind beside them."""

    def prepare(self, model_path):
        return self.prepare_reference(model_path)


class PerturbingBackend(ExactKernelsBackend):
    """Exact kernels, except that the fused run of a model ``wrong(model)`` picks comes out wrong (the
    plain Q/DQ reference runner stays correct); by default models with full-range int8 weights, as
    saturating kernels would."""

    def __init__(self, cfg, wrong=None):
        super().__init__(cfg)
        self.wrong = wrong or (lambda m: any(i.data_type == TensorProto.INT8 and
                                             np.abs(numpy_helper.to_array(i).astype(int)).max() > 64
                                             for i in m.graph.initializer))

    def prepare(self, model_path):
        pm = super().prepare(model_path)
        if not self.wrong(onnx.load(str(model_path))):
            return pm

        class Wrong(OrtPrepared):
            def run(self, feeds):
                return [o * 0.5 + 1.0 for o in pm.run(feeds)]

        wrong = Wrong.__new__(Wrong)
        wrong.__dict__.update(pm.__dict__)
        return wrong


def _conv_setup(tmp_path, backend):
    model = models.conv_chain(batch=2)
    specs = input_specs(model)
    feeds = [f for f, _ in synthetic_batches(specs, 16, 0)]
    stats = collect(model, lambda: iter([Batch(f, None, 2) for f in feeds[:4]]),
                    CalibrationMethod("minmax", 99.99, 2048), 1, lambda it, desc: it)
    calib = Calibration(stats)
    rules = resolve_rules(model, [{"module_name": "*", "weights": {"dtype": "int8"},
                                   "activations": {"dtype": "int8"}}])
    float_path = tmp_path / "float.onnx"
    onnx.save(model, str(float_path))
    holdout = Holdout(feeds[4:8], [None] * 4, [2] * 4)
    with backend.prepare(float_path) as pm:
        holdout.set_reference(pm)

    def build(wr: str, float_nodes=frozenset()):
        kept = {k: v for k, v in rules.items() if k not in float_nodes}
        return apply_plan(model, onnxruntime_plan(model, kept, "uint8", weight_range=wr), calib)

    return build, holdout


def test_fidelity_failure_switches_to_an_exact_weight_storage(tmp_path):
    backend = PerturbingBackend(ort_backend().cfg)
    build, holdout = _conv_setup(tmp_path, backend)
    checker = checking.Checker(backend, holdout, AccuracyBudget(), fused=True, workdir=tmp_path)
    measured = []

    def measure(paths):
        measured.append(paths)
        return [1.0 + i for i in range(len(paths))]  # the first exact variant is "fastest"

    storage = weight_storage.choose_weight_range(build, checker, "auto", False, measure)
    choice, why, checked = storage.weight_range, storage.reason, storage.checked
    full = next(c for c in checked if c.name == "weights_full")
    assert full.fidelity is not None and not full.fidelity.ok
    assert choice == "reduced" and "disagree with the Q/DQ reference" in why
    assert len(measured) == 1 and len(measured[0]) == 2  # both exact variants timed side by side
    # the reduced model really stores 7-bit weights
    m = build("reduced")
    w = [numpy_helper.to_array(i) for i in m.graph.initializer if i.data_type == TensorProto.INT8]
    assert w and max(int(np.abs(a.astype(int)).max()) for a in w) <= 64


def test_known_saturating_cpu_never_gets_full_range_weights(tmp_path):
    backend = ort_backend()
    build, holdout = _conv_setup(tmp_path, backend)
    checker = checking.Checker(backend, holdout, AccuracyBudget(), fused=True, workdir=tmp_path)
    storage = weight_storage.choose_weight_range(build, checker, "auto", True, lambda p: [2.0, 1.0])
    choice, why = storage.weight_range, storage.reason
    assert choice == "uint8" and "saturate (AVX2 without VNNI)" in why
    # a CPU whose u8 x s8 kernels are exact gets full range: this CPU's real kernels where they are
    # exact (VNNI, AMX), else the Q/DQ math that stands in for them
    exact = backend if cpu_facts().u8s8_saturates is False else ExactKernelsBackend(backend.cfg)
    exact_checker = checking.Checker(exact, holdout, AccuracyBudget(), fused=True, workdir=tmp_path)
    choice = weight_storage.choose_weight_range(build, exact_checker, "auto", False, lambda p: [1.0] * len(p)).weight_range
    assert choice == "full"
    storage = weight_storage.choose_weight_range(build, checker, "reduced", False, lambda p: [1.0] * len(p))
    choice, why = storage.weight_range, storage.reason
    assert choice == "reduced" and why == "quantize.weight_range=reduced"


def test_this_cpus_real_kernels_get_the_weight_storage_its_kind_needs(tmp_path):
    """The decision on this CPU's own kernels and facts: full range with VNNI or AMX, an exact
    variant (7-bit or uint8 weights) on AVX2 without VNNI, and the chosen model runs exactly."""
    backend = ort_backend()
    build, holdout = _conv_setup(tmp_path, backend)
    checker = checking.Checker(backend, holdout, AccuracyBudget(), fused=True, workdir=tmp_path)
    facts = cpu_facts()
    units = [n.name for n in models.conv_chain(batch=2).graph.node if n.op_type in ("Conv", "Gemm", "MatMul")]
    storage = weight_storage.choose_weight_range(build, checker, "auto", facts.u8s8_saturates,
                                            lambda p: [1.0] * len(p), units)
    assert storage.chosen.usable and storage.chosen.fidelity is not None and storage.chosen.fidelity.ok
    if facts.u8s8_saturates:
        assert storage.weight_range in ("reduced", "uint8") and "saturate" in storage.reason
    else:
        assert storage.weight_range == "full" and not storage.culprits


def one_bad_kernel(m: onnx.ModelProto) -> bool:
    """``conv2`` reads a dequantized weight: one fused kernel that disagrees with the Q/DQ reference."""
    dq = {o for n in m.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return any(n.name == "conv2" and n.input[1] in dq for n in m.graph.node)


def test_planted_kernel_disagreement_is_localized_to_its_node(tmp_path):
    backend = PerturbingBackend(ort_backend().cfg, one_bad_kernel)
    build, holdout = _conv_setup(tmp_path, backend)
    checker = checking.Checker(backend, holdout, AccuracyBudget(), fused=True, workdir=tmp_path)
    units = [n.name for n in models.conv_chain(batch=2).graph.node if n.op_type in ("Conv", "Gemm", "MatMul")]
    assert len(units) >= 3 and "conv2" in units
    timed = []
    storage = weight_storage.choose_weight_range(
        build, checker, "auto", False, lambda p: timed.append(p) or [1.0] * len(p), units)
    choice, why, checked, culprits = storage.weight_range, storage.reason, storage.checked, storage.culprits
    assert culprits == ["conv2"] and choice == "full" and "conv2" in why
    assert checked[0].usable and not timed  # the whole model's weight storage is untouched


def test_low_snr_model_on_an_exact_cpu_keeps_full_range_weights(tmp_path):
    """A noisy quantized model whose fused run differs from its Q/DQ reference by about its own
    quantization noise (as any two quantized runs do) is no kernel fault: full-range weights stay."""
    from pipeline.accuracy.fidelity import kernel_fidelity

    class NoisyTwin(OnnxRuntimeBackend):
        """The fused run is another quantized realization: as far from float as the reference, but
        with its own noise (the reference is the float output plus noise 1, fused plus noise 2)."""

        def prepare(self, model_path):
            return _Shifted(super().prepare(model_path), seed=2)

        def prepare_reference(self, model_path):
            return _Shifted(super().prepare(model_path), seed=1)

    class _Shifted:
        def __init__(self, pm, seed):
            self.pm, self.rng = pm, np.random.default_rng(seed)

        def run(self, feeds):
            outs = self.pm.run(feeds)
            return [o + self.rng.standard_normal(o.shape).astype(o.dtype) * float(np.std(o)) for o in outs]

        def close(self):
            self.pm.close()

    backend = NoisyTwin(ort_backend().cfg)
    path = tmp_path / "float.onnx"
    onnx.save(models.conv_chain(batch=2), str(path))
    feeds = [f for f, _ in synthetic_batches(input_specs(models.conv_chain(batch=2)), 64, 0)]
    with ort_backend().prepare(path) as pm:
        floats = [[np.asarray(o) for o in pm.run(f)] for f in feeds]
    r = kernel_fidelity(backend, path, feeds, float_outputs=floats)
    assert r.snr_db < 5 and r.ok and 0.6 < r.noise_ratio < 1.6  # ~0 dB apart, equally far from float
    # a kernel that adds error of its own is still caught
    r_bad = kernel_fidelity(PerturbingBackend(ort_backend().cfg, one_bad_kernel), _write_q(tmp_path), feeds[:2],
                            float_outputs=[[np.asarray(o) for o in ort_backend().run(path, f)] for f in feeds[:2]])
    assert not r_bad.ok and "reference's error vs float" in r_bad.reason


def _write_q(tmp_path):
    build, _ = _conv_setup(tmp_path, ort_backend())
    path = tmp_path / "q.onnx"
    onnx.save(build("full"), str(path))
    return path


def test_final_summary_says_which_models_miss_the_budget(capsys, tmp_path):
    from pipeline.app.summary import print_summary
    from pipeline.records.evaluate import DataSummary, EvaluateMetrics, Reproduce

    text = "PTQ model misses the accuracy budget: top-1 drop 64.0 points (max 1); likely cause: ..."
    metrics = EvaluateMetrics("FP32 float", {}, DataSummary("digits", 10, 1, 10, True), 1, {}, Reproduce("", ""),
                              headline="float 97.0% | ptq 33.0% OVER BUDGET", over_budget=[text])
    print_summary({"evaluate": {"status": "done", "metrics": metrics}}, tmp_path)
    out = capsys.readouterr().out
    assert "OVER BUDGET" in out and f"WARNING: {text}" in out


# ------------------------------------------------------------------ no model that does not run is written
def _dense_setup(tmp_path):
    from pipeline.quant.placement import resolve_rules as rr

    model = models.dense_2d_bias()
    specs = input_specs(model)
    feeds = [f for f, _ in synthetic_batches(specs, 8, 0)]
    stats = collect(model, lambda: iter([Batch(f, None, 2) for f in feeds]),
                    CalibrationMethod("minmax", 99.9, 2048), 1, lambda it, desc: it)
    rules = rr(model, [{"module_name": "*", "weights": {"dtype": "int8"}, "activations": {"dtype": "int8"}}])
    backend = ort_backend()
    float_path = tmp_path / "float.onnx"
    onnx.save(model, str(float_path))
    holdout = Holdout(feeds[:2], [None] * 2, [2] * 2)
    with backend.prepare(float_path) as pm:
        holdout.set_reference(pm)
    checker = checking.Checker(backend, holdout, AccuracyBudget(), fused=True, workdir=tmp_path)
    return model, rules, Calibration(stats), checker


def test_checks_loaded_ahead_in_a_worker_give_the_verdicts_of_checks_one_by_one(tmp_path):
    model, rules, calib, checker = _dense_setup(tmp_path)
    plans = [set(), {"dense1/MatMul"}, {"dense2/MatMul"}, {"dense1/MatMul", "dense2/MatMul"}]
    built = [apply_plan(model, onnxruntime_plan(model, {k: v for k, v in rules.items() if k not in skip}, "uint8"),
                        calib) for skip in plans]
    one_by_one = [checker.check(q, "one").verdict.error for q in built]
    ahead = [c.verdict.error for c in checker.check_each((q, f"ahead_{k % 2}") for k, q in enumerate(built))]
    assert ahead == one_by_one and len(set(one_by_one)) > 1
    stopped = checker.check_each((q, f"stop_{k % 2}") for k, q in enumerate(built))
    assert next(stopped).scored
    stopped.close()  # the model loaded ahead is closed with it


def test_the_candidate_check_each_keeps_is_built_once_for_the_checks_of_that_model(tmp_path, monkeypatch):
    """check_each keeps the runtime form of the candidates ``keep`` takes (the last one taken, the earlier
    closed); ``runs`` of that model prepares only its reference, and the fidelity check after it prepares
    nothing: the verdict is the one-by-one check's."""
    model, rules, calib, checker = _dense_setup(tmp_path)
    plans = [{"dense1/MatMul"}, set(), {"dense2/MatMul"}]
    built = [apply_plan(model, onnxruntime_plan(model, {k: v for k, v in rules.items() if k not in skip}, "uint8"),
                        calib) for skip in plans]
    one_by_one = checker.check(built[1], "one", fidelity=True)
    closed, prepared = [], []
    real_prepare, real_reference = checker.backend.prepare, checker.backend.prepare_reference

    def prepare(path, *a, **k):
        pm = real_prepare(path, *a, **k)
        prepared.append(("fused", Path(path).name))
        real_close = pm.close
        pm.close = lambda: closed.append(Path(path).name) or real_close()
        return pm

    monkeypatch.setattr(checker.backend, "prepare", prepare)
    monkeypatch.setattr(checker.backend, "prepare_reference",
                        lambda path: prepared.append(("reference", Path(path).name)) or real_reference(path))
    names = [f"keep_{k}" for k in range(3)]
    seen = list(checker.check_each(zip(built, names, strict=True), keep=lambda c: c.name in ("keep_0", "keep_1")))
    assert [c.scored for c in seen] == [True] * 3
    assert closed == ["keep_0.onnx", "keep_2.onnx"]  # keep_1 replaced keep_0 and stays built
    prepared.clear()
    assert checker.runs(built[1]) is None
    assert prepared == [("reference", "keep_1.onnx")]
    again = checker.check(built[1], "storage", fidelity=True)
    assert prepared == [("reference", "keep_1.onnx")]  # nothing built again
    assert again.verdict.error == one_by_one.verdict.error and again.fidelity.ok == one_by_one.fidelity.ok


def test_tf2onnx_style_2d_biases_run_as_int32_per_axis(tmp_path):
    model, rules, calib, checker = _dense_setup(tmp_path)
    q = apply_plan(model, onnxruntime_plan(model, rules, "uint8"), calib)
    bias_dq = [n for n in q.graph.node if n.op_type == "DequantizeLinear" and "b2" in n.input[0]]
    assert bias_dq and next(a.i for a in bias_dq[0].attribute if a.name == "axis") == 1
    assert checker.runs(q) is None  # fused and as plain Q/DQ math


def test_a_placement_the_runtime_rejects_is_caught_and_its_nodes_stay_float(tmp_path, caplog):
    """The per-axis bias DQ along the size-1 axis (what qdq-tune wrote for [1, N] biases before): ORT
    fuses it away with optimizations on, but the plain Q/DQ run fails; the nodes are left float."""
    model, rules, calib, checker = _dense_setup(tmp_path)

    def build(skip):
        q = apply_plan(model, onnxruntime_plan(model, {k: v for k, v in rules.items() if k not in skip}, "uint8"), calib)
        for n in q.graph.node:
            if n.op_type == "DequantizeLinear" and any(a.name == "axis" and a.i == 1 for a in n.attribute) \
                    and "b2" in n.input[0]:
                next(a for a in n.attribute if a.name == "axis").i = 0  # the old, invalid layout
        return q

    assert "per axis quantization" in checker.runs(build(set()))
    with caplog.at_level("WARNING"):
        skip, _ = culprits.runnable(build, checker, {n.name for n in model.graph.node})
    assert skip == {"dense2/BiasAdd", "dense2/MatMul"}
    assert "left float: onnxruntime cannot run its quantized form" in caplog.text
    assert checker.runs(build(skip)) is None


def test_recovery_finds_nodes_that_only_matter_together():
    """Two nodes whose errors compound (float alone, neither helps much; float together, the budget is
    met): the prefix search over the single-node ranking misses them, the greedy set growth finds the
    pair."""
    from pathlib import Path

    from pipeline.accuracy.budget import AccuracyVerdict
    from tasks.quantize.checker import Candidate
    from tasks.quantize.recovery import greedy_recovery, rank_sensitivity, recover

    nodes = ["stft", "enc0", "enc1", "lstm", "head"]

    def snr(float_nodes: frozenset) -> float:
        db = 12.0 + 3.0 * ("stft" in float_nodes) + 1.0 * ("lstm" in float_nodes) + 0.5 * ("head" in float_nodes)
        return db + (10.0 if {"stft", "enc0"} <= float_nodes else 0.0)

    class Checker:
        calls = 0

        def check(self, model, name):
            Checker.calls += 1
            db = snr(model)
            return Candidate(name, Path("m.onnx"), AccuracyVerdict(db >= 20, "snr", f"SNR {db} dB", snr_db=db))

        def check_each(self, items):
            return (self.check(m, n) for m, n in items)

    checker = Checker()
    ranking = rank_sensitivity(nodes, frozenset, checker)
    assert [r["node"] for r in ranking][:2] == ["stft", "lstm"]
    assert recover(ranking, frozenset, checker, max_nodes=2) == ([], None)
    chosen, met, steps = greedy_recovery(ranking, frozenset, checker, max_nodes=3)
    assert sorted(chosen) == ["enc0", "stft"] and met.verdict.ok, steps
    assert steps[-1]["ok"] and Checker.calls < 30


def _additive_checker(contribution: dict[str, float], floor_db: float):
    """A stub checker for recovery: each quantized node adds its noise ``contribution`` (noise / signal),
    the budget is met above ``floor_db``; counts its checks."""
    import math
    from pathlib import Path

    from pipeline.accuracy.budget import AccuracyVerdict
    from tasks.quantize.checker import Candidate

    class Checker:
        calls = 0

        def check(self, float_nodes, name):
            Checker.calls += 1
            nsr = sum(v for n, v in contribution.items() if n not in float_nodes) or 1e-12
            db = -10 * math.log10(nsr)
            return Candidate(name, Path("m.onnx"), AccuracyVerdict(db >= floor_db, "snr", f"SNR {db:.1f} dB",
                                                                   snr_db=db))

        def check_each(self, items):
            return (self.check(m, n) for m, n in items)

    return Checker()


def test_recovery_ranks_many_nodes_by_stretches_first_and_stays_bounded():
    """120 nodes, two culprits in the middle of the graph: the stretches whose float helps most are ranked
    node by node, the culprits come first and the budget is met with them alone, in far fewer checks
    than ranking every node (what made a BERT-base's recovery outlast its calibration)."""
    from tasks.quantize.recovery import Allowance, Closest, rank_nodes, recover

    nodes = [f"n{k:03d}" for k in range(120)]
    contribution = {n: 1e-5 for n in nodes} | {"n047": 0.02, "n081": 0.01}
    checker = _additive_checker(contribution, floor_db=25.0)
    ranking, measured = rank_nodes(nodes, frozenset, checker, Allowance(), Closest())
    assert len(measured) == 12 and measured[0]["nodes"] == 10
    assert [r["node"] for r in ranking[:2]] == ["n047", "n081"]
    assert len(ranking) == 120 and ranking[-1]["error_without"] is None and "stretch" in ranking[-1]
    float_nodes, met = recover(ranking, frozenset, checker, max_nodes=60)
    assert sorted(float_nodes) == ["n047", "n081"] and met.verdict.ok
    assert checker.calls <= 12 + 30 + 7, checker.calls


def test_recovery_checks_nothing_past_its_time_allowance_and_its_bar_counts_checks():
    import time

    from tasks.quantize.recovery import Allowance, MissedBudget, recover_budget

    nodes = [f"n{k}" for k in range(30)]
    checker = _additive_checker({n: 1e-3 for n in nodes}, floor_db=40.0)
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["y"], name=n) for n in nodes], "g", [], []))

    class Bar:
        total, n = 0, 0

        def refresh(self):
            pass

        def set_postfix_str(self, s, refresh=True):
            pass

        def update(self, k):
            self.n += k

    from pipeline.accuracy.budget import AccuracyVerdict

    start = MissedBudget(nodes, AccuracyVerdict(False, "snr", "SNR 15.2 dB", snr_db=15.2), {})
    spent = recover_budget(model, start, frozenset, checker, 15, Allowance(time.monotonic() - 1, Bar()))
    assert spent.candidate is None and checker.calls == 0
    assert all(r["error"] == "not checked: recovery's time allowance ran out" for r in spent.report["stretches"])
    bar = Bar()
    met = recover_budget(model, start, frozenset, checker, 30, Allowance(None, bar))
    assert met.candidate is not None and len(met.float_nodes) == 30  # only every node float meets 40 dB
    assert bar.n == checker.calls > 0 and bar.total >= bar.n


def test_recovery_starts_no_check_that_would_end_past_its_allowance():
    """The allowance is over once TAIL_CHECKS more checks, as long as the checks so far took on average,
    would end past the deadline: recovery then ends within its allowance, not the checks under way after it."""
    import time

    from tasks.quantize.recovery import Allowance

    now = time.monotonic()
    slow = Allowance(now + 1.0, started=now - 2.0, checks=4)  # 0.5 s a check, 1 s left: three pass it
    quick = Allowance(now + 1.0, started=now - 2.0, checks=10)  # 0.2 s a check
    assert slow.over() and not quick.over()
    assert not Allowance(now + 1.0).over() and Allowance(now - 0.1).over() and not Allowance(None).over()


def test_recovery_aims_inside_the_budget_by_its_margin():
    from pipeline.accuracy.budget import AccuracyBudget

    b = AccuracyBudget(min_snr_db=20.0, min_cosine=0.99, max_drop=1.0)
    t = b.tightened(1.0)
    assert t.min_snr_db == 21.0 and t.max_drop == 1.0
    assert t.max_disagreement == pytest.approx(10 ** -0.1)  # 2 flips in 251 decisive samples no longer pass
    scores = {"agreement": 0.99, "decisive_agreement": 249 / 251, "decisive_samples": 251, "snr_db": 30.0}
    assert b.judge(Scores.from_dict(scores), None).ok and not t.judge(Scores.from_dict(scores), None).ok
    assert t.judge(Scores.from_dict({**scores, "decisive_agreement": 250 / 251}), None).ok
    assert t.min_cosine == pytest.approx(1 - 0.01 * 10 ** -0.1)  # 1 dB less error energy
    assert b.tightened(0.0) == b


def test_a_model_judged_once_is_not_run_as_its_saturating_twin_again(tmp_path, monkeypatch):
    """``kind_verdicts``: the saturating twin's verdict on the same held-out samples and budget is kept for
    the process (autotune shipping the PTQ model judges the model quantize judged); another budget or other
    samples run the twin again. Where this host's kernels are exact, the other exact kinds take its verdict."""
    import dataclasses

    from pipeline.accuracy import kinds
    from pipeline.quant.cpu import KINDS, PIN_ENV

    monkeypatch.setenv(PIN_ENV, "avx2 avx512f avx512bw avx512_vnni amx_int8")
    monkeypatch.setattr(kinds, "_TWIN_VERDICTS", type(kinds._TWIN_VERDICTS)())
    backend = ort_backend()
    build, holdout = _conv_setup(tmp_path, backend)
    q = build("full")
    path = tmp_path / "q.onnx"
    onnx.save(q, str(path))
    runs = []
    judge = kinds._judge_reference

    def counted(*args):
        runs.append(args[1].name)
        return judge(*args)

    monkeypatch.setattr(kinds, "_judge_reference", counted)
    host = checking.Checker(backend, holdout, AccuracyBudget(), fused=True, workdir=tmp_path).check(q, "q").verdict
    first = kinds.kind_verdicts(backend, path, holdout, AccuracyBudget(), host)
    by_kind = {k.kind: k for k in first}
    assert set(by_kind) == set(KINDS) and by_kind["amx"].how == kinds.MEASURED
    assert all(by_kind[k].verdict == host for k in KINDS if not KINDS[k].saturates)  # exact: the host's run
    saturating = [k for k in KINDS if KINDS[k].saturates]
    if by_kind[saturating[0]].how != kinds.SATURATION:
        pytest.skip(f"no pair sum of this model can leave int16 ({by_kind[saturating[0]].note})")
    assert len(runs) == 1  # one twin run for every saturating kind
    again = dataclasses.replace(holdout, feeds=[dict(f) for f in holdout.feeds])  # the same samples, another run's
    assert kinds.kind_verdicts(backend, path, again, AccuracyBudget(), host) == first and len(runs) == 1
    kinds.kind_verdicts(backend, path, holdout, AccuracyBudget(min_snr_db=40.0), host)
    assert len(runs) == 2  # another budget: judged again
