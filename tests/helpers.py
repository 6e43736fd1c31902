"""Helpers every test module may import: the `tune` command run as a subprocess or in process, config
composition, the shared override sets, a fake trtexec, a CPU without VNNI under qemu-user, and small
models the helpers need. Test modules import from here (and `tests.models`), never from each other."""

from __future__ import annotations

import json
import os
import platform
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from omegaconf import OmegaConf
from onnx import TensorProto, helper, numpy_helper

from pipeline.backends import create_backend
from pipeline.backends.onnxruntime import OnnxRuntimeBackend
from pipeline.backends.onnxruntime.config import OnnxRuntimeBackendConfig
from pipeline.backends.tensorrt.trtexec import TrtexecBackend
from pipeline.graph.bodies import body
from tests import models

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "trtexec"


PLAIN_QUANTIZE = ["quantize.algorithm=minmax", "quantize.equalization=false", "quantize.smoothing=false",
                  "quantize.bias_correction=false"]


def record_runtime_search(monkeypatch, kill_at: int | None = None) -> list[str]:
    """The names of the candidates the runtime search measures from now on (a fresh list); with
    ``kill_at``, it raises KeyboardInterrupt (a kill) when it starts measuring that candidate (1-based)."""
    from tasks.autotune.runtime import search as rs

    measured: list[str] = []
    real_step = getattr(rs.RuntimeSearch._step, "__wrapped__", rs.RuntimeSearch._step)

    def step(self, cand, current):
        if kill_at is not None and len(measured) == kill_at - 1:
            raise KeyboardInterrupt
        measured.append(cand.name)
        return real_step(self, cand, current)

    step.__wrapped__ = real_step
    monkeypatch.setattr(rs.RuntimeSearch, "_step", step)
    return measured


# QDQ_TUNE_TEST_CPU=Haswell runs every `tune` the tests start on that CPU, emulated by qemu-user (the
# tests' own process stays native): the end-to-end tests on an AVX2 CPU without VNNI, on any x86 host
EMULATED_CPU = os.environ.get("QDQ_TUNE_TEST_CPU")


def tune_command() -> list[str]:
    if EMULATED_CPU:
        return ["qemu-x86_64", "-cpu", EMULATED_CPU, sys.executable, "-m", "pipeline.app.cli"]
    exe = shutil.which("tune", path=str(Path(sys.executable).parent)) or shutil.which("tune")
    return [exe] if exe else [sys.executable, "-m", "pipeline.app.cli"]


# The default, backend=auto, quantizes and tunes for every runtime here: a test runs ONNX Runtime unless it
# names a backend (a later backend= wins), so each test pays for one runtime; the tests of auto name it.
PINNED_BACKEND = "backend=onnxruntime"
# the tests' models run in well under a millisecond: blocks of 2 ms keep their timings short (a test
# that sets backend.min_block_ms itself wins: it comes later)
TEST_BLOCK = "backend.min_block_ms=2"


def pin_backend(args: list[str]) -> list[str]:
    """``args`` with PINNED_BACKEND and TEST_BLOCK as the first overrides (before the first ``key=value``:
    every override after them, a backend= too, wins over them)."""
    i = next((k for k, a in enumerate(args) if "=" in a and not a.startswith("-")), len(args))
    return [*args[:i], PINNED_BACKEND, TEST_BLOCK, *args[i:]]


