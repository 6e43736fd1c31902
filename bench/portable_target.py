"""What a deployment right on every x86 CPU kind costs on the host: `tune target=host` against
`tune target.cpus=[avx2,avx512,avx512_vnni,amx]`, both `backend=auto`, per model, side by side in one
interleaved run (p10 over rounds of timed runs, ONNX Runtime fp32 as the reference), with each pick's
output error on feeds no one calibrated or checked on, natively and under `qemu-x86_64 -cpu Haswell` (an
AVX2 CPU without VNNI, where u8 x s8 kernels saturate), and each pick's own verdict per CPU kind (the
manifest's checked_on: run here, Q/DQ math, or the saturating twin). Also printed: each run's tuning time.

    apt-get install qemu-user; pip install -e ".[bench]"
    python bench/portable_target.py --model digits --model bert4 --model minilm --feeds 2
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import emulated_accuracy  # noqa: E402
from accuracy_vs_ort import run_tune  # noqa: E402
from openvino_vs_nncf import CALIB, HOLDOUT, MODELS, backends, errors, feeds_for  # noqa: E402
from runtime_choice import BENCH_SECONDS, MAX_ROUNDS, shipped  # noqa: E402

TARGETS = {"host": [], "x86": ["target.cpus=[avx2,avx512,avx512_vnni,amx]"]}


def kinds_of(rd: Path) -> str:
    """The pick's verdict per CPU kind, as its run recorded it: e.g. 'avx2 ok, amx ok'."""
    from pipeline.artifacts import Manifest
    from pipeline.records.stages import shipped_record

    record = shipped_record(Manifest(rd))
    if record is None:
        return "not recorded"
    return ", ".join(f"{k.kind} {'ok' if k.ok else 'not judged' if k.ok is None else 'MISSES'}" for k in record.kinds)


def bench(key: str, root: Path, rounds: int, runs: int, feeds: int, timeout: float) -> list[dict]:
    from pipeline.backends.ratios import timed_seconds
    from pipeline.backends.timing import TimingPlan, pooled, time_interleaved
    from pipeline.quant.cpu import cpu_facts

    overrides, _, scored = feeds_for(key, root)
    seconds = {}
    for name, extra in TARGETS.items():
        err, seconds[name] = run_tune(root / name, "[export,quantize,autotune]",
                                      [*overrides, "backend=auto", f"quantize.calibration.batches={CALIB}",
                                       f"accuracy.holdout_batches={HOLDOUT}", "autotune.preset=quick", *extra])
        if err:
            raise SystemExit(f"{key}: tune {' '.join(extra) or 'target=host'} failed: {err}")
    float_path = root / "host" / "export" / "model.onnx"
    picks = {name: shipped(root / name) for name in TARGETS}
    rows = [("ORT fp32", backends()["ort"], float_path),
            *[(f"target={name} (picked {picks[name][2]})", picks[name][0], picks[name][1]) for name in TARGETS]]
    with ExitStack() as stack:
        prepared = [stack.enter_context(be.prepare(p)) for _, be, p in rows]
        names = list(prepared[0].output_names)
        specs = {s.name for s in prepared[0].specs}
        scored = [{k: v for k, v in f.items() if k in specs} for f in scored]
        for pm in prepared:
            pm.set_timing_feeds(scored[0])
        errs = [errors(pm, prepared[0], scored, names, MODELS[key][2]) for pm in prepared]
        blocks, errs_t = time_interleaved(prepared, TimingPlan(
            MAX_ROUNDS, runs, 10, until=lambda b: max(map(len, b)) >= rounds and timed_seconds(b) >= BENCH_SECONDS))
        timings = pooled(blocks, errs_t, "mixed")
    ref = timings[0].p10_ms
    out = [{"model": key, "row": n, "p10_ms": t.p10_ms, "vs_ort_fp32": ref / t.p10_ms, "error": e,
            "cpu": cpu_facts().describe()} for (n, _, _), t, e in zip(rows, timings, errs, strict=True)]
    for row, name in zip(out[1:], TARGETS, strict=True):
        row.update(tuning_s=round(seconds[name], 1), kinds=kinds_of(root / name))
    emulated = {r["run"]: r for r in emulated_accuracy.bench(key, root, feeds, timeout, list(TARGETS))}
    for row, name in zip(out[1:], TARGETS, strict=True):
        row["emulated_avx2"] = emulated[name]["emulated"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", choices=sorted(MODELS), required=True)
    ap.add_argument("--results-root", type=Path, default=Path("/tmp/qdq_portable_target"))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--feeds", type=int, default=2, help="unseen feeds per model under the emulator (slow)")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per emulated model")
    args = ap.parse_args()
    rows = []
    for key in args.model:
        got = bench(key, args.results_root / key, args.rounds, args.runs, args.feeds, args.timeout)
        for r in got:
            print(json.dumps(r), flush=True)
        rows += got
    print(f"\nCPU: {rows[0]['cpu']}\n")
    print("| model | row | p10 ms | vs ORT fp32 | error, this CPU | error, emulated AVX2 | verdict per kind | tuning s |")
    print("|---|---|---:|---:|---|---|---|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['row']} | {r['p10_ms']:.3f} | {r['vs_ort_fp32']:.2f}x | {r['error']} | "
              f"{r.get('emulated_avx2', '')} | {r.get('kinds', '')} | {r.get('tuning_s', '')} |")


if __name__ == "__main__":
    main()
