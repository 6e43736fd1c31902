#!/usr/bin/env python3
"""AIMET-ONNX as a peer quantizer for the accuracy benchmark: float ONNX -> Q/DQ ONNX (int8 W8A8).

Runs with a SEPARATE venv that has aimet-onnx (not the project's .venv), e.g.:

    python3.11 -m venv /work/aimet-venv
    echo 'torch==2.13.0' > /tmp/aimet_constraints.txt          # CPU wheel; keeps pip off CUDA torch
    /work/aimet-venv/bin/pip install torch==2.13.0
    /work/aimet-venv/bin/pip install aimet-onnx==2.42.0 torchvision==0.28.0 -c /tmp/aimet_constraints.txt
    /work/aimet-venv/bin/python bench/aimet_peer.py --model float.onnx --feeds DIR --calib 16 \
        --out out.onnx --recipe best

DIR holds one .npz per feed (keys = ONNX input names, exact static shapes); the first --calib files in
sorted order are the calibration set.

Recipes
  ptq   BN fold (graph preparation; AIMET's sim warns without it) + QuantizationSimModel
        (quant_scheme tf_enhanced, config "default" = per-channel symmetric int8 weights for
        Conv/ConvTranspose/Gemm/MatMul, asymmetric 8-bit activations) + compute_encodings on the
        calibration feeds + to_onnx_qdq (activations exported as uint8, weights as int8 + DequantizeLinear,
        int32 bias).
  best  AIMET's PTQ flow: BN fold + cross-layer equalization (Relu6->Relu where Conv-Clip-Conv, cross-layer
        scaling, high-bias fold; only when the graph has Conv/ConvTranspose), then AdaRound (default) or
        Sequential MSE (--weight-opt seqmse) on the sim, then the same encodings + export as ptq.
        Bias correction is not part of aimet_onnx 2.42 (it exists only in aimet-torch), so it is skipped
        and recorded as such in "steps".

Before AIMET sees the model it is prepared: the graph inputs are fixed to the feed shapes, constants are
folded / Constant nodes lifted to initializers (onnxscript optimizer; paddle2onnx models keep every weight
in a Constant node, which AIMET's ConnectedGraph does not treat as a parameter), and shapes inferred.

The last stdout line is JSON: {"recipe", "steps", "seconds", "out", ...}. Any failure prints one line
"aimet_peer: error: <stage>: <cause>" on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
import tempfile
import time
import traceback
import warnings


class StageError(Exception):
    pass


_stage = "startup"


def _set_stage(name: str) -> None:
    global _stage
    _stage = name


def _load_feeds(feed_dir: str, n: int):
    import numpy as np

    files = sorted(glob.glob(os.path.join(feed_dir, "*.npz")))
    if not files:
        raise StageError(f"no .npz feeds in {feed_dir}")
    if n <= 0 or n > len(files):
        raise StageError(f"--calib {n} but {len(files)} feeds in {feed_dir}")
    feeds = []
    for f in files[:n]:
        with np.load(f) as z:
            feeds.append({k: z[k] for k in z.files})
    return feeds


def _prepare(model, feed, steps):
    """Static input shapes from the feeds, constants folded and lifted to initializers, shapes inferred."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    init_names = {t.name for t in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in init_names]
    missing = [i.name for i in graph_inputs if i.name not in feed]
    if missing:
        raise StageError(f"feeds lack model inputs {missing} (feed keys {sorted(feed)})")
    fixed = []
    for inp in graph_inputs:
        arr = np.asarray(feed[inp.name])
        dims = inp.type.tensor_type.shape.dim
        if len(dims) != arr.ndim:
            raise StageError(f"input {inp.name}: rank {len(dims)} in model, feed shape {arr.shape}")
        for d, v in zip(dims, arr.shape, strict=True):
            static = d.HasField("dim_value") and d.dim_value > 0  # paddle2onnx writes -1 for dynamic
            if static and d.dim_value != v:
                raise StageError(f"input {inp.name}: model dim {d.dim_value} != feed dim {v} ({arr.shape})")
            if not static:
                fixed.append(inp.name)
            d.Clear()
            d.dim_value = int(v)
    # Drop stale dynamic dims so shape inference recomputes them from the static inputs.
    for out in model.graph.output:
        for d in out.type.tensor_type.shape.dim:
            if not (d.HasField("dim_value") and d.dim_value > 0):
                d.Clear()
    del model.graph.value_info[:]
    if fixed:
        steps.append(f"fix_input_shapes({','.join(sorted(set(fixed)))})")

    n_const = sum(1 for n in model.graph.node if n.op_type == "Constant")
    import onnxscript.optimizer

    model = onnxscript.optimizer.optimize(model)
    # Lift any Constant node that survived (e.g. above the folder's size limits) to an initializer.
    keep = []
    lifted = 0
    for node in model.graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            t = numpy_helper.to_array(node.attribute[0].t)
            model.graph.initializer.append(numpy_helper.from_array(t, node.output[0]))
            lifted += 1
        else:
            keep.append(node)
    del model.graph.node[:]
    model.graph.node.extend(keep)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    onnx.checker.check_model(model)
    steps.append(f"fold_constants(Constant nodes {n_const}->0, nodes now {len(model.graph.node)})")
    for out in model.graph.output:
        if any(not d.HasField("dim_value") for d in out.type.tensor_type.shape.dim):
            raise StageError(f"output {out.name} still has a dynamic shape after shape inference")
    return model


