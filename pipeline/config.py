"""Structured-config schemas for the shared groups (model, data, backend) and the primary config.

Each YAML file under conf/ extends one of these dataclasses (``defaults: [base_<name>, _self_]``),
so Hydra rejects an unknown key or a wrong type at composition time, naming the full key. Stage
schemas live next to their stage (``tasks/<stage>/config.py``) and are registered here through the
stage registry. Checks that span fields run in ``validate`` and report every problem at once.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from pipeline import backend_config
from pipeline.artifacts import check_onnx_path, user_path
from pipeline.backend_config import CustomBackendConfig, auto_backend_schema, runtime_schema, runtime_section
from pipeline.errors import ConfigError, InputError
from pipeline.registry import stage_schemas, stage_validators
from pipeline.values import enum_value


class StageName(str, Enum):
    export = "export"
    quantize = "quantize"
    autotune = "autotune"
    gen_trt_engine = "gen_trt_engine"
    evaluate = "evaluate"


STAGE_ORDER = [s.value for s in StageName]


# --------------------------------------------------------------------------- model


class Exporter(str, Enum):
    torchscript = "torchscript"  # torch.onnx.export(dynamo=False): fast, plain op graph
    dynamo = "dynamo"  # torch.onnx.export(dynamo=True): needs onnxscript


@dataclass
class ModelConfig:
    name: str = MISSING
    batch_size: int = 1
    opset: int = 17
    exporter: Exporter = Exporter.torchscript
    # input name -> full static shape; fixes dynamic dims of an ONNX file or shapes a user model's inputs
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    # export verification: ORT output must match torch within atol + rtol * max|torch output|
    verify_atol: float = 1e-4
    verify_rtol: float = 1e-4


@dataclass
class DigitsCnnConfig(ModelConfig):
    """Small CNN trained on the fly on scikit-learn's bundled 8x8 digits, upsampled to image_size."""

    name: str = "digits_cnn"
    batch_size: int = 32
    image_size: int = 32
    channels: list[int] = field(default_factory=lambda: [32, 64, 128])
    epochs: int = 12
    learning_rate: float = 2e-3
    train_batch_size: int = 64


@dataclass
class ResNetConfig(ModelConfig):
    """Standard ResNet (BasicBlock for 18/34, Bottleneck for 50/101/152) with seeded random weights."""

    name: str = "resnet18"
    depth: int = 18
    input_size: int = 224
    in_channels: int = 3
    num_classes: int = 1000


@dataclass
class BertTinyConfig(ModelConfig):
    """BERT-style transformer encoder with seeded random weights, classification head on [CLS]."""

    name: str = "bert_tiny"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 512
    seq_len: int = 128
    vocab_size: int = 30522
    num_labels: int = 2


@dataclass
class OnnxModelConfig(ModelConfig):
    """An existing ONNX file: export is skipped, the file is validated and copied into results_dir."""

    name: str = "onnx"
    onnx_path: str = MISSING
    # keep the file's dynamic dims (a deployable dynamic-batch model): model.input_shapes then gives the
    # shapes calibration, timing and subgraph extraction use, recorded in the model's metadata
    keep_dynamic_shapes: bool = False
    # input name -> the value deployment always feeds (a sample rate, a mode flag): export binds it and
    # replaces the If nodes it and the static shapes decide by their taken branch (pipeline/transforms/specialize.py);
    # feeds that carry another value for it are refused
    fixed_inputs: dict[str, Any] = field(default_factory=dict)


@dataclass
class CustomModelConfig(ModelConfig):
    """A user nn.Module built from ``_target_`` (a dotted import path) called with ``args``."""

    name: str = "custom"
    _target_: str = MISSING
    args: dict[str, Any] = field(default_factory=dict)
    checkpoint: Optional[str] = None
    input_names: list[str] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    # input name -> numpy dtype name (default float32)
    input_dtypes: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- data


class DataSource(str, Enum):
    auto = "auto"  # digits for digits_cnn, synthetic for random-weight built-ins, none for user models
    digits = "digits"  # scikit-learn's bundled digits, labelled
    synthetic = "synthetic"  # seeded random data shaped from the model's inputs
    npz = "npz"  # a .npz file or a folder of .npy files
    custom = "custom"  # a user callable (_target_) returning a DataLoader or iterable
    none = "none"  # nothing configured: synthetic, with a warning that accuracy will suffer


