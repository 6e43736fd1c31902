"""The float-exact passes quantize runs before calibration, one module per pass with its rewrite, and
what they share: ``sequence`` (the passes in order under one postcondition, ``run_passes``),
``postcondition`` (the float-exact rule), ``graph_edit`` (the constant editor), ``activations`` (the
float activations a pass reads), ``scale_folding``, ``equalization`` and ``smoothing``. RNN lowering
(``pipeline.transforms.rnn``) runs first, as a pass of ``sequence`` too.

Equalization and smoothing rescale channels so that a quantization grid fits them better:

Both transforms rescale channels so that a quantization grid fits them better, without changing what
the float model computes (up to float rounding of the rescaled constants):

- ``equalize_cross_layer``: cross-layer equalization (Nagel et al. 2019, "Data-Free Quantization";
  AIMET's CLE). For Conv -> [Relu | LeakyRelu] -> Conv, output channel i of the first conv is divided
  by s_i and input channel i of the second multiplied by s_i, with s_i = sqrt(r1_i / r2_i) so both
  per-channel weight ranges become sqrt(r1_i * r2_i). Exact because Relu and LeakyRelu are positively
  homogeneous (f(x / s) = f(x) / s for s > 0). Clip (Relu6) is not: ONNX Clip takes scalar bounds, so
  the per-channel bound 6 / s_i cannot be expressed, and such pairs are left alone.
- ``smooth_outliers``: SmoothQuant-style outlier migration (Xiao et al. 2023). An activation read by
  MatMul/Gemm with constant weights is divided per channel by s and the weights' input rows multiplied
  by s; 1/s is folded into the tensor's producer when it is a linear op with constants
  (LayerNormalization, Mul by a constant, MatMul/Gemm, followed by any chain of constant bias Adds),
  else a ``Mul(t, 1/s)`` is inserted before the smoothed consumers. alpha is chosen per tensor by the
  output error of int8 Q/DQ math on sampled activation rows.

Both are pure functions: the input model is never mutated; they return a new model and JSON-able
records of what changed.
"""
