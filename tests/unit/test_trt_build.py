"""TensorRT builder settings (autotune/trt_build.json) without a GPU: the candidates the runtime search
tries on tensorrt and trtexec, the trtexec flags and IBuilderConfig calls each produces, the search
keeping a faster setting and dropping a slower one (a fake trtexec whose timing depends on the flags
an engine was built with), resuming after an interruption, the file, and the stages that use it."""

from __future__ import annotations

import enum
import json
import logging
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from pipeline.backends.base import PreparedModel
from pipeline.backends.tensorrt import TensorRTBackend
from pipeline.backends.tensorrt import search as runtime_trt
from pipeline.backends.tensorrt.config import TensorRTBackendConfig
from pipeline.backends.tensorrt.settings import TrtBuildSettings
from pipeline.errors import StageError, StateError
from tasks.autotune.config import RuntimeSearchConfig
from tests import models
from tests.helpers import calls_of, fake_trtexec, qdq_conv_chain, record_runtime_search, trtexec_backend

ALL = TrtBuildSettings(builder_optimization_level=5, tiling_optimization_level=1, max_aux_streams=0)
ALL_NAMES = ["builder optimization level 4", "builder optimization level 5", "tiling optimization level FAST",
             "tiling optimization level MODERATE", "single stream (max_aux_streams 0)"]


class _Verdict:
    ok, what = True, "within budget"

    def to_dict(self) -> dict:
        return {"ok": True, "what": self.what}


def _tensorrt(version: str = "10.8.0", **cfg) -> TensorRTBackend:
    b = TensorRTBackend(OmegaConf.structured(TensorRTBackendConfig(**cfg)))
    b._trt = SimpleNamespace(__name__="tensorrt", __version__=version)
    return b


# --------------------------------------------------------------------------- the file


def test_settings_round_trip_and_describe_themselves(tmp_path):
    path = ALL.save(tmp_path / "trt_build.json")
    assert json.loads(path.read_text()) == {"builder_optimization_level": 5, "tiling_optimization_level": 1,
                                            "max_aux_streams": 0}
    assert TrtBuildSettings.load(path) == ALL
    assert ALL.describe() == "builder optimization level 5; tiling optimization level 1 (FAST); max aux streams 0"
    assert TrtBuildSettings().describe() == "the backend's own build settings"
    assert TrtBuildSettings.load(TrtBuildSettings().save(tmp_path / "none.json")) == TrtBuildSettings()


@pytest.mark.parametrize("text, detail", [
    ('{"builder_optimization_level": 9}', "builder_optimization_level=9, expected null or an integer 0..5"),
    ('{"builder_optimization_level": true}', "builder_optimization_level=True"),
    ('{"max_aux_streams": -1}', "max_aux_streams=-1, expected null or an integer >= 0"),
    ('{"tiling": 1}', "unknown key 'tiling'"),
    ("[1, 2]", "expected an object"),
    ('{"max_aux_streams": ', "corrupt"),
])
def test_a_corrupt_settings_file_is_a_one_line_error(tmp_path, text, detail):
    path = tmp_path / "trt_build.json"
    path.write_text(text)
    with pytest.raises(StateError) as exc:
        TrtBuildSettings.load(path)
    msg = str(exc.value)
    assert len(msg.splitlines()) == 1 and str(path) in msg and detail in msg


# --------------------------------------------------------------------------- flags and builder-config calls


class _Tiling(enum.IntEnum):  # trt.TilingOptimizationLevel, as the Python API defines it
    NONE = 0
    FAST = 1
    MODERATE = 2
    FULL = 3


class _RecordingConfig:
    """An IBuilderConfig with the three attributes (TensorRT 10.8 defaults), recording what is set."""

    builder_optimization_level, tiling_optimization_level, max_aux_streams = 3, _Tiling.NONE, -1

    def __init__(self) -> None:
        object.__setattr__(self, "calls", [])

    def __setattr__(self, name: str, value: object) -> None:
        self.calls.append((name, value))


