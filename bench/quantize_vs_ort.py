"""Default-placement int8 model vs onnxruntime.quantization.quantize_static on ORT CPU.

Runs `tune stages=[export,quantize]` for a model, then quantizes the same float model with ORT's
quantize_static (QDQ format, uint8 activations, per-channel int8 weights, after quant_pre_process,
calibrated on the same batches), and measures float / ours / ORT side by side in one interleaved
run (paired blocks, p10 and median). Accuracy: top-1 on the digits test split for digits_cnn,
argmax agreement with float (and SNR) on the evaluation data otherwise.

    python bench/quantize_vs_ort.py --model digits_cnn
    python bench/quantize_vs_ort.py --model resnet18 --extra model.batch_size=8 model.input_size=224
    python bench/quantize_vs_ort.py --model bert_tiny
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="digits_cnn")
    ap.add_argument("--extra", nargs="*", default=[], help="more tune overrides")
    ap.add_argument("--results-dir", default=None)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--runs", type=int, default=20, help="timed runs per model per round")
    ap.add_argument("--calib-batches", type=int, default=16)
    args = ap.parse_args()

    from pipeline.backends import compare_interleaved, create_backend
    from pipeline.backends.timing import TimingPlan
    from pipeline.data.adapters import DataProvider
    from pipeline.graph.model import input_specs, load_model
    from tests.helpers import compose

    rd = Path(args.results_dir or tempfile.mkdtemp(prefix=f"bench_{args.model}_"))
    overrides = [f"model={args.model}", f"quantize.calibration.batches={args.calib_batches}", *args.extra]
    subprocess.run([sys.executable, "-m", "pipeline.app.cli", "stages=[export,quantize]", f"results_dir={rd}",
                    "progress=false", *overrides], check=True, cwd=ROOT)
    float_path = rd / "export" / "model.onnx"
    ours = rd / "quantize" / "quantized_model.onnx"
    cfg = compose(overrides + [f"results_dir={rd}", f"backend.timing_runs={args.runs}", "backend.warmup_runs=5"])
    model = load_model(float_path)
    specs = input_specs(model)
    provider = DataProvider(cfg, specs)

    ort_path = rd / "ort_quantize_static.onnx"
    _ort_quantize(float_path, ort_path, provider, args.calib_batches, rd)

    backend = create_backend(cfg.backend)
    paths = [float_path, ours, ort_path]
    names = ["float (FP32)", "qdq-tune default placement", "ORT quantize_static (QDQ u8/s8 per-channel)"]
    timings = compare_interleaved(backend, paths, TimingPlan(args.rounds, args.runs, backend.warmup_runs))
    accs = _accuracy(backend, paths, provider)
    print(f"\nmodel {args.model} {' '.join(args.extra)}  (ORT CPU, {backend.describe()['threads']} threads, "
          f"{args.rounds} interleaved rounds x {args.runs} runs)")
    print(f"{'model':46s} {'median ms':>10s} {'p10 ms':>9s} {'speedup(med)':>13s} {'accuracy':>22s}")
    for n, t, a in zip(names, timings, accs, strict=True):
        print(f"{n:46s} {t.median_ms:10.3f} {t.p10_ms:9.3f} {timings[0].median_ms / t.median_ms:12.2f}x {a:>22s}")
    ratio_med = timings[2].median_ms / timings[1].median_ms
    ratio_p10 = timings[2].p10_ms / timings[1].p10_ms
    print(f"\nours vs ORT quantize_static: {ratio_med:.3f}x (median), {ratio_p10:.3f}x (p10)  (>1 = ours faster)")


def _ort_quantize(float_path: Path, out: Path, provider, n_batches: int, rd: Path) -> None:
    from accuracy_vs_ort import ort_quantize
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = rd / "ort_preprocessed.onnx"
    quant_pre_process(str(float_path), str(pre))
    ort_quantize(pre, out, provider, n_batches, reduce_range=False)


def _accuracy(backend, paths, provider) -> list[str]:
    outs: list[list[np.ndarray]] = [[] for _ in paths]
    labels = []
    prepared = [backend.prepare(p) for p in paths]
    for b in provider.batches("evaluation"):
        for i, pm in enumerate(prepared):
            outs[i].append(pm.run(b.feeds)[0][: b.valid])
        if b.labels is not None:
            labels.append(b.labels[: b.valid])
    res = []
    ref = np.concatenate(outs[0])
    for o in outs:
        o = np.concatenate(o)
        if labels:
            y = np.concatenate(labels)
            res.append(f"top-1 {100 * np.mean(o.argmax(-1) == y):.2f}%")
        else:
            agree = np.mean(o.argmax(-1) == ref.argmax(-1))
            snr = 10 * np.log10(np.sum(ref**2) / max(np.sum((o - ref) ** 2), 1e-30))
            res.append(f"agree {100 * agree:.1f}% SNR {snr:.1f}dB")
    return res


if __name__ == "__main__":
    main()
