"""Models past the 2 GB protobuf limit, and calibration memory: peak RSS and wall time per stage.

Two models, each through its stages one `tune` process per stage under `/usr/bin/time -v` (peak RSS
is the process's maximum resident set):

- ``big``: generated here, ``--layers`` MatMul + Relu layers of ``--width`` x ``--width`` fp32
  weights (9 x 8192 x 8192: 2.4 GB) stored as ONNX external data, He-initialised so activations keep
  their scale; `data=synthetic autotune.preset=quick`, stages export, quantize, autotune, evaluate.
  The shipped model is then loaded in ONNX Runtime from its path and its relative output error vs
  the float model is measured on 8 synthetic inputs.
- ``bert_base``: the built-in BERT encoder at BERT-base size (12 layers, hidden 768, 438 MB fp32),
  stages export and quantize with 16 calibration batches and the defaults.

    python bench/large_model.py --root /tmp/large                # both
    python bench/large_model.py --root /tmp/large --only big --layers 3 --width 4096   # smaller
    python bench/large_model.py --root /tmp/large --only big --together   # one process for the four stages

``--together`` runs the generated model's four stages in one `tune` process, as the acceptance command
does (`stages=[export,quantize,autotune,evaluate]`): its peak RSS is the whole run's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BERT_BASE = ["model=bert_tiny", "model.hidden_size=768", "model.num_layers=12", "model.num_heads=12",
             "model.intermediate_size=3072", "quantize.calibration.batches=16"]


def write_big_model(path: Path, layers: int, width: int, batch: int = 4, seed: int = 0) -> Path:
    """MatMul + Relu x ``layers`` with ``width`` x ``width`` weights written straight to external data,
    one layer in memory at a time."""
    import onnx
    from onnx import TensorProto, helper

    path.parent.mkdir(parents=True, exist_ok=True)
    data_name = path.name + ".data"
    rng = np.random.default_rng(seed)
    inits, nodes, offset = [], [], 0
    with open(path.parent / data_name, "wb") as fh:
        for i in range(layers):
            w = (rng.standard_normal((width, width), dtype=np.float32) * np.float32(np.sqrt(2.0 / width)))
            raw = w.tobytes()
            fh.write(raw)
            t = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=[width, width])
            t.data_location = TensorProto.EXTERNAL
            for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(len(raw)))):
                t.external_data.add(key=k, value=v)
            offset += len(raw)
            inits.append(t)
            prev = "input" if i == 0 else f"r{i - 1}"
            nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"layer{i}/MatMul"),
                      helper.make_node("Relu", [f"m{i}"], [f"r{i}" if i < layers - 1 else "output"],
                                       name=f"layer{i}/Relu")]
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, width])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, width])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def timed_stage(results: Path, stage: str, extra: list[str]) -> dict:
    """One `tune` process running ``stage``: exit code, wall seconds, peak RSS (GB), last error line."""
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "pipeline.app.cli", f"results_dir={results}",
           f"stages=[{stage}]", "progress=false", *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("tune: error")]
    return {"stage": stage, "rc": proc.returncode, "seconds": time.time() - t0,
            "peak_rss_gb": int(rss.group(1)) / 1024**2 if rss else None, "error": errors[-1] if errors else None}


def output_error(results: Path, feeds: int = 8) -> dict:
    """The shipped model, loaded by ONNX Runtime from its path, vs export's float model: relative L2
    error of the output over ``feeds`` synthetic inputs."""
    from pipeline.backends.onnxruntime.session import inference_session

    shipped = results / "autotune" / "optimized_final.onnx"
    rng = np.random.default_rng(1)
    ref, got = inference_session(results / "export" / "model.onnx"), inference_session(shipped)
    shape = [d if isinstance(d, int) else 1 for d in ref.get_inputs()[0].shape]
    num = den = 0.0
    for _ in range(feeds):
        x = {ref.get_inputs()[0].name: rng.standard_normal(shape).astype(np.float32)}
        a, b = ref.run(None, x)[0].astype(np.float64), got.run(None, x)[0].astype(np.float64)
        num, den = num + float(np.sum((a - b) ** 2)), den + float(np.sum(a ** 2))
    return {"rel_error": float(np.sqrt(num / den)), "shipped_bytes": sum(
        p.stat().st_size for p in shipped.parent.glob("optimized_final.onnx*"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/tmp/qdq_large")
    ap.add_argument("--only", choices=["big", "bert_base"])
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--together", action="store_true", help="the generated model's stages in one process")
    args = ap.parse_args()
    root = Path(args.root)
    rows = []
    if args.only in (None, "big"):
        src = root / "big" / "big.onnx"
        if not src.exists():
            write_big_model(src, args.layers, args.width)
        size = sum(p.stat().st_size for p in src.parent.glob("big.onnx*"))
        rd = root / ("big_together" if args.together else "big_results")
        extra = ["model=onnx", f"model.onnx_path={src}", "data=synthetic", "autotune.preset=quick"]
        for stage in (("export,quantize,autotune,evaluate",) if args.together else
                      ("export", "quantize", "autotune", "evaluate")):
            r = timed_stage(rd, stage, extra)
            rows.append({"model": f"generated {args.layers} x MatMul {args.width}^2 ({size / 1e9:.2f} GB)", **r})
            print(json.dumps(rows[-1]), flush=True)
            if r["rc"] != 0:
                break
        else:
            rows[-1].update(output_error(rd))
            print(json.dumps(rows[-1]), flush=True)
    if args.only in (None, "bert_base"):
        rd = root / "bert_base_results"
        for stage in ("export", "quantize"):
            r = timed_stage(rd, stage, BERT_BASE)
            rows.append({"model": "BERT-base (438 MB fp32), 16 calibration batches", **r})
            print(json.dumps(rows[-1]), flush=True)
            if r["rc"] != 0:
                break
    cpu = os.popen("lscpu | grep -o 'avx512_vnni\\|avx_vnni\\|avx2' | sort -u | tr '\\n' ' '").read().strip()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    print(f"\n{os.cpu_count()} CPUs ({cpu}), {ram:.0f} GB RAM\n")
    print("| model | stage | exit | wall time | peak RSS | notes |")
    print("|---|---|---|---:|---:|---|")
    for r in rows:
        note = r.get("error") or (f"shipped model {r['shipped_bytes'] / 1e9:.2f} GB, output error vs float "
                                  f"{r['rel_error']:.3f}" if "rel_error" in r else "")
        print(f"| {r['model']} | {r['stage']} | {r['rc']} | {r['seconds']:.0f} s | {r['peak_rss_gb']:.2f} GB | {note} |")


if __name__ == "__main__":
    main()