@dataclass
class DataConfig:
    source: DataSource = DataSource.auto
    # fraction of digits held out for evaluation (split fixed by seed)
    test_fraction: float = 0.3
    # npz: calibration file/folder and (optional) evaluation file/folder
    path: Optional[str] = None
    eval_path: Optional[str] = None
    # array names in an .npz holding labels (ignored for inputs)
    labels_key: str = "labels"
    # single .npz / .npy data: the axis each input's samples run along (default 0); null for an input
    # without a batch axis (a scalar sample rate, ...), fed whole with every batch. A folder of .npz
    # files instead holds one complete feed per file (every input at the model's exact shape).
    batch_axes: dict[str, Optional[int]] = field(default_factory=dict)
    # custom: dotted path of a callable returning a DataLoader/iterable; gets `split=` if it accepts it
    _target_: Optional[str] = None
    args: dict[str, Any] = field(default_factory=dict)
    # dict batches: the key holding the input (default: input, data, x, images, images_left, images_right)
    key: Optional[str] = None
    # synthetic: number of samples per split
    num_samples: int = 256


# --------------------------------------------------------------------------- accuracy


class AccuracyMetric(str, Enum):
    auto = "auto"  # top1 with labels; else SNR on every output (+ agreement on decisive samples for class scores)
    top1 = "top1"
    agreement = "agreement"
    snr = "snr"
    cosine = "cosine"
    custom = "custom"  # accuracy.custom_metric: the user's function decides


class OutputMetric(str, Enum):  # what accuracy.per_output holds one output to
    snr = "snr"
    cosine = "cosine"
    agreement = "agreement"  # top-1 agreement with the float model on decisive samples (class scores)


@dataclass
class AccuracyConfig:
    """The accuracy budget every quantized model is held to (quantize's PTQ model, every autotune
    candidate, the shipped model, evaluate's verdicts), checked against the float model on
    calibration batches the calibrator did not see."""

    enabled: bool = True
    metric: AccuracyMetric = AccuracyMetric.auto
    max_drop: float = 1.0  # points of top-1 (with labels) or of top-1 agreement with the float model
    min_snr_db: float = 20.0  # output SNR vs float, every output (20 dB = 10% relative L2 error)
    min_cosine: float = 0.99
    # the held-out calibration samples every decision is judged on (pipeline/accuracy/holdout.py): at
    # least holdout_samples, holdout_fraction of the data when that is more, at most
    # holdout_max_samples; holdout_batches: that many batches instead
    holdout_samples: int = 32
    holdout_fraction: float = 0.25
    holdout_max_samples: int = 512
    holdout_batches: Optional[int] = None
    # a model passes only when the budget holds at this one-sided bootstrap bound of its metric over the
    # held-out samples (0.5: at the metric itself)
    confidence: float = 0.95
    # the outputs the budget judges (default: every output); the shipped model keeps all of them
    outputs: list[str] = field(default_factory=list)
    # a metric per output where one does not fit all, e.g. {sentence_embedding: cosine, logits: agreement}
    per_output: dict[str, OutputMetric] = field(default_factory=dict)
    # the outputs that hold class scores (agreement and top-1 are counted on them); null: the first
    # output when its shape says so ([N, C] or [N, S, C])
    class_outputs: Optional[list[str]] = None
    # metric=custom: "pkg.module.function", fn(outputs, reference, labels) -> float, higher is better
    # (pipeline.accuracy.budget.CustomMetric); budget: score(float) - score(model) <= max_drop
    custom_metric: Optional[str] = None
    relative: bool = False  # metric=custom: max_drop is a percentage of the float model's score
    # when the PTQ model misses the budget, leave its most error-sensitive nodes float (at most this
    # share of the quantized nodes) until it meets it
    recovery: bool = True
    max_float_fraction: float = 0.5
    # recovery stops this far inside the SNR budget (cosine, top-1 disagreement, custom drop: the same
    # factor), so that the nodes it quantizes again leave room for autotune's choices; autotune and
    # evaluate use the budget itself
    recovery_margin_db: float = 1.0
    # recovery's time allowance, as a multiple of what calibration and placement took before it (at least
    # 5 s): past it recovery checks nothing new and keeps the best float set it found; 0: no limit
    recovery_time_factor: float = 1.0


