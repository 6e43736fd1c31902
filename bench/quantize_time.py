"""Quantize time side by side: our quantize stage against ONNX Runtime's `quantize_static` and NNCF's
`quantize`, on the same float ONNX and the same calibration feeds, per model, on this CPU; each quantized
model's output error on feeds none of them saw, next to its time.

Ours: `tune stages=[export,quantize] backend=<b> quantize.calibration.batches=8 accuracy.holdout_batches=8`
(its defaults otherwise: auto ranges, the held-out check, recovery where the budget is missed) for
backend onnxruntime, openvino and auto; the time is the quantize stage's own seconds from the manifest
(under auto, every runtime's together). ORT: `quantize_static` (QDQ, per-channel int8 weights, uint8
activations) on the 8 calibration feeds. NNCF: `nncf.quantize` of the same ONNX (its ONNX backend, whose
model every row's error is read on) and of the OpenVINO model converted from it (timed only; the conversion
is not counted), model_type TRANSFORMER for the encoders, subset_size 8.

Models:
- bert_base: a BERT-base encoder (12 layers, hidden 768, 12 heads, FFN 3072, vocabulary 30522, seq 128;
  outputs last_hidden_state [1, 128, 768] and pooler_output [1, 768]) with seeded random weights (for
  time; its accuracy figures say little), fed real token ids: English sentences from installed packages'
  metadata tokenized by all-MiniLM-L6-v2's tokenizer (the same bert-base-uncased vocabulary).
- minilm: the trained all-MiniLM-L6-v2 with two outputs (bench/trained_models.py, minilm_l6_2out), the
  same feeds; judged by the cosine of sentence_embedding.
- resnet50: torchvision's ResNet-50 architecture (`model=resnet50`, seeded weights), batch 1, 224x224,
  synthetic images.

    pip install -e ".[bench]"      # nncf, tokenizers
    python bench/quantize_time.py --model bert_base --model minilm --model resnet50
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from accuracy_vs_ort import run_tune  # noqa: E402
from openvino_vs_nncf import backends, errors, ort_u8  # noqa: E402

CALIB, HOLDOUT, SCORED = 8, 8, 4
OURS = ("onnxruntime", "openvino", "auto")
SEQ = 128
# model key -> (whether NNCF gets model_type=TRANSFORMER, the output the error is judged on or None)
MODELS = {"bert_base": (True, None), "minilm": (True, "sentence_embedding"), "resnet50": (False, None)}


def bert_base(path: Path) -> Path:
    """A BERT-base encoder with seeded random weights, exported once to ``path`` (inputs input_ids,
    attention_mask, token_type_ids [1, 128]; outputs last_hidden_state, pooler_output)."""
    if path.exists():
        return path
    import torch
    from torch import nn

    from tasks.export._models import EncoderLayer

    class Layer(EncoderLayer):
        def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # noqa: D102 - the mask's bias
            b, s, h = x.shape
            q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + bias
            ctx = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(b, s, h)
            x = self.ln1(x + self.attn_out(ctx))
            return self.ln2(x + self.ff2(self.act(self.ff1(x))))

    class BertBase(nn.Module):
        def __init__(self, vocab: int = 30522, hidden: int = 768, layers: int = 12, heads: int = 12,
                     intermediate: int = 3072):
            super().__init__()
            self.word, self.position = nn.Embedding(vocab, hidden), nn.Embedding(512, hidden)
            self.token_type = nn.Embedding(2, hidden)
            self.ln = nn.LayerNorm(hidden, eps=1e-12)
            self.layers = nn.ModuleList(Layer(hidden, heads, intermediate) for _ in range(layers))
            self.pooler = nn.Linear(hidden, hidden)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)

        def forward(self, input_ids, attention_mask, token_type_ids):
            pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
            x = self.ln(self.word(input_ids) + self.position(pos) + self.token_type(token_type_ids))
            bias = ((1.0 - attention_mask.to(torch.float32)) * -10000.0)[:, None, None, :]
            for layer in self.layers:
                x = layer(x, bias)
            return x, torch.tanh(self.pooler(x[:, 0]))

    torch.manual_seed(0)
    module = BertBase().eval()
    example = tuple(torch.ones(1, SEQ, dtype=torch.int64) for _ in range(3))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.onnx")
    with torch.no_grad():
        torch.onnx.export(module, example, str(tmp), dynamo=False, opset_version=17, do_constant_folding=True,
                          input_names=["input_ids", "attention_mask", "token_type_ids"],
                          output_names=["last_hidden_state", "pooler_output"])
    tmp.replace(path)
    return path


def write_feeds(feeds: list[dict], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for p in folder.glob("feed_*.npz"):
        p.unlink()
    for i, f in enumerate(feeds):
        np.savez(folder / f"feed_{i:04d}.npz", **f)


def model_and_feeds(key: str, root: Path) -> tuple[Path, list[str], list[dict]]:
    """(the float ONNX every row quantizes, our tune overrides, the feeds: calibration, holdout, scored)."""
    import trained_models as tm

    count = CALIB + HOLDOUT + SCORED
    if key in ("bert_base", "minilm"):
        feeds = tm.make_feeds("minilm_l6_2out", count)
        write_feeds(feeds, root / "feeds")
        shapes = "{input_ids: [1,128], attention_mask: [1,128], token_type_ids: [1,128]}"
        if key == "minilm":
            onnx_path = tm.fetch("minilm_l6_2out")
            metric = ["accuracy.outputs=[sentence_embedding]", "accuracy.metric=cosine", "accuracy.min_cosine=0.99"]
        else:
            onnx_path, metric = bert_base(root / "bert_base.onnx"), []
        return onnx_path, ["model=onnx", f"model.onnx_path={onnx_path}", f"model.input_shapes={shapes}",
                           "data=npz", f"data.path={root / 'feeds'}", *metric], feeds
    from pipeline.app.cli import open_dict_overrides
    from pipeline.data.adapters import DataProvider
    from pipeline.graph.model import input_specs, load_model
    from pipeline.graph.weights import own_folder
    from tests.helpers import compose

    overrides = ["model=resnet50", "model.batch_size=1", "model.input_size=224", "data=synthetic",
                 f"data.num_samples={count}"]
    rd = root / "export_only"
    err, _ = run_tune(rd, "[export]", overrides)
    if err:
        raise SystemExit(f"{key}: export failed: {err}")
    cfg = compose(open_dict_overrides([*overrides, f"results_dir={rd}"]))
    with own_folder():
        provider = DataProvider(cfg, input_specs(load_model(rd / "export" / "model.onnx")))
    feeds = [b.feeds for b in provider.batches("calibration", CALIB + HOLDOUT)]
    feeds += [b.feeds for b in provider.batches("evaluation", SCORED)]
    return rd / "export" / "model.onnx", overrides, feeds


def nncf_quantize(float_path: Path, calib: list[dict], transformer: bool, out: Path
                  ) -> tuple[Path | str, float, float | None]:
    """NNCF's quantize of the float ONNX (its ONNX backend: the model every row's error is read on) and of
    the OpenVINO model converted from it (its OpenVINO backend, timed only; the conversion is not counted):
    (the quantized ONNX or the error, its seconds, the OpenVINO backend's seconds or None)."""
    import nncf
    import onnx
    import openvino as ov

    kind = {"model_type": nncf.ModelType.TRANSFORMER} if transformer else {}
    t0 = time.perf_counter()
    try:
        q = nncf.quantize(onnx.load(str(float_path)), nncf.Dataset(calib), subset_size=len(calib), **kind)
    except Exception as exc:  # noqa: BLE001 - a peer that fails is a row saying so
        return f"failed: {type(exc).__name__}: {str(exc)[:200]}", time.perf_counter() - t0, None
    seconds = time.perf_counter() - t0
    onnx.save(q, str(out / "nncf.onnx"))
    del q
    model = ov.convert_model(str(float_path))
    t0 = time.perf_counter()
    try:
        nncf.quantize(model, nncf.Dataset(calib), subset_size=len(calib), **kind)
        ov_seconds: float | None = time.perf_counter() - t0
    except Exception:  # noqa: BLE001 - the ONNX row stands; the OpenVINO one is left out
        ov_seconds = None
    return out / "nncf.onnx", seconds, ov_seconds


def stage_seconds(rd: Path, stage: str) -> float | None:
    """The stage's seconds in ``rd``; under backend=auto without autotune (no top-level entry), every
    runtime's own together."""

    def seconds(path: Path) -> float | None:
        try:
            return float(json.loads(path.read_text())["stages"][stage]["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    top = seconds(rd / "manifest.json")
    if top is not None:
        return top
    subs = [t for p in sorted((rd / "runtimes").glob("*/manifest.json")) if (t := seconds(p)) is not None]
    return sum(subs) if subs else None


def ours(key: str, root: Path, overrides: list[str], backend: str) -> tuple[Path | str, float | None, str]:
    """Our quantize under ``backend``, from scratch (a skipped stage would report an earlier run's seconds):
    (the PTQ model or the error, the stage's seconds, the runtime it runs on)."""
    rd = root / backend
    shutil.rmtree(rd, ignore_errors=True)
    err, _ = run_tune(rd, "[export,quantize]", [*overrides, f"backend={backend}",
                                                f"quantize.calibration.batches={CALIB}",
                                                f"accuracy.holdout_batches={HOLDOUT}"])
    if err:
        return f"tune backend={backend} failed: {err}", None, backend
    runtime = backend
    model = rd / "quantize" / "quantized_model.onnx"
    if backend == "auto":  # the winner is chosen by autotune: the first runtime's PTQ model stands for it
        runtime = sorted(p.name for p in (rd / "runtimes").iterdir())[0]
        model = rd / "runtimes" / runtime / "quantize" / "quantized_model.onnx"
    return model, stage_seconds(rd, "quantize"), runtime


def bench(key: str, root: Path) -> list[dict]:
    transformer, judged = MODELS[key]
    float_path, overrides, feeds = model_and_feeds(key, root)
    calib, scored = feeds[:CALIB], feeds[CALIB + HOLDOUT:]
    rows: list[tuple[str, str, Path | str, float | None]] = []
    for backend in OURS:
        model, seconds, runtime = ours(key, root, overrides, backend)
        rows.append((f"ours (backend={backend})", runtime, model, seconds))
    t0 = time.perf_counter()
    ort_model = ort_u8(float_path, calib, root)
    rows.append(("ORT quantize_static", "onnxruntime", ort_model, time.perf_counter() - t0))
    nncf_model, nncf_s, nncf_ov_s = nncf_quantize(float_path, calib, transformer, root)
    rows.append(("NNCF quantize (ONNX model)", "openvino", nncf_model, nncf_s))
    if nncf_ov_s is not None:
        rows.append(("NNCF quantize (OpenVINO model; error not read)", "openvino", "-", nncf_ov_s))
    fastest_nncf = min(t for t in (nncf_s, nncf_ov_s) if t is not None)  # ratios against NNCF's faster path
    b = backends()
    on = {"onnxruntime": b["ort"], "openvino": b["ov_f32"]}
    out = []
    with ExitStack() as stack:
        ref = stack.enter_context(b["ort"].prepare(float_path))
        names = list(ref.output_names)
        for name, runtime, model, seconds in rows:
            row = {"model": key, "row": name, "seconds": round(seconds, 1) if seconds is not None else None,
                   "nncf_ratio": round(seconds / fastest_nncf, 2) if seconds is not None else None}
            if isinstance(model, Path):
                with on[runtime].prepare(model) as pm:
                    row["error"] = f"{errors(pm, ref, scored, names, judged)} on {runtime}"
            else:
                row["error"] = model
            out.append(row)
    return out


def main() -> None:
    from pipeline.quant.cpu import cpu_facts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", choices=sorted(MODELS))
    ap.add_argument("--results-root", default="/tmp/qdq_quantize_time")
    args = ap.parse_args()
    print(f"CPU: {cpu_facts().describe()}", flush=True)
    rows = []
    for key in args.model or list(MODELS):
        got = bench(key, Path(args.results_root) / key)
        for r in got:
            print(json.dumps(r), flush=True)
        rows += got
    print("\n| model | quantizer | seconds | vs NNCF's faster path | error on unseen feeds (vs ORT fp32) |")
    print("|---|---|---:|---:|---|")
    for r in rows:
        secs = f"{r['seconds']:.1f}" if r["seconds"] is not None else "-"
        ratio = f"{r['nncf_ratio']:.2f}x" if r["nncf_ratio"] is not None else "-"
        print(f"| {r['model']} | {r['row']} | {secs} | {ratio} | {r['error']} |")


if __name__ == "__main__":
    main()
