"""Region discovery: partition invariants, boundaries, determinism and equal cuts of repeated blocks,
on the tiny builders, on hand-made awkward graphs and on real exported ResNet-18 / BERT graphs."""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.graph.index import GraphIndex
from tasks.autotune.region import inspect as region_inspect
from tasks.autotune.region.pattern import RegionPattern
from tasks.autotune.region.region import Region, RegionType
from tasks.autotune.region.search import CombinedRegionSearch, discover_regions
from tests import models
from tests.helpers import run_tune


# ---------------------------------------------------------------- helpers
def _structural(model: onnx.ModelProto) -> set[int]:
    consts = GraphIndex(model).constants
    return {i for i, n in enumerate(model.graph.node) if not n.output or any(o not in consts for o in n.output)}


def _check(root: Region, model: onnx.ModelProto, max_seq: int = 10, min_topdown: int = 10) -> None:
    """Every invariant the autotuner relies on."""
    nodes = model.graph.node
    g = GraphIndex(model)
    regions = [root, *root.descendants()]
    assert root.type == RegionType.ROOT and root.level == 0 and root.parent is None
    assert [r.id for r in regions] == list(range(len(regions)))  # unique, pre-order
    leaves = [r for r in regions if r.type == RegionType.LEAF]
    owned = sorted(i for r in leaves for i in r.nodes)
    assert owned == list(range(len(nodes))), "LEAF regions must partition the nodes"
    structural = _structural(model)
    for r in regions:
        if r.type != RegionType.LEAF:
            assert r.nodes == [] and r.children
        else:
            assert not r.children
            assert sum(1 for i in r.nodes if i in structural) <= max(max_seq, min_topdown)
        for c in r.children:
            assert c.parent is r and c.level == r.level + 1
        # boundaries recomputed from the node set
        members = set(r.all_nodes())
        made = {o: i for i in members for o in nodes[i].output}
        ins, outs = [], []
        for i in r.all_nodes():
            ins += [t for t in nodes[i].input if t and t not in made and t not in g.constants and t not in ins]
            outs += [t for t in nodes[i].output if t and t not in g.constants and t not in outs and (
                t in g.graph_outputs or any(idx not in members for idx in _readers(model, t)))]
        assert sorted(r.inputs) == sorted(ins) and len(set(r.inputs)) == len(r.inputs)
        assert sorted(r.outputs) == sorted(outs) and len(set(r.outputs)) == len(r.outputs)
        # children in topological order: nothing flows from a later child into an earlier one
        for a, early in enumerate(r.children):
            for late in r.children[a + 1:]:
                assert not set(late.outputs) & set(early.inputs), f"children of region {r.id} out of order"


def _readers(model: onnx.ModelProto, tensor: str) -> list[int]:
    return [i for i, n in enumerate(model.graph.node) if tensor in n.input]


def _ops(model: onnx.ModelProto, region: Region) -> list[str]:
    return [model.graph.node[i].op_type for i in region.all_nodes()]


def _shape(region: Region, model: onnx.ModelProto) -> tuple:
    """Type, op types in order and children's shapes: equal for equally cut regions."""
    return (region.type, tuple(_ops(model, region)), tuple(_shape(c, model) for c in region.children))


def _dump(root: Region) -> list[tuple]:
    return [(r.id, r.type, r.level, tuple(r.nodes), tuple(r.inputs), tuple(r.outputs), len(r.children))
            for r in [root, *root.descendants()]]


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name)


def _make(nodes, inputs, outputs, inits, name="g") -> onnx.ModelProto:
    model = helper.make_model(helper.make_graph(nodes, name, inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return onnx.shape_inference.infer_shapes(model)


def _stacked_attention(layers: int = 3, hidden: int = 16, seq: int = 8) -> onnx.ModelProto:
    """Post-LN attention layers sharing one additive mask computed once from a graph input: the
    mask's paths straddle every layer, so its convergence must not swallow the layers."""
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, hidden])
    mask = helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, seq])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, hidden])
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(-1e4, np.float32), "neg"),
             numpy_helper.from_array(np.array(0.25, np.float32), "scale")]
    nodes = [helper.make_node("Sub", ["one", "mask"], ["inv"]), helper.make_node("Mul", ["inv", "neg"], ["bias"])]
    h = "x"
    for k in range(layers):
        p = f"l{k}_"
        inits += [_init(p + w, (hidden, hidden), rng) for w in ("wq", "wk", "wv", "wo")]
        inits += [numpy_helper.from_array(np.ones(hidden, np.float32), p + "g"),
                  numpy_helper.from_array(np.zeros(hidden, np.float32), p + "b")]
        nodes += [
            helper.make_node("MatMul", [h, p + "wq"], [p + "q"]),
            helper.make_node("MatMul", [h, p + "wk"], [p + "k"]),
            helper.make_node("MatMul", [h, p + "wv"], [p + "v"]),
            helper.make_node("Transpose", [p + "k"], [p + "kt"], perm=[0, 2, 1]),
            helper.make_node("MatMul", [p + "q", p + "kt"], [p + "s0"]),
            helper.make_node("Mul", [p + "s0", "scale"], [p + "s1"]),
            helper.make_node("Add", [p + "s1", "bias"], [p + "s2"]),
            helper.make_node("Softmax", [p + "s2"], [p + "pr"], axis=-1),
            helper.make_node("MatMul", [p + "pr", p + "v"], [p + "ctx"]),
            helper.make_node("MatMul", [p + "ctx", p + "wo"], [p + "o"]),
            helper.make_node("Add", [p + "o", h], [p + "res"]),
            helper.make_node("LayerNormalization", [p + "res", p + "g", p + "b"], [p + "out"], axis=-1),
        ]
        h = p + "out"
    nodes.append(helper.make_node("Identity", [h], ["y"]))
    return _make(nodes, [x, mask], [y], inits, "stacked_attention")


