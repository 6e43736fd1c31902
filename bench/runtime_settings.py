"""The runtime search on the built-in models: is a shipped model with its shipped session settings
ever slower than the same model with ORT's defaults, and what does each gain against float?

For each model, `tune stages=[export,quantize,autotune] autotune.preset=quick` (the runtime search
on), then one interleaved run (``--rounds`` x ``--runs``) of float and shipped models, each with
ORT's default session and with autotune/ort_session.json. Ratios are p10 latencies (medians in
brackets); the shipped model's accuracy verdict is autotune's.

    python bench/runtime_settings.py --results-root /tmp/rt            # digits_cnn, resnet18, bert_tiny
    python bench/runtime_settings.py --model digits_cnn --rounds 10 --runs 20
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from accuracy_vs_ort import run_tune  # noqa: E402

from pipeline.records.autotune import AutotuneMetrics  # noqa: E402

MODELS = {"digits_cnn": [], "resnet18": ["model.input_size=112"], "bert_tiny": []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", choices=list(MODELS), help="default: all")
    ap.add_argument("--results-root", default="/tmp/qdq_runtime_settings")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()

    from omegaconf import OmegaConf

    from pipeline.backends.onnxruntime import OnnxRuntimeBackend
    from pipeline.backends.onnxruntime.config import OnnxRuntimeBackendConfig
    from pipeline.backends.onnxruntime.session import SessionSettings
    from pipeline.backends.timing import TimingPlan, compare_prepared

    backend = OnnxRuntimeBackend(OmegaConf.structured(OnnxRuntimeBackendConfig(warmup_runs=5, timing_runs=args.runs)))
    rows = []
    for name in args.model or list(MODELS):
        rd = Path(args.results_root) / name
        err, took = run_tune(rd, "[export,quantize,autotune]", [f"model={name}", *MODELS[name], "autotune.preset=quick"])
        if err:
            rows.append(f"| {name} | failed: {err} | | | | |")
            continue
        m = AutotuneMetrics.from_dict(json.loads((rd / "manifest.json").read_text())["stages"]["autotune"]["metrics"],
                                      f"{rd}/manifest.json's autotune entry")
        settings = SessionSettings.load(rd / "autotune" / "ort_session.json")
        float_path, shipped = rd / "autotune" / "baseline.onnx", rd / "autotune" / "optimized_final.onnx"
        tuned, plain = backend.with_settings(settings), backend.as_deployed()
        prepared = [b.prepare(p) for b, p in ((plain, float_path), (tuned, float_path), (plain, shipped),
                                               (tuned, shipped))]
        try:
            t = compare_prepared(backend.name, prepared, TimingPlan(args.rounds, args.runs, 5))
        finally:
            for pm in prepared:
                pm.close()
        fd, ft, sd, st = t

        def r(a, b) -> str:
            return f"{a.p10_ms / b.p10_ms:.2f}x ({a.median_ms / b.median_ms:.2f}x)"

        rows.append(f"| {name} | {m.shipped}, {m.accuracy.final.what if m.accuracy.final else ''} | {settings.describe()} | "
                    f"{r(fd, sd)} | {r(fd, st)} | {r(ft, st)} | {r(sd, st)} |")
        print(rows[-1], f"(tune {took:.0f} s)", flush=True)
    print("\n| model | shipped, accuracy | session settings | shipped, ORT defaults vs float | shipped, its settings "
          "vs float | shipped vs float, both with its settings | its settings vs ORT defaults (shipped) |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
