"""Accuracy only, on an emulated AVX2 CPU without VNNI: the models `bench/runtime_choice.py` shipped on
this machine (each single-runtime run's and auto's pick, with the settings each ships), run under
`qemu-x86_64 -cpu Haswell`, where u8 x s8 int8 kernels saturate and there is no bf16; their outputs on the
bench's unseen feeds against ONNX Runtime fp32 computed natively. Also the same models natively, in the
same run, so the two columns differ only by the CPU. Emulated time means nothing: no timing here.
Before any model, one-node float probes (MatMul, Tanh, ...) run on each runtime under the emulator: a
model with an op the emulator computes differently from this CPU on its runtime gets "not a
measurement" with the ops it got wrong, not an error figure.

Each model runs in its own emulated process with one thread (qemu-user's multi-threaded guests are
unreliable); that process prints the CPU the tool reads there (CPUID), so every row names its CPU.

    apt-get install qemu-user
    python bench/runtime_choice.py --model digits --results-root R      # tunes and ships the models
    python bench/emulated_accuracy.py --model digits --results-root R   # same R: reads those runs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from openvino_vs_nncf import MODELS, backends, feeds_for, output_error  # noqa: E402
from runtime_choice import RUNS, shipped  # noqa: E402

SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def one_thread(backend):
    """``backend`` with the settings it ships, on one thread (the settings' own thread count replaced)."""
    import dataclasses

    settings = backend.settings
    if settings is None:
        settings = backend.shipped_settings.type()
    if hasattr(settings, "intra_op_num_threads"):
        settings = dataclasses.replace(settings, intra_op_num_threads=1)
    if hasattr(settings, "properties"):
        settings = dataclasses.replace(settings, properties=tuple(
            sorted({**dict(settings.properties), "INFERENCE_NUM_THREADS": "1"}.items())))
    return backend.with_settings(settings)


def child(rd: Path, feeds: Path, out: Path) -> None:
    """Run ``rd``'s shipped deployment on one thread over the feeds in ``feeds``; outputs to ``out``."""
    from pipeline.quant.cpu import cpu_facts

    backend, model, runtime = shipped(rd)
    backend = one_thread(backend)
    files = sorted(feeds.glob("feed_*.npz"))
    t0 = time.perf_counter()
    with backend.prepare(model) as pm:
        outs = [pm.run(dict(np.load(f))) for f in files]
    arrays = {f"{i}_{k}": o for i, got in enumerate(outs) for k, o in enumerate(got)}
    np.savez(out, **arrays)
    print(json.dumps({"runtime": runtime, "cpu": cpu_facts().describe(), "outputs": len(outs[0]),
                      "seconds": round(time.perf_counter() - t0, 1)}))


# one-node float models the emulator must compute as this CPU does before its numbers mean anything
# (qemu 7.2, the first release that emulates AVX2, miscomputes OpenVINO's AVX2 Tanh kernel)
PROBE_OPS = ("MatMul", "Tanh", "Sigmoid", "HardSigmoid", "Exp", "Erf", "Softmax")
PROBE_TOLERANCE = 1e-4  # relative L2 against ONNX Runtime fp32 on this CPU


def probe_models(folder: Path) -> tuple[list[Path], dict[str, np.ndarray]]:
    """One float model per PROBE_OPS op, [64, 256] in and out, and their input."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((256, 256)) * 0.1).astype(np.float32), "w")
    paths = []
    for op in PROBE_OPS:
        node = helper.make_node(op, ["x", "w"] if op == "MatMul" else ["x"], ["y"])
        graph = helper.make_graph([node], op, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 256])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 256])],
                                  [w] if op == "MatMul" else [])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        paths.append(folder / f"probe_{op}.onnx")
        onnx.save(model, str(paths[-1]))
    return paths, {"x": (rng.standard_normal((64, 256)) * 2).astype(np.float32)}


def probe_child(runtime: str, folder: Path, out: Path) -> None:
    """Run every probe model in ``folder`` on ``runtime`` (one thread, as deployed); outputs to ``out``."""
    from pipeline.backends import create_backend
    from tests.helpers import compose

    default = create_backend(compose([f"backend={runtime}"]).backend)
    backend = one_thread(default.fp32_variant() or default)
    feeds = dict(np.load(folder / "probe_input.npz"))
    got = {}
    for op in PROBE_OPS:
        with backend.prepare(folder / f"probe_{op}.onnx") as pm:
            got[op] = pm.run(feeds)[0]
    np.savez(out, **got)


def emulator_faults(runtimes: set[str], work: Path, timeout: float) -> dict[str, dict[str, float | str]]:
    """Per runtime, the probe ops the emulator computes differently from this CPU in FP32 (op -> rel. L2),
    or {"*": why} where its probes failed to run at all."""
    folder = work / "probes"
    folder.mkdir(parents=True, exist_ok=True)
    paths, feeds = probe_models(folder)
    np.savez(folder / "probe_input.npz", **feeds)
    ref = backends()["ort"]
    want = {}
    for op, path in zip(PROBE_OPS, paths, strict=True):
        with ref.prepare(path) as pm:
            want[op] = pm.run(feeds)[0]
    faults: dict[str, dict[str, float | str]] = {}
    for runtime in sorted(runtimes):
        out = folder / f"{runtime}.npz"
        proc = emulated([__file__, "--probe", runtime, str(folder), str(out)], timeout)
        if proc.returncode != 0:
            faults[runtime] = {"*": f"its probe models failed under the emulator (rc {proc.returncode})"}
            continue
        with np.load(out) as z:
            bad = {op: float(np.linalg.norm(z[op] - w) / np.linalg.norm(w)) for op, w in want.items()}
        faults[runtime] = {op: e for op, e in bad.items() if not e <= PROBE_TOLERANCE}
    return faults


def model_fault(faults: dict[str, float | str], model: Path) -> str | None:
    """Why the emulator's numbers for ``model`` are not measurements: a probe op it computes wrongly that
    the model has (any graph, bodies included), or its runtime's probes failing; None where it has none."""
    if "*" in faults:
        return str(faults["*"])
    from pipeline.graph.model import iter_nodes, load_model

    ops = {n.op_type for n in iter_nodes(load_model(model, check=False).graph)}
    bad = {op: e for op, e in faults.items() if op in ops}
    if not bad:
        return None
    return "the emulator computes its FP32 " + ", ".join(f"{op} (rel. L2 {e:.2g})" for op, e in bad.items()) \
        + " unlike this CPU"


def read_outputs(path: Path, feeds: int, outputs: int) -> list[list[np.ndarray]]:
    with np.load(path) as z:
        return [[z[f"{i}_{k}"] for k in range(outputs)] for i in range(feeds)]


def emulated(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        raise SystemExit("needs qemu-user (apt-get install qemu-user) to emulate an AVX2 CPU without VNNI")
    env = {**os.environ, **SINGLE_THREAD}
    return subprocess.run([qemu, "-cpu", "Haswell", sys.executable, *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def bench(key: str, root: Path, count: int, timeout: float, names: list[str]) -> list[dict]:
    _, _, scored = feeds_for(key, root)
    runs = {name: root / name for name in names}
    missing = [str(rd) for rd in runs.values() if not (rd / "manifest.json").exists()]
    if missing:
        raise SystemExit(f"{key}: no runtime_choice run in {missing[0]}; run bench/runtime_choice.py with "
                         f"--results-root {root.parent} first")
    float_path = next(iter(runs.values())) / "export" / "model.onnx"
    work = root / "emulated"
    feed_dir = work / "feeds"
    if feed_dir.exists():
        shutil.rmtree(feed_dir)
    feed_dir.mkdir(parents=True)
    with backends()["ort"].prepare(float_path) as ref:
        names = list(ref.output_names)
        wanted = {s.name for s in ref.specs}
        feeds = [{k: v for k, v in f.items() if k in wanted} for f in scored[:count]]
        want = [ref.run(f) for f in feeds]
    for i, f in enumerate(feeds):
        np.savez(feed_dir / f"feed_{i:04d}.npz", **f)
    judged = MODELS[key][2]
    faults = emulator_faults({shipped(rd)[2] for rd in runs.values()}, work, timeout)
    rows = []
    for name, rd in runs.items():
        backend, model, runtime = shipped(rd)
        with one_thread(backend).prepare(model) as pm:
            native = output_error([pm.run(f) for f in feeds], want, names, judged)
        out = work / f"{name}.npz"
        proc = emulated([__file__, "--child", str(rd), str(feed_dir), str(out)], timeout)
        row = {"model": key, "run": name, "ships": runtime, "native": native, "feeds": len(feeds)}
        if proc.returncode != 0:
            row["emulated"] = f"failed (rc {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
        else:
            info = json.loads(proc.stdout.strip().splitlines()[-1])
            row["emulated"] = output_error(read_outputs(out, len(feeds), info["outputs"]), want, names, judged)
            fault = model_fault(faults.get(runtime, {}), model)
            if fault:
                row["emulated"] = f"not a measurement ({row['emulated']}): {fault}"
            row.update(emulated_cpu=info["cpu"], emulated_seconds=info["seconds"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] in ("--child", "--probe"):
        run = child if sys.argv[1] == "--child" else probe_child
        run(sys.argv[2] if run is probe_child else Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", choices=sorted(MODELS), required=True)
    ap.add_argument("--results-root", required=True, type=Path, help="bench/runtime_choice.py's --results-root")
    ap.add_argument("--feeds", type=int, default=4, help="unseen feeds per model (emulation is slow)")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per emulated model")
    ap.add_argument("--run", action="append", choices=RUNS, help="repeatable; default: every run")
    args = ap.parse_args()
    rows = []
    for key in args.model:
        rows += bench(key, args.results_root / key, args.feeds, args.timeout, args.run or list(RUNS))
    print("\n| model | run | ships | error, this CPU | error, emulated AVX2 | emulated CPU |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['run']} | {r['ships']} | {r['native']} | {r['emulated']} | "
              f"{r.get('emulated_cpu', '')} |")


if __name__ == "__main__":
    main()
