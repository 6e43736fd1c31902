"""autotune.mode=subgraph end to end on tiny models: outputs and report, group reuse, resume after
kill -9 in phase 2 and in phase 3, a dynamic-batch model, fp8, TensorRT-RTX builds of the outputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests import models
from tests.helpers import QUICK, assert_final_line, pin_backend, run_tune, tune_command

SUBGRAPH = ["autotune.mode=subgraph", *QUICK]


def _args(model: Path, rd: Path, extra: list[str] | None = None) -> list[str]:
    return ["stages=[export,quantize,autotune]", "model=onnx", f"model.onnx_path={model}", "data=synthetic",
            f"results_dir={rd}", *SUBGRAPH, *(extra or [])]


def _cache(rd: Path) -> dict:
    return json.loads((rd / "autotune" / "autotune_cache.json").read_text())


def _check_consistent(cache: dict) -> None:
    """Every measurement is recorded once: one per profiled group, one per measured validation step;
    the steps form the tree an uninterrupted run takes (a bisected step lists its children, a step
    known from its parent's model names the step measured), and the kept ones chain model to model."""
    steps = cache["phase3"]["steps"]
    assert cache["measurements"] == len(cache["groups"]) + sum(s["measured"] for s in steps)
    assert [s["index"] for s in steps] == list(range(len(steps)))
    assert [s["pass"] for s in steps] == sorted(s["pass"] for s in steps) and [s["pass"] for s in steps].count(0) <= 1
    for s in steps:
        assert all(steps[c]["parent"] == s["index"] and c > s["index"] for c in s["children"])
        if s["parent"] is not None:
            parent = steps[s["parent"]]
            assert s["index"] in parent["children"] and set(s["changes"]) <= set(parent["changes"])
            assert not parent["kept"] and parent["outcome"] in ("slower", "over_budget", "failed")
        if not s["measured"]:
            assert steps[s["known_from"]]["measured"] and not s["kept"]
    kept = [s for s in steps if s["kept"]]
    assert all(b["reference_sha"] == a["candidate_sha"] for a, b in zip(kept, kept[1:], strict=False))
    kept1 = {k for s in kept if s["pass"] == 1 for k in s["changes"]}
    assert not any(k in kept1 for s in steps if s["pass"] == 2 for k in s["changes"])  # kept: not retried


def _tree(cache: dict) -> list:
    return [(s["pass"], s["changes"], s["parent"], s["outcome"], s["measured"]) for s in cache["phase3"]["steps"]]


@pytest.fixture
def blocks(residual_models) -> Path:
    return residual_models['blocks']


@pytest.mark.slow
def test_outputs_report_and_group_reuse(blocks, tmp_path):
    rd = tmp_path / "r"
    proc = run_tune(_args(blocks, rd), cwd=tmp_path, check=True)
    out = rd / "autotune"
    for name in ("optimized_raw.onnx", "optimized_final.onnx", "autotune_cache.json", "report.md", "baseline.onnx"):
        assert (out / name).exists(), name
    assert_final_line(proc.stderr, json.loads((rd / "manifest.json").read_text())["stages"]["autotune"]["metrics"])
    cache = _cache(rd)
    _check_consistent(cache)
    # the three residual blocks have the same structure and shapes: their groups are measured once
    instances = [len(g["instances"]) for g in cache["groups"].values()]
    assert max(instances) == 3
    assert sorted((out / "subgraphs").glob("group_*.onnx")) and len(list((out / "subgraphs").glob("*.onnx"))) == \
        len(cache["groups"])
    assert len(list((out / "logs").glob("group_*.json"))) == len(cache["groups"])
    assert len(list((out / "logs").glob("validation_step_*.json"))) == len(cache["phase3"]["steps"])
    # every extracted subgraph runs on its own, and every group tried the heuristic schemes
    import onnxruntime as ort

    from pipeline.backends.base import specs_of
    from pipeline.data.adapters import fixed_feeds

    for sub in (out / "subgraphs").glob("*.onnx"):
        sess = ort.InferenceSession(str(sub), providers=["CPUExecutionProvider"])
        sess.run(None, fixed_feeds(specs_of(sub)))
    conv_groups = [g for g in cache["groups"].values() if any("conv" in n for n in g["nodes"])]
    assert conv_groups and all({"none", "preferred", "weights_only"} <= set(g["schemes"]) for g in conv_groups)
    metrics = json.loads((rd / "manifest.json").read_text())["stages"]["autotune"]["metrics"]
    assert metrics["mode"] == "subgraph" and metrics["measurements"] == cache["measurements"]
    report = (out / "report.md").read_text()
    assert "| group | instances | nodes |" in report and metrics["final_line"] in report
    groups_table = report.split("| group | instances | nodes |", 1)[1]
    assert len([ln for ln in groups_table.splitlines() if ln.startswith("| ") and ln[2].isdigit()]) == len(cache["groups"])
    # how many full-model steps each phase took, and why; one row per step
    steps_table = report.split("| step | phase | groups | bisects step | result |", 1)[1].split("\n\n", 1)[0]
    assert "| phase | full-model steps | why |" in report and "| final guard |" in report
    assert len([ln for ln in steps_table.splitlines() if ln.startswith("| ") and ln[2].isdigit()]) == \
        len(cache["phase3"]["steps"])
    # the shipped model meets the budget and runs
    assert metrics["accuracy"]["final"]["ok"]
    for name in ("optimized_raw.onnx", "optimized_final.onnx"):
        m = onnx.load(str(out / name))
        onnx.checker.check_model(m)
        ort.InferenceSession(str(out / name), providers=["CPUExecutionProvider"]).run(None, fixed_feeds(specs_of(
            out / name)))
    # re-running the same command is up to date; a forced autotune re-run resumes and measures nothing
    again = run_tune(_args(blocks, rd, ["autotune.performance_threshold=1.01"]), cwd=tmp_path, check=True)
    assert "resuming from" in again.stderr
    assert _cache(rd)["measurements"] == cache["measurements"]


def _wait(proc: subprocess.Popen, rd: Path, ready, timeout: float = 300) -> dict:
    path = rd / "autotune" / "autotune_cache.json"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if path.exists():
            try:
                doc = json.loads(path.read_text())
                if ready(doc):
                    return doc
            except (json.JSONDecodeError, OSError):  # read while being replaced: retry
                pass
        time.sleep(0.02)
    raise AssertionError("the run ended before it could be killed; make the test model slower")


@pytest.mark.slow
def test_kill_in_phase2_and_in_phase3_then_resume(tmp_path):
    # more distinct groups (different widths) so that both phases last long enough to be killed in
    model = models.save(models.residual_block(blocks=3, channels=48, size=32), tmp_path, "wide")
    rd = tmp_path / "killed"
    extra = ["autotune.accuracy.enabled=false"]
    args = [*tune_command(), *pin_backend(_args(model, rd, extra))]

    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    _wait(proc, rd, lambda d: len(d["groups"]) >= 1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    phase2_before = len(_cache(rd)["groups"])
    assert not _cache(rd)["phase3"]["steps"]

    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    _wait(proc, rd, lambda d: len(d["phase3"]["steps"]) >= 1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    cache = _cache(rd)
    assert len(cache["groups"]) > phase2_before and cache["phase3"]["steps"]
    again = run_tune(_args(model, rd, extra), cwd=tmp_path, check=True)
    assert "resuming from" in again.stderr
    final = _cache(rd)
    _check_consistent(final)
    # what was measured before each kill was kept as it was, not measured again (a parent step may
    # have gained children since)
    assert [{**s, "children": []} for s in final["phase3"]["steps"][:len(cache["phase3"]["steps"])]] == \
        [{**s, "children": []} for s in cache["phase3"]["steps"]]
    assert all(final["groups"][k] == v for k, v in cache["groups"].items())
    # same number of distinct groups as an uninterrupted run of the same command
    full = tmp_path / "full"
    run_tune(_args(model, full, extra), cwd=tmp_path, check=True)
    assert len(_cache(full)["groups"]) == len(final["groups"])


@pytest.mark.slow
def test_kill_during_a_bisection_then_resume(tmp_path):
    """A budget no quantized model meets makes every step over the budget, on any CPU: the start and
    every grouped step are rejected and bisected down to single groups and their fallback schemes.
    Killed in the middle of that, the run resumes into the same tree of steps as an uninterrupted phase 3."""
    import shutil

    model = models.save(models.residual_block(blocks=2, channels=16, size=16), tmp_path, "m")
    rd = tmp_path / "killed"
    run_tune([*_args(model, rd)[1:], "stages=[export,quantize]"], cwd=tmp_path, check=True)
    full = tmp_path / "full"
    shutil.copytree(rd, full)
    strict = ["stages=[autotune]", "accuracy.metric=snr", "accuracy.min_snr_db=200"]
    args = [*tune_command(), *pin_backend(_args(model, rd, strict)[1:])]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    _wait(proc, rd, lambda d: any(s["parent"] is not None and s["parent"] > 0 for s in d["phase3"]["steps"]))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = _cache(rd)
    again = run_tune(_args(model, rd, strict)[1:], cwd=tmp_path, check=True)
    assert "resuming from" in again.stderr
    final = _cache(rd)
    _check_consistent(final)
    steps = final["phase3"]["steps"]
    assert [{**s, "children": []} for s in steps[:len(before["phase3"]["steps"])]] == \
        [{**s, "children": []} for s in before["phase3"]["steps"]]
    assert all(s["outcome"] == "over_budget" for s in steps)
    assert any(len(s["changes"]) > 1 and len(s["children"]) == 2 for s in steps if s["pass"] > 0)  # bisected
    # the same phase-2 results (phase 2 is timed, so they are copied), phase 3 uninterrupted
    (full / "autotune").mkdir(exist_ok=True)
    (full / "autotune" / "autotune_cache.json").write_text(json.dumps({**final, "phase3": {"steps": []}}))
    run_tune(_args(model, full, strict)[1:], cwd=tmp_path, check=True)
    assert _tree(_cache(full)) == _tree(final)
    metrics = json.loads((rd / "manifest.json").read_text())["stages"]["autotune"]["metrics"]
    assert metrics["full_model_measurements"] == sum(s["measured"] for s in steps)
    # every step over the budget: what ships has no Q/DQ (float, or the tuned model, which stayed the float
    # start and can measure a hair faster than the float file)
    shipped = onnx.load(str(rd / "autotune" / "optimized_final.onnx"))
    assert metrics["shipped"] in ("float", "tuned"), metrics["shipped"]
    assert not [n for n in shipped.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    report = (rd / "autotune" / "report.md").read_text()
    assert "| phase | full-model steps | why |" in report and "| pass 1 |" in report


@pytest.mark.slow
def test_dynamic_batch_model_keeps_its_dynamic_dim(tmp_path):
    model = models.save(models.with_dynamic_batch(models.conv_chain(channels=16, size=24)), tmp_path, "dyn")
    rd = tmp_path / "r"
    run_tune(_args(model, rd, ["model.keep_dynamic_shapes=true", "model.input_shapes={input: [4,3,24,24]}"]),
             cwd=tmp_path, check=True)
    import onnxruntime as ort

    for name in ("export/model.onnx", "autotune/optimized_raw.onnx", "autotune/optimized_final.onnx"):
        m = onnx.load(str(rd / name))
        dim = m.graph.input[0].type.tensor_type.shape.dim[0]
        assert dim.dim_param == "batch" and not dim.HasField("dim_value"), name
        sess = ort.InferenceSession(str(rd / name), providers=["CPUExecutionProvider"])
        for batch in (1, 3):
            (y,) = sess.run(None, {"input": np.zeros((batch, 3, 24, 24), np.float32)})
            assert y.shape == (batch, 10)
    # subgraphs were extracted at the given shapes
    sub = next((rd / "autotune" / "subgraphs").glob("*.onnx"))
    assert onnx.load(str(sub)).graph.input[0].type.tensor_type.shape.dim[0].dim_value == 4
    import importlib.util

    if importlib.util.find_spec("tensorrt_rtx_bindings") or importlib.util.find_spec("tensorrt_rtx"):
        from pipeline.backends import create_backend
        from tests.helpers import compose

        rtx = create_backend(compose(["backend=tensorrt_rtx"]).backend)
        for name in ("optimized_raw", "optimized_final"):  # dynamic batch: built with an optimization profile
            res = rtx.build(rd / "autotune" / f"{name}.onnx", tmp_path / f"{name}.engine", tmp_path / f"{name}.log")
            assert res.engine_path.stat().st_size > 0


@pytest.mark.slow
def test_fp8_subgraph_mode_warns_and_ships_what_the_guard_allows(tmp_path):
    model = models.save(models.conv_chain(channels=32, size=24), tmp_path, "m")
    rd = tmp_path / "r"
    proc = run_tune(_args(model, rd, ["quantize=fp8"]), cwd=tmp_path, check=True)
    assert "no fast fp8 kernels" in proc.stderr
    metrics = json.loads((rd / "manifest.json").read_text())["stages"]["autotune"]["metrics"]
    assert metrics["quant_type"] == "fp8" and (rd / "autotune" / "optimized_final.onnx").exists()
    assert metrics["shipped"] in ("float", "tuned", "ptq") and metrics["accuracy"]["final"]["ok"]


def test_corrupt_cache_is_a_one_line_error_and_a_foreign_one_is_set_aside(tmp_path):
    from tasks.autotune.subgraph.records import CACHE_VERSION

    model = models.save(models.conv_chain(), tmp_path, "m")
    rd = tmp_path / "r"
    (rd / "autotune").mkdir(parents=True)
    cache = rd / "autotune" / "autotune_cache.json"
    cache.write_text("{not json")
    proc = run_tune(_args(model, rd), cwd=tmp_path)
    assert proc.returncode == 2 and "autotune_cache.json is corrupt" in proc.stderr and "Traceback" not in proc.stderr
    cache.write_text(json.dumps({"version": CACHE_VERSION, "model_sha256": "0" * 64, "context": None, "groups": {},
                                 "phase3": {"steps": []}}))
    foreign = cache.read_bytes()
    proc = run_tune(_args(model, rd), cwd=tmp_path)  # the stage's own cache of another model: set aside
    assert proc.returncode == 0 and "belongs to a different model" in proc.stderr, proc.stderr
    assert [p.read_bytes() for p in (rd / "autotune" / "stale").glob("*/autotune_cache.json")] == [foreign]


def test_missing_graph_json_is_a_one_line_error(tmp_path):
    model = models.save(models.conv_chain(), tmp_path, "m")
    proc = run_tune(_args(model, tmp_path / "r", ["autotune.graph_json=nope.json"]), cwd=tmp_path)
    assert proc.returncode == 2 and "autotune.graph_json=nope.json: no such file" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_trt_graph_json_gives_the_groups(tmp_path):
    """A TensorRT 10 layer-information file (fixture) decides the groups; ORT measures them."""
    fixture = Path(__file__).parents[1] / "fixtures" / "trtexec" / "graph_fp16_conv_chain.json"
    model = models.save(models.conv_chain(channels=16, size=24), tmp_path, "m")
    rd = tmp_path / "r"
    proc = run_tune(_args(model, rd, [f"autotune.graph_json={fixture}"]), cwd=tmp_path, check=True)
    assert "fusion groups from graph_fp16_conv_chain.json" in proc.stderr
    nodes = sorted(tuple(g["nodes"]) for g in _cache(rd)["groups"].values())
    assert ("conv1", "relu1") in nodes and ("conv2", "relu2") in nodes


@pytest.mark.rtx
@pytest.mark.slow
def test_subgraph_outputs_build_with_tensorrt_rtx(blocks, tmp_path):
    import importlib.util

    if importlib.util.find_spec("tensorrt_rtx") is None:
        pytest.importorskip("tensorrt_rtx_bindings")
    from pipeline.backends import create_backend
    from tests.helpers import compose

    rtx = create_backend(compose(["backend=tensorrt_rtx"]).backend)
    for placement in ("onnxruntime", "tensorrt"):
        rd = tmp_path / placement
        run_tune(_args(blocks, rd, [f"quantize.placement={placement}"]), cwd=tmp_path, check=True)
        for name in ("optimized_raw", "optimized_final"):
            res = rtx.build(rd / "autotune" / f"{name}.onnx", tmp_path / f"{placement}_{name}.engine",
                            tmp_path / f"{placement}_{name}.log")
            assert res.engine_path.stat().st_size > 0


@pytest.mark.slow
def test_trtexec_backend_generates_the_graph_json_and_profiles_layers(tmp_path):
    """backend=trtexec without autotune.graph_json: one FP16 build writes model.fp16.graph.json (the fake
    trtexec returns a TensorRT 10 fixture for conv_chain), subgraphs are timed with --exportProfile and
    without the full model's shape flags."""
    from tests.helpers import calls_of, fake_trtexec

    exe, calls = fake_trtexec(tmp_path, layer_info="graph_fp16_conv_chain.json")
    model = models.save(models.conv_chain(), tmp_path, "m")
    rd = tmp_path / "r"
    proc = run_tune(_args(model, rd, ["backend=trtexec", f"backend.trtexec_path={exe}", "backend.warmup_ms=0",
                                      "backend.trtexec_args=['--optShapes=input:2x3x16x16','--noDataTransfers']"]),
                    cwd=tmp_path, check=True)
    graph = rd / "autotune" / "model.fp16.graph.json"
    assert graph.exists() and "fusion groups from model.fp16.graph.json" in proc.stderr
    argv = calls_of(calls)
    layer_builds = [a for a in argv if any(x.startswith("--exportLayerInfo=") for x in a)]
    assert len(layer_builds) == 1 and "--fp16" in layer_builds[0]
    sub_runs = [a for a in argv if any(x.startswith("--loadEngine=") and "group_" not in x for x in a)
                and any(x.startswith("--exportProfile=") for x in a)]
    assert sub_runs and not any(x.startswith("--optShapes") for a in sub_runs for x in a)
    nodes = sorted(tuple(g["nodes"]) for g in _cache(rd)["groups"].values())
    assert ("conv1", "relu1") in nodes
    # the fixture profile names layers of no subgraph: total latency decides, and the run still ends
    assert (rd / "autotune" / "optimized_final.onnx").exists()


def _layer_info(model: onnx.ModelProto, path: Path) -> Path:
    """TensorRT 10 layer information for ``model``: a Conv or Add fused with the Relu after it."""
    consumers: dict[str, list] = {}
    for n in model.graph.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n)
    layers, done = [], set()
    for n in model.graph.node:
        if n.name in done:
            continue
        group = [n]
        after = consumers.get(n.output[0], [])
        if n.op_type in ("Conv", "Add") and len(after) == 1 and after[0].op_type == "Relu":
            group.append(after[0])
        done.update(x.name for x in group)
        layers.append({"Name": " + ".join(x.name for x in group),
                       "LayerType": "CaskConvolution" if n.op_type == "Conv" else n.op_type,
                       "Metadata": "".join(f"[ONNX Layer: {x.name}]" for x in group)})
    path.write_text(json.dumps({"Layers": layers, "Bindings": []}))
    return path


@pytest.mark.slow
def test_subgraph_mode_builds_at_most_a_third_of_region_modes_full_models_on_trtexec(tmp_path):
    """On a TensorRT path every full-model step is an engine build of the whole network: count them
    (the fake trtexec records each invocation) for the same model and settings in both modes. Subgraph
    mode's count includes its float build for the layer information and the check of optimized_raw.onnx."""
    import shutil

    from tests.helpers import calls_of, fake_trtexec

    m = models.residual_block(blocks=3)
    exe, calls = fake_trtexec(tmp_path, layer_info=str(_layer_info(m, tmp_path / "layers.json")))
    model = models.save(m, tmp_path, "m")
    # the builder-settings search after placement builds the same engines in both modes: left out here
    trt = ["backend=trtexec", f"backend.trtexec_path={exe}", "backend.warmup_ms=0", "autotune.runtime.enabled=false"]
    base = ["model=onnx", f"model.onnx_path={model}", "data=synthetic", *QUICK, *trt]
    run_tune(["stages=[export,quantize]", f"results_dir={tmp_path / 'region'}", *base], cwd=tmp_path, check=True)
    shutil.copytree(tmp_path / "region", tmp_path / "subgraph")

    def full_model_builds(mode: str) -> int:
        calls.unlink(missing_ok=True)
        run_tune(["stages=[autotune]", f"results_dir={tmp_path / mode}", f"autotune.mode={mode}", *base],
                 cwd=tmp_path, check=True)
        onnx_args = [x for argv in calls_of(calls) for x in argv if x.startswith("--onnx=")]
        assert onnx_args
        return sum(1 for x in onnx_args if "qdq-tune-subgraph-" not in x)  # not an extracted subgraph

    region, subgraph = full_model_builds("region"), full_model_builds("subgraph")
    assert subgraph * 3 <= region, (subgraph, region)
    assert (tmp_path / "subgraph" / "autotune" / "model.fp16.graph.json").exists()  # groups from trtexec's build
    metrics = json.loads((tmp_path / "subgraph" / "manifest.json").read_text())["stages"]["autotune"]["metrics"]
    # the fake times every engine alike: no step pays, and the guard decides from the steps' own
    # paired measurements instead of building float, PTQ and tuned engines once more
    assert not metrics["guard"]["measured"] and [p["phase"] for p in metrics["phases"]] == ["start", "pass 1", "pass 2"]
