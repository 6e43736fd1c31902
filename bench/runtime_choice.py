"""Which runtime ships, by measurement: `tune backend=auto` against each single-runtime run and the peers, per
model, in one interleaved run (p10 over rounds of timed runs, every model timed on the same real feed), with
each model's output error on feeds no one calibrated or checked on next to its speed.

Rows: ONNX Runtime fp32 (the reference), OpenVINO's own float (its default precision), our ONNX Runtime
run's shipped model (with its session settings), our OpenVINO run's (with its compile settings), auto's
pick (the winner's model and settings), ONNX Runtime's `quantize_static` u8 on ONNX Runtime, and NNCF's
`quantize` and `quantize_with_accuracy_control` on OpenVINO (bench/openvino_vs_nncf.py builds them the
same way). Every model comes from the same float ONNX and calibration feeds. Also printed: the tuning time
of auto against each single-runtime run (and the winner's), auto's race after PTQ (the runtimes it did not
tune, with their figures), and by how much auto's pick trails (or leads) the fastest single-runtime
shipped model.

    pip install -e ".[bench]"      # nncf, tokenizers
    python bench/runtime_choice.py --model digits --model resnet18 --model bert4 --model minilm
"""

from __future__ import annotations

import shutil
import sys
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from accuracy_vs_ort import run_tune  # noqa: E402
from openvino_vs_nncf import (  # noqa: E402
    CALIB,
    HOLDOUT,
    MODELS,
    backends,
    errors,
    feeds_for,
    nncf_models,
    ort_u8,
    run_models,
)

from pipeline.app.race import race_line  # noqa: E402

RUNS = ("onnxruntime", "openvino", "auto")
SINGLE_ROW = {"onnxruntime": 2, "openvino": 3}  # the row of each single-runtime run's shipped model
PEERS = ("ORT quantize_static", "NNCF")  # rows of peers' models (ours must load, or the bench fails)
MAX_ROUNDS, BENCH_SECONDS = 300, 20.0  # rounds at most; timed seconds (all rows) before the rounds may end


def tuned(key: str, root: Path, overrides: list[str]) -> dict[str, tuple[Path, float]]:
    """Each of our runs (backend=onnxruntime, openvino, auto) on the same model, from scratch (a results_dir
    left by an earlier bench would skip its stages and time nothing): its results_dir and seconds."""
    out = {}
    for name in RUNS:
        rd = root / name
        shutil.rmtree(rd, ignore_errors=True)
        err, seconds = run_tune(rd, "[export,quantize,autotune]",
                                [*overrides, f"backend={name}", f"quantize.calibration.batches={CALIB}",
                                 f"accuracy.holdout_batches={HOLDOUT}", "autotune.preset=quick"])
        if err:
            raise SystemExit(f"{key}: tune backend={name} failed: {err}")
        out[name] = (rd, seconds)
    return out


def shipped(rd: Path):
    """(backend with the settings it ships, shipped model, runtime name) of one of our runs."""
    from pipeline.app.api import shipped_runtime
    from pipeline.artifacts import Manifest
    from pipeline.backends import create_backend
    from tests.helpers import compose

    manifest = Manifest(rd)
    runtime = shipped_runtime(manifest)
    backend = create_backend(compose([f"backend={runtime}"]).backend)
    kind = backend.shipped_settings
    path = manifest.artifact(kind.artifact) if kind is not None else None
    if path is not None:
        backend = backend.with_settings(kind.type.load(path))
    return backend, manifest.artifact("autotune/optimized_final.onnx"), runtime


