"""Confidence in a latency ratio measured in paired rounds (``time_interleaved``): each round's
candidate/reference ratio of best runs, and the t interval of their mean log ratio. Autotune's paired
measurements, the runtime-settings search, the float-precision check and ``backend=auto``'s choice share it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# a sequential measurement runs at least this many rounds before its interval may end it
MIN_ROUNDS = 3
# two-sided 95% Student t quantiles for 1..10 degrees of freedom (the last one beyond: conservative)
_T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23)


def chain_interval(steps: Sequence[Sequence[float]]) -> tuple[float, float]:
    """95% confidence interval of a product of ratios, each from its own per-round ratios (a chain of
    paired steps: A/B from one, B/C from the next); the t quantile of the fewest rounds, so it errs
    wide. (1, 1) for no steps: a model against itself."""
    if not steps:
        return 1.0, 1.0
    if any(len(r) < 2 for r in steps):
        return 0.0, math.inf
    logs = [np.log(np.asarray(r, dtype=np.float64)) for r in steps]
    mean = sum(float(np.mean(x)) for x in logs)
    se = math.sqrt(sum(float(np.var(x, ddof=1)) / len(x) for x in logs))
    half = _T95[min(min(len(x) for x in logs) - 2, len(_T95) - 1)] * se
    return math.exp(mean - half), math.exp(mean + half)


def ratio_interval(ratios: Sequence[float]) -> tuple[float, float]:
    """95% confidence interval of a candidate/reference ratio from its per-round ratios (t interval of
    the mean log ratio); (0, inf) from fewer than two rounds."""
    return chain_interval([ratios])


def sequential_verdict(ratios: Sequence[float], threshold: float, min_rounds: int = MIN_ROUNDS) -> str | None:
    """"below" or "above" once ``min_rounds`` rounds are in and the ratio's interval lies entirely on
    that side of ``threshold``; None while it straddles it."""
    if len(ratios) < max(min_rounds, 2):
        return None
    low, high = ratio_interval(ratios)
    return "below" if high < threshold else "above" if low > threshold else None


def round_ratios(ref_blocks: list[list[float]], cand_blocks: list[list[float]]) -> list[float]:
    """Per round, the candidate's best run over the reference's best run (spikes removed)."""
    return [min(c) / min(r) for r, c in zip(ref_blocks, cand_blocks, strict=False) if min(r) > 0]


# an undecided duel goes on past its rounds while they are cheap: up to CHEAP_ROUNDS rounds in all, as
# long as its timed runs so far took less than CHEAP_SECONDS (a model of a tenth of a millisecond
# spreads more from round to round than 12 rounds can resolve, and 64 of its rounds take about a second)
CHEAP_ROUNDS, CHEAP_SECONDS = 64, 2.0


def timed_seconds(blocks: list[list[list[float]]]) -> float:
    """The seconds the timed runs of ``time_interleaved``'s blocks took, all models together."""
    return sum(sum(block) for model in blocks for block in model) / 1000.0


def clear_leader(blocks: list[list[list[float]]]) -> bool:
    """Whether, after at least MIN_ROUNDS complete rounds that took CHEAP_SECONDS or more, the deployment
    with the lowest p10 so far is clearly faster than every other one still timed (``sequential_verdict``
    of each ratio leader/other below 1): more rounds would not change which one is fastest. Cheap rounds
    all run: a fast model's latency switches between levels within a second here, so its few first
    rounds may all catch one level. A deployment that dropped out (fewer blocks) is not compared."""
    rounds = max((len(b) for b in blocks), default=0)
    live = [i for i, b in enumerate(blocks) if len(b) == rounds]
    if rounds < MIN_ROUNDS or len(live) < 2 or timed_seconds(blocks) < CHEAP_SECONDS:
        return False
    lead = min(live, key=lambda i: _p10(blocks[i]))
    return all(sequential_verdict(round_ratios(blocks[i], blocks[lead]), 1.0) == "below" for i in live if i != lead)


def _p10(model_blocks: list[list[float]]) -> float:
    """The p10 of one model's timed runs over all its blocks."""
    return float(np.percentile([t for b in model_blocks for t in b], 10))