def _bn_fold(model, steps):
    from aimet_onnx.batch_norm_fold import fold_all_batch_norms_to_weight

    n_bn = sum(1 for n in model.graph.node if n.op_type == "BatchNormalization")
    if not n_bn:
        return [], []
    conv_bn, bn_conv = fold_all_batch_norms_to_weight(model)
    left = sum(1 for n in model.graph.node if n.op_type == "BatchNormalization")
    steps.append(f"bn_fold({len(conv_bn) + len(bn_conv)} of {n_bn} BatchNormalization folded, {left} left)")
    return conv_bn, bn_conv


def _cle(model, conv_bn, bn_conv, steps):
    """aimet_onnx.cross_layer_equalization.equalize_model, step by step so we can report what it did."""
    from aimet_onnx.cross_layer_equalization import CrossLayerScaling, HighBiasFold
    from aimet_onnx.utils import replace_relu6_with_relu
    from onnxruntime.quantization.onnx_quantizer import ONNXModel

    if not any(n.op_type in ("Conv", "ConvTranspose") for n in model.graph.node):
        steps.append("cle: not applicable (no Conv/ConvTranspose)")
        return
    om = ONNXModel(model)
    n_relu = sum(1 for n in model.graph.node if n.op_type == "Relu")
    replace_relu6_with_relu(om)
    n_relu6 = sum(1 for n in model.graph.node if n.op_type == "Relu") - n_relu
    cls_info = CrossLayerScaling(om).scale_model()
    n_pairs = sum(len(s.cls_pair_info_list) for s in cls_info)
    bn_dict = {conv.name: bn for conv, bn in conv_bn + bn_conv}
    HighBiasFold(om).bias_fold(cls_info, bn_dict)
    steps.append(
        f"cle(relu6->relu {n_relu6}, cross-layer-scaled pairs {n_pairs}, high_bias_fold "
        f"{'on' if bn_dict and n_pairs else 'n/a'})"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--feeds", required=True, help="folder of per-feed .npz files")
    ap.add_argument("--calib", type=int, default=16, help="first N sorted feeds calibrate")
    ap.add_argument("--out", required=True)
    ap.add_argument("--recipe", choices=["best", "ptq"], default="best")
    ap.add_argument("--weight-opt", choices=["adaround", "seqmse", "none"], default="adaround",
                    help="best recipe's weight-rounding step (default adaround)")
    ap.add_argument("--adaround-iters", type=int, default=200,
                    help="AdaRound iterations per layer (AIMET recommends 10000; default kept small for 2 CPU cores)")
    ap.add_argument("--seqmse-candidates", type=int, default=20)
    ap.add_argument("--opt-samples", type=int, default=8,
                    help="calibration feeds used by AdaRound/SeqMSE (first K of the --calib set)")
    ap.add_argument("--clamp-activations", type=float, default=0.0, metavar="VAL",
                    help="after calibration, clamp every activation encoding to [-VAL, VAL] "
                         "(aimet_onnx.quantsim.clamp_activation_encodings; needed for BERT-style additive "
                         "attention masks of -3.4e38). 0 = off (default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)

    t0 = time.time()
    steps: list[str] = []
    try:
        _set_stage("import")
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
        warnings.filterwarnings("ignore")
        import onnx
        import onnxruntime as ort
        import torch

        torch.set_num_threads(args.threads)
        import aimet_onnx
        from aimet_onnx import QuantizationSimModel, apply_adaround, apply_seq_mse
        from aimet_onnx.common.utils import AimetLogger

        if not args.verbose:
            AimetLogger.set_level_for_all_areas(logging.WARNING)
            logging.getLogger().setLevel(logging.WARNING)

        _set_stage("feeds")
        feeds = _load_feeds(args.feeds, args.calib)

        _set_stage("prepare")
        model = onnx.load(args.model)
        model = _prepare(model, feeds[0], steps)

        _set_stage("bn_fold")
        conv_bn, bn_conv = _bn_fold(model, steps)

        if args.recipe == "best":
            _set_stage("cle")
            _cle(model, conv_bn, bn_conv, steps)
            steps.append("bias_correction: skipped (not in aimet_onnx 2.42; aimet-torch only)")

        _set_stage("quantsim")
        tmp = tempfile.mkdtemp(prefix="aimet_peer_")
        use_seqmse = args.recipe == "best" and args.weight_opt == "seqmse"
        sim = QuantizationSimModel(
            model,
            param_type="int8",
            activation_type="int8",
            # aimet_onnx 2.42 SequentialMse asserts the sim's scheme is TF (min_max); its activation
            # quantizers are switched to tf_enhanced right after SeqMSE has set the weight encodings.
            quant_scheme="min_max" if use_seqmse else "tf_enhanced",
            config_file="default",
            providers=["CPUExecutionProvider"],
            path=tmp,
            session_options_kwargs={"intra_op_num_threads": args.threads, "inter_op_num_threads": 1},
        )
        n_params = len(sim.param_names)
        n_acts = len(sim.activation_names)
        steps.append(
            f"quantsim(tf_enhanced, config default: int8 per-channel symmetric weights, 8-bit asymmetric "
            f"activations; {n_params} param + {n_acts} activation quantizers)"
        )

        if args.recipe == "best" and args.weight_opt != "none":
            opt_feeds = feeds[: max(1, min(args.opt_samples, len(feeds)))]
            if args.weight_opt == "adaround":
                _set_stage("adaround")
                t = time.time()
                apply_adaround(sim, opt_feeds, num_iterations=args.adaround_iters)
                steps.append(
                    f"adaround({args.adaround_iters} iters/layer, {len(opt_feeds)} feeds, {time.time() - t:.0f}s)"
                )
            else:
                _set_stage("seqmse")
                t = time.time()
                apply_seq_mse(sim, opt_feeds, num_candidates=args.seqmse_candidates)
                steps.append(
                    f"seq_mse({args.seqmse_candidates} candidates, {len(opt_feeds)} feeds, {time.time() - t:.0f}s)"
                )
                from aimet_onnx.common.defs import QuantScheme

                params = set(sim.param_names)
                switched = 0
                for name, q in sim.qc_quantize_op_dict.items():
                    if name not in params:
                        q.set_quant_scheme(QuantScheme.post_training_tf_enhanced)
                        switched += 1
                sim._quant_scheme = QuantScheme.post_training_tf_enhanced  # pylint: disable=protected-access
                steps.append(f"activation quantizers -> tf_enhanced ({switched})")

        _set_stage("compute_encodings")
        t = time.time()
        sim.compute_encodings(feeds)
        steps.append(f"compute_encodings({len(feeds)} feeds, {time.time() - t:.0f}s)")
        if args.clamp_activations > 0:
            from aimet_onnx.quantsim import clamp_activation_encodings

            clamp_activation_encodings(sim, args.clamp_activations)
            steps.append(f"clamp_activation_encodings({args.clamp_activations:g})")

        _set_stage("export")
        qdq = sim.to_onnx_qdq(export_int32_bias=True, prequantize_constants=True, force_activation_as="unsigned")
        out_dir = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(out_dir, exist_ok=True)
        if qdq.ByteSize() > 1_800_000_000:
            onnx.save(qdq, args.out, save_as_external_data=True)
        else:
            onnx.save(qdq, args.out)
        n_q = sum(1 for n in qdq.graph.node if n.op_type == "QuantizeLinear")
        n_dq = sum(1 for n in qdq.graph.node if n.op_type == "DequantizeLinear")
        steps.append(f"to_onnx_qdq(QuantizeLinear {n_q}, DequantizeLinear {n_dq}, int32 bias, uint8 activations)")

        _set_stage("verify_ort")
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        sess = ort.InferenceSession(args.out, so, providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        sess.run(None, {k: feeds[0][k] for k in names})
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - one line on stderr is the contract
        if os.environ.get("AIMET_PEER_TRACEBACK"):
            traceback.print_exc()
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"aimet_peer: error: {_stage}: {type(e).__name__}: {msg}"[:2000], file=sys.stderr)
        return 1

    print(json.dumps({
        "recipe": args.recipe,
        "steps": steps,
        "seconds": round(time.time() - t0, 1),
        "out": os.path.abspath(args.out),
        "aimet_onnx": aimet_onnx.__version__,
        "onnxruntime": ort.__version__,
        "torch": torch.__version__,
        "calib": args.calib,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