def _dynamic_reshape() -> onnx.ModelProto:
    """A projection whose Reshape target is computed at run time from the activation's Shape
    (int64 edges, Constant nodes): a small convergence of non-float tensors."""
    rng = np.random.default_rng(1)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2, 8, 8])
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["p"]),
        helper.make_node("Shape", ["p"], ["shp"]),
        helper.make_node("Constant", [], ["idx"], value=numpy_helper.from_array(np.array([0, 1], np.int64))),
        helper.make_node("Gather", ["shp", "idx"], ["bs"]),
        helper.make_node("Constant", [], ["tail"], value=numpy_helper.from_array(np.array([2, 8], np.int64))),
        helper.make_node("Concat", ["bs", "tail"], ["target"], axis=0),
        helper.make_node("Reshape", ["p", "target"], ["r"]),
        helper.make_node("Transpose", ["r"], ["y"], perm=[0, 2, 1, 3]),
    ]
    return _make(nodes, [x], [y], [_init("w", (16, 16), rng)], "dynamic_reshape")


def _inception(blocks: int = 2, c: int = 4) -> onnx.ModelProto:
    """Branches of different depth joined by Concat; one branch diverges again inside (nesting)."""
    rng = np.random.default_rng(2)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 8, 8])
    nodes, inits, h = [], [], "x"

    def conv(src: str, dst: str, cin: int = c) -> None:
        inits.append(_init(dst + "_w", (c, cin, 1, 1), rng))
        nodes.append(helper.make_node("Conv", [src, dst + "_w"], [dst]))

    for b in range(blocks):
        p = f"b{b}_"
        conv(h, p + "a")
        conv(h, p + "b0")
        nodes.append(helper.make_node("Relu", [p + "b0"], [p + "b1"]))
        conv(p + "b1", p + "b2")
        conv(p + "b1", p + "b3")
        nodes.append(helper.make_node("Concat", [p + "b2", p + "b3"], [p + "b4"], axis=1))
        conv(p + "b4", p + "b5", cin=2 * c)
        nodes.append(helper.make_node("MaxPool", [h], [p + "m0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
        conv(p + "m0", p + "m1")
        nodes.append(helper.make_node("Concat", [p + "a", p + "b5", p + "m1"], [p + "cat"], axis=1))
        conv(p + "cat", p + "out", cin=3 * c)
        nodes.append(helper.make_node("Relu", [p + "out"], [p + "h"]))
        h = p + "h"
    nodes.append(helper.make_node("Identity", [h], ["y"]))
    return _make(nodes, [x], [y], inits, "inception")


def _plain_chain(pairs: int = 30, c: int = 4) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 8, 8])
    nodes, inits, h = [], [], "x"
    for k in range(pairs):
        inits.append(_init(f"w{k}", (c, c, 3, 3), rng))
        nodes += [helper.make_node("Conv", [h, f"w{k}"], [f"c{k}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{k}"], [f"r{k}"])]
        h = f"r{k}"
    nodes.append(helper.make_node("Identity", [h], ["y"]))
    return _make(nodes, [x], [y], inits, "plain_chain")


def _signatures(model: onnx.ModelProto, regions: list[Region]) -> list[str]:
    g = GraphIndex(model)
    return [RegionPattern.from_region(r, model, g).signature for r in regions]


# ---------------------------------------------------------------- tiny builders
@pytest.mark.parametrize("builder", [models.conv_chain, models.residual_block, models.attention_block,
                                     _stacked_attention, _dynamic_reshape, _inception, _plain_chain])
def test_partition_and_boundaries(builder):
    model = builder()
    for max_seq, min_topdown in ((10, 10), (3, 4), (1, 1)):
        root = CombinedRegionSearch(model, max_seq, min_topdown).search()
        _check(root, model, max_seq, min_topdown)


def test_residual_blocks_take_their_relu_and_match():
    model = models.residual_block(blocks=3)
    regions = discover_regions(model)
    assert [_ops(model, r) for r in regions] == [
        ["Conv", "Relu"],
        *[["Conv", "Relu", "Conv", "Add", "Relu"]] * 3,  # the last block keeps its Relu too
        ["GlobalAveragePool", "Flatten", "Gemm"],
    ]
    sigs = _signatures(model, regions)
    assert len(set(sigs[1:4])) == 1 and len(set(sigs)) == 3


def test_sequences_are_bounded_and_periodic():
    model = _plain_chain(30)
    regions = discover_regions(model, maximum_sequence_region_size=10)
    assert [len(r.nodes) for r in regions] == [10] * 6 + [1]
    assert len(set(_signatures(model, regions[:6]))) == 1
    small = discover_regions(models.conv_chain(), maximum_sequence_region_size=3)
    assert [len(r.nodes) for r in small] == [3, 3, 1]


def test_shared_mask_does_not_swallow_layers():
    model = _stacked_attention(layers=3)
    regions = discover_regions(model)
    layers = [r for r in regions if "Softmax" in _ops(model, r)]
    assert len(layers) == 3
    assert len({_shape(r, model) for r in layers}) == 1
    assert len(set(_signatures(model, layers))) == 1
    # the mask arithmetic is a region of its own, not part of the first layer
    assert any(_ops(model, r) == ["Sub", "Mul"] for r in regions)


def test_runtime_shape_subgraph_is_one_convergence():
    model = _dynamic_reshape()
    regions = discover_regions(model)
    ops = [_ops(model, r) for r in regions]
    # the Transpose feeding the graph output is no complete tail (no divergence follows it)
    assert ops == [["MatMul"], ["Shape", "Constant", "Gather", "Constant", "Concat", "Reshape"], ["Transpose"]]
    # constants (the Constant nodes' outputs) are never boundaries
    assert regions[1].inputs == ["p"] and regions[1].outputs == ["r"]


def test_nested_convergence_gives_composites():
    model = _inception(blocks=2)
    root = CombinedRegionSearch(model, minimum_topdown_search_size=4).search()
    _check(root, model, 10, 4)
    blocks = [r for r in root.children if r.type == RegionType.COMPOSITE]
    assert len(blocks) == 2 and _shape(blocks[0], model) == _shape(blocks[1], model)
    inner = [c for c in blocks[0].children if "Concat" in _ops(model, c) and len(c.all_nodes()) == 3]
    assert inner, "the inner Conv/Conv -> Concat convergence is a child region"
    flat = CombinedRegionSearch(model).search()  # 10 nodes per block: a LEAF at the default threshold
    assert all(r.type == RegionType.LEAF for r in flat.children)


def test_unsorted_graph_and_graph_outputs_inside():
    model = models.residual_block(blocks=2)
    ordered = [[model.graph.node[i].name for i in r.nodes] for r in discover_regions(model)]
    shuffled = onnx.ModelProto()
    shuffled.CopyFrom(model)
    nodes = list(shuffled.graph.node)
    random.Random(0).shuffle(nodes)
    del shuffled.graph.node[:]
    shuffled.graph.node.extend(nodes)
    root = CombinedRegionSearch(shuffled).search()
    _check(root, shuffled)
    assert sorted(sorted(shuffled.graph.node[i].name for i in r.nodes) for r in root.children) == \
        sorted(sorted(names) for names in ordered)
    # an intermediate tensor that is also a graph output is a boundary output of its region
    extra = onnx.ModelProto()
    extra.CopyFrom(model)
    extra.graph.output.append(helper.make_tensor_value_info("h1", TensorProto.FLOAT, None))
    root = CombinedRegionSearch(extra).search()
    _check(root, extra)
    assert any("h1" in r.outputs for r in root.children)


def test_deterministic_and_fast_on_a_deep_graph():
    model = models.residual_block(blocks=200)
    start = time.perf_counter()
    first = CombinedRegionSearch(model).search()
    assert time.perf_counter() - start < 2.0
    assert _dump(first) == _dump(CombinedRegionSearch(model).search())
    blocks = first.children[1:-1]
    assert len(blocks) == 200 and len({_shape(r, model) for r in blocks}) == 1


def test_empty_graph_and_bad_sizes():
    model = _make([], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])], [])
    root = CombinedRegionSearch(model).search()
    assert root.children == [] and root.type == RegionType.ROOT
    with pytest.raises(ValueError, match="maximum_sequence_region_size"):
        CombinedRegionSearch(models.conv_chain(), maximum_sequence_region_size=0)