def _accuracy_problems(acc: DictConfig) -> list[str]:
    problems = []
    if acc.max_drop < 0:
        problems.append(f"accuracy.max_drop={acc.max_drop}: must be >= 0 (points)")
    if not -1.0 <= acc.min_cosine <= 1.0:
        problems.append(f"accuracy.min_cosine={acc.min_cosine}: must be in [-1, 1]")
    if acc.holdout_batches is not None and acc.holdout_batches < 1:
        problems.append(f"accuracy.holdout_batches={acc.holdout_batches}: must be >= 1 (or null: sized from "
                        f"accuracy.holdout_samples)")
    if acc.holdout_samples < 1 or acc.holdout_max_samples < acc.holdout_samples:
        problems.append(f"accuracy.holdout_samples={acc.holdout_samples}, holdout_max_samples="
                        f"{acc.holdout_max_samples}: need 1 <= holdout_samples <= holdout_max_samples")
    if not 0.0 < acc.holdout_fraction < 1.0:
        problems.append(f"accuracy.holdout_fraction={acc.holdout_fraction}: must be in (0, 1)")
    if not 0.5 <= acc.confidence < 1.0:
        problems.append(f"accuracy.confidence={acc.confidence}: must be in [0.5, 1) (0.95: the budget must hold at "
                        f"the 95% lower bound)")
    if acc.recovery_margin_db < 0:
        problems.append(f"accuracy.recovery_margin_db={acc.recovery_margin_db}: must be >= 0 (dB)")
    if acc.recovery_time_factor < 0:
        problems.append(f"accuracy.recovery_time_factor={acc.recovery_time_factor}: must be >= 0 (0: no limit)")
    if not 0.0 < acc.max_float_fraction <= 1.0:
        problems.append(f"accuracy.max_float_fraction={acc.max_float_fraction}: must be in (0, 1]")
    custom = enum_value(acc.metric) == "custom"
    if custom and not acc.custom_metric:
        problems.append("accuracy.metric=custom: set accuracy.custom_metric=pkg.module.function "
                        "(called as fn(outputs, reference, labels) -> float, higher is better)")
    elif acc.custom_metric and not custom:
        problems.append(f"accuracy.custom_metric={acc.custom_metric} is used only with accuracy.metric=custom")
    elif custom:
        from pipeline.registry import import_object

        try:
            fn = import_object(str(acc.custom_metric), "accuracy.custom_metric")
        except ConfigError as exc:
            problems.append(str(exc))
        else:
            if not callable(fn):
                problems.append(f"accuracy.custom_metric={acc.custom_metric} is a {type(fn).__name__}, not a function")
    return problems


_NOTED: set[str] = set()


def note_once(message: str) -> None:
    """One ``tune: <message>`` line on stderr per process: validation runs before the job and again
    in it, and a note about the config should be read once."""

    if message not in _NOTED:
        _NOTED.add(message)
        print(f"tune: {message}", file=sys.stderr)


def apply_aliases(cfg: DictConfig) -> None:
    """Move values set under the deprecated ``autotune.accuracy.*`` to ``accuracy.*`` (in place), with
    a one-line note per key, so both spellings compose the same run."""
    old = OmegaConf.select(cfg, "autotune.accuracy")
    if not isinstance(old, DictConfig) or not isinstance(cfg.get("accuracy"), DictConfig):
        return
    for key, value in list(old.items()):
        if value is None:
            continue
        cfg.accuracy[key] = value
        old[key] = None
        note_once(f"note: autotune.accuracy.{key} is deprecated; use accuracy.{key}")


# --------------------------------------------------------------------------- primary


# --------------------------------------------------------------------------- target


class CpuKindName(str, Enum):
    """A CPU kind `target.cpus` lists (pipeline.quant.cpu.KINDS says what each is), or x86: all."""

    avx2 = "avx2"
    avx512 = "avx512"
    avx_vnni = "avx_vnni"
    avx512_vnni = "avx512_vnni"
    amx = "amx"
    x86 = "x86"