# a fast model's latency switches between levels up to this factor apart within a second (silero-vad's float
# on Zen 4: 0.09 or 0.13 ms per block), so rounds that took under CHEAP_SECONDS may all have caught one level:
# from them a runtime is judged out of reach only where its ratio clears the bar by more than this factor
LEVEL_SPREAD = 1.5


def _group_bests(blocks: list[list[list[float]]], group: Sequence[int], rounds: int) -> list[float] | None:
    """Per round, the best run of a group's deployments that ran every round (None: none did)."""
    live = [i for i in group if len(blocks[i]) == rounds]
    return [min(min(blocks[i][r]) for i in live) for r in range(rounds)] if live else None


def race_decided(blocks: list[list[list[float]]], groups: Sequence[Sequence[int]], bar: float) -> bool:
    """Whether a race of runtimes is decided: each runtime is a group of deployments (indices into
    ``time_interleaved``'s blocks) and its latency per round the best of them; once MIN_ROUNDS complete
    rounds are in, every runtime but the fastest (lowest p10) must be clearly within ``bar`` times the
    fastest's latency (kept: a wrong keep costs tuning time only) or clearly beyond it (out of reach:
    ``sequential_verdict``), beyond by more than LEVEL_SPREAD while the rounds were cheap (under
    CHEAP_SECONDS). A runtime whose deployments all dropped out is not waited for."""
    rounds = max((len(b) for b in blocks), default=0)
    if rounds < MIN_ROUNDS:
        return False
    bests = [b for b in (_group_bests(blocks, g, rounds) for g in groups) if b is not None]
    if len(bests) < 2:
        return True
    lead = min(bests, key=lambda b: float(np.percentile(b, 10)))
    cheap = timed_seconds(blocks) < CHEAP_SECONDS
    for other in bests:
        if other is lead:
            continue
        ratios = [o / lo for o, lo in zip(other, lead, strict=True) if lo > 0]
        if sequential_verdict(ratios, bar) != "below" and not _clear(ratios, "above", cheap, bar):
            return False
    return True


def _clear(ratios: list[float], side: str, cheap: bool, bar: float = 1.0) -> bool:
    """Whether per-round ratios lie clearly on ``side`` ("below" or "above") of ``bar``
    (``sequential_verdict``), by more than LEVEL_SPREAD where ``cheap``."""
    if sequential_verdict(ratios, bar) != side:
        return False
    low, high = ratio_interval(ratios)
    return not cheap or (high * LEVEL_SPREAD < bar if side == "below" else low > bar * LEVEL_SPREAD)


def choice_decided(blocks: list[list[list[float]]], runtimes: Sequence[tuple[int, int]]) -> bool:
    """Whether backend=auto's final choice is decided: ``runtimes`` are each runtime's (float, shipped)
    indices into ``time_interleaved``'s blocks (one index where its float is what it ships; the reference
    float is no contender and is not waited for). Once MIN_ROUNDS complete rounds are in, each runtime's
    float must be clearly slower than its shipped model (its autotune's pick stands) or clearly faster
    (it displaces it), and the fastest runtime's pick clearly faster than every other runtime's; while the
    rounds are cheap (under CHEAP_SECONDS), faster only by more than LEVEL_SPREAD counts. A deployment
    that dropped out is not waited for."""
    rounds = max((len(b) for b in blocks), default=0)
    if rounds < MIN_ROUNDS:
        return False
    cheap = timed_seconds(blocks) < CHEAP_SECONDS
    picks = []
    for f, s in runtimes:
        live = [i for i in dict.fromkeys((s, f)) if len(blocks[i]) == rounds]
        if len(live) == 2:
            float_over_shipped = round_ratios(blocks[s], blocks[f])
            if _clear(float_over_shipped, "below", cheap):
                live = [f]
            elif sequential_verdict(float_over_shipped, 1.0) != "above":
                return False
        picks += live[:1]
    if len(picks) < 2:
        return True
    lead = min(picks, key=lambda i: _p10(blocks[i]))
    return all(_clear(round_ratios(blocks[lead], blocks[i]), "above", cheap) for i in picks if i != lead)
