"""trtexec backend without a GPU: command lines, output parsing on trtexec 10.x fixtures, and a fake
trtexec executable for the invocation logic (logs, engine writing, the "Unknown option" retry)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from pipeline.backends.tensorrt.common import EngineBuildConfig
from pipeline.backends.tensorrt.trtexec import (
    TrtexecBackend,
    TrtexecRun,
    parse_profile,
    parse_summary,
    parse_times,
    strip_profiling,
    timing_from_summary,
)
from pipeline.errors import BackendUnavailable, InputError, StageError
from tests import models
from tests.helpers import calls_of, compose, fake_trtexec, qdq_conv_chain, trtexec_backend

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "trtexec"


# --------------------------------------------------------------------------- helpers



# --------------------------------------------------------------------------- command lines


def test_build_command_line():
    run = TrtexecRun(onnx=Path("m.onnx"), save_engine=Path("m.engine"), strongly_typed=True, workspace_size=512,
                     shapes={"input": ([1, 3, 16, 16], [4, 3, 16, 16], [8, 3, 16, 16]),
                             "ids:0": ([1, 8], [1, 8], [2, 8])},
                     timing_cache=Path("tc.cache"), plugins=["/p/libmy.so"], skip_inference=True,
                     extra_args=["--builderOptimizationLevel=5", "--useCudaGraph"])
    argv = run.argv("trtexec")
    assert argv[0] == "trtexec"
    assert "--onnx=m.onnx" in argv and "--saveEngine=m.engine" in argv and "--skipInference" in argv
    assert "--stronglyTyped" in argv and "--fp16" not in argv
    assert "--memPoolSize=workspace:512M" in argv
    # names holding ':' are quoted, as trtexec's shape grammar asks
    assert "--minShapes=input:1x3x16x16,'ids:0':1x8" in argv
    assert "--optShapes=input:4x3x16x16,'ids:0':1x8" in argv
    assert "--maxShapes=input:8x3x16x16,'ids:0':2x8" in argv
    assert "--timingCacheFile=tc.cache" in argv
    assert "--staticPlugins=/p/libmy.so" in argv and "--setPluginsToSerialize=/p/libmy.so" in argv
    # user arguments verbatim, last
    assert argv[-2:] == ["--builderOptimizationLevel=5", "--useCudaGraph"]
    assert not any(a.startswith(("--warmUp", "--iterations")) for a in argv)


def test_timing_command_line_uses_milliseconds_and_user_args_win():
    run = TrtexecRun(load_engine=Path("m.engine"), shapes={"input": ([1, 3], [4, 3], [8, 3])}, warmup_ms=250,
                     iterations=40, export_times=Path("t.json"), plugins=["/p/libmy.so"])
    argv = run.argv("trtexec")
    assert "--warmUp=250" in argv and "--iterations=40" in argv and "--duration=0" in argv
    assert "--shapes=input:4x3" in argv and "--exportTimes=t.json" in argv
    assert "--staticPlugins=/p/libmy.so" in argv and not any("setPluginsToSerialize" in a for a in argv)
    assert "--percentile=10,90,95,99" in argv
    # a user's own --warmUp / --percentile replaces ours instead of appearing twice
    run.extra_args = ["--warmUp=1000", "--percentile=50"]
    argv = run.argv("trtexec")
    assert [a for a in argv if a.startswith("--warmUp")] == ["--warmUp=1000"]
    assert [a for a in argv if a.startswith("--percentile")] == ["--percentile=50"]
    run.duration_s = 5
    assert "--duration=5" in run.argv("trtexec") and "--iterations=40" not in run.argv("trtexec")


def test_profiling_flags_and_strip():
    run = TrtexecRun(onnx=Path("m.onnx"), warmup_ms=200, iterations=10, export_profile=Path("p.json"),
                     export_layer_info=Path("l.json"))
    argv = run.argv("trtexec")
    for flag in ("--profilingVerbosity=detailed", "--exportProfile=p.json", "--exportLayerInfo=l.json",
                 "--separateProfileRun"):
        assert flag in argv
    stripped = strip_profiling(argv)
    assert not any(a.startswith(("--profilingVerbosity", "--export", "--separateProfileRun"))
                   for a in stripped if not a.startswith("--exportTimes"))
    assert "--onnx=m.onnx" in stripped and "--warmUp=200" in stripped


def test_strongly_typed_only_with_qdq_and_precision_flags(tmp_path):
    exe, _ = fake_trtexec(tmp_path)
    b = trtexec_backend(exe)
    float_model = models.save(models.conv_chain(), tmp_path, "float")
    qdq_model = tmp_path / "qdq.onnx"
    onnx.save(qdq_conv_chain(), str(qdq_model))
    run, _ = b._build_run(float_model, EngineBuildConfig())
    assert "--stronglyTyped" not in run.argv("trtexec")
    run, _ = b._build_run(float_model, EngineBuildConfig(data_type="FP16"))
    assert "--fp16" in run.argv("trtexec") and "--stronglyTyped" not in run.argv("trtexec")
    run, _ = b._build_run(qdq_model, EngineBuildConfig(data_type="FP16"))
    argv = run.argv("trtexec")
    assert "--stronglyTyped" in argv and "--fp16" not in argv  # precision comes from the Q/DQ nodes


def test_shapes_from_batch_shortcut_and_explicit(tmp_path):
    exe, _ = fake_trtexec(tmp_path)
    b = trtexec_backend(exe)
    dyn = models.save(models.with_dynamic_batch(models.conv_chain()), tmp_path, "dyn")
    run, _ = b._build_run(dyn, EngineBuildConfig(min_batch_size=1, opt_batch_size=4, max_batch_size=16))
    argv = run.argv("trtexec")
    assert "--minShapes=input:1x3x16x16" in argv and "--optShapes=input:4x3x16x16" in argv
    assert "--maxShapes=input:16x3x16x16" in argv
    opts = EngineBuildConfig(min_shapes={"input": [2, 3, 16, 16]}, opt_shapes={"input": [2, 3, 16, 16]},
                             max_shapes={"input": [3, 3, 16, 16]})
    run, _ = b._build_run(dyn, opts)
    assert "--maxShapes=input:3x3x16x16" in run.argv("trtexec")
    static = models.save(models.conv_chain(), tmp_path, "static")
    run, _ = b._build_run(static, EngineBuildConfig(min_batch_size=1, opt_batch_size=4, max_batch_size=16))
    assert not any("Shapes" in a for a in run.argv("trtexec"))  # static inputs need no profile
    with pytest.raises(StageError, match="inputs \\['input'\\]"):
        b._build_run(dyn, EngineBuildConfig(opt_shapes={"images": [1, 3, 16, 16]}))


def test_plugins_are_checked_and_passed(tmp_path):
    exe, _ = fake_trtexec(tmp_path)
    lib = tmp_path / "libplug.so"
    lib.write_bytes(b"\x7fELF")
    b = trtexec_backend(exe, f"backend.plugin_libraries=[{lib}]")
    model = models.save(models.conv_chain(), tmp_path, "m")
    run, _ = b._build_run(model, b.default_options())
    assert run.plugins == [str(lib)]
    with pytest.raises(InputError, match="libmissing.so does not exist"):
        b._build_run(model, EngineBuildConfig(plugin_libraries=[str(tmp_path / "libmissing.so")]))


# --------------------------------------------------------------------------- parsing


def test_parse_summary_10x_fixture():
    s = parse_summary((FIXTURES / "perf_10x.log").read_text())
    assert s.queries == 50 and s.throughput_qps == pytest.approx(17793.6)
    gpu = s.times["GPU Compute Time"]
    assert gpu.median == pytest.approx(0.0429688) and gpu.percentiles[10] == pytest.approx(0.0419922)
    assert gpu.percentiles[90] == pytest.approx(0.0440674) and gpu.percentiles[99] == pytest.approx(0.0491943)
    assert s.times["Latency"].mean == pytest.approx(0.0549236)
    assert set(s.times) == {"Latency", "Enqueue Time", "H2D Latency", "GPU Compute Time", "D2H Latency"}
    t = timing_from_summary(s, "x.log")
    # GPU compute time, not Latency (which adds the host<->device copies)
    assert t.median_ms == pytest.approx(0.0429688) and t.p10_ms == pytest.approx(0.0419922)
    assert t.n == 50 and t.ok and t.log_path == "x.log"


def test_summary_without_p10_falls_back_to_min():
    text = ("[01/02/2024-09:00:00] [I] === Performance summary ===\n"
            "[01/02/2024-09:00:00] [I] Throughput: 812.3 qps\n"
            "[01/02/2024-09:00:00] [I] Latency: min = 1.5 ms, max = 2.5 ms, mean = 1.7 ms, median = 1.6 ms, "
            "percentile(99%) = 2.4 ms\n")
    t = timing_from_summary(parse_summary(text))
    assert t.median_ms == 1.6 and t.p10_ms == 1.5 and t.min_ms == 1.5 and math.isnan(t.p90_ms)
    assert timing_from_summary(parse_summary("no summary here")) is None


def test_parse_profile_skips_count_record():
    prof = parse_profile((FIXTURES / "profile_10x.json").read_text())
    assert prof["count"] == 50
    assert [p["name"] for p in prof["layers"]][:2] == ["__myl_MulMinMaxRounCastConc_myl0_0", "conv1_myl0_1"]
    assert all("name" in p for p in prof["layers"]) and len(prof["layers"]) == 6
    assert prof["layers"][1]["medianMs"] == pytest.approx(0.011776)


def test_parse_profile_tolerates_unescaped_names_and_nan():
    text = ('[\n  { "count" : 3 }\n'
            ', { "name" : "Reformatting "quoted" layer", "timeMs" : 0.3, "averageMs" : 0.1, "medianMs" : 0.1, '
            '"percentage" : nan }\n'
            ', { "name" : "conv1", "timeMs" : 0.6, "averageMs" : 0.2, "medianMs" : 0.2, "percentage" : 66.6 }\n]\n')
    prof = parse_profile(text)
    assert prof["count"] == 3
    assert [p["name"] for p in prof["layers"]] == ['Reformatting "quoted" layer', "conv1"]
    assert math.isnan(prof["layers"][0]["percentage"])


def test_parse_layer_info_fixture():
    from pipeline.graph.layer_info import parse_layer_info

    info = parse_layer_info(json.loads((FIXTURES / "layer_info_10x.json").read_text()), "trtexec")
    assert info["io_tensors"] == ["input", "logits"]
    conv = info["layers"][1]
    # \x1f between fused nodes, \x1e between sub-groups: both split
    assert conv["onnx_nodes"] == ["conv1/in_dq", "conv1/w_dq", "conv1", "relu1"]
    assert conv["TacticName"].startswith("sm89_xmma_fprop")
    eleven = parse_layer_info({"Layers": ["a", "b"], "I/O Tensors": [{"Name": "input"}]}, "trtexec")
    assert eleven["layers"] == [{"Name": "a", "onnx_nodes": []}, {"Name": "b", "onnx_nodes": []}]
    assert eleven["io_tensors"] == [{"Name": "input"}]


def test_parse_times_drops_old_style_warmups():
    samples = parse_times((FIXTURES / "times_10x.json").read_text(), warmup_ms=200)
    assert len(samples) == 50 and min(samples) == pytest.approx(0.041)
    old = json.dumps([{"startComputeMs": 10.0, "computeMs": 9.0}, {"startComputeMs": 210.0, "computeMs": 1.0}])
    assert parse_times(old, warmup_ms=200) == [1.0]


# --------------------------------------------------------------------------- invocations


def test_check_available_is_one_line(tmp_path):
    b = TrtexecBackend(compose(["backend=trtexec", "backend.trtexec_path=no-such-trtexec-xyz"]).backend)
    with pytest.raises(BackendUnavailable) as exc:
        b.check_available()
    msg = str(exc.value)
    assert len(msg.splitlines()) == 1
    assert "backend.trtexec_path=no-such-trtexec-xyz" in msg and "not found on PATH" in msg
    assert "backend=onnxruntime" in msg
    with pytest.raises(BackendUnavailable, match="does not exist or is not executable"):
        TrtexecBackend(compose(["backend=trtexec", f"backend.trtexec_path={tmp_path}/trtexec"]).backend
                       ).check_available()
    exe, _ = fake_trtexec(tmp_path)
    trtexec_backend(exe)  # found: no error


def test_build_writes_engine_and_log(tmp_path):
    exe, calls = fake_trtexec(tmp_path)
    b = trtexec_backend(exe, "backend.export_layer_info=true")
    model = models.save(models.conv_chain(), tmp_path, "m")
    out, log_path = tmp_path / "out" / "model.engine", tmp_path / "out" / "build.log"
    res = b.build(model, out, log_path, EngineBuildConfig(workspace_size=256))
    assert out.read_bytes() == b"fake serialized engine"
    assert res.info["engine_bytes"] == out.stat().st_size and res.info["layers"] == 3
    text = log_path.read_text()
    assert text.startswith("$ ") and "--skipInference" in text and "exit code 0" in text
    argv = calls_of(calls)[-1]
    assert "--memPoolSize=workspace:256M" in argv and "--profilingVerbosity=detailed" in argv
    assert b.version == "10.8.0" and b.last_layer_info["layers"][1]["onnx_nodes"][-1] == "relu1"
    assert not list(out.parent.glob(".model.engine.*"))  # no temporary left behind


def test_measure_uses_exported_times_and_warmup_ms(tmp_path):
    exe, calls = fake_trtexec(tmp_path)
    b = trtexec_backend(exe, "backend.warmup_ms=300", "backend.warmup_runs=7", "backend.timing_runs=50",
                "backend.export_profile=true")
    b.logs_dir = tmp_path / "logs"
    model = models.save(models.conv_chain(), tmp_path, "m")
    t = b.measure(model)
    assert t.ok and t.n == 50 and t.min_ms == pytest.approx(0.041)
    argv = calls_of(calls)[-1]
    assert "--warmUp=300" in argv and "--iterations=50" in argv  # milliseconds; warmup_runs does not apply
    assert b.last_profile["count"] == 50
    assert Path(t.log_path).parent == tmp_path / "logs"
    assert b.measure(model) is t and len(calls_of(calls)) == 1  # identical model measured once


def test_unknown_profiling_option_retries_once_and_is_remembered(tmp_path):
    exe, calls = fake_trtexec(tmp_path, reject_profiling=True)
    b = trtexec_backend(exe, "backend.export_profile=true", "backend.timing_runs=50")
    b.logs_dir = tmp_path / "logs"
    model = models.save(models.conv_chain(), tmp_path, "m")
    t = b.measure(model)
    assert t.ok and t.median_ms > 0
    first, second = calls_of(calls)
    assert any(a.startswith("--exportProfile") for a in first)
    assert not any(a.startswith(("--exportProfile", "--profilingVerbosity", "--separateProfileRun"))
                   for a in second)
    assert b.profiling_supported is False and b.last_profile is None
    assert len(list((tmp_path / "logs").glob("*.unknown-option.log"))) == 1
    # later runs leave the flags out from the start: no second failing attempt
    other = models.save(models.residual_block(), tmp_path, "other")
    assert b.measure(other).ok
    assert len(calls_of(calls)) == 3 and not any("--exportProfile" in a for a in calls_of(calls)[2])
    assert b.layer_info(model) is None


def test_no_gpu_is_backend_unavailable(tmp_path):
    exe, _ = fake_trtexec(tmp_path, no_gpu=True)
    b = trtexec_backend(exe)
    with pytest.raises(BackendUnavailable, match="no usable CUDA GPU") as exc:
        b.measure(models.save(models.conv_chain(), tmp_path, "m"))
    assert len(str(exc.value).splitlines()) == 1


def test_failed_build_names_the_log(tmp_path):
    exe = tmp_path / "trtexec"
    exe.write_text(f"#!{sys.executable}\nprint('[03/14/2025-10:21:09] [E] [TRT] ModelImporter.cpp:151: ERROR: "
                   f"No importer registered for op: Foo')\nraise SystemExit(1)\n")
    exe.chmod(0o755)
    b = trtexec_backend(exe)
    model = models.save(models.conv_chain(), tmp_path, "m")
    with pytest.raises(StageError, match="No importer registered for op: Foo.*full log: .*build.log"):
        b.build(model, tmp_path / "m.engine", tmp_path / "build.log")
    assert not (tmp_path / "m.engine").exists()
    assert b.measure(model).ok is False


def test_prepare_time_runs_and_run(tmp_path):
    exe, calls = fake_trtexec(tmp_path)
    b = trtexec_backend(exe, "backend.warmup_ms=100")
    model = models.save(models.conv_chain(), tmp_path, "m")
    with b.prepare(model) as pm:
        assert "--skipInference" in calls_of(calls)[0]
        times = pm.time_runs(10)
        assert len(times) == 10 and all(x > 0 for x in times)
        argv = calls_of(calls)[-1]
        assert any(a.startswith("--loadEngine=") for a in argv) and "--warmUp=100" in argv
        feeds = {"input": np.zeros((2, 3, 16, 16), np.float32)}
        (out,) = pm.run(feeds)
        assert out.shape == (2, 10) and out[1, 9] == 19.0
        workdir = pm.workdir
    assert not workdir.exists()
    assert os.access(exe, os.X_OK)


# --------------------------------------------------------------------------- review follow-ups


def test_parse_outputs_keeps_each_outputs_element_type():
    from pipeline.backends.tensorrt.trtexec import parse_outputs

    text = json.dumps([{"name": "ids", "dimensions": "2", "values": [3, 7]},
                       {"name": "logits", "dimensions": "2x2", "values": [0.5, 1.5, 2.5, 3.5]}])
    outs = parse_outputs(text, {"ids": np.dtype(np.int64), "logits": np.dtype(np.float16)})
    assert outs["ids"].dtype == np.int64 and outs["ids"].tolist() == [3, 7]
    assert outs["logits"].dtype == np.float16 and outs["logits"].shape == (2, 2)
    assert parse_outputs(text)["ids"].dtype == np.float32  # undeclared: float32 as before


def test_build_info_reports_data_type(tmp_path):
    exe, _ = fake_trtexec(tmp_path)
    b = trtexec_backend(exe)
    float_model = models.save(models.conv_chain(), tmp_path, "float")
    qdq_model = tmp_path / "qdq.onnx"
    onnx.save(qdq_conv_chain(), str(qdq_model))
    assert b.build(float_model, None, None, EngineBuildConfig(data_type="fp16")).info["data_type"] == "FP16"
    assert b.build(float_model, None, None, EngineBuildConfig()).info["data_type"] == "FP32"
    assert b.build(qdq_model, None, None, EngineBuildConfig(data_type="FP16")).info["data_type"] == "strongly_typed"


def test_prepared_runs_never_read_a_stale_times_or_outputs_file(tmp_path):
    exe, _ = fake_trtexec(tmp_path)
    b = trtexec_backend(exe, "backend.warmup_ms=0")
    model = models.save(models.conv_chain(), tmp_path, "m")
    with b.prepare(model) as pm:
        (pm.workdir / "times.json").write_text(json.dumps([{"startComputeMs": 1.0, "computeMs": 999.0}] * 3))
        (pm.workdir / "outputs.json").write_text(json.dumps([{"name": "logits", "dimensions": "1", "values": [-1]}]))
        # a trtexec that writes neither file: the stale ones must not be read back
        exe.write_text(f"#!{sys.executable}\nprint({(FIXTURES / 'perf_10x.log').read_text()!r})\n")
        assert 999.0 not in pm.time_runs(3)
        with pytest.raises(StageError, match="wrote no outputs"):
            pm.run({"input": np.zeros((2, 3, 16, 16), np.float32)})


def test_measure_cache_lives_in_the_base_class(tmp_path):
    from pipeline.backends.base import Backend

    assert "measure" not in TrtexecBackend.__dict__ and "_measure_uncached" in TrtexecBackend.__dict__
    exe, calls = fake_trtexec(tmp_path)
    b = trtexec_backend(exe, "backend.timing_runs=50")
    model = models.save(models.conv_chain(), tmp_path, "m")
    t = Backend.measure(b, model)
    assert t.ok and b.measure(model) is t and len(calls_of(calls)) == 1
    assert b.measure(model, timing_runs=20) is not t and len(calls_of(calls)) == 2