def bench(key: str, root: Path, rounds: int, runs: int) -> list[dict]:
    from pipeline.artifacts import sha256_file
    from pipeline.backends.ratios import timed_seconds
    from pipeline.backends.timing import TimingPlan, pooled, time_interleaved

    overrides, calib_hold, scored = feeds_for(key, root)
    ours = tuned(key, root, overrides)
    float_path = ours["auto"][0] / "export" / "model.onnx"
    # the exported model's inputs only (export binds model.fixed_inputs, e.g. silero-vad's sample rate)
    from pipeline.graph.model import input_specs, load_model
    from pipeline.graph.weights import own_folder

    with own_folder():  # its weights' hard links gone after: onnx.load (NNCF's peer) refuses linked data files
        names = {s.name for s in input_specs(load_model(float_path, check=False))}
    calib_hold = [{k: v for k, v in f.items() if k in names} for f in calib_hold]
    scored = [{k: v for k, v in f.items() if k in names} for f in scored]
    b = backends()
    picks = {name: shipped(rd) for name, (rd, _) in ours.items()}
    peers = nncf_models(float_path, calib_hold[:CALIB], calib_hold[CALIB:], MODELS[key][1], root)
    rows = [("ORT fp32", b["ort"], float_path), ("OpenVINO float (default precision)", b["ov"], float_path),
            ("ours, backend=onnxruntime", picks["onnxruntime"][0], picks["onnxruntime"][1]),
            ("ours, backend=openvino", picks["openvino"][0], picks["openvino"][1]),
            (f"ours, backend=auto (picked {picks['auto'][2]})", picks["auto"][0], picks["auto"][1]),
            ("ORT quantize_static u8 (on ORT)", b["ort"], ort_u8(float_path, calib_hold[:CALIB], root)),
            *[(f"{name} (on OpenVINO)", b["ov"], p) for name, p in peers.items()]]
    live = [(n, be, p) for n, be, p in rows if isinstance(p, Path)]
    failed: dict[str, str] = {}
    with ExitStack() as stack:
        prepared, kept = [], []
        for n, be, p in live:
            try:
                prepared.append(stack.enter_context(be.prepare(p)))
                kept.append((n, be, p))
            except Exception as exc:  # noqa: BLE001 - a peer's model its runtime cannot load is a row saying so
                if not n.startswith(PEERS):
                    raise
                failed[n] = f"failed to load: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        live = kept
        for pm in prepared:
            pm.set_timing_feeds(scored[0])
        names = list(prepared[0].output_names)
        errs = [errors(pm, prepared[0], scored, names, MODELS[key][2]) for pm in prepared]
        # at least ``rounds`` rounds, and more while the timed runs took under BENCH_SECONDS: a fast model's
        # latency switches between two levels within a second here, and ten 10 ms blocks may all catch one
        blocks, errs_t = time_interleaved(prepared, TimingPlan(
            MAX_ROUNDS, runs, 10, until=lambda b: max(map(len, b)) >= rounds and timed_seconds(b) >= BENCH_SECONDS))
        timings = pooled(blocks, errs_t, "mixed")
    ref = timings[0].p10_ms
    out = [{"model": key, "row": n, "p10_ms": t.p10_ms, "vs_ort_fp32": ref / t.p10_ms, "error": e}
           for (n, _, _), t, e in zip(live, timings, errs, strict=True)]
    out += [{"model": key, "row": n, "error": p} for n, _, p in rows if not isinstance(p, Path)]
    out += [{"model": key, "row": n, "error": why} for n, why in failed.items()]
    single = min(timings[2].p10_ms, timings[3].p10_ms)
    auto_be, auto_model, auto_rt = picks["auto"]
    same_be, same_model, _ = picks[auto_rt]
    # auto's pick is the deployment the single run of its runtime made (same model bytes, same settings),
    # or a different one (its own autotune chose another placement or settings: tuning variance)
    same = sha256_file(auto_model) == sha256_file(same_model) and auto_be.settings == same_be.settings
    # one deployment has one speed: where auto's pick is that single run's deployment, it takes that row's
    # timing, and how far its own row read from it is the bench's noise between identical deployments
    twin = timings[SINGLE_ROW[auto_rt]] if same else timings[4]
    out.append({"model": key, "row": "auto vs the fastest single-runtime shipped model",
                "auto_over_best": twin.p10_ms / single, "picked": auto_rt, "same_deployment": same,
                "identical_rows": timings[4].p10_ms / twin.p10_ms if same else None,
                "tuning_seconds": {n: round(s, 1) for n, (_, s) in ours.items()},
                "race": race_line(ours["auto"][0])})
    return out


def main() -> None:
    rows = run_models(bench, __doc__, "/tmp/qdq_runtime_choice")
    print("\n| model | row | p10 ms | vs ORT fp32 | error on unseen feeds |")
    print("|---|---|---:|---:|---|")
    for r in rows:
        if "p10_ms" in r:
            print(f"| {r['model']} | {r['row']} | {r['p10_ms']:.3f} | {r['vs_ort_fp32']:.2f}x | {r['error']} |")
        elif "auto_over_best" in r:
            t = r["tuning_seconds"]
            same = (f"the same deployment as backend={r['picked']}'s, whose row's timing it takes; its own "
                    f"row read {r['identical_rows']:.3f}x that one" if r["same_deployment"] else
                    f"a different deployment from backend={r['picked']}'s")
            print(f"| {r['model']} | auto picked {r['picked']}: {r['auto_over_best']:.3f}x the latency of the "
                  f"fastest single-runtime shipped model ({same}); tuned in {t['auto']} s vs {t['onnxruntime']} + "
                  f"{t['openvino']} s ({t['auto'] / t[r['picked']]:.2f}x backend={r['picked']}'s single run); "
                  f"{r['race'] or 'no race'} | | | |")
        else:
            print(f"| {r['model']} | {r['row']} | | | {r['error']} |")


if __name__ == "__main__":
    main()
