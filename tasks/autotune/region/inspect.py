"""Show how region discovery partitions a model, before spending hours profiling it.

    python -m tasks.autotune.region.inspect --model model.onnx [--verbose] [--max-sequence-size N]
                                            [--include-all-regions]

Prints a summary (regions by type, node coverage by LEAF regions, LEAF size histogram, unique
patterns among the regions the autotuner profiles: optimisation time grows with patterns, not
regions) and the region tree. By default regions without a quantizable op are left out of the tree
(they are still counted); ``--include-all-regions`` lists them too. ``--verbose`` adds every node's
op type and name and the boundary tensor names.

Patterns come from ``tasks.autotune.region.pattern.RegionPattern``, so the count is the one the autotuner
will see.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import onnx

from pipeline.errors import PipelineError
from pipeline.graph.index import GraphIndex
from pipeline.graph.model import load_model
from pipeline.quant.placement import QUANTIZABLE_OPS
from tasks.autotune.region.pattern import RegionPattern
from tasks.autotune.region.region import Region, RegionType
from tasks.autotune.region.search import CombinedRegionSearch

PROG = "region_inspect"


def _signature(region: Region, model: onnx.ModelProto, g: GraphIndex) -> str:
    return RegionPattern.from_region(region, model, g).signature


def _quantizable(region: Region, model: onnx.ModelProto) -> bool:
    return any(model.graph.node[i].op_type in QUANTIZABLE_OPS for i in region.all_nodes())


def _tree(items: list[tuple[str, list]], prefix: str = "") -> list[str]:
    """Render (label, sub-items) pairs as a box-drawing tree."""
    lines = []
    for k, (label, subs) in enumerate(items):
        last = k == len(items) - 1
        lines.append(f"{prefix}{'└─' if last else '├─'} {label}")
        lines += _tree(subs, prefix + ("   " if last else "│  "))
    return lines


def _control_flow(model: onnx.ModelProto) -> list[str]:
    """What became of the model's control flow: the inputs it was specialized on (export's
    model.fixed_inputs) and, per If/Loop/Scan of the main graph, its bodies' nodes, how many of them
    are quantized, and why the rest are float. Regions cover the main graph only."""
    from pipeline.graph.model import WEIGHTED_OPS, iter_nodes
    from pipeline.transforms.specialize import recorded_fixed_inputs

    lines = []
    fixed = recorded_fixed_inputs(model)
    if fixed:
        lines.append(f"Specialized on fixed inputs {fixed}: the If nodes they decided were replaced by their "
                     f"taken branch at export")
    control = [n for n in model.graph.node if n.op_type in ("If", "Loop", "Scan")]
    if not control:
        return lines
    lines.append(f"Control flow: {len(control)} If/Loop/Scan node(s); regions cover the main graph, bodies are "
                 f"placed by the quantize stage and kept as placed by autotune")
    for node in control:
        graphs = [a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
        inside = [n for g in graphs for n in iter_nodes(g)]
        weighted = sum(n.op_type in (*WEIGHTED_OPS, "LSTM", "GRU", "RNN") for n in inside)
        dq = {o for n in inside if n.op_type == "DequantizeLinear" for o in n.output}
        quantized = sum(n.op_type in WEIGHTED_OPS and any(i in dq for i in n.input) for n in inside)
        if quantized:
            why = f"{quantized} of {weighted} weighted ops quantized"
        elif node.op_type == "If":
            why = ("float: If bodies stay float (when its condition depends on an input deployment fixes, "
                   "model.fixed_inputs specializes it)")
        else:
            why = "float: nothing quantized inside (no quantizable op, or a float model)"
        lines.append(f"  {node.op_type} {node.name}: {len(inside)} body nodes, {weighted} weighted; {why}")
    return lines


def _contents(r: Region, nodes: Sequence[onnx.NodeProto], verbose: bool) -> list[tuple[str, list]]:
    """A region's nodes and boundary tensors: counted, with its ops; ``verbose``: listed by name."""
    if verbose:
        return [(f"Nodes: {len(r.nodes)}", [(f"{nodes[i].op_type}  {nodes[i].name}", []) for i in r.nodes]),
                (f"Inputs: {len(r.inputs)} tensors", [(t, []) for t in r.inputs]),
                (f"Outputs: {len(r.outputs)} tensors", [(t, []) for t in r.outputs])]
    ops = [(f"Ops: {', '.join(nodes[i].op_type for i in r.nodes)}", [])] if r.nodes else []
    return [*ops, (f"Inputs: {len(r.inputs)} tensors", []), (f"Outputs: {len(r.outputs)} tensors", [])]


