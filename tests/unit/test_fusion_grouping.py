"""Subgraph mode, phase 1: fusion groups read off real ONNX Runtime sessions, mapped back to the
original nodes by boundary tensors."""

from __future__ import annotations

from tests import models
from tests.helpers import ort_fusion_groups


def _groups(model) -> dict[tuple[str, ...], tuple[str, ...]]:
    return {g.names: g.fused_ops for g in ort_fusion_groups(model)}


def test_conv_relu_chain():
    groups = _groups(models.conv_chain())
    assert groups[("conv1", "relu1")] == ("FusedConv",)
    assert groups[("conv2", "relu2")] == ("FusedConv",)
    assert {("gap",), ("flatten",), ("fc",)} <= set(groups)
    g = ort_fusion_groups(models.conv_chain())
    assert g[0].signature == g[1].signature  # identical Conv+Relu groups are measured once


def test_residual_block_keeps_the_add_apart_from_the_conv_feeding_it():
    groups = _groups(models.residual_block())
    assert groups[("block0/conv1", "block0/relu1")] == ("FusedConv",)
    assert groups[("block0/conv2",)] == ("Conv",)
    assert groups[("block0/add",)] == ("Add",)
    every = [n for names in groups for n in names]
    assert len(every) == len(set(every)) == len(models.residual_block().graph.node)  # each node in one group


def test_transformer_layer_layernorm_and_gelu_fusions():
    groups = _groups(models.transformer_layer())
    assert groups[("attn/residual", "ln1")] == ("SkipLayerNormalization",)
    assert groups[("ffn/gelu/Div", "ffn/gelu/Erf", "ffn/gelu/Add", "ffn/gelu/Mul", "ffn/gelu/Mul_1")] == ("Gelu",)
    assert groups[("attn/k_t", "attn/scores", "attn/scale")] == ("FusedMatMul",)
    # MatMul + bias Add becomes a Gemm between two Reshapes the original graph does not have: one group
    assert groups[("ffn/fc1/MatMul", "ffn/fc1/Add")] == ("Reshape", "Gemm", "Reshape")
    g = next(g for g in ort_fusion_groups(models.transformer_layer()) if g.names == ("attn/residual", "ln1"))
    assert g.region.inputs == ["input", "o"] and g.region.outputs == ["h1"]  # boundary tensors, not node names


def test_trtexec_graph_json_groups_and_skips_layers_of_no_onnx_node():
    """--exportLayerInfo of an FP16 build (TensorRT 10 format): Reformat copies and the Shuffle/NoOp
    layers TensorRT inserts around the Gemm name no ONNX node and belong to no group."""
    import json
    from pathlib import Path

    from tasks.autotune.subgraph.fusion_grouping import layer_fusion_groups

    doc = json.loads((Path(__file__).parents[1] / "fixtures" / "trtexec" / "graph_fp16_conv_chain.json").read_text())
    groups = {g.names: g.fused_ops for g in layer_fusion_groups(models.conv_chain(), doc)}
    assert groups == {("conv1", "relu1"): ("CaskConvolution",), ("conv2", "relu2"): ("CaskConvolution",),
                      ("gap",): ("CaskPooling",), ("flatten",): ("NoOp",), ("fc",): ("CaskGemmConvolution",)}


def test_trt_layers_sharing_an_onnx_node_are_one_group():
    """TensorRT's Q/DQ builds split a node into a prologue kernel and the fused kernel (layer_info_10x.json)."""
    import json
    from pathlib import Path

    from tasks.autotune.subgraph.fusion_grouping import layer_fusion_groups

    doc = json.loads((Path(__file__).parents[1] / "fixtures" / "trtexec" / "layer_info_10x.json").read_text())
    g = next(g for g in layer_fusion_groups(models.conv_chain(), doc) if "conv1" in g.names)
    assert g.names == ("conv1", "relu1") and g.fused_ops == ("kgen", "CaskConvolution")
    assert g.region.inputs == ["input"] and g.region.outputs == ["r1"]