@dataclass
class TargetConfig:
    """The CPU kinds the shipped deployment must be right on, beside the host it is tuned on (group
    `target`: host, x86). Numerics are chosen for the weakest kind (weights that cannot saturate u8 x s8
    kernels without VNNI; OpenVINO float layers in f32 unless every kind runs bf16), and the accuracy
    verdict is given per kind. Kinds: avx2, avx512, avx_vnni, avx512_vnni, amx; x86 is all of them."""

    cpus: list[CpuKindName] = field(default_factory=list)  # []: this host's kind only (target=host)


@dataclass
class TuneConfig:
    # the stages to run, in pipeline order whatever the order given; each is skipped when up to date
    stages: list[StageName] = field(default_factory=lambda: list(StageName))
    results_dir: str = MISSING  # where every stage reads and writes its artifacts (resumable)
    seed: int = 42  # seeds data splits, sampling and built-in models' weights
    progress: bool = True  # progress bars on a terminal
    # re-run the requested stages even when they are up to date
    force: bool = False
    model: Any = MISSING
    data: Any = MISSING
    backend: Any = MISSING
    export: Any = MISSING
    quantize: Any = MISSING
    autotune: Any = MISSING
    accuracy: Any = MISSING  # the accuracy budget (group `accuracy`), shared by every stage that makes a model
    target: Any = MISSING  # the CPU kinds the deployment must be right on (group `target`)
    gen_trt_engine: Any = MISSING
    evaluate: Any = MISSING


_SHARED_GROUPS: dict[str, dict[str, type]] = {
    "model": {
        "base_digits_cnn": DigitsCnnConfig,
        "base_resnet": ResNetConfig,
        "base_bert_tiny": BertTinyConfig,
        "base_onnx": OnnxModelConfig,
        "base_custom_model": CustomModelConfig,
    },
    "data": {"base_data": DataConfig},
    "accuracy": {"base_accuracy": AccuracyConfig},
    "target": {"base_target": TargetConfig},
}

_registered = False


def shared_groups() -> dict[str, dict[str, type]]:
    """group -> {schema name: dataclass} of the groups every stage shares (model, data, accuracy, target,
    backend); the stages' own groups come from ``pipeline.registry.stage_schemas``. The backend group has
    one schema per built-in runtime's class (runtimes that share one, as TensorRT and TensorRT-RTX do, under
    the first one's name), custom's and auto's."""
    backend: dict[str, type] = {}
    for r in backend_config.RUNTIMES:
        if runtime_schema(r) not in backend.values():
            backend[f"base_{r.name}"] = runtime_schema(r)
    backend |= {"base_custom_backend": CustomBackendConfig, "base_auto_backend": auto_backend_schema()}
    return {**{group: dict(schemas) for group, schemas in _SHARED_GROUPS.items()}, "backend": backend}


