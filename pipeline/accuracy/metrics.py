"""Output-fidelity metrics (top-k, agreement, cosine, SNR) and a batch-by-batch accumulator, shared by
evaluate (float vs quantized models) and the accuracy budget of quantize and autotune.

Every function takes whole (padded) batches plus ``valid``, the number of real samples at the front
of the batch: DataProvider pads the last batch by repeating its last sample, and those copies must
not count. Arrays whose first dimension is not the batch size (batch-independent outputs) are used
whole. Sums are kept in float64 so that long evaluations do not lose precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.accuracy.confidence import SampleScores, snr_db_of
from pipeline.accuracy.scores import OutputScores, Scores


def valid_rows(a: np.ndarray, valid: int | None, batch: int | None = None) -> np.ndarray:
    """The first ``valid`` samples of ``a`` when its first axis is the batch axis, else ``a`` itself."""
    if valid is None or a.ndim == 0:
        return a
    if batch is not None and a.shape[0] != batch:
        return a
    return a[:valid]


def _is_float(a: np.ndarray) -> bool:
    return np.issubdtype(a.dtype, np.floating)


def predictions(output: np.ndarray) -> np.ndarray | None:
    """Predicted class per sample (and per position for [N, ..., C] outputs), or None if undefined.

    Float outputs of shape [N, C] or [N, S, C] (per-sample or per-position class scores) are scores
    over the last axis; an integer output is taken as ids already (a model that ends in ArgMax). A
    float output with one value per sample has no argmax to agree on, and neither has a map of rank
    4 or more ([N, 1, H, W] detection probabilities: an argmax over image columns means nothing).
    """
    if not _is_float(output):
        return output
    return np.argmax(output, axis=-1) if _class_scores(output) else None


def _class_scores(output: np.ndarray) -> bool:
    """Float scores over the last axis, per sample ([N, C]) or per position ([N, S, C])."""
    return _is_float(output) and output.ndim in (2, 3)


def topk_hits(logits: np.ndarray, labels: np.ndarray, k: int, valid: int | None = None) -> int:
    """Samples among the first ``valid`` whose label is among the ``k`` highest scores."""
    logits = valid_rows(logits, valid)
    labels = valid_rows(labels.reshape(-1), valid)
    if logits.ndim != 2 or logits.shape[0] != labels.shape[0]:
        raise ValueError(f"top-k needs [N, classes] scores and N labels, got {logits.shape} and {labels.shape}")
    if k > logits.shape[1]:
        raise ValueError(f"top-{k} needs at least {k} classes, the output has {logits.shape[1]}")
    if k == 1:
        top = np.argmax(logits, axis=1)[:, None]
    else:
        top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    return int(np.sum(np.any(top == labels.astype(np.int64)[:, None], axis=1)))


def _per_sample(counts: np.ndarray, valid: int) -> np.ndarray:
    """Per-position counts [valid, ...] summed to one value per sample; counts that are not
    batch-major (one prediction for the whole batch) go to the batch's first sample."""
    if counts.ndim and counts.shape[0] == valid:
        return counts.reshape(valid, -1).sum(axis=1).astype(np.float64)
    out = np.zeros(valid, dtype=np.float64)
    if valid:
        out[0] = float(np.sum(counts))
    return out


def agreement_per_sample(reference: np.ndarray, test: np.ndarray, valid: int) -> tuple[np.ndarray, np.ndarray]:
    """(agreeing, compared) predictions of ``test`` vs ``reference`` per valid sample (zeros where
    the outputs hold no class scores)."""
    ref_pred, test_pred = predictions(reference), predictions(test)
    if ref_pred is None or test_pred is None:
        return np.zeros(valid), np.zeros(valid)
    batch = reference.shape[0] if reference.ndim else None
    ref_pred = valid_rows(ref_pred, valid, batch)
    test_pred = valid_rows(test_pred, valid, batch)
    return _per_sample(ref_pred == test_pred, valid), _per_sample(np.ones(ref_pred.shape, bool), valid)


