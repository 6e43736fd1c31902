"""Subgraph mode vs region mode: tuning wall time, measurements, and both final models side by side.

For each model, runs `tune stages=[export,quantize,autotune]` once per mode (default preset; each
mode in its own results_dir, skipped when already up to date there), reads the autotune stage's
wall time and measurement counts from the manifest, then measures the float model, the PTQ model
and both optimized_final.onnx files in one interleaved run. Accuracy is each shipped model's
verdict on the held-out batches (the same budget for both modes).

    python bench/subgraph_vs_region.py                      # resnet50 and a 6-layer bert_tiny
    python bench/subgraph_vs_region.py --models resnet50 --results-root /tmp/sg_bench
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    # random-weight ResNet-50: minmax/entropy int8 miss the default budget (SNR ~15 dB on the
    # held-out batches); percentile calibration plus the quantize stage's sensitive-node recovery meets it
    "resnet50": ["model=resnet50", "quantize.algorithm=percentile"],
    "bert6": ["model=bert_tiny", "model.num_layers=6", "model.hidden_size=384", "model.num_heads=6",
              "model.intermediate_size=1536", "model.batch_size=8"],
}


def _run(overrides: list[str], rd: Path) -> dict:
    subprocess.run([sys.executable, "-m", "pipeline.cli", "stages=[export,quantize,autotune]", f"results_dir={rd}",
                    "progress=false", *overrides], check=True, cwd=ROOT)
    entry = json.loads((rd / "manifest.json").read_text())["stages"]["autotune"]
    return {"seconds": entry["finished"] - entry["started"], **entry["metrics"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert6", help=f"comma-separated, from {sorted(MODELS)}")
    ap.add_argument("--extra", nargs="*", default=[], help="tune overrides for every run")
    ap.add_argument("--results-root", default=None)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()

    from pipeline.backends import compare_interleaved, create_backend
    from pipeline.cpu import describe
    from tests.conftest import compose

    root = Path(args.results_root or tempfile.mkdtemp(prefix="bench_sg_"))
    rows = []
    for name in args.models.split(","):
        base = [*MODELS[name], *args.extra]
        runs = {mode: _run([*base, f"autotune.mode={mode}"], root / f"{name}_{mode}") for mode in ("region", "subgraph")}
        cfg = compose([*base, f"results_dir={root / f'{name}_region'}"])
        backend = create_backend(cfg.backend)
        paths = [root / f"{name}_region" / "export" / "model.onnx",
                 root / f"{name}_region" / "quantize" / "quantized_model.onnx",
                 root / f"{name}_region" / "autotune" / "optimized_final.onnx",
                 root / f"{name}_subgraph" / "autotune" / "optimized_final.onnx"]
        t = compare_interleaved(backend, paths, rounds=args.rounds, runs_per_round=args.runs)
        rows.append((name, runs, t))

    print(f"\nCPU: {describe()}; results in {root}")
    print(f"final models measured in one interleaved run: {args.rounds} rounds x {args.runs} runs, p10 latency\n")
    print("| model | mode | tuning wall time | full-model measurements | subgraph measurements | final p10 ms | "
          "vs float | vs region final | shipped | accuracy (held-out) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, runs, (flt, ptq, reg, sub) in rows:
        for mode, timing in (("region", reg), ("subgraph", sub)):
            m = runs[mode]
            full = m.get("full_model_measurements", m.get("measurements"))
            subm = m.get("subgraph_measurements", 0)
            acc = m["accuracy"]["final"]
            print(f"| {name} | {mode} | {m['seconds']:.0f} s | {full} | {subm} | {timing.p10_ms:.3f} | "
                  f"{flt.p10_ms / timing.p10_ms:.2f}x | {reg.p10_ms / timing.p10_ms:.3f}x | {m['shipped']} | "
                  f"{'ok' if acc['ok'] else 'OVER'}: {acc['what']} |")
        r, s = runs["region"], runs["subgraph"]
        print(f"| {name} | (PTQ) | - | - | - | {ptq.p10_ms:.3f} | {flt.p10_ms / ptq.p10_ms:.2f}x | "
              f"{reg.p10_ms / ptq.p10_ms:.3f}x | - | - |")
        print(f"\n{name}: subgraph mode tuned {r['seconds'] / max(s['seconds'], 1e-9):.1f}x faster than region mode "
              f"({s['seconds']:.0f} s vs {r['seconds']:.0f} s); its final model is {reg.p10_ms / sub.p10_ms:.3f}x "
              f"region mode's speed (p10; float {flt.p10_ms:.3f} ms)\n")


if __name__ == "__main__":
    main()