def test_each_setting_has_its_trtexec_flag_and_builder_config_call():
    assert ALL.trtexec_flags() == ["--builderOptimizationLevel=5", "--tilingOptimizationLevel=1", "--maxAuxStreams=0"]
    assert TrtBuildSettings(max_aux_streams=0).trtexec_flags() == ["--maxAuxStreams=0"]
    trt, config = SimpleNamespace(__name__="tensorrt", TilingOptimizationLevel=_Tiling), _RecordingConfig()
    ALL.apply(trt, config)
    assert config.calls == [("builder_optimization_level", 5), ("tiling_optimization_level", _Tiling.FAST),
                            ("max_aux_streams", 0)]
    assert type(config.calls[1][1]) is _Tiling  # the enum member, not the int
    TrtBuildSettings().apply(trt, config := _RecordingConfig())
    assert config.calls == []


def test_a_setting_this_tensorrt_lacks_is_a_one_line_error():
    class Config:  # TensorRT before 10.8: no tiling optimization level
        builder_optimization_level, max_aux_streams = 3, -1

    trt = SimpleNamespace(__name__="tensorrt", __version__="10.7.0")
    with pytest.raises(StageError) as exc:
        ALL.apply(trt, Config())
    msg = str(exc.value)
    assert len(msg.splitlines()) == 1 and "tiling_optimization_level=1" in msg and "tensorrt 10.7.0" in msg
    assert "10.8 or later" in msg


@pytest.mark.rtx
def test_tensorrt_rtx_takes_the_builder_config_calls_and_builds(tmp_path, monkeypatch):
    """The attribute names and values against a real IBuilderConfig (TensorRT-RTX builds on the CPU), and a
    whole build with them through the tensorrt backend's code path."""
    trt = pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX bindings missing: pip install "
                                                              "'qdq-tune[rtx]'")
    config = trt.Builder(trt.Logger(trt.Logger.ERROR)).create_builder_config()
    assert (config.builder_optimization_level, config.max_aux_streams) == (3, -1)  # the documented defaults
    assert config.tiling_optimization_level == trt.TilingOptimizationLevel.NONE
    ALL.apply(trt, config)
    assert (config.builder_optimization_level, config.max_aux_streams) == (5, 0)
    assert config.tiling_optimization_level == trt.TilingOptimizationLevel.FAST

    from pipeline.backends.tensorrt import TensorRTRtxBackend
    from tests.helpers import compose

    applied = []
    real_apply = TrtBuildSettings.apply

    def apply(self, trt, config):  # the builder config the build uses, as the settings leave it
        real_apply(self, trt, config)
        applied.append((config.builder_optimization_level, int(config.tiling_optimization_level),
                        config.max_aux_streams))

    monkeypatch.setattr(TrtBuildSettings, "apply", apply)
    rtx = TensorRTRtxBackend(compose(["backend=tensorrt_rtx"]).backend).with_settings(ALL)
    model = models.save(models.conv_chain(), tmp_path, "conv")
    result = rtx.build(model, tmp_path / "m.engine", tmp_path / "build.log")
    assert applied == [(5, 1, 0)]
    assert (tmp_path / "m.engine").stat().st_size > 0 and result.info["build_settings"] == ALL.describe()
    assert f"build settings: {ALL.describe()}" in (tmp_path / "build.log").read_text()


def test_trtexec_builds_carry_the_settings_and_the_users_flag_wins(tmp_path):
    exe, calls = fake_trtexec(tmp_path)
    model = models.save(qdq_conv_chain(), tmp_path, "q")
    plain = trtexec_backend(exe, "backend.warmup_ms=0")
    plain.logs_dir = tmp_path / "logs"
    tuned = plain.with_settings(ALL)
    tuned.build(model, tmp_path / "a.engine")
    plain.build(model, tmp_path / "b.engine")
    with tuned.prepare(model) as pm:
        pm.time_runs(2)
    first, second, build, run = calls_of(calls)
    assert [a for a in first if a.startswith(("--builder", "--tiling", "--maxAux"))] == ALL.trtexec_flags()
    assert not any(a.startswith(("--builder", "--tiling", "--maxAux")) for a in second)
    assert set(ALL.trtexec_flags()) <= set(build)
    assert not any(a.startswith(("--builder", "--tiling", "--maxAux")) for a in run)  # runs load the engine
    assert tuned.describe()["build_settings"] == ALL.describe() and "build_settings" not in plain.describe()
    # the copy and the original count their invocations together: no log overwrites another
    assert len(list((tmp_path / "logs").glob("*.log"))) == 4
    user = trtexec_backend(exe, "backend.trtexec_args=['--maxAuxStreams=2']").with_settings(ALL)
    calls.unlink()
    user.build(model, tmp_path / "c.engine")
    (argv,) = calls_of(calls)
    assert "--maxAuxStreams=2" in argv and "--maxAuxStreams=0" not in argv and "--builderOptimizationLevel=5" in argv
    # a timing is of one model under one set of settings: the tuned copy does not reuse the plain one's
    assert plain.measure(model).ok and plain.measure(model).ok and plain.with_settings(ALL).measure(model).ok
    measured = [a for a in calls_of(calls) if "--exportTimes" in " ".join(a)]
    assert len(measured) == 2 and set(ALL.trtexec_flags()) <= set(measured[1])


