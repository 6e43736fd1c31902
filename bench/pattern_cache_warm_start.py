"""Warm start: a sibling model tuned with another run's pattern cache needs fewer schemes.

Tunes model A (bert_tiny, 2 layers), then its sibling B (3 layers: the same patterns, one more
layer) twice: cold, and warm with A's autotuner_state_pattern_cache.yaml. All three runs start
without the QDQ-baseline seeds (autotune.import_qdq_baseline=false), so the search has to find the
placements itself. For each run it prints the
measurements made (patterns found in the cache get autotune.warm_start_budget of the scheme budget)
and how many schemes were measured before each committed scheme was first measured; then the two
final models of B are measured side by side to show they reach the same latency.

    python bench/pattern_cache_warm_start.py
    python bench/pattern_cache_warm_start.py --extra model.batch_size=8
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def tune(rd: Path, overrides: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "pipeline.app.cli", "stages=[export,quantize,autotune]", f"results_dir={rd}",
                    "progress=false", *overrides], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def counts(rd: Path) -> tuple[int, int]:
    """(measurements in total, schemes measured until the committed one was first measured)."""
    doc = yaml.safe_load((rd / "autotune" / "autotuner_state.yaml").read_text())
    total = reach = 0
    for p in doc["patterns"].values():
        recs = p["records"]
        total += sum(len(r["measurements"]) for r in recs)
        best = p.get("best")
        idx = next((i for i, r in enumerate(recs) if r["scheme"] == best), len(recs) - 1)
        reach += idx + 1
    return total, reach


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--extra", nargs="*", default=[], help="more tune overrides for all runs")
    ap.add_argument("--root", default=None)
    args = ap.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="bench_cache_"))
    # no QDQ-baseline seeds: the search has to find placements itself, which is what a cache saves
    common = ["model=bert_tiny", "autotune.preset=quick", "autotune.import_qdq_baseline=false", *args.extra]
    a, cold, warm = root / "a", root / "b_cold", root / "b_warm"
    tune(a, [*common, "model.num_layers=2"])
    cache = a / "autotune" / "autotuner_state_pattern_cache.yaml"
    tune(cold, [*common, "model.num_layers=3"])
    tune(warm, [*common, "model.num_layers=3", f"autotune.pattern_cache={cache}"])

    from pipeline.backends import compare_interleaved, create_backend
    from pipeline.backends.timing import TimingPlan
    from tests.helpers import compose

    backend = create_backend(compose([*common, "model.num_layers=3"]).backend)
    t_float, t_cold, t_warm = compare_interleaved(
        backend, [cold / "export" / "model.onnx", cold / "autotune" / "optimized_final.onnx",
                  warm / "autotune" / "optimized_final.onnx"], TimingPlan(10, 20, backend.warmup_runs))
    (c_total, c_reach), (w_total, w_reach) = counts(cold), counts(warm)
    print(f"\nsibling model B = bert_tiny 3 layers {' '.join(args.extra)}; cache from A = 2 layers ({cache})")
    print(f"{'run':10s} {'measurements':>13s} {'schemes to reach final':>23s} {'final p10 ms':>13s} {'vs float':>9s}")
    print(f"{'cold':10s} {c_total:13d} {c_reach:23d} {t_cold.p10_ms:13.3f} {t_float.p10_ms / t_cold.p10_ms:8.2f}x")
    print(f"{'warm':10s} {w_total:13d} {w_reach:23d} {t_warm.p10_ms:13.3f} {t_float.p10_ms / t_warm.p10_ms:8.2f}x")
    print(f"\nwarm start: {w_total} measurements instead of {c_total} ({c_total / max(w_total, 1):.2f}x fewer), "
          f"final placement reached after {w_reach} schemes instead of {c_reach}; "
          f"final latency warm/cold = {t_warm.p10_ms / t_cold.p10_ms:.3f} (p10, same interleaved run)")


if __name__ == "__main__":
    main()
