"""How closely the saturating twin (pipeline/quant/saturation.py) computes what the real u8 x s8 kernels of
a CPU without VNNI compute: each runtime's quantized models of a `tune backend=auto` run (its PTQ and its
tuned model) run with that runtime's fused kernels under `qemu-x86_64 -cpu Haswell` (AVX2, no VNNI) on
a few unseen feeds, against the same models' Q/DQ math and their twins, both run natively as plain Q/DQ
math (ONNX Runtime with no graph optimizations). Relative L2 over every output; "this CPU vs Q/DQ" is the
same fused kernels on this machine (exact int8 with VNNI or AMX): the rounding floor that twin vs
emulated is to be read against, while Q/DQ vs emulated is what the saturation costs.

    apt-get install qemu-user
    python bench/portable_target.py --model digits ...          # makes R/<model>/host (backend=auto)
    python bench/saturation_model.py --model digits --results-root R --feeds 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from emulated_accuracy import emulated, emulator_faults, model_fault, read_outputs  # noqa: E402
from openvino_vs_nncf import MODELS, feeds_for  # noqa: E402

RUNTIMES = ("onnxruntime", "openvino")


def child(runtime: str, model: Path, feed_dir: Path, out: Path) -> None:
    """``model`` on ``runtime``'s fused kernels, one thread, f32 float layers, over the feeds in ``feed_dir``."""
    from pipeline.backends.onnxruntime.session import inference_session, ort_session_options
    from pipeline.quant.cpu import cpu_facts

    files = sorted(feed_dir.glob("feed_*.npz"))
    if runtime == "onnxruntime":
        session = inference_session(model, ort_session_options("all", threads=1))
        outs = [session.run(None, dict(np.load(f))) for f in files]
    else:
        from pipeline.backends.openvino.settings import CompileSettings

        compiled = CompileSettings.from_dict({"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1}).compile(model)
        outs = [[np.asarray(v) for v in compiled(dict(np.load(f))).values()] for f in files]
    np.savez(out, **{f"{i}_{k}": o for i, got in enumerate(outs) for k, o in enumerate(got)})
    print(json.dumps({"outputs": len(outs[0]), "cpu": cpu_facts().describe()}))


def rel_l2(got: list[list[np.ndarray]], want: list[list[np.ndarray]]) -> float:
    num = sum(float(np.sum((np.asarray(g, np.float64) - w) ** 2)) for gs, ws in zip(got, want, strict=True)
              for g, w in zip(gs, ws, strict=True))
    den = sum(float(np.sum(np.asarray(w, np.float64) ** 2)) for ws in want for w in ws)
    return float(np.sqrt(num / max(den, 1e-30)))


def bench(key: str, root: Path, count: int, timeout: float) -> list[dict]:
    from pipeline.backends.onnxruntime.session import inference_session, ort_session_options
    from pipeline.graph.model import load_model, save_model
    from pipeline.quant.placement import PLACEMENTS
    from pipeline.quant.saturation import saturating_twin

    _, _, scored = feeds_for(key, root)
    run = root / "host"
    work = root / "saturation"
    feed_dir = work / "feeds"
    feed_dir.mkdir(parents=True, exist_ok=True)
    for old in feed_dir.glob("feed_*.npz"):
        old.unlink()
    faults = emulator_faults(set(RUNTIMES), work, timeout)
    rows = []
    for runtime in RUNTIMES:
        for what, rel in (("PTQ", "quantize/quantized_model.onnx"), ("tuned", "autotune/optimized_final.onnx")):
            path = run / "runtimes" / runtime / rel
            if not path.exists():
                continue
            model = load_model(path, check=False)
            specs = {i.name for i in model.graph.input}
            feeds = [{k: v for k, v in f.items() if k in specs} for f in scored[:count]]
            for i, f in enumerate(feeds):
                np.savez(feed_dir / f"feed_{i:04d}.npz", **f)
            plain = inference_session(model, ort_session_options("disable", threads=1))
            qdq = [plain.run(None, f) for f in feeds]
            twin, report = saturating_twin(model, PLACEMENTS[runtime].pair_order)
            twin_path = save_model(twin, work / f"{runtime}_{what}_twin.onnx")  # weights on disk written too
            modelled = [inference_session(twin_path, ort_session_options("disable", threads=1)).run(None, f) for f in feeds]
            out = work / f"{runtime}_{what}.npz"
            native = work / f"{runtime}_{what}_native.npz"
            child(runtime, path, feed_dir, native)  # this CPU's fused kernels: the rounding floor
            row_native = rel_l2(read_outputs(native, len(feeds), len(qdq[0])), qdq)
            proc = emulated([__file__, "--child", runtime, str(path), str(feed_dir), str(out)], timeout)
            row = {"model": key, "runtime": runtime, "what": what, "layers_that_can_saturate": len(report.corrected),
                   "twin_vs_qdq": rel_l2(modelled, qdq), "native_vs_qdq": row_native}
            if proc.returncode != 0:
                row["emulated"] = f"failed (rc {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
            else:
                info = json.loads(proc.stdout.strip().splitlines()[-1])
                real = read_outputs(out, len(feeds), info["outputs"])
                row.update(emulated_vs_qdq=rel_l2(real, qdq), emulated_vs_twin=rel_l2(real, modelled),
                           emulated_cpu=info["cpu"], fault=model_fault(faults.get(runtime, {}), path))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", choices=sorted(MODELS), required=True)
    ap.add_argument("--results-root", required=True, type=Path, help="bench/portable_target.py's --results-root")
    ap.add_argument("--feeds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=7200)
    args = ap.parse_args()
    rows = []
    for key in args.model:
        rows += bench(key, args.results_root / key, args.feeds, args.timeout)
    print("\n| model | runtime | model | layers that can saturate | this CPU vs Q/DQ | twin vs Q/DQ | emulated vs Q/DQ "
          "| emulated vs twin |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        emu = (f"{r['emulated_vs_qdq']:.4f} | {r['emulated_vs_twin']:.4f}" if "emulated_vs_twin" in r
               else f"{r['emulated']} |")
        note = f" ({r['fault']})" if r.get("fault") else ""
        print(f"| {r['model']} | {r['runtime']}{note} | {r['what']} | {r['layers_that_can_saturate']} | "
              f"{r['native_vs_qdq']:.4f} | {r['twin_vs_qdq']:.4f} | {emu} |")


if __name__ == "__main__":
    main()
