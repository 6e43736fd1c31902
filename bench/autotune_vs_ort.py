"""optimized_final.onnx vs float, the PTQ model and ORT quantize_static, side by side on ORT CPU.

Runs `tune stages=[export,quantize,autotune]` (preset quick unless told otherwise), quantizes the
same float model with onnxruntime.quantization.quantize_static (QDQ, uint8 activations, per-channel
int8 weights, same calibration batches), then measures all four models in one interleaved run and
prints speedups (ratios of p10 and of medians) and accuracy / agreement with float.

    python bench/autotune_vs_ort.py --model resnet18
    python bench/autotune_vs_ort.py --model bert_tiny
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bert_tiny")
    ap.add_argument("--extra", nargs="*", default=["autotune.preset=quick"], help="tune overrides")
    ap.add_argument("--results-dir", default=None)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()

    from quantize_vs_ort import _accuracy, _ort_quantize

    from pipeline.backends import compare_interleaved, create_backend
    from pipeline.backends.timing import TimingPlan
    from pipeline.data.adapters import DataProvider
    from pipeline.graph.model import input_specs, load_model
    from tests.helpers import compose

    rd = Path(args.results_dir or tempfile.mkdtemp(prefix=f"bench_at_{args.model}_"))
    overrides = [f"model={args.model}", *args.extra]
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "pipeline.app.cli", "stages=[export,quantize,autotune]", f"results_dir={rd}",
                    "progress=false", *overrides], check=True, cwd=ROOT)
    tune_s = time.time() - t0
    cfg = compose([*overrides, f"results_dir={rd}", f"backend.timing_runs={args.runs}", "backend.warmup_runs=5"])
    float_path = rd / "export" / "model.onnx"
    provider = DataProvider(cfg, input_specs(load_model(float_path)))
    ort_path = rd / "ort_quantize_static.onnx"
    _ort_quantize(float_path, ort_path, provider, int(cfg.quantize.calibration.batches), rd)
    paths = [float_path, rd / "quantize" / "quantized_model.onnx", rd / "autotune" / "optimized_final.onnx", ort_path]
    names = ["float (FP32)", "PTQ (quantize stage)", "optimized_final (autotune)", "ORT quantize_static u8/s8"]
    backend = create_backend(cfg.backend)
    timings = compare_interleaved(backend, paths, TimingPlan(args.rounds, args.runs, backend.warmup_runs))
    accs = _accuracy(backend, paths, provider)
    print(f"\nmodel {args.model} {' '.join(args.extra)}: tune stages=[export,quantize,autotune] took {tune_s:.0f} s")
    print(f"(ORT CPU, {backend.describe()['threads']} threads, {args.rounds} interleaved rounds x {args.runs} runs)")
    print(f"{'model':30s} {'p10 ms':>9s} {'median ms':>10s} {'vs float(p10)':>14s} {'accuracy':>24s}")
    for n, t, a in zip(names, timings, accs, strict=True):
        print(f"{n:30s} {t.p10_ms:9.3f} {t.median_ms:10.3f} {timings[0].p10_ms / t.p10_ms:13.2f}x {a:>24s}")
    f, p, o = timings[2], timings[1], timings[3]
    print(f"\noptimized_final speedup: vs float {timings[0].p10_ms / f.p10_ms:.3f}x, vs PTQ {p.p10_ms / f.p10_ms:.3f}x, "
          f"vs ORT quantize_static {o.p10_ms / f.p10_ms:.3f}x (p10);  medians: "
          f"{timings[0].median_ms / f.median_ms:.3f}x, {p.median_ms / f.median_ms:.3f}x, {o.median_ms / f.median_ms:.3f}x")


if __name__ == "__main__":
    main()