# ---------------------------------------------------------------- real exported graphs
@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("region_search")
    runs = {"resnet18": ["model=resnet18", "model.input_size=32"],
            "bert": ["model=bert_tiny", "model.num_layers=3", "model.seq_len=16", "model.vocab_size=64",
                     "model.hidden_size=32", "model.intermediate_size=64"]}
    out = {}
    for name, args in runs.items():
        run_tune(["stages=[export]", *args, f"results_dir={root / name}"], cwd=root, check=True)
        out[name] = root / name / "export" / "model.onnx"
    return out


def test_resnet18_blocks(exported):
    model = onnx.load(str(exported["resnet18"]))
    root = CombinedRegionSearch(model).search()
    _check(root, model)
    regions = root.children
    ops = [_ops(model, r) for r in regions]
    plain = ["Conv", "Relu", "Conv", "Add", "Relu"]
    down = ["Conv", "Conv", "Relu", "Conv", "Add", "Relu"]
    assert ops == [["Conv", "Relu", "MaxPool"], plain, plain, down, plain, down, plain, down, plain,
                   ["GlobalAveragePool", "Flatten", "Gemm"]]
    sigs = _signatures(model, regions)
    assert len({sigs[k] for k in (1, 2, 4, 6, 8)}) == 1 and len({sigs[k] for k in (3, 5, 7)}) == 1
    assert len(set(sigs)) == 4 < len(regions)
    assert _dump(root) == _dump(CombinedRegionSearch(model).search())