def run_tune(args: list[str], cwd: Path, timeout: float = 900, check: bool = False,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`tune ARGS` in ``cwd`` (on ONNX Runtime unless ARGS name a backend: see PINNED_BACKEND)."""
    args = pin_backend(args)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if EMULATED_CPU:  # emulation is ~50x slower, and qemu-user's multi-threaded guests are unreliable
        proc = run_emulated(tune_command()[:-2], ["-m", "pipeline.app.cli", *args], cwd=cwd, timeout=timeout * 50,
                            env=env)
    else:
        proc = subprocess.run([*tune_command(), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"tune {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def tune_in_process(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`tune ARGS --cfg job` as the command line runs it (main() with these argv, in ``cwd``) without a
    new interpreter: the config is composed, validated and printed by the same code, in a fraction of
    a subprocess's start-up. For commands that stop before a job runs (--cfg job, errors)."""
    import contextlib
    import io

    from pipeline.app import cli

    out, err, code = io.StringIO(), io.StringIO(), 0
    argv = sys.argv
    sys.argv = ["tune", *args]
    try:
        with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(["tune", *args], code, out.getvalue(), err.getvalue())


def compose(overrides: list[str] | None = None, config_dir: str | None = None, config_name: str = "tune"):
    from pipeline.app.cli import compose
    from pipeline.config import register_configs

    register_configs()
    return compose(config_dir, config_name, overrides or [])


QUICK = ["autotune.preset=quick", "backend.warmup_runs=1", "autotune.warmup_runs=1", "autotune.timing_runs=8",
         "quantize.calibration.batches=2", "data.num_samples=16", "progress=false", *PLAIN_QUANTIZE]


def qdq_conv_chain(zero_type: int = TensorProto.INT8, zero_point: int = 0) -> onnx.ModelProto:
    """conv_chain with one Q/DQ pair in front of conv1 (enough for "the model has Q/DQ"): int8
    symmetric, or of ``zero_type`` with ``zero_point`` (uint8 asymmetric: TensorRT parses a rewritten copy)."""
    m = models.conv_chain()
    g = m.graph
    g.initializer.extend([numpy_helper.from_array(np.array(0.05, np.float32), "s"),
                          helper.make_tensor("z", zero_type, [], [zero_point])])
    q = helper.make_node("QuantizeLinear", ["input", "s", "z"], ["input_q"], name="conv1/in_q")
    dq = helper.make_node("DequantizeLinear", ["input_q", "s", "z"], ["input_dq"], name="conv1/in_dq")
    g.node[0].input[0] = "input_dq"
    g.node.insert(0, dq)
    g.node.insert(0, q)
    return m


def fake_trtexec(tmp_path: Path, reject_profiling: bool = False, no_gpu: bool = False,
                 layer_info: str = "layer_info_10x.json") -> tuple[Path, Path]:
    """An executable standing in for trtexec: records its argv, writes the files it is asked for
    (``layer_info``: the fixture it writes for --exportLayerInfo)."""
    calls = tmp_path / "calls.jsonl"
    script = tmp_path / "trtexec"
    script.write_text(f"""#!{sys.executable}
import json, shutil, sys
from pathlib import Path
FIX = Path({str(FIXTURES)!r})
args = sys.argv[1:]
with open({str(calls)!r}, "a") as fh:
    fh.write(json.dumps(args) + "\\n")
opts = dict(a.split("=", 1) if "=" in a else (a, "") for a in args)
print("&&&& RUNNING TensorRT.trtexec [TensorRT v100800] [b43] # trtexec " + " ".join(args))
if {no_gpu!r}:
    print("[03/14/2025-10:21:07] [E] Cuda failure: no CUDA-capable device is detected")
    sys.exit(1)
profiling = [a.split("=")[0] for a in args if a.split("=")[0] in
             ("--exportProfile", "--exportLayerInfo", "--profilingVerbosity", "--separateProfileRun")]
if {reject_profiling!r} and profiling:
    print("[03/14/2025-10:21:07] [E] Unknown option: " + profiling[0] + " " + opts.get(profiling[0], ""))
    print("&&&& FAILED TensorRT.trtexec [TensorRT v100800] [b43] # trtexec " + " ".join(args))
    sys.exit(1)
if "--saveEngine" in opts:
    Path(opts["--saveEngine"]).write_bytes(b"fake serialized engine")
if "--exportLayerInfo" in opts:
    shutil.copy(FIX / {layer_info!r}, opts["--exportLayerInfo"])
if "--skipInference" in opts:
    print("[03/14/2025-10:21:11] [I] Engine built in 1.86 sec.")
    print("[03/14/2025-10:21:11] [I] Skipped inference phase since --skipInference is added.")
    sys.exit(0)
if "--exportTimes" in opts:
    shutil.copy(FIX / "times_10x.json", opts["--exportTimes"])
if "--exportProfile" in opts:
    shutil.copy(FIX / "profile_10x.json", opts["--exportProfile"])
if "--exportOutput" in opts:
    Path(opts["--exportOutput"]).write_text(json.dumps(
        [{{"name": "logits", "dimensions": "2x10", "values": [float(i) for i in range(20)]}}]))
print((FIX / "perf_10x.log").read_text())
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script, calls


def calls_of(calls: Path) -> list[list[str]]:
    return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def trtexec_backend(exe: Path, *overrides: str) -> TrtexecBackend:
    cfg = compose(["backend=trtexec", f"backend.trtexec_path={exe}", *overrides])
    b = create_backend(cfg.backend)
    assert isinstance(b, TrtexecBackend)
    return b


def ort_backend() -> OnnxRuntimeBackend:
    return OnnxRuntimeBackend(OmegaConf.structured(OnnxRuntimeBackendConfig(warmup_runs=1, timing_runs=4)))


def openvino_backend():
    """OpenVINO's CPU plugin with short timing, as ort_backend."""
    from pipeline.backends.openvino import OpenVinoBackend
    from pipeline.backends.openvino.config import OpenVinoBackendConfig

    return OpenVinoBackend(OmegaConf.structured(OpenVinoBackendConfig(warmup_runs=1, timing_runs=4)))


def saturating_model() -> onnx.ModelProto:
    """u8 activations at 255 times s8 weights at 127: VPMADDUBSW's int16 pair sums (AVX2 without VNNI)
    saturate at 32767 < 2 x 255 x 127, VNNI's int32 sums do not."""
    c = 16
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])
    inits = [numpy_helper.from_array(np.array(1 / 255, np.float32), "xs"),
             numpy_helper.from_array(np.array(0, np.uint8), "xz"),
             numpy_helper.from_array(np.full((4, c, 1, 1), 127, np.int8), "wq"),
             numpy_helper.from_array(np.full(4, 0.01, np.float32), "ws"),
             numpy_helper.from_array(np.zeros(4, np.int8), "wz"),
             numpy_helper.from_array(np.array(0.5, np.float32), "ys"),
             numpy_helper.from_array(np.array(0, np.uint8), "yz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
             helper.make_node("Conv", ["xd", "wd"], ["c"]),
             helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["cq"]),
             helper.make_node("DequantizeLinear", ["cq", "ys", "yz"], ["y"])]
    m = helper.make_model(helper.make_graph(nodes, "saturate", [x], [y], inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def qemu_haswell() -> list[str] | None:
    """A command prefix that runs this Python on an emulated AVX2 CPU without VNNI (qemu-user)."""
    qemu = shutil.which("qemu-x86_64")
    if qemu is None or platform.machine() != "x86_64":
        return None
    return [qemu, "-cpu", "Haswell", sys.executable]


def run_emulated(prefix: list[str], args: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``args`` run by Python on the emulated CPU with one thread everywhere (BLAS too: qemu-user's
    multi-threaded guests are unreliable). qemu-user itself crashes now and then (SIGSEGV in the
    emulator, seen in two CI runs so far): a run killed by a signal is run once more, and if that one
    dies too, the test fails with both runs' last lines."""
    env = {**kwargs.pop("env", os.environ), **{k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                                  "MKL_NUM_THREADS")}}
    proc = subprocess.run([*prefix, *args], capture_output=True, text=True, env=env, **kwargs)
    if proc.returncode >= 0:
        return proc
    again = subprocess.run([*prefix, *args], capture_output=True, text=True, env=env, **kwargs)
    if again.returncode < 0:
        again.stderr = f"{proc.stderr[-1500:]}\n--- run again, killed too ---\n{again.stderr}"
    return again


def body_matmuls(model: onnx.ModelProto) -> dict[str, list[str]]:
    """MatMul inside any Loop/Scan body -> the op types producing its two inputs (in its own body)."""
    out = {}

    def visit(graph: onnx.GraphProto, inside: bool) -> None:
        producer = {o: n.op_type for n in graph.node for o in n.output}
        for n in graph.node:
            if inside and n.op_type == "MatMul":
                out[n.name] = [producer.get(t, "outer") for t in n.input[:2]]
            if n.op_type in ("Loop", "Scan"):
                visit(body(n), True)

    visit(model.graph, False)
    return out


def assert_final_line(stderr: str, metrics: dict) -> None:
    """autotune's final line and headline: a speedup for a quantized model, none when float ships (on
    a CPU where no int8 placement beats float, e.g. AVX2 without VNNI, the float model may ship)."""
    assert "Baseline: " in stderr
    if metrics["shipped"] == "float":
        assert "Final: the float model itself (no speedup)" in stderr
        assert metrics["headline"].startswith("ships float") and metrics["speedup"] == 1.0
        assert "tuned" not in metrics["headline"].split(":", 1)[0]
    else:
        assert "x speedup)" in stderr and not metrics["headline"].startswith("ships float")


def ort_fusion_groups(model: onnx.ModelProto) -> list:
    """The fusion groups ONNX Runtime's CPU EP forms for ``model`` (what its backend reports to subgraph mode)."""
    from pipeline.backends.onnxruntime.backend import optimized_graph
    from tasks.autotune.subgraph.fusion_grouping import map_fusions

    return map_fusions(model, optimized_graph(model))
