"""Accuracy as the user defines it, on a trained sentence encoder with two outputs.

all-MiniLM-L6-v2 exported with token_embeddings [1, 128, 384] and sentence_embedding [1, 384]
(bench/trained_models.py, key minilm_l6_2out), fed English sentences from installed packages'
metadata tokenized by its own tokenizer.json. Two runs of the same spec, `accuracy.metric=cosine
accuracy.min_cosine=0.99 autotune.preset=quick`:

- judged on every output (the default): the budget falls on token_embeddings;
- `accuracy.outputs=[sentence_embedding]`: judged on what the service reads.

The sentences are shuffled once (a fixed order); the first ``--feeds`` (96) are given to the
pipeline as calibration feeds, each seed in its own order: it calibrates on the first
quantize.calibration.batches (16) and holds out what accuracy.holdout_samples / holdout_fraction
size (32 here). The next ``--unseen`` sentences (64, the same for every seed) are scored here, never
seen by the pipeline. Each shipped model, with
the session settings it ships with (autotune/ort_session.json) and with ORT's default session, is
timed against the float model with ORT's defaults and with the same settings, in one interleaved
run on a real feed (p10; median in brackets); its sentence cosine with the float model on the
unseen feeds is reported (mean and min), and its outputs listed.

    pip install tokenizers
    python bench/user_accuracy.py --results-root /tmp/ua --only sentence --seeds 0 1 2
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

from accuracy_vs_ort import CALIB, run_tune, time_on_real_feed  # noqa: E402

from pipeline.records.autotune import AutotuneMetrics  # noqa: E402

KEY = "minilm_l6_2out"
VARIANTS = {"every output (default)": [], "accuracy.outputs=[sentence_embedding]": ["accuracy.outputs=[sentence_embedding]"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results-root", default="/tmp/qdq_user_accuracy")
    ap.add_argument("--feeds", type=int, default=96, help="calibration feeds given to the pipeline")
    ap.add_argument("--unseen", type=int, default=64, help="feeds scored here, never seen by the pipeline")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="calibration/holdout orders")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--only", choices=["all", "sentence"], help="run one of the two variants")
    args = ap.parse_args()

    import onnx
    import trained_models as tm

    from pipeline.accuracy.metrics import cosine_similarities
    from pipeline.app.cli import open_dict_overrides
    from pipeline.backends import create_backend
    from pipeline.backends.onnxruntime.session import SessionSettings, inference_session
    from pipeline.data.adapters import DataProvider
    from pipeline.graph.model import input_specs, load_model
    from tests.helpers import compose

    root = Path(args.results_root)
    info = tm.write_feeds(KEY, root / "all_feeds", args.feeds + args.unseen)
    # one fixed shuffle first, so that the calibration feeds and the unseen ones come from the same mix
    # of passages (the later feeds are later sentences of the same paragraphs)
    every = sorted(Path(info["folder"]).glob("feed_*.npz"))
    every = [every[i] for i in np.random.default_rng(2026).permutation(len(every))]
    eval_dir = _copy_feeds(every[args.feeds:], root / "eval_feeds")
    eval_feeds = [dict(np.load(p)) for p in sorted(eval_dir.glob("*.npz"))]
    rows = []
    for seed in args.seeds:
        order = np.random.default_rng(seed).permutation(args.feeds) if seed else np.arange(args.feeds)
        feeds = _copy_feeds([every[i] for i in order], root / f"feeds_seed{seed}")
        base = [*tm.overrides(KEY, feeds), f"data.eval_path={eval_dir}", f"quantize.calibration.batches={CALIB}",
                "autotune.preset=quick"]
        for label, extra in VARIANTS.items():
            if args.only and (args.only == "sentence") != bool(extra):
                continue
            rd = root / f"{'outputs_sentence' if extra else 'outputs_all'}_seed{seed}"
            err, took = run_tune(rd, "[export,quantize,autotune]", [*base, *extra])
            if err:
                rows.append({"variant": label, "seed": seed, "error": err})
                continue
            metrics = AutotuneMetrics.from_dict(json.loads((rd / "manifest.json").read_text())["stages"]["autotune"]
                                                ["metrics"], f"{rd}/manifest.json's autotune entry")
            shipped = rd / "autotune" / "optimized_final.onnx"
            float_path = rd / "export" / "model.onnx"
            names = [o.name for o in onnx.load(str(shipped), load_external_data=False).graph.output]
            ref, got = inference_session(float_path), inference_session(shipped)
            cos = [float(cosine_similarities(ref.run(["sentence_embedding"], f)[0],
                                             got.run(["sentence_embedding"], f)[0])[0]) for f in eval_feeds]
            cfg = compose(open_dict_overrides([*base, *extra, f"results_dir={rd}", f"backend.timing_runs={args.runs}"]))
            provider = DataProvider(cfg, input_specs(load_model(float_path)))
            settings = SessionSettings.load(rd / "autotune" / "ort_session.json")
            t_float, t_float_same, t_default, t_shipped = time_on_real_feed(
                create_backend(cfg.backend), [float_path, float_path, shipped, shipped], provider, args.rounds,
                args.runs, settings=[SessionSettings(), settings, SessionSettings(), settings])
            rows.append({"variant": label, "seed": seed, "shipped": metrics.shipped, "outputs": names,
                         "float_nodes": len(metrics.search.float_nodes), "session": settings.describe(),
                         "p10": t_float.p10_ms / t_shipped.p10_ms, "median": t_float.median_ms / t_shipped.median_ms,
                         "p10_default_session": t_float.p10_ms / t_default.p10_ms,
                         "p10_same_session": t_float_same.p10_ms / t_shipped.p10_ms,
                         "cos_mean": float(np.mean(cos)), "cos_min": float(np.min(cos)), "verdict":
                         metrics.accuracy.final.what if metrics.accuracy.final else "", "tuning_s": took})
            print(json.dumps(rows[-1]), flush=True)

    print(f"\n{tm.MODELS[KEY]['description']}; {args.feeds} calibration feeds, scored on {len(eval_feeds)} unseen feeds; "
          f"{args.rounds} x {args.runs} interleaved runs vs float (ORT default session)\n")
    print("| judged | seed | shipped | outputs kept | nodes float | session settings | vs float, p10 (median) | "
          "same, ORT default session | vs float with the same settings | sentence cosine mean (min) | "
          "verdict on the holdout |")
    print("|---|---:|---|---|---:|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['seed']} | failed: {r['error']} | | | | | | | | |")
            continue
        print(f"| {r['variant']} | {r['seed']} | {r['shipped']} | {', '.join(r['outputs'])} | {r['float_nodes']} | {r['session']} | "
              f"{r['p10']:.2f}x ({r['median']:.2f}x) | {r['p10_default_session']:.2f}x | {r['p10_same_session']:.2f}x | "
              f"{r['cos_mean']:.4f} ({r['cos_min']:.4f}) | {r['verdict']} |")


def _copy_feeds(paths: list[Path], folder: Path) -> Path:
    """``paths`` copied into ``folder`` as feed_0000.npz, ... in the given order (earlier feeds removed)."""
    folder.mkdir(parents=True, exist_ok=True)
    for p in folder.glob("*.npz"):
        p.unlink()
    for i, p in enumerate(paths):
        (folder / f"feed_{i:04d}.npz").write_bytes(p.read_bytes())
    return folder


if __name__ == "__main__":
    main()