def _size_histogram(sizes: list[int]) -> list[str]:
    """LEAF region sizes (min, max, mean) and their histogram; nothing without LEAF regions."""
    if not sizes:
        return []
    lines = [f"LEAF region sizes: min={min(sizes)}, max={max(sizes)}, avg={sum(sizes) / len(sizes):.1f}",
             "LEAF size histogram (nodes: regions):"]
    hist = Counter(sizes)
    peak = max(hist.values())
    for size in sorted(hist):
        bar = "#" * max(1, round(30 * hist[size] / peak))
        lines.append(f"  {size:>4}: {bar} {hist[size]}")
    return lines


def inspect_model(path: str | Path, verbose: bool = False, max_sequence_size: int = 10,
                  include_all_regions: bool = False) -> str:
    """The inspection report for the model at ``path`` (raises PipelineError for unusable files)."""
    model = load_model(path)
    search = CombinedRegionSearch(model, maximum_sequence_region_size=max_sequence_size)
    root = search.search()
    g = search.index
    nodes = model.graph.node
    regions = root.descendants()
    leaves = [r for r in regions if r.type == RegionType.LEAF]
    composites = [r for r in regions if r.type == RegionType.COMPOSITE]
    total = len(nodes)
    counts = Counter(i for r in leaves for i in r.nodes)
    once = sum(1 for i in range(total) if counts[i] == 1)
    pct = 100.0 * once / total if total else 100.0

    top_sigs = {r.id: _signature(r, model, g) for r in root.children}
    uses = Counter(top_sigs.values())
    all_sigs = {_signature(r, model, g) for r in regions}

    shown = {r.id for r in regions if include_all_regions or _quantizable(r, model)}

    def item(r: Region) -> tuple[str, list]:
        subs: list = [(f"Direct nodes: {len(r.nodes)}", []), (f"Total nodes (recursive): {len(r.all_nodes())}", []),
                      (f"Children: {len(r.children)}", [])]
        if r.id in top_sigs:
            sig = top_sigs[r.id]
            subs.append((f"Pattern: {sig[:12]} (shared by {uses[sig]} region{'s' * (uses[sig] != 1)})", []))
        subs += _contents(r, nodes, verbose)
        subs += [item(c) for c in r.children if c.id in shown]
        return f"Region {r.id} (Level {r.level}, Type: {r.type.value})", subs

    sizes = [len(r.nodes) for r in leaves]
    lines = [
        f"Model: {path} ({total} nodes, {len(g.graph_inputs)} inputs, {len(g.graph_outputs)} outputs)",
        f"Region search: maximum_sequence_region_size={max_sequence_size}, "
        f"minimum_topdown_search_size={search.min_topdown}",
        f"Summary: {len(regions)} regions ({len(leaves)} LEAF, {len(composites)} COMPOSITE), "
        f"{once}/{total} nodes ({pct:.1f}%)",
        f"Coverage: {once}/{total} nodes in exactly one LEAF region ({pct:.1f}%)",
    ]
    lines += _size_histogram(sizes)
    source = "tasks.autotune.region.pattern"
    lines.append(f"Unique patterns: {len(uses)} among {len(root.children)} top-level regions "
                 f"({len(all_sigs)} among all {len(regions)} regions; {source})")
    hidden = len(regions) - len(shown)
    if hidden:
        lines.append(f"Not listed: {hidden} regions without quantizable ops (--include-all-regions lists them)")
    lines += _control_flow(model)
    lines.append("")
    lines.append(f"Region {root.id} (Level {root.level}, Type: {root.type.value}): {len(root.all_nodes())} nodes, "
                 f"{len(root.children)} children, {len(root.inputs)} inputs, {len(root.outputs)} outputs")
    lines += _tree([item(c) for c in root.children if c.id in shown])
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Show the regions the Q/DQ autotuner finds in a model.")
    parser.add_argument("--model", "-m", required=True, help="path of the ONNX model")
    parser.add_argument("--verbose", "-v", action="store_true", help="list nodes and boundary tensors")
    parser.add_argument("--max-sequence-size", type=int, default=10,
                        help="maximum nodes in a sequence region (default: 10)")
    parser.add_argument("--include-all-regions", action="store_true",
                        help="also list regions without quantizable ops")
    args = parser.parse_args(argv)
    if args.max_sequence_size < 1:
        parser.error(f"--max-sequence-size={args.max_sequence_size}: must be >= 1")
    try:
        report = inspect_model(args.model, args.verbose, args.max_sequence_size, args.include_all_regions)
    except PipelineError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
