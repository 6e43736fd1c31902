"""The OpenVINO compile properties search: its candidates differ from what OpenVINO picks for the model,
changes accumulate into settings that round-trip through openvino_compile.json, and the public API
compiles the shipped model with them. Autotune's float baseline is OpenVINO's default precision unless
that misses the accuracy budget against the FP32 float, then the FP32 float; evaluate follows that choice."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from pipeline.accuracy.budget import AccuracyBudget
from pipeline.backends.openvino import OpenVinoBackend
from pipeline.backends.openvino.config import OpenVinoBackendConfig
from pipeline.backends.openvino.search import apply_change, base_settings, candidates, search_candidates
from pipeline.backends.openvino.settings import CompileSettings, core
from pipeline.data.adapters import synthetic_batches
from pipeline.errors import StateError
from pipeline.graph.model import input_specs
from tasks.autotune.tune_setup import Holdout, float_baseline  # the holdout type autotune judges on
from tests import models


def _backend(**overrides) -> OpenVinoBackend:
    return OpenVinoBackend(OmegaConf.structured(OpenVinoBackendConfig(warmup_runs=1, timing_runs=4, **overrides)))


def test_candidates_differ_from_what_openvino_picks_for_the_model(tmp_path):
    backend = _backend()
    cands, found = search_candidates(backend, models.save(models.conv_chain(), tmp_path, "c"))
    picked = found["openvino_picked"]
    assert found["openvino_version"] and set(picked) >= {"INFERENCE_PRECISION_HINT", "INFERENCE_NUM_THREADS"}
    for name, change in cands:
        ((key, value),) = change.items()
        assert str(value) != picked[key], name  # no candidate measures what already runs
        apply_change(base_settings(backend), change)  # every change is a property OpenVINO takes
    assert any(n.startswith("CPU pinning") for n, _ in cands)


def test_candidates_follow_the_cpu_and_the_picked_values():
    picked = {"INFERENCE_PRECISION_HINT": "bf16", "INFERENCE_NUM_THREADS": "4", "NUM_STREAMS": "1",
              "ENABLE_CPU_PINNING": "YES", "CPU_DENORMALS_OPTIMIZATION": "NO"}
    assert candidates(picked, ["BF16", "FP32", "INT8"]) == [
        ("inference precision f32", {"INFERENCE_PRECISION_HINT": "f32"}),
        ("1 inference thread", {"INFERENCE_NUM_THREADS": 1}),
        ("CPU pinning off", {"ENABLE_CPU_PINNING": "NO"}),
        ("denormals optimization on", {"CPU_DENORMALS_OPTIMIZATION": "YES"})]
    f32 = {**picked, "INFERENCE_PRECISION_HINT": "f32", "NUM_STREAMS": "2", "ENABLE_CPU_PINNING": "NO",
           "CPU_DENORMALS_OPTIMIZATION": "YES"}
    names = [n for n, _ in candidates(f32, ["FP32", "INT8"])]  # no BF16 on this CPU: f32 only
    assert names == ["1 inference thread", "single stream (NUM_STREAMS 1)", "CPU pinning on"]
    assert [n for n, _ in candidates(f32, ["BF16"], cpu=False)] == ["inference precision bf16",
                                                                            "single stream (NUM_STREAMS 1)"]


def test_no_candidate_is_a_count_taken_from_this_hosts_cores():
    """Thread and stream counts are rules that mean the same on every machine (one thread, one stream, or
    OpenVINO's own choice left open), whatever count OpenVINO picked here."""
    for threads in ("2", "7", "64"):
        picked = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": "3"}
        counts = [v for _, change in candidates(picked, ["FP32"]) for k, v in change.items()
                  if k in ("INFERENCE_NUM_THREADS", "NUM_STREAMS")]
        assert counts == [1, 1], counts


class _Kind:
    """A backend on a CPU kind whose OpenVINO picks ``default`` for float layers when nothing pins one."""

    def __init__(self, default):
        self.default, self.settings = default, None

    def with_settings(self, settings):
        other = _Kind(self.default)
        other.settings = settings
        return other

    def float_precision(self):
        given = dict(self.settings.properties).get("INFERENCE_PRECISION_HINT") if self.settings else None
        return {"bf16": "BF16", "f32": "FP32", "f16": "FP16"}.get(given, self.default)


@pytest.mark.parametrize("kind, default", [("avx2", "FP32"), ("avx512", "FP32"), ("avx512_vnni", "FP32"),
                                           ("avx512_vnni with avx512_bf16", "BF16"), ("amx", "BF16")])
def test_shipped_settings_pin_the_precision_the_checks_ran_on_every_kind(kind, default):
    """Every shipped openvino_compile.json names its inference precision: left open, OpenVINO picks bf16 on a
    CPU with AMX or AVX-512 BF16, so a float checked in f32 on an AVX2 host would compile in bf16 there."""
    backend = _Kind(default)
    for settings in (CompileSettings(), CompileSettings.from_dict({"PERFORMANCE_HINT": "LATENCY"})):
        pinned = settings.pinned(backend)
        assert pinned.to_dict()["INFERENCE_PRECISION_HINT"] == {"FP32": "f32", "BF16": "bf16"}[default], kind
        assert set(settings.to_dict().items()) <= set(pinned.to_dict().items())
    chosen = CompileSettings.from_dict({"INFERENCE_PRECISION_HINT": "f32"})
    assert chosen.pinned(backend) == chosen  # a precision the search chose stays as it is


def test_pinned_settings_compile_in_the_precision_they_name(tmp_path):
    backend = _backend()
    pinned = CompileSettings().pinned(backend)
    compiled = pinned.compile(models.save(models.conv_chain(), tmp_path, "c"))
    named = pinned.to_dict()["INFERENCE_PRECISION_HINT"]
    assert named == backend.inference_precision(compiled)  # what OpenVINO picks here, now written out
    f32 = CompileSettings.from_dict({"INFERENCE_PRECISION_HINT": "f32"}).pinned(backend)
    assert backend.inference_precision(f32.compile(models.save(models.conv_chain(), tmp_path, "c"))) == "f32"


def test_changes_accumulate_and_the_settings_file_round_trips(tmp_path):
    backend = _backend(threads=2)
    base = base_settings(backend)
    assert base.to_dict() == {"INFERENCE_NUM_THREADS": "2", "PERFORMANCE_HINT": "LATENCY"}
    s = apply_change(apply_change(base, {"INFERENCE_PRECISION_HINT": "f32"}), {"INFERENCE_NUM_THREADS": 1})
    s = apply_change(s, {"ENABLE_CPU_PINNING": "NO"})
    assert s.to_dict() == {"ENABLE_CPU_PINNING": "NO", "INFERENCE_NUM_THREADS": "1",
                           "INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
    path = s.save(tmp_path / "openvino_compile.json")
    assert CompileSettings.load(path) == s and "INFERENCE_NUM_THREADS=1" in s.describe()
    compiled = s.compile(models.save(models.conv_chain(), tmp_path, "c"))
    assert compiled.get_property("INFERENCE_NUM_THREADS") == 1


def test_a_settings_file_that_is_not_json_is_a_state_error_naming_it(tmp_path):
    # unknown properties and bad values: tests/unit/test_openvino_backend.py
    bad = tmp_path / "openvino_compile.json"
    bad.write_text("{not json")
    with pytest.raises(StateError, match="openvino_compile.json"):
        CompileSettings.load(bad)


def test_openvino_model_compiles_the_shipped_model_with_its_shipped_settings(tmp_path):
    from pipeline.api import openvino_model
    from pipeline.artifacts import Manifest

    out = tmp_path / "autotune"
    out.mkdir()
    model = models.save(models.conv_chain(), out, "optimized_final")
    settings = CompileSettings.from_dict({"INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": "f32"})
    manifest = Manifest(tmp_path)
    outputs = {"autotune/optimized_final.onnx": manifest.describe_file(model),
               "autotune/openvino_compile.json": manifest.describe_file(settings.save(out / "openvino_compile.json"))}
    manifest.update("autotune", status="done", outputs=outputs)
    compiled = openvino_model(tmp_path)
    assert compiled.get_property("INFERENCE_NUM_THREADS") == 1
    assert compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name() == "f32"
    del outputs["autotune/openvino_compile.json"]  # none shipped: OpenVINO's defaults
    manifest.update("autotune", outputs=outputs)
    default = core().get_property("CPU", "INFERENCE_PRECISION_HINT")
    assert openvino_model(tmp_path).get_property("INFERENCE_PRECISION_HINT") == default


def _float_choice(tmp_path):
    """A backend with a float precision below FP32, a tiny model's path and a holdout on it."""
    backend = _backend()
    if backend.fp32_variant() is None:
        pytest.skip("OpenVINO runs float in FP32 on this CPU: there is no lower default precision to judge")
    model = models.conv_chain(batch=2)
    feeds = [f for f, _ in synthetic_batches(input_specs(model), 6, 0)]
    return backend, models.save(model, tmp_path, "m"), Holdout(feeds[:3], [None] * 3, [2] * 3)


def test_the_float_baseline_is_openvinos_default_unless_it_misses_the_budget_then_fp32(tmp_path, monkeypatch):
    import tasks.autotune.tune_setup as ts

    backend, path, holdout = _float_choice(tmp_path)
    default = backend.float_precision()
    monkeypatch.setattr(ts, "fp32_latency_ratio", lambda *a: (1.0, False))  # the budget alone decides here

    kept, choice = float_baseline(backend, path, holdout, AccuracyBudget(metric="snr", min_snr_db=20))
    assert kept is backend and (choice.precision, choice.default, choice.note) == (default, default, "")
    assert choice.verdict.ok

    strict = AccuracyBudget(metric="snr", min_snr_db=200)  # no float below FP32 is this close to FP32
    switched, choice = float_baseline(backend, path, holdout, strict)
    assert (switched.float_precision(), choice.precision, choice.default) == ("FP32", "FP32", default)
    assert not choice.verdict.ok and choice.note.startswith(f"{default} float misses the budget: ")
    # f32 is in its own keys: the runtime search starts from it and "as deployed" keeps it
    assert base_settings(switched).to_dict()["INFERENCE_PRECISION_HINT"] == "f32"
    assert switched.as_deployed().float_precision() == "FP32"
    # the reference candidates are judged against is the FP32 float: it meets any budget on it
    with switched.prepare(path) as pm:
        assert holdout.score(pm, strict).ok


def test_the_float_baseline_is_fp32_where_the_default_float_is_clearly_slower(tmp_path, monkeypatch):
    import tasks.autotune.tune_setup as ts

    backend, path, holdout = _float_choice(tmp_path)
    ratio, clear = ts.fp32_latency_ratio(backend, backend.fp32_variant(), path)  # measured: a real ratio
    assert 0 < ratio < 10 and (not clear or ratio < ts.FP32_FASTER)  # clearly below: its median too
    monkeypatch.setattr(ts, "fp32_latency_ratio", lambda *a: (0.8, True))  # a tiny model on a CPU without AMX
    fastest, choice = float_baseline(backend, path, holdout, AccuracyBudget(metric="snr", min_snr_db=20))
    default = backend.float_precision()
    assert fastest.float_precision() == "FP32" and (choice.precision, choice.reason) == ("FP32", "is slower here")
    assert choice.verdict.ok and choice.fp32_ratio == 0.8
    assert choice.note == f"{default} float is slower here: the FP32 float runs at 0.80x its latency"


def test_evaluate_follows_autotunes_fp32_baseline_only_where_autotune_judged_this_float(tmp_path):
    from types import SimpleNamespace

    from pipeline.artifacts import Manifest
    from tasks.evaluate.stage import model_runtimes

    backend = _backend()
    if backend.fp32_variant() is None:
        pytest.skip("OpenVINO runs float in FP32 on this CPU: there is no lower default precision to judge")
    default = backend.float_precision()

    def runtimes(autotune):
        manifest = Manifest(tmp_path)
        manifest.stages["autotune"] = autotune
        return model_runtimes(SimpleNamespace(manifest=manifest), backend, None)

    from pipeline.records.evaluate import FloatBaseline

    fp32 = {"precision": "FP32", "default": default, "note": f"{default} float misses the budget: ..."}
    for kept in ({}, {"status": "done", "metrics": {"float_baseline": {"precision": default, "default": default}}},
                 {"status": "failed", "metrics": {"float_baseline": fp32}},  # not the models evaluated
                 {"status": "done", "metrics": {"float_baseline": {**fp32, "default": "F8"}}}):  # another float
        r = runtimes(kept)
        assert (r.plain.float_precision(), r.of("float_fp32").float_precision()) == (default, "FP32")
        assert r.extra_float == ("float_fp32", "float (FP32)") and r.choice is None
    r = runtimes({"status": "done", "metrics": {"float_baseline": fp32}})
    assert (r.of("float").float_precision(), r.of("ptq").float_precision()) == ("FP32", "FP32")
    assert r.of("float_default").float_precision() == default and r.of("autotuned") is r.plain
    assert r.extra_float == ("float_default", f"float ({default})") and r.choice == FloatBaseline.from_dict(fp32)


def test_the_float_baseline_choice_is_kept_for_a_resumed_run(tmp_path, monkeypatch):
    import json

    import tasks.autotune.tune_setup as ts
    from pipeline.errors import StateError

    backend, path, holdout = _float_choice(tmp_path)
    record = tmp_path / "float_baseline.json"
    budget = AccuracyBudget(metric="snr", min_snr_db=20)
    monkeypatch.setattr(ts, "fp32_latency_ratio", lambda *a: (0.8, True))
    first, choice = float_baseline(backend, path, holdout, budget, record)
    assert first.float_precision() == "FP32" and record.exists()

    def not_again(*a):
        raise AssertionError("timed again: a resumed run must keep the choice (near the threshold it could flip)")

    monkeypatch.setattr(ts, "fp32_latency_ratio", not_again)
    again, kept = float_baseline(backend, path, holdout, budget, record)
    assert again.float_precision() == "FP32" and kept == choice
    # another budget is another question: chosen afresh
    monkeypatch.setattr(ts, "fp32_latency_ratio", lambda *a: (1.0, False))
    other, fresh = float_baseline(backend, path, holdout, AccuracyBudget(metric="snr", min_snr_db=10), record)
    assert other is backend and fresh.precision == backend.float_precision()
    doc = json.loads(record.read_text())  # a state document: version, its key, the choice
    assert doc["version"] == ts.FLOAT_BASELINE_VERSION and doc["baseline"]["precision"] == fresh.precision
    # a record from before the header (its key and the choice only) is read as it is
    record.write_text(json.dumps({"key": doc["key"], "baseline": doc["baseline"]}))
    assert float_baseline(backend, path, holdout, AccuracyBudget(metric="snr", min_snr_db=10), record)[1] == fresh
    for corrupt in ("{broken", json.dumps({"key": doc["key"], "baseline": {"colour": 1}})):
        record.write_text(corrupt)
        with pytest.raises(StateError, match=r"float baseline record .* is corrupt .*; delete it to choose"):
            float_baseline(backend, path, holdout, AccuracyBudget(metric="snr", min_snr_db=10), record)
