"""Accuracy and speed of our PTQ and autotuned models vs ORT quantize_static (reduce_range off and on).

For each model, runs `tune stages=[export,quantize,autotune] autotune.preset=quick` (plus --extra)
into <results-root>/<model>, quantizes the same float model with onnxruntime.quantization's
quantize_static (QDQ, uint8 activations, per-channel int8 weights, after quant_pre_process,
calibrated on the first quantize.calibration.batches calibration batches, as the quantize stage
was) once with reduce_range=False and once with reduce_range=True, then scores all five models
against the float model on the evaluation data (pipeline.accuracy.metrics.ModelScores) and times them in one
interleaved run. Accuracy is top-1 where the data is labelled (digits_cnn); every model also gets
top-1 agreement with float, relative L2 error of the outputs vs float (= 10^(-SNR/20)) and SNR.
Speed is float latency / model latency (> 1 = faster than float), of p10 and of medians. Prints a
markdown table for README.md and the command that reproduces it.

    python bench/accuracy_vs_ort.py                       # digits_cnn, resnet18, bert_tiny
    python bench/accuracy_vs_ort.py --model digits_cnn --rounds 4
    python bench/accuracy_vs_ort.py --model resnet18 --extra model.batch_size=8

Trained third-party models (bench/trained_models.py: minilm_l6, ppocr_det, ppocr_cls) get one table
each with an ablation of quantize's accuracy features, all scored and timed in ONE interleaved run:

    python bench/accuracy_vs_ort.py --model minilm_l6 --model ppocr_det --model ppocr_cls

Per model, --feeds (32) real feeds are written to <root>/<model>/feeds: quantize calibrates on feeds
0..15 (quantize.calibration.batches=16), its accuracy checks (recovery, bias correction, autotune's
budget) use feeds 16..23 (accuracy.holdout_batches=8), and every row is scored on feeds
24..31 only (data.eval_path=<root>/<model>/eval_feeds holds copies of them): no variant saw them.
Rows: float; "ours: plain PTQ" (minmax, no equalization / smoothing / bias correction / outlier
handling / recovery), plain PTQ with one feature switched on (each its own results_dir under
<root>/<model>/<variant>), the shipped defaults (quantize, and autotune.preset=quick on top, both from
<root>/<model>/defaults), ORT quantize_static (u8 and reduce_range, calibrated on feeds 0..15), and
AIMET-ONNX's best recipe (bench/aimet_peer.py run with --aimet-python, a separate venv).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from pipeline.errors import StateError  # noqa: E402
from pipeline.records.autotune import AutotuneMetrics  # noqa: E402
from pipeline.records.quantize import QuantizeMetrics  # noqa: E402

MODELS = ("digits_cnn", "resnet18", "bert_tiny")
TRAINED = ("minilm_l6", "ppocr_det", "ppocr_cls", "silero_vad")  # keys of trained_models.MODELS
AIMET_PYTHON = Path("/work/aimet-venv/bin/python")
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
    ap.add_argument("--model", action="append", choices=MODELS + TRAINED,
                    help=f"repeatable; default: {', '.join(MODELS)}; trained models: {', '.join(TRAINED)}")
    ap.add_argument("--extra", nargs="*", default=[], help="more tune overrides (after autotune.preset=quick)")
    ap.add_argument("--results-root", default=None, help="results_dir of each model is <root>/<model>")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    ap.add_argument("--runs", type=int, default=20, help="timed runs per model per round")
    ap.add_argument("--max-batches", type=int, default=None, help="evaluation batches (default: all)")
    ap.add_argument("--feeds", type=int, default=32,
                    help="trained models: real feeds written (16 calibrate, 8 hold out, the rest are scored)")
    ap.add_argument("--aimet-python", default=str(AIMET_PYTHON) if AIMET_PYTHON.exists() else None,
                    help="python of a venv with aimet-onnx, runs bench/aimet_peer.py (default: "
                         f"{AIMET_PYTHON} if it exists)")
    ap.add_argument("--aimet-timeout", type=float, default=1800, help="seconds before the AIMET run is given up")
    args = ap.parse_args()
    models = args.model or list(MODELS)

    import onnxruntime as ort

    from pipeline.quant.cpu import describe

    print(f"CPU: {describe()}")
    print(f"onnxruntime {ort.__version__}")
    root = Path(args.results_root or tempfile.mkdtemp(prefix="bench_acc_"))
    rows: list[Row] = []
    tables: list[str] = []
    threads = None
    for m in models:
        if m in TRAINED:
            try:
                trows, threads, header = bench_trained(m, root / m, args)
                tables.append(f"### {m}\n\n{header}\n\n{trained_markdown(m, trows)}")
            except Exception as exc:  # noqa: BLE001 - the other models still get their tables
                tables.append(f"### {m}\n\nfailed: {type(exc).__name__}: {exc}")
                print(f"{m}: failed: {type(exc).__name__}: {exc}", flush=True)
        else:
            model_rows, threads = bench_model(m, root / m, args)
            rows += model_rows
    print(f"\nORT CPU EP, {threads} threads; latency: one interleaved run per model, {args.rounds} rounds x "
          f"{args.runs} runs; speed = float latency / model latency (>1 = faster than float)\n")
    if rows:
        print(markdown(rows))
    for t in tables:
        print(f"\n{t}")
    cmd = ["python", "bench/accuracy_vs_ort.py", *(f"--model={m}" for m in models), f"--rounds={args.rounds}",
           f"--runs={args.runs}"]
    if args.max_batches is not None:
        cmd.append(f"--max-batches={args.max_batches}")
    if any(m in TRAINED for m in models) and args.feeds != 32:
        cmd.append(f"--feeds={args.feeds}")
    if any(m in TRAINED for m in models) and args.aimet_timeout != 1800:
        cmd.append(f"--aimet-timeout={args.aimet_timeout:g}")
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
    from pipeline.backends.timing import TimingPlan
    from pipeline.data.adapters import DataProvider
    from pipeline.graph.model import input_specs, load_model
    from tests.helpers import compose

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
    timed = iter(compare_interleaved(backend, ok, TimingPlan(args.rounds, args.runs, 5)))
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
    from pipeline.accuracy.metrics import ModelScores

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


# --------------------------------------------------------------------------- trained third-party models

CALIB, HOLDOUT = 16, 8
# plain static PTQ: minmax ranges, none of quantize's accuracy features
PLAIN = ["quantize.algorithm=minmax", "quantize.equalization=false", "quantize.smoothing=false",
         "quantize.bias_correction=false", "quantize.outlier_threshold=0", "accuracy.recovery=false"]
# (row label, results_dir name, overrides on top of PLAIN); "defaults" is the shipped configuration
ABLATION = [
    ("ours: plain PTQ", "plain", []),
    ("ours: + equalization", "equalization", ["quantize.equalization=true"]),
    ("ours: + smoothing", "smoothing", ["quantize.smoothing=true"]),
    ("ours: + bias correction", "bias_correction", ["quantize.bias_correction=true"]),
    ("ours: + mse ranges", "mse", ["quantize.algorithm=mse"]),
    ("ours: + auto ranges", "auto", ["quantize.algorithm=auto"]),
]


@dataclass
class TRow:
    variant: str
    path: Path | None
    scores: dict | None = None
    p10_ratio: float = math.nan
    median_ratio: float = math.nan
    float_nodes: int | None = None
    notes: str = ""
    error: str | None = None


def run_tune(rd: Path, stages: str, overrides: list[str]) -> tuple[str | None, float]:
    """`tune stages=<stages> results_dir=<rd> <overrides>` in a subprocess, its output in rd/tune.log;
    (None or the error's last line, seconds)."""
    rd.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(rd / "tune.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "pipeline.app.cli", f"stages={stages}", f"results_dir={rd}",
                               "progress=false", *overrides], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    took = time.time() - t0
    if proc.returncode == 0:
        return None, took
    lines = [ln.strip() for ln in (rd / "tune.log").read_text(errors="replace").splitlines() if ln.strip()]
    errs = [ln for ln in lines if "Error" in ln or "error" in ln]
    return f"tune exit {proc.returncode}: {(errs or lines or ['(no output)'])[-1][:300]}", took


def quantize_metrics(rd: Path) -> QuantizeMetrics | None:
    """quantize's manifest metrics in ``rd`` as their record; None where it recorded none or they do not read."""
    try:
        recorded = json.loads((rd / "manifest.json").read_text())["stages"]["quantize"].get("metrics")
        return QuantizeMetrics.from_dict(recorded, f"{rd}/manifest.json's quantize entry") if recorded else None
    except (OSError, ValueError, KeyError, StateError):
        return None


def quantize_notes(m: QuantizeMetrics | None, switched: str | None = None) -> str:
    """The headline's bits after the first ';' (holdout verdict, weights, transforms, float nodes), and
    why a transform that was switched on changed nothing."""
    head = m.headline if m is not None else ""
    first, *rest = head.split("; ")
    bits = []
    if m is not None and m.ranges is not None:
        bits.append(f"{m.ranges.chosen} ranges chosen")
    if "nodes quantized" in first:
        bits.append(first.split(": ", 1)[-1].split(" (")[0])  # "N nodes quantized"
    bits += rest
    if switched in ("equalization", "smoothing"):
        rec = next((t for t in (m.transforms if m is not None else []) if t.get("transform") == switched), None)
        if rec is not None and not rec.get("applied"):
            bits.append(f"{switched} not applied: {rec.get('reason')}")
    if switched == "bias_correction":
        b = m.bias_correction if m is not None else None
        if b is None or not b.applied:
            bits.append(f"bias correction not kept: {b.reason if b is not None and b.reason is not None else 'not run'}"
                        + (f" ({b.before} -> {b.after})" if b is not None and b.before else ""))
    return _short("; ".join(bits))


def _short(text: str) -> str:
    """Accuracy verdicts without the output name, the budget and the sample count."""
    text = re.sub(r" on output '[^']*'", "", text)
    text = re.sub(r" \(min [^)]*\)", "", text)
    return re.sub(r" on \d+ decisive samples", "", text)


def bench_trained(key: str, rd: Path, args: argparse.Namespace) -> tuple[list[TRow], int, str]:
    import trained_models as tm

    from pipeline.app.cli import open_dict_overrides
    from pipeline.backends import create_backend
    from pipeline.data.adapters import DataProvider
    from pipeline.graph.model import input_specs, load_model
    from tests.helpers import compose

    rd.mkdir(parents=True, exist_ok=True)
    info = tm.write_feeds(key, rd / "feeds", args.feeds)
    n = info["count"]
    first_eval = CALIB + HOLDOUT if n > CALIB + HOLDOUT else CALIB
    eval_dir = rd / "eval_feeds"
    shutil.rmtree(eval_dir, ignore_errors=True)
    eval_dir.mkdir()
    for i in range(first_eval, n):
        shutil.copy2(rd / "feeds" / f"feed_{i:04d}.npz", eval_dir / f"feed_{i:04d}.npz")
    scored = (f"feeds {first_eval}..{n - 1} (not calibrated on, not in quantize's/autotune's holdout)"
              if first_eval == CALIB + HOLDOUT else
              f"feeds {first_eval}..{n - 1} (not calibrated on, but quantize's holdout)")
    base = [*info["overrides"], f"data.eval_path={eval_dir}", f"quantize.calibration.batches={CALIB}",
            f"accuracy.holdout_batches={HOLDOUT}"]
    print(f"{key}: {n} feeds in {rd / 'feeds'} (sha256 {info['digest']}); calibration feeds 0..{CALIB - 1}, "
          f"holdout {CALIB}..{CALIB + HOLDOUT - 1}, scored on {scored}", flush=True)

    rows = [TRow("float (FP32)", None)]
    for label, name, extra in ABLATION:
        vd = rd / name
        err, took = run_tune(vd, "[export,quantize]", [*base, *PLAIN, *extra, *args.extra])
        print(f"{key}: {label}: tune stages=[export,quantize] took {took:.0f} s ({vd})"
              + (f": {err}" if err else ""), flush=True)
        row = TRow(label, None if err else vd / "quantize" / "quantized_model.onnx", error=err)
        m = quantize_metrics(vd)
        if not err:
            row.float_nodes = len(m.float_nodes) if m is not None else 0
            row.notes = quantize_notes(m, name if name not in ("mse", "auto") else None)
        rows.append(row)
    dd = rd / "defaults"
    err, took = run_tune(dd, "[export,quantize,autotune]", [*base, "autotune.preset=quick", *args.extra])
    print(f"{key}: defaults: tune stages=[export,quantize,autotune] autotune.preset=quick took {took:.0f} s ({dd})"
          + (f": {err}" if err else ""), flush=True)
    qp = dd / "quantize" / "quantized_model.onnx"
    m = quantize_metrics(dd)
    q_row = TRow("ours: quantize (defaults, with recovery)", qp if qp.exists() else None,
                 error=None if qp.exists() else (err or "no quantized_model.onnx"))
    if qp.exists():
        q_row.float_nodes = len(m.float_nodes) if m is not None else 0
        q_row.notes = quantize_notes(m)
    a_row = TRow("ours: autotuned (quick, on defaults)", None if err else dd / "autotune" / "optimized_final.onnx",
                 error=err)
    if not err:
        try:
            am = AutotuneMetrics.from_dict(json.loads((dd / "manifest.json").read_text())["stages"]["autotune"]
                                           ["metrics"], f"{dd}/manifest.json's autotune entry")
            a_row.notes = f"shipped {am.shipped}" + (
                f" ({am.shipped_reason})" if am.shipped != "tuned" and am.shipped_reason else "")
            a_row.notes += f"; tune-time speedup {am.speedup if am.speedup is not None else math.nan:.2f}x"
        except (OSError, ValueError, KeyError, StateError):
            pass
        from pipeline.artifacts import sha256_file
        if qp.exists() and sha256_file(qp) == sha256_file(a_row.path):
            a_row.notes = "= quantize file; " + a_row.notes
    rows += [q_row, a_row]

    # the float model every variant started from (export/model.onnx of a finished run)
    float_path = next((d / "export" / "model.onnx" for d in [dd, *(rd / a[1] for a in ABLATION)]
                       if (d / "export" / "model.onnx").exists()), None)
    if float_path is None:
        raise RuntimeError(f"{key}: no run got past export (see {rd}/*/tune.log)")
    rows[0].path = float_path
    # `++` for dict-typed keys (model.input_shapes), as the tune CLI does
    cfg = compose(open_dict_overrides([*base, f"results_dir={dd}", f"backend.timing_runs={args.runs}",
                                        "backend.warmup_runs=5"]))
    provider = DataProvider(cfg, input_specs(load_model(float_path)))

    ort_rows = [TRow("ORT quantize_static u8", None), TRow("ORT quantize_static reduce_range", None)]
    pre = rd / "ort_preprocessed.onnx"
    src, opset_note = float_path, ""
    try:
        import onnx

        fm = onnx.load(str(float_path))
        opset = next((o.version for o in fm.opset_import if o.domain in ("", "ai.onnx")), 0)
        if opset < 13:  # quantize_static writes per-channel DequantizeLinear with `axis`, which needs opset 13
            src = rd / "float_opset13.onnx"
            onnx.save(onnx.version_converter.convert_version(fm, 13), str(src))
            opset_note = f"opset {opset} converted to 13 first (per-channel DequantizeLinear needs 13)"
    except Exception as exc:  # noqa: BLE001 - reported in the rows
        src, opset_note = float_path, f"opset conversion failed ({type(exc).__name__}: {exc})".splitlines()[0][:200]
    try:
        from onnxruntime.quantization.shape_inference import quant_pre_process

        quant_pre_process(str(src), str(pre))
    except Exception as exc:  # noqa: BLE001 - reported in the rows
        pre = src
        opset_note += ("; " if opset_note else "") + f"quant_pre_process failed ({type(exc).__name__}), " \
                                                     "quantized without it"
    for r in ort_rows:
        r.notes = opset_note
    for r, reduce_range in zip(ort_rows, (False, True), strict=True):
        out = rd / f"ort_quantize_static{'_reduce_range' if reduce_range else ''}.onnx"
        t0 = time.time()
        try:
            ort_quantize(pre, out, provider, CALIB, reduce_range)
            r.path = out
        except Exception as exc:  # noqa: BLE001 - a variant ORT cannot quantize is reported in its row
            r.error = f"quantize_static failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]
        print(f"{key}: {r.variant} took {time.time() - t0:.0f} s" + (f": {r.error}" if r.error else ""), flush=True)
    rows += ort_rows
    rows.append(aimet_row(key, rd, float_path, args))

    backend = create_backend(cfg.backend)
    max_batches = args.max_batches if args.max_batches is not None else cfg.evaluate.max_batches
    paths = [r.path for r in rows]
    scores = score_isolated(backend, paths, provider, max_batches, int(cfg.evaluate.top_k))
    for r, (s, serr) in zip(rows, scores, strict=True):
        r.scores = s
        if serr and not r.error:
            r.error = serr
    ok = [r for r in rows if r.path is not None and r.error is None]
    t0 = time.time()
    timings = time_on_real_feed(backend, [r.path for r in ok], provider, args.rounds, args.runs)
    ref = timings[0] if ok and ok[0] is rows[0] else None
    for r, t in zip(ok, timings, strict=True):
        if not t.ok:
            r.error = f"timing failed: {t.error}".splitlines()[0]
        elif ref is not None and ref.ok:
            r.p10_ratio, r.median_ratio = ref.p10_ms / t.p10_ms, ref.median_ms / t.median_ms
    threads = backend.describe().get("threads")
    header = (f"{tm.MODELS[key]['description']}. Scored on {scored}: "
              f"{rows[0].scores['samples'] if rows[0].scores else '?'} samples"
              + (f"; float latency p10 {ref.p10_ms:.3f} ms, median {ref.median_ms:.3f} ms" if ref and ref.ok else "")
              + f" ({args.rounds} rounds x {args.runs} runs, {time.time() - t0:.0f} s).")
    print(f"{key}: {header}", flush=True)
    return rows, threads, header


def time_on_real_feed(backend, paths: list[Path], provider, rounds: int, runs: int, settings: list | None = None
                      ) -> list:
    """compare_interleaved, but every model is timed on the first evaluation feed instead of the backend's
    synthetic one: synthetic token ids (0..99) overflow token_type_ids' 2-row embedding in models whose
    Gather table is behind a DequantizeLinear (ORT's and AIMET's), so their input bound is not known.
    ``settings``: per model, ONNX Runtime session settings (None: the backend's own)."""
    from contextlib import ExitStack

    from pipeline.backends.base import Timing
    from pipeline.backends.timing import TimingPlan, compare_prepared, prepared_models

    feed = next(iter(provider.batches("evaluation", 1))).feeds
    if settings is not None:  # one backend per model, each with its session settings
        with ExitStack() as stack:
            prepared = [stack.enter_context(backend.with_settings(s).prepare(p)) for p, s in
                        zip(paths, settings, strict=True)]
            for pm in prepared:
                pm._feeds = {k: feed[k] for k in pm._feeds}
            return compare_prepared(backend.name, prepared, TimingPlan(rounds, runs, 5))
    with prepared_models(backend, paths) as (prepared, errors):
        for pm in prepared:
            if pm is not None and hasattr(pm, "_feeds"):
                pm._feeds = {k: feed[k] for k in pm._feeds}
        timed = iter(compare_prepared(backend.name, [pm for pm in prepared if pm is not None], TimingPlan(rounds, runs, 5)))
        return [next(timed) if pm is not None else Timing.failed(backend.name, e or "not prepared")
                for pm, e in zip(prepared, errors, strict=True)]


def aimet_row(key: str, rd: Path, float_path: Path, args: argparse.Namespace) -> TRow:
    """AIMET-ONNX's best recipe (bench/aimet_peer.py in its own venv); the row says why when it cannot run."""
    row = TRow("AIMET-ONNX best recipe", None)
    py = args.aimet_python
    if not py:
        row.error = f"not run: no --aimet-python and {AIMET_PYTHON} does not exist"
        return row
    if not Path(py).exists():
        row.error = f"not run: --aimet-python {py} does not exist"
        return row
    out = rd / "aimet_best.onnx"
    out.unlink(missing_ok=True)
    cmd = [py, str(ROOT / "bench" / "aimet_peer.py"), "--model", str(float_path), "--feeds", str(rd / "feeds"),
           "--calib", str(CALIB), "--out", str(out), "--recipe", "best"]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.aimet_timeout)
    except subprocess.TimeoutExpired:
        row.error = f"aimet_peer.py timed out after {args.aimet_timeout:.0f} s"
        print(f"{key}: AIMET: {row.error}", flush=True)
        return row
    (rd / "aimet.log").write_text(f"$ {shlex.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    took = time.time() - t0
    if proc.returncode != 0 or not out.exists():
        errs = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        line = next((ln for ln in reversed(errs) if ln.startswith("aimet_peer: error")), errs[-1] if errs else "")
        row.error = f"aimet_peer.py exit {proc.returncode}: {line[:300] or '(no output)'}"
        print(f"{key}: AIMET failed after {took:.0f} s: {row.error}", flush=True)
        return row
    row.path = out
    try:
        doc = json.loads([ln for ln in proc.stdout.splitlines() if ln.strip()][-1])
        steps = doc.get("steps")
        if isinstance(steps, list):  # the recipe's steps; graph preparation and export are the same every time
            skip = ("fix_input_shapes", "fold_constants", "to_onnx_qdq")
            steps = ", ".join(str(s)[:90] for s in steps if not str(s).startswith(skip))
        row.notes = f"{steps}; {doc.get('seconds', took):.0f} s" if steps else f"{took:.0f} s"
    except (ValueError, IndexError, TypeError, AttributeError):
        row.notes = f"{took:.0f} s (no JSON summary line)"
    print(f"{key}: AIMET best recipe took {took:.0f} s", flush=True)
    return row


def score_isolated(backend, paths: list[Path | None], provider, max_batches: int | None, top_k: int
                   ) -> list[tuple[dict | None, str | None]]:
    """Like score(), but a model that cannot be prepared or run gets an error instead of failing the others."""
    from pipeline.accuracy.metrics import ModelScores

    prepared: list = []
    errors: list[str | None] = []
    try:
        for p in paths:
            if p is None:
                prepared.append(None)
                errors.append(None)
                continue
            try:
                prepared.append(backend.prepare(p))
                errors.append(None)
            except Exception as exc:  # noqa: BLE001
                prepared.append(None)
                errors.append(f"does not load: {type(exc).__name__}: {exc}".splitlines()[0][:300])
        if prepared[0] is None:
            raise RuntimeError(f"the float model {paths[0]} does not load: {errors[0]}")
        acc = [None if pm is None else ModelScores(top_k=top_k) for pm in prepared]
        for b in provider.batches("evaluation", max_batches):
            ref = prepared[0].run(b.feeds)
            for i, (pm, s) in enumerate(zip(prepared, acc, strict=True)):
                if pm is None or s is None:
                    continue
                try:
                    s.update(ref, ref if i == 0 else pm.run(b.feeds), b.labels, b.valid)
                except Exception as exc:  # noqa: BLE001
                    errors[i] = f"does not run: {type(exc).__name__}: {exc}".splitlines()[0][:300]
                    acc[i] = None
        return [(None if s is None else s.result(), e) for s, e in zip(acc, errors, strict=True)]
    finally:
        for pm in prepared:
            if pm is not None:
                pm.close()


def trained_markdown(key: str, rows: list[TRow]) -> str:
    if key == "minilm_l6":
        cols = ["mean cosine vs float"]
    else:
        cols = ["rel. L2 err vs float", "SNR dB"] + (["agreement w/ float"] if key == "ppocr_cls" else [])
    head = ["variant", *cols, "nodes left float", "speed p10", "speed median", "notes"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 2) + "---|"]
    for r in rows:
        s = r.scores
        if s is None:
            vals = ["–"] * len(cols)
        elif key == "minilm_l6":
            vals = ["–" if s.get("cosine") is None else f"{s['cosine']:.5f}"]
        else:
            snr = s["snr_db"]
            vals = ["0" if snr == math.inf else f"{10 ** (-snr / 20):.4f}", "∞" if snr == math.inf else f"{snr:.1f}"]
            if key == "ppocr_cls":
                vals.append("–" if s.get("agreement") is None else f"{100 * s['agreement']:.1f}%")
        fl = "–" if r.float_nodes is None else str(r.float_nodes)
        speed = (["–", "–"] if math.isnan(r.p10_ratio) else [f"{r.p10_ratio:.2f}x", f"{r.median_ratio:.2f}x"])
        notes = "; ".join(x for x in (r.error, r.notes) if x).replace("|", "/")
        lines.append("| " + " | ".join([r.variant, *vals, fl, *speed, notes]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
