"""Subgraph mode's report: the rows the stage's metrics carry (one per distinct group, one per
phase-3 step, one per phase) and ``report.md``, written from them once the guard has decided."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.artifacts import atomic_write_text
from pipeline.records.autotune import AutotuneMetrics
from tasks.autotune.paired_step import PairedStep
from tasks.autotune.subgraph.records import PASSES, PTQ, GroupResult

if TYPE_CHECKING:
    from tasks.autotune.subgraph.profiling import GroupSet


def phase_summary(steps: list[PairedStep], start: str, n1: int, n2: int, idle: str | None
                  ) -> list[dict[str, Any]]:
    """Full-model steps per phase, and why they were taken (``idle``: why pass 2 had nothing to test)."""
    out = []
    for pass_, what in ((0, "the PTQ placement against the float model"),
                        (1, f"{n1} group{'s' if n1 != 1 else ''} "
                            + ("whose local result beats their PTQ form" if start == "ptq"
                               else "with a local winner")),
                        (2, f"{n2} group{'s' if n2 != 1 else ''} not kept, retried in context")):
        st = [s for s in steps if s.pass_ == pass_]
        measured = [s for s in st if s.measured]
        bisected = [s for s in st if s.children and len(s.changes) > 1]
        kept = sum(len(s.changes) for s in st if s.kept) if pass_ else None
        if pass_ == 0:
            why = (f"{what}: {st[0].reason}; phase 3 starts from "
                   f"{'it' if start == 'ptq' else 'the float model'}") if st else "no PTQ placement to start from"
        elif not st:
            why = idle if pass_ == 2 and idle else f"{what}: nothing to test"
        else:
            why = (f"{what}: {len(measured)} measured step{'s' if len(measured) != 1 else ''}"
                   + (f" ({len(bisected)} bisected" + (f", {len(st) - len(measured)} known from their parent"
                                                        if len(st) > len(measured) else "") + ")" if bisected else "")
                   + f"; {kept} group{'s' if kept != 1 else ''} kept")
        out.append({"phase": PASSES[pass_], "steps": len(measured), "known": len(st) - len(measured), "why": why})
    return out


def _step_note(step: PairedStep) -> str:
    n = len(step.changes)
    return f"step {step.index}{f' ({n} groups together)' if n > 1 else ''}: {step.reason}"


def group_rows(gs: GroupSet, results: dict[str, GroupResult], steps: list[PairedStep], chosen: dict[str, str],
               incremental_validation: bool) -> list[dict[str, Any]]:
    """One row per distinct group, in graph order: its local result and what validation made of it."""
    rows = []
    for key, regions in sorted(gs.by_key.items(), key=lambda kv: kv[1][0].id):
        rec = results[key]
        mine = [st for st in steps if st.pass_ > 0 and key in st.changes]
        measured = [st for st in mine if st.measured]
        state = chosen.get(key)
        kept = state is not None and state != PTQ and incremental_validation
        rows.append({
            "group": regions[0].id, "instances": len(regions), "nodes": rec.nodes, "fused_ops": rec.fused_ops,
            "scheme": rec.winner, "local_gain": rec.local_gain, "metric": rec.metric,
            "validation": ("kept" if kept else "rejected" if mine else "PTQ placement" if state == PTQ else
                           "not validated" if rec.winner != "none" and not incremental_validation else "-"),
            "kept_scheme": state if kept else None,
            "full_model_ratio": measured[-1].ratio if measured else None,
            "step": mine[-1].index if mine else None,
            "reason": _step_note(mine[-1]) if mine else rec.error,
        })
    return rows


def step_rows(gs: GroupSet, steps: list[PairedStep]) -> list[dict[str, Any]]:
    """One row per phase-3 step."""
    return [{"step": st.index, "phase": PASSES[st.pass_], "parent": st.parent,
             "groups": "PTQ placement" if st.pass_ == 0 else
             ", ".join(str(i) for i in sorted(gs.first_id(k) for k in st.changes)),
             "measured": st.measured, "outcome": st.outcome, "reason": st.reason}
            for st in steps]


def write_group_report(path: Path, metrics: AutotuneMetrics) -> None:
    """autotune/report.md of a subgraph-mode run: the final line and one row per distinct group (the
    counts and rows are subgraph mode's own, in ``metrics.search.details``)."""
    mode = metrics.search.details
    rows = mode.get("group_report") or []
    raw = mode["raw"]
    lines = [
        "# autotune (subgraph mode)", "",
        metrics.final_line, "",
        f"Shipped: {metrics.shipped} ({metrics.shipped_reason}).", "",
        f"{mode['fusion_groups']} fusion groups, {mode['groups']} with something to quantize, "
        f"{mode['distinct_groups']} distinct (each measured once on its subgraph); {metrics.search.measurements} "
        f"measurements ({mode['tuning_seconds']:.0f} s of tuning in this invocation); incremental validation "
        f"{'on' if mode['incremental_validation'] else 'off'}, {mode['kept_groups']} groups kept.", "",
        "optimized_raw.onnx (every local winner, unvalidated): " + (
            f"runs; accuracy {raw['accuracy']['what']}"
            f"{'' if raw['accuracy']['ok'] else ' (OVER BUDGET)'}" if raw.get("runs")
            else f"does not run ({raw.get('error')})") + ".", "",
    ]
    lines += _phase_lines(metrics)
    lines += [
        "| group | instances | nodes | scheme (subgraph) | local gain | validation | full model | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for g in rows:
        nodes = ", ".join(g["nodes"][:4]) + (f" (+{len(g['nodes']) - 4})" if len(g["nodes"]) > 4 else "")
        full = f"{1.0 / g['full_model_ratio']:.3f}x" if g.get("full_model_ratio") else "-"
        lines.append(f"| {g['group']} | {g['instances']} | {nodes} | {g['scheme']} | {g['local_gain']:.2f}x "
                     f"({g['metric']}) | {g['validation']}{' (' + g['kept_scheme'] + ')' if g.get('kept_scheme') else ''}"
                     f" | {full} | {g.get('reason') or ''} |")
    atomic_write_text(path, "\n".join(lines) + "\n")


def _phase_lines(metrics: AutotuneMetrics) -> list[str]:
    """The full-model steps per phase (the final guard's included) and one row per phase-3 step."""
    phases = metrics.search.details.get("phases") or []
    if not phases:
        return []
    guard = metrics.guard
    steps = [*phases, {"phase": "final guard", "steps": int(guard is not None and guard.measured), "known": 0,
                       "why": guard.why if guard is not None else ""}]
    counts = ", ".join(f"{r['phase']} {r['steps']}" for r in steps)
    lines = [f"Full-model steps: {sum(r['steps'] for r in steps)} ({counts}).", "",
             "| phase | full-model steps | why |", "|---|---|---|"]
    for r in steps:
        known = f" (+{r['known']} known from their parent)" if r["known"] else ""
        lines.append(f"| {r['phase']} | {r['steps']}{known} | {r['why']} |")
    lines += ["", "| step | phase | groups | bisects step | result |", "|---|---|---|---|---|"]
    for st in metrics.search.details.get("steps") or []:
        parent = "-" if st["parent"] is None else str(st["parent"])
        lines.append(f"| {st['step']} | {st['phase']} | {st['groups']} | {parent} | {st['reason']} |")
    lines.append("")
    return lines