# --------------------------------------------------------------------------- candidates


def test_candidates_and_what_each_changes(tmp_path):
    exe, _ = fake_trtexec(tmp_path)
    b = trtexec_backend(exe)
    b.version = "10.8.0"
    cands = runtime_trt.candidates(b)
    assert [n for n, _ in cands] == ALL_NAMES
    flags = [runtime_trt.apply_change(TrtBuildSettings(), c).trtexec_flags() for _, c in cands]
    assert flags == [["--builderOptimizationLevel=4"], ["--builderOptimizationLevel=5"],
                     ["--tilingOptimizationLevel=1"], ["--tilingOptimizationLevel=2"], ["--maxAuxStreams=0"]]
    b.version = "10.7.0"  # no tiling optimization level before 10.8
    assert [n for n, _ in runtime_trt.candidates(b)] == [ALL_NAMES[0], ALL_NAMES[1], ALL_NAMES[4]]
    b.version = None  # not run yet: the version is unknown, so nothing version-bound is proposed
    assert "tiling" not in " ".join(n for n, _ in runtime_trt.candidates(b))
    fixed = trtexec_backend(exe, "backend.trtexec_args=['--builderOptimizationLevel=5','--maxAuxStreams=2']")
    fixed.version = "10.9.0"
    assert [n for n, _ in runtime_trt.candidates(fixed)] == ALL_NAMES[2:4]
    # the tensorrt backend starts from backend.builder_optimization_level
    assert [n for n, _ in runtime_trt.candidates(_tensorrt("10.9.0.34", builder_optimization_level=4))] == \
        ALL_NAMES[1:]
    assert [n for n, _ in runtime_trt.candidates(_tensorrt("10.0.1", builder_optimization_level=5))] == \
        ALL_NAMES[4:]
    assert runtime_trt.base_settings(_tensorrt()) == TrtBuildSettings()


# --------------------------------------------------------------------------- the search

# per setting value, the factor the fake trtexec applies to an engine's time: level 4 helps, level 5
# less than 4, tiling FAST helps, MODERATE hurts, a single stream helps by less than keep_below asks
# (0.98); a float model takes twice as long
_FACTORS = {"--builderOptimizationLevel": {"4": 0.8, "5": 0.9}, "--tilingOptimizationLevel": {"1": 0.9, "2": 1.05},
            "--maxAuxStreams": {"0": 0.99}}


