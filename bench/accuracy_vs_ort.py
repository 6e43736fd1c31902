"""Accuracy and speed of our PTQ and autotuned models vs ORT quantize_static (reduce_range off and on).

For each model, runs `tune stages=[export,quantize,autotune] autotune.preset=quick` (plus --extra)
into <results-root>/<model>, quantizes the same float model with onnxruntime.quantization's
quantize_static (QDQ, uint8 activations, per-channel int8 weights, after quant_pre_process,
calibrated on the first quantize.calibration.batches calibration batches, as the quantize stage
was) once with reduce_range=False and once with reduce_range=True, then scores all five models
against the float model on the evaluation data (pipeline.metrics.ModelScores) and times them in one
interleaved run. Accuracy is top-1 where the data is labelled (digits_cnn); every model also gets
top-1 agreement with float, relative L2 error of the outputs vs float (= 10^(-SNR/20)) and SNR.
Speed is float latency / model latency (> 1 = faster than float), of p10 and of medians. Prints a
markdown table for README.md and the command that reproduces it.

    python bench/accuracy_vs_ort.py                       # digits_cnn, resnet18, bert_tiny
    python bench/accuracy_vs_ort.py --model digits_cnn --rounds 4
    python bench/accuracy_vs_ort.py --model resnet18 --extra model.batch_size=8
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MODELS = ("digits_cnn", "resnet18", "bert_tiny")
VARIANTS = ("float (FP32)", "ours: PTQ", "ours: autotuned", "ORT quantize_static", "ORT quantize_static reduce_range")


@dataclass
class Row:
    model: str
    variant: str
    scores: dict | None  # ModelScores.result(), None if the model could not be built or run
    p10_ratio: float = math.nan
    median_ratio: float = math.nan
    error: str | None = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", choices=MODELS, help="repeatable; default: all three")
    ap.add_argument("--extra", nargs="*", default=[], help="more tune overrides (after autotune.preset=quick)")
    ap.add_argument("--results-root", default=None, help="results_dir of each model is <root>/<model>")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    ap.add_argument("--runs", type=int, default=20, help="timed runs per model per round")
    ap.add_argument("--max-batches", type=int, default=None, help="evaluation batches (default: all)")
    args = ap.parse_args()
    models = args.model or list(MODELS)

    import onnxruntime as ort

    from pipeline.cpu import describe

    print(f"CPU: {describe()}")
    print(f"onnxruntime {ort.__version__}")
    root = Path(args.results_root or tempfile.mkdtemp(prefix="bench_acc_"))
    rows: list[Row] = []
    threads = None
    for m in models:
        model_rows, threads = bench_model(m, root / m, args)
        rows += model_rows
    print(f"\nORT CPU EP, {threads} threads; latency: one interleaved run per model, {args.rounds} rounds x "
          f"{args.runs} runs; speed = float latency / model latency (>1 = faster than float)\n")
    print(markdown(rows))
    cmd = ["python", "bench/accuracy_vs_ort.py", *(f"--model={m}" for m in models), f"--rounds={args.rounds}",
           f"--runs={args.runs}"]
    if args.max_batches is not None:
        cmd.append(f"--max-batches={args.max_batches}")
    if args.extra:
        cmd += ["--extra", *args.extra]
    print(f"\nCPU: {describe()}; onnxruntime {ort.__version__}")
    print(f"reproduce: {shlex.join(cmd)}")
    print(f"results: {root}")


def bench_model(name: str, rd: Path, args: argparse.Namespace) -> tuple[list[Row], int]:
    from onnxruntime.quantization.shape_inference import quant_pre_process
    from pattern_cache_warm_start import tune

    from pipeline.artifacts import sha256_file
    from pipeline.backends import compare_interleaved, create_backend
    from pipeline.data import DataProvider
    from pipeline.graph import input_specs, load_model
    from tests.conftest import compose

    overrides = [f"model={name}", "autotune.preset=quick", *args.extra]
    t0 = time.time()
    tune(rd, overrides)
    print(f"{name}: tune stages=[export,quantize,autotune] took {time.time() - t0:.0f} s ({rd})", flush=True)
    cfg = compose([*overrides, f"results_dir={rd}", f"backend.timing_runs={args.runs}", "backend.warmup_runs=5"])
    float_path = rd / "export" / "model.onnx"
    provider = DataProvider(cfg, input_specs(load_model(float_path)))
    paths: list[Path | None] = [float_path, rd / "quantize" / "quantized_model.onnx",
                                rd / "autotune" / "optimized_final.onnx"]
    errors: list[str | None] = [None, None, None]
    pre = rd / "ort_preprocessed.onnx"
    quant_pre_process(str(float_path), str(pre))
    for reduce_range in (False, True):
        out = rd / f"ort_quantize_static{'_reduce_range' if reduce_range else ''}.onnx"
        try:
            ort_quantize(pre, out, provider, int(cfg.quantize.calibration.batches), reduce_range)
            paths.append(out)
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - a variant ORT cannot quantize is reported in its row
            paths.append(None)
            errors.append(f"quantize_static failed: {type(exc).__name__}: {exc}".splitlines()[0])

    backend = create_backend(cfg.backend)
    max_batches = args.max_batches if args.max_batches is not None else cfg.evaluate.max_batches
    scores = score(backend, paths, provider, max_batches, int(cfg.evaluate.top_k))
    ok = [p for p in paths if p is not None]
    timed = iter(compare_interleaved(backend, ok, rounds=args.rounds, runs_per_round=args.runs, warmup_runs=5))
    timings = [next(timed) if p is not None else None for p in paths]
    ref = timings[0]
    variants = list(VARIANTS)
    if sha256_file(paths[1]) == sha256_file(paths[2]):  # autotune kept the PTQ placement: rows differ by noise only
        variants[2] += " (= PTQ file)"
    rows = []
    for variant, s, t, err in zip(variants, scores, timings, errors, strict=True):
        row = Row(name, variant, s, error=err)
        if t is not None and not t.ok:
            row.error = f"timing failed: {t.error}".splitlines()[0]
        elif t is not None and ref is not None and ref.ok:
            row.p10_ratio, row.median_ratio = ref.p10_ms / t.p10_ms, ref.median_ms / t.median_ms
        rows.append(row)
    if ref is not None and ref.ok:
        print(f"{name}: float latency p10 {ref.p10_ms:.3f} ms, median {ref.median_ms:.3f} ms; scored on "
              f"{scores[0]['samples'] if scores[0] else '?'} evaluation samples", flush=True)
    return rows, backend.describe().get("threads")


def ort_quantize(pre: Path, out: Path, provider, n_batches: int, reduce_range: bool) -> None:
    """ORT's quantize_static of the quant_pre_process'ed float model ``pre`` as a user would call it:
    QDQ, u8 activations, per-channel s8 weights, calibrated on the first ``n_batches`` calibration batches."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(provider.batches("calibration", n_batches))

        def get_next(self):
            b = next(self.it, None)
            return None if b is None else b.feeds

    quantize_static(str(pre), str(out), Reader(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8, per_channel=True, reduce_range=reduce_range)


def score(backend, paths: list[Path | None], provider, max_batches: int | None, top_k: int) -> list[dict | None]:
    """ModelScores.result() of every model vs the float model (paths[0]) in one pass over the evaluation data."""
    from pipeline.metrics import ModelScores

    prepared = []
    try:
        for p in paths:
            prepared.append(None if p is None else backend.prepare(p))
        acc = [None if pm is None else ModelScores(top_k=top_k) for pm in prepared]
        for b in provider.batches("evaluation", max_batches):
            ref = prepared[0].run(b.feeds)
            for pm, s in zip(prepared, acc, strict=True):
                if pm is not None:
                    s.update(ref, ref if pm is prepared[0] else pm.run(b.feeds), b.labels, b.valid)
        return [None if s is None else s.result() for s in acc]
    finally:
        for pm in prepared:
            if pm is not None:
                pm.close()


def markdown(rows: list[Row]) -> str:
    lines = ["| model | variant | top-1 | agreement w/ float | rel. L2 err vs float | SNR dB | speed p10 | speed median |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.scores is None:
            lines.append(f"| {r.model} | {r.variant} | {r.error or 'failed'} | | | | | |")
            continue
        s = r.scores
        snr = s["snr_db"]
        top1 = "–" if s["top1"] is None else f"{100 * s['top1']:.2f}%"
        agree = "–" if s["agreement"] is None else f"{100 * s['agreement']:.2f}%"
        rel = "0" if snr == math.inf else f"{10 ** (-snr / 20):.4f}"
        snr_s = "∞" if snr == math.inf else f"{snr:.1f}"
        speed = (f"{r.p10_ratio:.2f}x | {r.median_ratio:.2f}x" if r.error is None
                 else f"{r.error} | ")
        lines.append(f"| {r.model} | {r.variant} | {top1} | {agree} | {rel} | {snr_s} | {speed} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