def cosine_similarities(reference: np.ndarray, test: np.ndarray, valid: int | None = None) -> np.ndarray:
    """Cosine similarity per valid sample of the flattened outputs.

    Two all-zero samples are identical (1.0); a zero sample against a non-zero one scores 0.0.
    """
    batch = reference.shape[0] if reference.ndim else None
    r = valid_rows(reference, valid, batch).astype(np.float64)
    t = valid_rows(test, valid, batch).astype(np.float64)
    if r.ndim < 2:  # one value per sample, or batch-independent: treat the whole array as one sample
        r, t = r.reshape(1, -1), t.reshape(1, -1)
    r, t = r.reshape(r.shape[0], -1), t.reshape(t.shape[0], -1)
    nr, nt = np.linalg.norm(r, axis=1), np.linalg.norm(t, axis=1)
    dot = np.sum(r * t, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = dot / (nr * nt)
    both_zero = (nr == 0) & (nt == 0)
    one_zero = (nr == 0) ^ (nt == 0)
    cos = np.where(both_zero, 1.0, np.where(one_zero, 0.0, cos))
    return np.clip(cos, -1.0, 1.0)


DECISIVE_MARGIN = 0.5
# in ModelScores.class_outputs: "the first output, when its shape says so" (the default guess)
FIRST_OUTPUT = "*first*"


def decisive_per_sample(reference: np.ndarray, test: np.ndarray, valid: int,
                        margin: float = DECISIVE_MARGIN) -> tuple[np.ndarray, np.ndarray]:
    """(agreeing, compared) predictions per valid sample over the positions whose float top-1 score
    leads the runner-up by at least ``margin`` x the RMS of that sample's scores."""
    if not _class_scores(reference) or reference.shape[-1] < 2 or not _is_float(test):
        return np.zeros(valid), np.zeros(valid)
    batch = reference.shape[0]
    r = valid_rows(reference, valid, batch).astype(np.float64)
    t = valid_rows(test, valid, batch)
    top2 = np.partition(r, -2, axis=-1)[..., -2:]  # the runner-up in place, the top after it
    rms = np.sqrt(np.mean(r * r, axis=-1))
    decisive = (top2[..., 1] - top2[..., 0]) >= margin * rms
    same = np.argmax(r, axis=-1) == np.argmax(t, axis=-1)
    return _per_sample(same & decisive, valid), _per_sample(decisive, valid)


def energies_per_sample(reference: np.ndarray, test: np.ndarray, valid: int) -> tuple[np.ndarray, np.ndarray]:
    """(sum of reference^2, sum of (test - reference)^2) per valid sample, in float64; an output that
    is not batch-major has its energies spread evenly over the batch's samples."""
    batch = reference.shape[0] if reference.ndim else None
    r = valid_rows(reference, valid, batch).astype(np.float64)
    t = valid_rows(test, valid, batch).astype(np.float64)
    if r.ndim and r.shape[0] == valid:
        r2, t2 = r.reshape(valid, -1), t.reshape(valid, -1)
        return np.sum(r2 * r2, axis=1), np.sum((t2 - r2) ** 2, axis=1)
    share = 1.0 / max(valid, 1)
    return np.full(valid, float(np.sum(r * r)) * share), np.full(valid, float(np.sum((t - r) ** 2)) * share)


def snr_from_energies(signal: float, noise: float) -> float:
    """10 log10(signal / noise) in dB; +inf when there is no noise (identical outputs)."""
    return float(snr_db_of(np.float64(signal), np.float64(noise)))


def db_text(x: float | None) -> str:
    """An SNR for messages: "12.3 dB", "inf dB" (identical outputs) or "n/a"."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else (
        "inf dB" if x == math.inf else f"{x:.1f} dB")


def energies(reference: np.ndarray, test: np.ndarray, valid: int | None = None) -> tuple[float, float]:
    """(sum of reference^2, sum of (test - reference)^2) over the valid samples, in float64."""
    batch = reference.shape[0] if reference.ndim else 1
    signal, noise = energies_per_sample(reference, test, batch if valid is None else valid)
    return float(signal.sum()), float(noise.sum())


def snr_db(reference: np.ndarray, test: np.ndarray, valid: int | None = None) -> float:
    return snr_from_energies(*energies(reference, test, valid))


def json_safe(obj: Any) -> Any:
    """Replace inf/nan floats with None: strict JSON has no Infinity or NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


@dataclass
class ModelScores:
    """Running totals for one model compared with the float model over the evaluation batches."""

    top_k: int = 5
    samples: int = 0
    labelled: int = 0  # samples whose labels could be scored against the first output
    top1_hits: int = 0
    topk_hits: int = 0
    topk_possible: bool = True
    agree: int = 0
    compared: int = 0
    signal: list[float] = field(default_factory=list)  # per output
    noise: list[float] = field(default_factory=list)
    cosine_sums: list[float] = field(default_factory=list)  # per output (float outputs only)
    cosine_counts: list[int] = field(default_factory=list)
    float_outputs: list[bool] = field(default_factory=list)
    # top-1 agreement on the samples whose float top-1 leads its runner-up by at least DECISIVE_MARGIN
    # of the sample's score RMS: near-tied scores (random-weight classifiers) flip on any noise and say
    # nothing about the model; a flip of a clear decision does
    decisive_agree: int = 0
    decisive_compared: int = 0
    output_names: list[str] = field(default_factory=list)  # optional, for verdicts that name an output
    # the outputs that hold class scores (agreement is counted on them); None: the first output, when
    # its shape says so ([N, C] or [N, S, C] floats, or integer ids)
    class_outputs: list[str] | None = None
    # per output, for the class outputs: [agreeing, compared, decisive agreeing, decisive compared]
    agreement_counts: list[list[int]] = field(default_factory=list)
    custom: float | None = None  # accuracy.custom_metric's score, set by whoever computed it
    per_sample: SampleScores = field(default_factory=SampleScores)  # for the verdicts' confidence bounds
    keep_samples: bool = True  # False: totals only (a verdict on the value, not on a bound)

    def classes(self, count: int) -> list[int]:
        """Indices of the outputs treated as class scores, the first one being the labels' output
        (FIRST_OUTPUT in class_outputs: the first output, when its shape says so)."""
        if self.class_outputs is None:
            return [0]
        out = [0 if n == FIRST_OUTPUT else self.output_names.index(n) for n in self.class_outputs
               if n == FIRST_OUTPUT or n in self.output_names[:count]]
        return list(dict.fromkeys(out))

    def update(self, reference: list[np.ndarray], outputs: list[np.ndarray], labels: np.ndarray | None,
               valid: int) -> None:
        """Add one batch: ``reference`` are the float model's outputs on the same feeds."""
        self.samples += valid
        classes = self.classes(len(outputs))
        first = outputs[classes[0]] if classes else None
        labelled = first is not None and labels is not None and _is_float(first) and first.ndim == 2 \
            and labels.size == first.shape[0]
        if labelled:
            self.labelled += valid
            self.top1_hits += topk_hits(first, labels, 1, valid)
            if self.top_k > 1 and first.shape[1] >= self.top_k:
                self.topk_hits += topk_hits(first, labels, self.top_k, valid)
            else:
                self.topk_possible = False
        if not self.signal:
            k = len(outputs)
            self.signal, self.noise = [0.0] * k, [0.0] * k
            self.cosine_sums, self.cosine_counts = [0.0] * k, [0] * k
            self.float_outputs = [_is_float(r) for r in reference]
            self.agreement_counts = [[0, 0, 0, 0] for _ in range(k)]
        columns = self._columns(reference, outputs, classes, valid)
        for i in range(len(outputs)):
            counts = self.agreement_counts[i]
            for j, name in enumerate(("agree", "compared", "decisive_agree", "decisive")):
                counts[j] += int(columns[name][:, i].sum())
            self.signal[i] += float(columns["signal"][:, i].sum())
            self.noise[i] += float(columns["noise"][:, i].sum())
            if self.float_outputs[i]:
                self.cosine_sums[i] += float(columns["cosine"][:, i].sum())
                self.cosine_counts[i] += valid
        if classes:
            self.agree, self.compared, self.decisive_agree, self.decisive_compared = \
                self.agreement_counts[classes[0]]
        drop = None
        if labelled:
            hit = np.argmax(valid_rows(first, valid), axis=1) == labels.reshape(-1)[:valid]
            ref_hit = np.argmax(valid_rows(reference[classes[0]], valid), axis=1) == labels.reshape(-1)[:valid]
            drop = ref_hit.astype(np.float64) - hit
        if self.keep_samples:
            self.per_sample.add(columns, drop)

    @staticmethod
    def _columns(reference: list[np.ndarray], outputs: list[np.ndarray], classes: list[int],
                 valid: int) -> dict[str, np.ndarray]:
        """One batch's per-sample values, each [valid, outputs]."""
        cols: dict[str, list[np.ndarray]] = {n: [] for n in ("signal", "noise", "cosine", "agree", "compared",
                                                              "decisive_agree", "decisive")}
        zeros = np.zeros(valid)
        for i, (r, o) in enumerate(zip(reference, outputs, strict=True)):
            for name, v in zip(("signal", "noise"), energies_per_sample(r, o, valid), strict=True):
                cols[name].append(v)
            cos = cosine_similarities(r, o, valid) if _is_float(r) else np.full(valid, np.nan)
            cols["cosine"].append(cos if cos.size == valid else np.full(valid, float(np.mean(cos))))
            pairs = (agreement_per_sample(r, o, valid), decisive_per_sample(r, o, valid)) if i in classes \
                else ((zeros, zeros), (zeros, zeros))
            for name, v in zip(("agree", "compared", "decisive_agree", "decisive"), (*pairs[0], *pairs[1]),
                               strict=True):
                cols[name].append(v)
        return {n: np.stack(v, axis=1) if v else np.zeros((valid, 0)) for n, v in cols.items()}

    def scores(self) -> Scores:
        """What was accumulated, as plain floats; a score that does not apply is None. SNR may be +inf."""
        accuracy = self.labelled > 0 and self.labelled == self.samples
        count = len(self.signal)
        named = bool(self.output_names) and len(self.output_names) == count
        outputs = tuple(self._output(i, named) for i in range(count))
        labels = self.output_names if named else list(range(count))
        return Scores(
            samples=self.samples, top1=self.top1_hits / self.labelled if accuracy else None, top_k=self.top_k,
            topk=self.topk_hits / self.labelled if self.top_k > 1 and accuracy and self.topk_possible else None,
            agreement=self.agree / self.compared if self.compared else None,
            cosine=outputs[0].cosine if outputs else None, snr_db=snr_from_energies(sum(self.signal), sum(self.noise)),
            decisive_agreement=self.decisive_agree / self.decisive_compared if self.decisive_compared else None,
            decisive_samples=self.decisive_compared,
            identical_outputs=bool(self.noise) and all(n == 0.0 for n in self.noise), outputs=outputs,
            class_outputs=tuple(labels[i] for i in self.classes(count)
                                if self.agreement_counts and self.agreement_counts[i][1]),
            per_sample=self.per_sample if self.keep_samples else None)

    def _output(self, i: int, named: bool) -> OutputScores:
        """Output ``i``'s scores; agreement and decisive agreement on the class outputs only."""
        agree, compared, decisive_agree, decisive = self.agreement_counts[i]
        counted = compared > 0
        return OutputScores(
            name=self.output_names[i] if named else None,
            snr_db=snr_from_energies(self.signal[i], self.noise[i]),
            cosine=self.cosine_sums[i] / self.cosine_counts[i] if self.float_outputs[i] and self.cosine_counts[i] else None,
            is_float=self.float_outputs[i], agreement=agree / compared if counted else None,
            decisive_agreement=decisive_agree / decisive if counted and decisive else None,
            decisive_samples=decisive if counted else None)

    def result(self) -> dict[str, Any]:
        """``scores()`` in its dict form (metrics.json's per-model scores)."""
        return self.scores().to_dict()