def test_bert_layers(exported):
    model = onnx.load(str(exported["bert"]))
    root = CombinedRegionSearch(model).search()
    _check(root, model)
    regions = root.children
    attention = [r for r in regions if any(o == "Softmax" for o in _ops(model, r))]
    ffn = [r for r in regions if "Erf" in _ops(model, r)]
    assert len(attention) == len(ffn) == 3
    assert len({_shape(r, model) for r in attention}) == 1 and len({_shape(r, model) for r in ffn}) == 1
    # Q, K and V projections are cut alike inside the attention region
    proj = [c for c in attention[0].children if _ops(model, c)[0] == "MatMul" and "Transpose" in _ops(model, c)
            and "Softmax" not in _ops(model, c) and len(c.inputs) == 1]
    assert len(proj) == 3 and len({tuple(_ops(model, c)) for c in proj}) == 1
    sigs = _signatures(model, regions)
    assert len(set(sigs)) == 4 < len(regions)  # stem, attention, FFN, head


# ---------------------------------------------------------------- region_inspect
def test_inspect_report(exported, capsys):
    assert region_inspect.main(["--model", str(exported["resnet18"])]) == 0
    out = capsys.readouterr().out
    assert "Summary: 10 regions (10 LEAF, 0 COMPOSITE), 49/49 nodes (100.0%)" in out
    assert "Coverage: 49/49 nodes in exactly one LEAF region (100.0%)" in out
    assert "Unique patterns: 4 among 10 top-level regions" in out
    assert "├─ Region 1 (Level 1, Type: LEAF)" in out and "LEAF size histogram" in out
    verbose = region_inspect.inspect_model(exported["bert"], verbose=True)
    assert "(100.0%)" in verbose and "Type: COMPOSITE" in verbose and "input_ids" in verbose


def test_inspect_hides_regions_without_quantizable_ops(tmp_path):
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])
    model = _make([helper.make_node("Conv", ["x", "w0"], ["a"]), helper.make_node("Erf", ["a"], ["b"]),
                   helper.make_node("Sqrt", ["b"], ["c"]), helper.make_node("Conv", ["c", "w1"], ["y"])],
                  [x], [y], [_init("w0", (2, 2, 1, 1), rng), _init("w1", (2, 2, 1, 1), rng)])
    path = models.save(model, tmp_path, "erf")
    default = region_inspect.inspect_model(path, max_sequence_size=1)
    assert "Not listed: 2 regions without quantizable ops" in default and "Region 2 (" not in default
    everything = region_inspect.inspect_model(path, max_sequence_size=1, include_all_regions=True)
    assert "Region 2 (" in everything and "Summary: 4 regions (4 LEAF, 0 COMPOSITE), 4/4 nodes (100.0%)" in everything


def test_inspect_errors(tmp_path, capsys):
    assert region_inspect.main(["--model", str(tmp_path / "missing.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("region_inspect: error: ") and "missing.onnx" in err[0]
    (tmp_path / "junk.onnx").write_bytes(b"\x00not onnx\xff")
    assert region_inspect.main(["--model", str(tmp_path / "junk.onnx")]) == 2
    assert capsys.readouterr().err.startswith("region_inspect: error: ")