def timed_trtexec(tmp_path: Path) -> tuple[Path, Path]:
    """A fake trtexec whose engines remember the builder flags they were built with, and whose timed
    runs take the time those flags give (``_FACTORS``)."""
    calls, script = tmp_path / "calls.jsonl", tmp_path / "trtexec"
    script.write_text(f"""#!{sys.executable} -S
import json, sys
args = sys.argv[1:]
with open({str(calls)!r}, "a") as fh:
    fh.write(json.dumps(args) + "\\n")
opts = dict(a.split("=", 1) if "=" in a else (a, "") for a in args)
print("&&&& RUNNING TensorRT.trtexec [TensorRT v100800] [b43] # trtexec " + " ".join(args))
factors = {_FACTORS!r}
if "--saveEngine" in opts:
    ms = 2.0 if opts["--onnx"].endswith("float.onnx") else 1.0
    for flag, table in factors.items():
        ms *= table.get(opts.get(flag), 1.0)
    open(opts["--saveEngine"], "w").write(json.dumps(ms))
if "--skipInference" in opts:
    sys.exit(0)
ms = json.loads(open(opts["--loadEngine"]).read())
n = int(opts.get("--iterations", "10"))
open(opts["--exportTimes"], "w").write(json.dumps([{{"startComputeMs": 1.0 + i, "computeMs": ms}} for i in range(n)]))
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, calls


def test_the_search_keeps_a_faster_setting_and_drops_a_slower_one(tmp_path, caplog):
    """Through trtexec command lines end to end: each step builds both engines with their flags, and
    what ships is what the fake made faster; the final comparison reports float against it both ways."""
    from tasks.autotune.runtime.search import tune_runtime

    exe, calls = timed_trtexec(tmp_path)
    out = tmp_path / "autotune"
    out.mkdir()
    models.save(qdq_conv_chain(), out, "optimized_final")
    float_model = models.save(models.conv_chain(), tmp_path, "float")
    b = trtexec_backend(exe, "backend.warmup_ms=0", "backend.warmup_runs=1", "backend.timing_runs=16")
    b.version = "10.8.0"
    setup = SimpleNamespace(backend=b, out=out, judge=lambda pm: _Verdict(), baseline_path=float_model,
                            context_items={})
    with caplog.at_level(logging.INFO, "tune.autotune"):
        artifacts, metrics = tune_runtime(setup, OmegaConf.structured(RuntimeSearchConfig()))
    assert set(artifacts) == {"autotune/trt_build.json", "autotune/runtime_search.json"}
    assert [(s["name"], s["kept"]) for s in metrics["steps"]] == [
        (ALL_NAMES[0], True), (ALL_NAMES[1], False), (ALL_NAMES[2], True), (ALL_NAMES[3], False),
        (ALL_NAMES[4], False)]
    assert metrics["steps"][1]["ratio"] == pytest.approx(0.9 / 0.8)  # level 5 against the kept level 4
    assert metrics["steps"][4]["ratio"] == pytest.approx(0.99) and "not below 0.98" in metrics["steps"][4]["why"]
    found = TrtBuildSettings(builder_optimization_level=4, tiling_optimization_level=1)
    assert TrtBuildSettings.load(out / "trt_build.json") == found and metrics["settings"] == found.to_dict()
    assert metrics["searched"] and metrics["file"] == "autotune/trt_build.json"
    assert metrics["speedup_vs_float_default"] == pytest.approx(2.0 / 0.72)
    assert metrics["speedup_vs_float_same_settings"] == pytest.approx(2.0)
    assert "ships builder optimization level 4; tiling optimization level 1 (FAST)" in caplog.text
    builds = [a for a in calls_of(calls) if "--skipInference" in a]
    assert ["--builderOptimizationLevel=4", "--tilingOptimizationLevel=1"] in [
        [x for x in a if x.startswith(("--builder", "--tiling", "--maxAux"))] for a in builds]


class _FakePrepared(PreparedModel):
    def __init__(self, ms: float):
        self.ms = ms

    def time_runs(self, n: int) -> list[float]:
        return [self.ms] * n


class _TimedTensorRT(TensorRTBackend):
    """backend=tensorrt whose engines take the time their build settings give (``_FACTORS``)."""

    def prepare(self, model_path, profile: bool = False) -> _FakePrepared:
        ms = 1.0
        for flag in (self.settings or TrtBuildSettings()).trtexec_flags():
            name, value = flag.split("=")
            ms *= _FACTORS[name].get(value, 1.0)
        return _FakePrepared(ms)


def test_an_interrupted_tensorrt_search_resumes_at_the_next_candidate(tmp_path, monkeypatch):
    from tasks.autotune.runtime import search as rs

    b = _TimedTensorRT(OmegaConf.structured(TensorRTBackendConfig(warmup_runs=1, timing_runs=16)))
    b._trt = SimpleNamespace(__name__="tensorrt", __version__="10.8.0")
    path = models.save(qdq_conv_chain(), tmp_path, "q")
    rcfg, state = OmegaConf.structured(RuntimeSearchConfig(max_rounds=4)), tmp_path / "runtime_search.json"
    cands = runtime_trt.candidates(b)
    record_runtime_search(monkeypatch, kill_at=3)  # killed while the third candidate is measured
    with pytest.raises(KeyboardInterrupt):
        rs.RuntimeSearch(b, path, lambda pm: _Verdict(), rcfg, state, "ctx").run(cands)
    doc = json.loads(state.read_text())
    assert [s["name"] for s in doc["steps"]] == ALL_NAMES[:2] and doc["kind"] == "autotune/trt_build.json"
    assert doc["settings"]["builder_optimization_level"] == 4  # kept before the interruption
    measured = record_runtime_search(monkeypatch)
    search = rs.RuntimeSearch(b, path, lambda pm: _Verdict(), rcfg, state, "ctx")
    found = search.run(cands)
    assert measured == ALL_NAMES[2:] and search.doc["done"]
    assert found == TrtBuildSettings(builder_optimization_level=4, tiling_optimization_level=1)


def test_backends_without_a_search_say_so():
    from tasks.autotune.runtime.search import tune_runtime

    rtx = SimpleNamespace(name="tensorrt_rtx", shipped_settings=None, search_space=lambda: None)
    artifacts, metrics = tune_runtime(SimpleNamespace(backend=rtx, out=Path(".")), None)
    assert artifacts == {} and not metrics["searched"]
    assert metrics["why"] == "tensorrt_rtx has no runtime settings autotune searches"


# --------------------------------------------------------------------------- the stages that use the file


class _Manifest:
    def __init__(self, artifacts: dict[str, Path]):
        self.artifacts = artifacts

    def artifact(self, key: str) -> Path | None:
        return self.artifacts.get(key)


def _ctx(tmp_path: Path, exe: Path, artifacts: dict[str, Path]):
    from pipeline.stage import StageContext
    from tests.helpers import compose

    cfg = compose(["backend=trtexec", f"backend.trtexec_path={exe}", "stages=[gen_trt_engine]"])
    return StageContext(cfg, tmp_path, _Manifest(artifacts), logging.getLogger("test"))


def test_gen_trt_engine_builds_autotunes_model_with_the_shipped_settings(tmp_path):
    from tasks.gen_trt_engine.stage import GenTrtEngineStage

    exe, calls = fake_trtexec(tmp_path)
    model = models.save(qdq_conv_chain(), tmp_path, "optimized_final")
    settings = ALL.save(tmp_path / "trt_build.json")
    result = GenTrtEngineStage().run(_ctx(tmp_path, exe, {"autotune/optimized_final.onnx": model,
                                                          "autotune/trt_build.json": settings}))
    (argv,) = calls_of(calls)
    assert set(ALL.trtexec_flags()) <= set(argv) and ALL.describe() in result.metrics.headline
    assert result.metrics.runtime["build_settings"] == ALL.describe()
    # quantize's model was not tuned with them: built as configured
    calls.unlink()
    GenTrtEngineStage().run(_ctx(tmp_path, exe, {"quantize/quantized_model.onnx": model,
                                                 "autotune/trt_build.json": settings}))
    (argv,) = calls_of(calls)
    assert not set(ALL.trtexec_flags()) & set(argv)


def test_evaluate_times_the_tuned_model_with_its_backends_kind_of_settings(tmp_path):
    from pipeline.backends.onnxruntime import OnnxRuntimeBackend
    from pipeline.backends.onnxruntime.config import OnnxRuntimeBackendConfig
    from tasks.evaluate.stage import EvaluateStage

    exe, _ = fake_trtexec(tmp_path)
    trt_file = ALL.save(tmp_path / "trt_build.json")
    ctx = _ctx(tmp_path, exe, {"autotune/trt_build.json": trt_file})
    trtexec = trtexec_backend(exe)
    assert EvaluateStage._session_settings(ctx, trtexec) == ALL
    ort = OnnxRuntimeBackend(OmegaConf.structured(OnnxRuntimeBackendConfig()))
    assert EvaluateStage._session_settings(ctx, ort) is None  # no ort_session.json: ORT runs as configured
    TrtBuildSettings().save(trt_file)  # nothing changed: no second timing of float
    assert EvaluateStage._session_settings(ctx, trtexec) is None
