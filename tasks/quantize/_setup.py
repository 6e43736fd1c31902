"""What one quantize run shares, built once: the float model and its layer rules, the calibration data,
the ONNX Runtime backend every calibration and check runs on, the held-out checker, and the placement
kind and activation type of the configured backend (see ``QuantizeSetup.create``)."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx
from omegaconf import DictConfig

from pipeline.accuracy.budget import AccuracyBudget
from pipeline.accuracy.holdout import Holdout
from pipeline.backends import Backend, activation_type, compute_backend, judging_backend, placement_kind
from pipeline.calibrate.collect import CalibrationMethod, collect
from pipeline.data.adapters import Batch, DataProvider
from pipeline.graph.model import input_specs, model_hash
from pipeline.progress import progress_bar
from pipeline.quant.calibration import Calibration, TensorStats, WeightCache, activation_dtypes
from pipeline.quant.cpu import decision_facts
from pipeline.quant.placement import NodeDtypes, PlacementKind, resolve_rules
from pipeline.quant.plan import WeightVariant
from pipeline.quant.shared_stats import collect_once
from pipeline.transforms.record import TransformRecord
from pipeline.values import enum_value, section
from tasks.quantize.checker import Checker, temp_workdir
from tasks.quantize.passes.sequence import PassContext, RnnLowering, run_passes

log = logging.getLogger("tune.quantize")


@dataclass(frozen=True)
class QuantizeSetup:
    """What every step of a quantize run shares (see ``QuantizeStage.run``)."""

    cfg: DictConfig
    out_dir: Path
    # the float graph as calibrated before the float-exact transforms: export's model, with its LSTMs
    # unrolled where that is exact (``lowering``, None when quantize.lower_rnn is off)
    model: onnx.ModelProto
    rules: dict[str, NodeDtypes]
    lowering: TransformRecord | None
    provider: DataProvider
    total: int  # calibration batches: quantize.calibration.batches less any the holdout needs
    backend: Backend  # the compute backend (ONNX Runtime): calibration runs on it (checks: on the checker's)
    checker: Checker
    kind: PlacementKind
    act_type: str
    work: tempfile.TemporaryDirectory  # the candidates checked on the holdout; removed when decided
    start_weights: WeightVariant  # the weight storage the default placement and the held-out choices use (WeightVariant.start)
    # weight scales searched so far, shared by every Calibration of the run (see Calibration)
    weight_cache: WeightCache = field(default_factory=WeightCache)

    @classmethod
    def create(cls, cfg: DictConfig, out_dir: Path, float_path: Path, model: onnx.ModelProto,
               rules: dict[str, NodeDtypes]) -> QuantizeSetup:
        """The setup of ``model`` (export's, at ``float_path``) with its non-empty ``rules``."""
        from pipeline.graph.memory import check_weights_fit, memory_limit_bytes

        q = cfg.quantize
        check_weights_fit(model, memory_limit_bytes(q.calibration.max_memory_gb), "quantize.calibration.max_memory_gb")
        specs = input_specs(model)
        provider = DataProvider(cfg, specs)
        holdout = Holdout.from_config(cfg, specs, model=model)
        n_batches = total = holdout.split.calibration_batches  # never the held-out ones
        backend = compute_backend(cfg)
        kind = placement_kind(cfg)
        act_type = activation_type(cfg)
        with backend.prepare(float_path) as pm:
            holdout.set_reference(pm)
        work = temp_workdir(out_dir)
        # placements of fused CPU kernels are checked with the kernels that will run them, others as Q/DQ math
        checker = Checker(judging_backend(cfg, backend), holdout, AccuracyBudget.from_config(cfg),
                          fused=kind.cpu_kernels, workdir=Path(work.name))
        lowering = None
        if bool(q.lower_rnn):
            ctx = PassContext(q, lambda: provider.batches("calibration", n_batches), backend.threads,
                               activation_type(cfg))
            model, (lowering,) = run_passes(model, [RnnLowering()], ctx)
            if lowering.applied:
                rules = resolve_rules(model, q.layers, q.skip_names, q.op_types_to_quantize)
        saturates = kind.cpu_kernels and bool(decision_facts().u8s8_saturates)
        return cls(cfg, out_dir, model, rules, lowering, provider, total, backend, checker, kind, act_type, work,
                   WeightVariant.start(q.weight_range, saturates))

    @property
    def q(self) -> DictConfig:
        return self.cfg.quantize

    @property
    def builder(self) -> Callable[..., Any]:
        """The placement of the configured backend's fusions: ``builder(model, rules, act_type, ...)``."""
        return self.kind.builder

    def batches(self) -> Iterable[Batch]:
        return self.provider.batches("calibration", self.total)

    def progress(self, it: Iterable[Batch], desc: str) -> Iterable[Batch]:
        return progress_bar(bool(self.cfg.progress), iterable=it, total=self.total, desc=f"quantize: {desc}",
                            unit="batch")

    def calibrate(self, model: onnx.ModelProto) -> dict[str, TensorStats]:
        """Statistics of every candidate tensor of ``model`` on the calibration batches."""
        q = self.q
        method = CalibrationMethod(enum_value(q.algorithm), float(q.percentile), int(q.calibration.num_bins),
                                   activation_dtypes(self.cfg))
        # what the statistics depend on (backend=auto's runtimes share them: pipeline.quant.shared_stats)
        key = {"model": model_hash(model), "method": asdict(method), "batches": self.total, "seed": int(self.cfg.seed),
               "data": section(self.cfg, "data"), "fixed_inputs": section(self.cfg, "model.fixed_inputs")}
        return collect_once(key, lambda: collect(model, self.batches, method, self.backend.threads, self.progress,
                                                 self.max_bytes))

    def calibration_of(self, stats: dict[str, TensorStats], weight_clip: str) -> Calibration:
        """A Calibration of ``stats`` that shares the weight scales this run has searched: they do not
        depend on the activation statistics (a 2.4 GB model's five range candidates searched its 9 x 67M
        weights five times)."""
        calibration = Calibration(stats, weight_clip=weight_clip)
        calibration.weight_cache = self.weight_cache
        return calibration

    @property
    def max_bytes(self) -> float:
        """The working-set bound of the passes that observe tensors (quantize.calibration.max_memory_gb)."""
        from pipeline.graph.memory import memory_limit_bytes

        return memory_limit_bytes(self.q.calibration.max_memory_gb)
