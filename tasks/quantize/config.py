"""Schema of the `quantize` group (spec keys close to TAO's modelopt.onnx static-PTQ backend)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import DictConfig

from pipeline.quant.placement import PLACEMENTS


class Algorithm(str, Enum):
    minmax = "minmax"  # observed min/max (asymmetric where the dtype allows)
    max = "max"  # symmetric absolute max
    entropy = "entropy"  # KL-divergence threshold search over a histogram
    percentile = "percentile"  # `percentile` of |x|
    # the clip with the lowest quantization MSE per tensor and dtype (signed histogram); weights get a
    # per-channel clip search too
    mse = "mse"
    # whichever of minmax/percentile/entropy/mse everywhere, or each tensor's lowest-MSE one of them, gives
    # the PTQ model the lowest held-out output error (one calibration pass collects them all)
    auto = "auto"


class QDtype(str, Enum):
    int8 = "int8"
    fp8_e4m3fn = "fp8_e4m3fn"
    fp8_e5m2 = "fp8_e5m2"
    native = "native"  # leave in float


# `quantize.placement`: auto (the configured backend's own) or one of the placement kinds a runtime
# declares (pipeline.quant.placement.PLACEMENTS: whose fusions the Q/DQ follow)
Placement = Enum("Placement", {"auto": "auto", **{name: name for name in PLACEMENTS}}, type=str)


class ActivationType(str, Enum):
    auto = "auto"  # uint8 asymmetric for onnxruntime placement, int8 symmetric for TensorRT
    int8 = "int8"
    uint8 = "uint8"


class WeightRange(str, Enum):
    """Storage of int8 weights (ONNX Runtime placement; TensorRT placements keep full range unless forced)."""

    auto = "auto"  # full where the fused kernels are exact here, else the fastest exact variant (measured)
    full = "full"  # int8 in [-127, 127]
    reduced = "reduced"  # int8 in [-64, 64]: ORT's reduce_range, exact in u8 x s8 kernels without VNNI
    uint8 = "uint8"  # uint8 with zero point 128: ORT's U8U8 kernels, exact on every CPU


@dataclass
class DtypeSpec:
    dtype: QDtype = QDtype.int8


@dataclass
class LayerRule:
    # ONNX op type (Conv, Gemm, MatMul, ...), a node-name wildcard (/layer1/*), or "*" for all
    module_name: str = "*"
    weights: DtypeSpec = field(default_factory=DtypeSpec)
    activations: DtypeSpec = field(default_factory=DtypeSpec)


@dataclass
class CalibrationConfig:
    batches: int = 16  # calibration batches of model.batch_size samples (streamed)
    num_bins: int = 2048  # histogram bins for entropy / percentile
    # bound on calibration's working set (the weights, held by this process and by ONNX Runtime, plus one
    # batch of the observed tensors): past it the tensors are observed in groups, the model running once
    # per group and batch; weights alone over it are a one-line error. None: 80% of this machine's memory
    max_memory_gb: Optional[float] = None


@dataclass
class QuantizeConfig:
    mode: str = "static_ptq"
    algorithm: Algorithm = Algorithm.auto
    percentile: float = 99.99
    # rules are matched in order, first match wins; nodes no rule matches stay float
    layers: list[LayerRule] = field(default_factory=lambda: [LayerRule()])
    skip_names: list[str] = field(default_factory=list)  # node-name wildcards left in float
    op_types_to_quantize: list[str] = field(default_factory=list)  # empty: every supported op type
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    placement: Placement = Placement.auto  # whose fusions the Q/DQ follow; auto: the backend's own
    activation_type: ActivationType = ActivationType.auto  # auto: uint8 for CPU runtimes' kernels, else int8
    per_channel: bool = True  # per-output-channel weight scales
    # auto: full-range int8 where this CPU (and every target kind) computes it exactly, else 7-bit or uint8
    weight_range: WeightRange = WeightRange.auto
    # unroll LSTM nodes with a static sequence length (<= 64 steps) into MatMul and element-wise ops, so
    # their input and recurrent matrix products are quantized (kept only if the float outputs move by <= 1e-5)
    lower_rnn: bool = True
    # float-exact transforms before calibration, each kept only if the float outputs move by <= 1e-5:
    # a constant Div/Mul on an activation x activation MatMul's output (attention's 1/sqrt(d)) is folded
    # into the linear layer before one of its inputs, so no float op runs between the integer MatMul and
    # the Softmax ...
    fold_scales: bool = True
    # ... cross-layer equalization of Conv -> (Relu|LeakyRelu) -> Conv pairs (depthwise too) ...
    equalization: bool = True
    # ... and migration of outlier activation channels of MatMul/Gemm inputs into their producer
    # (SmoothQuant-style, strength chosen per layer by the measured int8 error)
    smoothing: bool = True
    # after placement: subtract the mean output shift quantization adds to each quantized node's bias,
    # kept only when it lowers the held-out error
    bias_correction: bool = True
    # when the PTQ model misses the accuracy budget, element-wise nodes (Add, Mul, Concat, ...) on a
    # tensor whose largest channel exceeds this many times the median channel are left float first,
    # before any node is ranked (0: off); BERT's FFN-output residual adds measure 40-230, others < 10
    outlier_threshold: float = 32.0
    use_external_data_format: bool = False


SCHEMA = QuantizeConfig


def validate(cfg: DictConfig) -> list[str]:
    q = cfg.quantize
    problems = []
    if q.mode != "static_ptq":
        problems.append(f"quantize.mode={q.mode}: only static_ptq is supported")
    if not 50.0 < q.percentile <= 100.0:
        problems.append(f"quantize.percentile={q.percentile}: must be in (50, 100]")
    if q.calibration.batches < 1:
        problems.append(f"quantize.calibration.batches={q.calibration.batches}: must be >= 1")
    if q.outlier_threshold < 0:
        problems.append(f"quantize.outlier_threshold={q.outlier_threshold}: must be >= 0 (0 turns it off)")
    if q.calibration.max_memory_gb is not None and not q.calibration.max_memory_gb > 0:
        problems.append(f"quantize.calibration.max_memory_gb={q.calibration.max_memory_gb}: must be > 0 "
                        "(or null: 80% of this machine's memory)")
    if q.calibration.num_bins < 128:
        problems.append(f"quantize.calibration.num_bins={q.calibration.num_bins}: must be >= 128")
    for i, rule in enumerate(q.layers):
        if not str(rule.module_name).strip():
            problems.append(f"quantize.layers[{i}].module_name: empty; use an op type, a wildcard or '*'")
    return problems