def _backend_nodes() -> dict[str, Any]:
    """The backend group's ConfigStore entries: ``base_<name>`` for every built-in runtime (its schema with its
    name), custom's and auto's."""
    nodes: dict[str, Any] = {f"base_{r.name}": runtime_section(r) for r in backend_config.RUNTIMES}
    return nodes | {"base_custom_backend": CustomBackendConfig, "base_auto_backend": auto_backend_schema()}


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent)."""
    global _registered
    if _registered:
        return
    cs = ConfigStore.instance()
    cs.store(name="base_tune", node=TuneConfig)
    for group, schemas in [*_SHARED_GROUPS.items(), ("backend", _backend_nodes())]:
        for name, node in schemas.items():
            cs.store(group=group, name=name, node=node)
    for stage, schema in stage_schemas().items():
        cs.store(group=stage, name=f"base_{stage}", node=schema)
    _registered = True


# sizes of the built-in architectures: zero or negative values would fail deep inside torch
_POSITIVE_MODEL_KEYS = ("input_size", "image_size", "in_channels", "num_classes", "hidden_size", "num_layers",
                        "num_heads", "intermediate_size", "seq_len", "vocab_size", "num_labels", "epochs",
                        "train_batch_size", "depth")


def validate(cfg: DictConfig) -> None:
    """Cross-field checks for the whole config; raises one ConfigError listing every problem."""
    apply_aliases(cfg)
    problems: list[str] = []
    for key in ("model", "data", "backend", "accuracy", "target"):
        if not isinstance(cfg.get(key), DictConfig):
            problems.append(f"{key}: missing config group; choose one with {key}=<option>")
    if problems:
        raise ConfigError(problems)
    problems += _unknown_keys(cfg, "")
    missing = sorted(OmegaConf.missing_keys(cfg))
    problems += [f"{k}: required value is missing; set it with {k}=..." for k in missing]
    if cfg.model.batch_size < 1:
        problems.append(f"model.batch_size={cfg.model.batch_size}: must be >= 1")
    for key in _POSITIVE_MODEL_KEYS:
        v = cfg.model.get(key)
        if isinstance(v, int) and v < 1:
            problems.append(f"model.{key}={v}: must be >= 1")
    if not 7 <= cfg.model.opset <= 23:
        problems.append(f"model.opset={cfg.model.opset}: supported opsets are 7..23")
    if cfg.model.name == "onnx" and not OmegaConf.is_missing(cfg.model, "onnx_path"):
        try:
            check_onnx_path(user_path(cfg.model.onnx_path), "model.onnx_path")
        except InputError as exc:
            problems.append(str(exc))
    if cfg.data.source == DataSource.npz and not cfg.data.path:
        problems.append("data.path: required for data=npz (a .npz file or a folder of .npy files)")
    if cfg.data.source == DataSource.custom and not cfg.data.get("_target_"):
        problems.append("data._target_: required for data=custom (dotted path of a callable)")
    if not 0.0 < cfg.data.test_fraction < 1.0:
        problems.append(f"data.test_fraction={cfg.data.test_fraction}: must be in (0, 1)")
    fp = cfg.backend.get("float_precision")
    if fp is not None and str(fp).upper() not in ("FP32", "FP16", "BF16"):
        problems.append(f"backend.float_precision={fp}: choose FP32, FP16 or BF16")
    if cfg.backend.warmup_runs < 0 or cfg.backend.timing_runs < 1:
        problems.append("backend.warmup_runs must be >= 0 and backend.timing_runs >= 1")
    if not cfg.backend.get("min_block_ms", 0.0) >= 0:
        problems.append(f"backend.min_block_ms={cfg.backend.min_block_ms}: must be >= 0 (0: blocks of timing_runs only)")
    if len(set(cfg.stages)) != len(cfg.stages):
        problems.append(f"stages={list(cfg.stages)}: a stage is listed twice")
    problems += _accuracy_problems(cfg.accuracy)
    for stage, check in stage_validators().items():
        if isinstance(cfg.get(stage), DictConfig):
            problems += check(cfg)
    if problems:
        raise ConfigError(problems)


def _unknown_keys(node: Any, path: str) -> list[str]:
    """Keys a schema does not declare (e.g. added with `+key=`): a typo would otherwise be ignored."""

    out: list[str] = []
    if isinstance(node, DictConfig):
        otype = OmegaConf.get_type(node)
        fields = {f.name for f in dataclasses.fields(otype)} if dataclasses.is_dataclass(otype) else None
        for key in node.keys():
            full = f"{path}.{key}" if path else str(key)
            if fields is not None and key not in fields:
                problems = f"unknown config key '{full}'; allowed: {', '.join(sorted(fields))}"
                out.append(problems)
                continue
            child = node._get_node(key)
            if isinstance(child, (DictConfig, ListConfig)):
                out += _unknown_keys(child, full)
    elif isinstance(node, ListConfig) and not node._is_none():
        for i, child in enumerate(node):
            out += _unknown_keys(child, f"{path}[{i}]")
    return out




def resolved_data_source(cfg: DictConfig) -> str:
    """`data.source` with `auto` resolved from the model."""
    src = cfg.data.source
    src = enum_value(src)
    if src != "auto":
        return src
    name = str(cfg.model.name)
    if name == "digits_cnn":
        return "digits"
    if name in ("onnx", "custom"):
        return "none"
    return "synthetic"


def ordered_stages(cfg: DictConfig) -> list[str]:
    """The requested stages in pipeline order (the order in the spec does not matter)."""
    wanted = {enum_value(s) for s in cfg.stages}
    return [s for s in STAGE_ORDER if s in wanted]
