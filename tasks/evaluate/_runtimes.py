"""Every runtime beside the one that ships, where the run chose its runtime by measurement.

The choice record (autotune/runtime_choice.json, ``pipeline.runtime_choice``) holds each runtime's p10
latency and its own float's against the reference float, from one interleaved run, and the evaluation
of every runtime that did not ship (made in its own results_dir). This evaluation is the shipped
runtime's. metrics.json's ``runtimes`` and report.md's "Every runtime" section put them side by side.
"""

from __future__ import annotations

from dataclasses import asdict

from pipeline.records.evaluate import EvaluateMetrics, RuntimesTable, RuntimeTableRow, runtime_evaluation
from pipeline.runtime_choice import FLOAT, ModelSummary, RuntimeChoice

THIS_REPORT = "evaluate/report.md"


def runtimes_metrics(choice: RuntimeChoice, metrics: EvaluateMetrics) -> RuntimesTable:
    """metrics.json's ``runtimes``: the choice, each row with its speedups over the reference float and its
    evaluation (the shipped runtime's is this one, ``metrics``)."""
    ref = choice.reference_p10_ms
    rows = []
    for r in choice.rows:
        ev = runtime_evaluation(metrics, THIS_REPORT) if r.runtime == choice.winner else r.evaluation
        fields = {**asdict(r), "evaluation": ev, "vs_reference": r.speedup(ref),
                  "float_vs_reference": ref / r.float_p10_ms if r.float_p10_ms else None}
        if r.runtime == choice.winner and choice.ships == FLOAT:  # its float ran clearly faster than its own pick
            best = choice.contenders[0]
            fields.update(shipped=f"{best.label} (its {r.shipped} model {r.speedup(ref):.2f}x)",
                          vs_reference=ref / best.p10_ms)
        rows.append(RuntimeTableRow(**fields))
    return RuntimesTable(choice.reference, ref, choice.winner, rows, dict(choice.left_out), choice.race)


def _cell(models: dict[str, ModelSummary], key: str, fallback: str = "–") -> str:
    m = models.get(key)
    if m is None:
        return fallback
    text = m.accuracy or "not scored"
    if m.speedup_p10 is not None and key != "float":
        text += f", {m.speedup_p10:.2f}x its float"
    return text + (" **OVER BUDGET**" if m.over_budget else "")


def section(metrics: EvaluateMetrics) -> list[str]:
    """report.md's "Every runtime" section ([] where the run did not choose its runtime)."""
    rt = metrics.runtimes
    if rt is None:
        return []
    lines = ["", "## Every runtime", "",
             f"The run tuned each runtime in its own results_dir and timed every runtime's shipped model and its "
             f"own float side by side with the {rt.reference} ({rt.reference_p10_ms:.3g} ms p10); "
             f"**{rt.winner}** is the fastest that meets the accuracy budget and ships. Accuracy and the "
             f"speedups over each runtime's own float are that runtime's evaluation on this data.", "",
             f"| runtime | ships | vs {rt.reference} (p10) | its float vs it | float | PTQ | tuned | report |",
             "|---|---|---:|---:|---|---|---|---|"]
    for r in rt.rows:
        speed = f"{r.vs_reference:.2f}x" if r.vs_reference else f"not timed ({r.error})"
        own = f"{r.float_precision} {r.float_vs_reference:.2f}x" if r.float_vs_reference else "–"
        ev = r.evaluation
        if ev is None:
            cells = ["–", "–", "–", r.evaluation_error or "not evaluated"]
        else:
            models = {m.key: m for m in ev.models}
            report = "this report" if ev.report == THIS_REPORT else f"[report.md](../{ev.report})"
            cells = [_cell(models, "float"), _cell(models, "ptq"), _cell(models, "autotuned", "as PTQ"), report]
        name = f"**{r.runtime}**" if r.runtime == rt.winner else r.runtime
        lines.append(f"| {name} | {r.shipped} | {speed} | {own} | " + " | ".join(cells) + " |")
    for name, why in rt.left_out.items():
        lines.append(f"| {name} | left out | {why} | | | | | |")
    if rt.race:
        lines += ["", f"The {rt.race} (a runtime whose PTQ model and float, at best, stay out of the leader's reach "
                      f"after what autotune can gain is not tuned; `backend.tune_all=true` tunes every runtime)."]
    return lines
