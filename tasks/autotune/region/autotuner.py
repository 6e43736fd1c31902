"""QDQAutotuner: the ask/tell driver of the region-mode search.

    autotuner = QDQAutotuner(model)
    autotuner.initialize(config, pattern_cache)
    for region in autotuner.regions:
        autotuner.set_profile_region(region, commit=True)
        if autotuner.current_profile_pattern_schemes is None:
            continue                      # pattern already profiled
        while (idx := autotuner.generate()) != -1:
            data = autotuner.export_onnx(None)
            autotuner.submit(measure(data))
    autotuner.set_profile_region(None, commit=True)
    autotuner.export_onnx("optimized_final.onnx")

Every region of a pattern shares the scheme being profiled. While a pattern is profiled, patterns
already profiled use their committed best and patterns not yet profiled use their QDQ-baseline
scheme, so each candidate is measured in the context of a realistic quantized model: fusions in a
runtime depend on the neighbours (a Q is only free if the next op consumes it quantized).

Scheme generation is deterministic given the state (so a resumed run continues exactly where the
killed one stopped): seeds first (QDQ baseline, pattern-cache entries, none, all), then coordinate
descent (toggle one fused group of the best scheme so far), then random mutations of the top
schemes (``top_percent_to_mutate``, at least ``minimum_schemes_to_mutate``, up to
``maximum_mutations`` group toggles), giving up after ``maximum_generation_attempts`` duplicates.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from pipeline.graph.index import GraphIndex
from pipeline.graph.model import model_hash, save_model
from pipeline.quant.calibration import Calibration
from pipeline.quant.placement import DEFAULT_PLACEMENT, NodeDtypes
from pipeline.quant.plan import WeightVariant
from pipeline.quant.qdq import apply_plan, get_quantized_tensors, raise_opset
from tasks.autotune.config import AutotuneConfig
from tasks.autotune.region.autotuner_state import TunerState
from tasks.autotune.region.insertion_points import InsertionPoint, candidate_points, point_groups, resolve
from tasks.autotune.region.pattern import RegionPattern
from tasks.autotune.region.pattern_cache import PatternCache
from tasks.autotune.region.plan_builder import PlanBuilder
from tasks.autotune.region.region import Region
from tasks.autotune.region.scheme import (
    InsertionScheme,
    Measurement,
    PatternSchemes,
    SchemeRecord,
    rank_by_ratio,
)

log = logging.getLogger("tune.autotune")

# Config takes its defaults from the stage schema: one place for every number the two share
_SCHEMA = AutotuneConfig()
# fields Config shares with the `autotune` config group, by name (the stage copies them over)
SHARED_FIELDS = ("default_q_scale", "default_q_zero_point", "top_percent_to_mutate", "minimum_schemes_to_mutate",
                 "maximum_mutations", "maximum_generation_attempts", "pattern_cache_minimum_distance",
                 "pattern_cache_max_entries_per_pattern", "maximum_sequence_region_size",
                 "minimum_topdown_search_size", "verbose", "warm_start_budget")


@dataclass
class Config:
    """Autotuner settings; the first block carries the reference tool's names and defaults."""

    default_quant_type: str = "int8"  # int8 | fp8
    default_dq_dtype: str = _SCHEMA.default_dq_dtype.value  # DQ output type where the consumer's is unknown
    default_q_scale: float = _SCHEMA.default_q_scale  # only where calibration.json has no range for a tensor
    default_q_zero_point: int = _SCHEMA.default_q_zero_point
    top_percent_to_mutate: float = _SCHEMA.top_percent_to_mutate
    minimum_schemes_to_mutate: int = _SCHEMA.minimum_schemes_to_mutate
    maximum_mutations: int = _SCHEMA.maximum_mutations
    maximum_generation_attempts: int = _SCHEMA.maximum_generation_attempts
    pattern_cache_minimum_distance: int = _SCHEMA.pattern_cache_minimum_distance
    pattern_cache_max_entries_per_pattern: int = _SCHEMA.pattern_cache_max_entries_per_pattern
    maximum_sequence_region_size: int = _SCHEMA.maximum_sequence_region_size
    minimum_topdown_search_size: int = _SCHEMA.minimum_topdown_search_size
    verbose: bool = _SCHEMA.verbose
    # qdq-tune additions
    schemes_per_region: int = 30
    placement: str = DEFAULT_PLACEMENT  # whose fusions shape the search space: a name in PLACEMENTS
    activation_type: str = "int8"  # storage of int8 activations: int8 (symmetric) | uint8 (ORT CPU)
    weight_range: WeightVariant = WeightVariant.full  # storage of int8 weights: the quantize stage's choice
    seed: int = 0
    warm_start_budget: float = _SCHEMA.warm_start_budget  # share of schemes_per_region for cached patterns
    node_filter_list: list[str] = field(default_factory=list)  # node-name wildcards; others are skipped
    # node -> dtypes from the quantize stage's rules (real mixed precision); None: uniform quant type
    node_dtypes: dict[str, NodeDtypes] | None = None
    # nodes the quantize stage left float to meet the accuracy budget (never quantized here either)
    float_nodes: list[str] = field(default_factory=list)


def _uniform_dtypes(model: onnx.ModelProto, quant_type: str) -> dict[str, NodeDtypes]:
    dt = "fp8_e4m3fn" if quant_type == "fp8" else "int8"
    return {n.name: NodeDtypes(dt, dt, f"autotune quant_type={quant_type}") for n in model.graph.node}


def _quantized_reads(baseline: onnx.ModelProto) -> tuple[set[str], set[tuple[str, int]]]:
    """The tensors a Q/DQ model quantizes, and the (node, input) pairs that read a DQ output."""
    dq_out = {n.output[0] for n in baseline.graph.node if n.op_type == "DequantizeLinear"}
    return get_quantized_tensors(baseline), {(n.name, k) for n in baseline.graph.node
                                            for k, t in enumerate(n.input) if t in dq_out}


def _flip(points: set[InsertionPoint], group: tuple[InsertionPoint, ...]) -> set[InsertionPoint]:
    """Remove a fused group that is fully in ``points``, else add all of it."""
    return points - set(group) if set(group) <= points else points | set(group)


class QDQAutotunerBase(PlanBuilder, TunerState):
    """Search machinery over a given list of regions (subclasses choose the regions); plan building
    (plan_builder.py) and state save/load (autotuner_state.py) are its mixins."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.index = GraphIndex(model)
        self.regions: list[Region] = []
        self.config = Config()
        self.calibration = Calibration(default_scale=0.1)
        self.pattern_cache: PatternCache | None = None
        self.patterns: dict[int, RegionPattern] = {}  # region id -> pattern
        self.orders: dict[int, list[int]] = {}  # region id -> canonical node order
        self.pattern_schemes: dict[str, PatternSchemes] = {}
        self.pattern_regions: dict[str, list[Region]] = {}
        self.skipped_regions: set[int] = set()
        self.baseline_latency_ms: float | None = None
        self.current_profile_region: Region | None = None
        self.current_profile_pattern_schemes: PatternSchemes | None = None
        self._pending: SchemeRecord | None = None
        self._dtypes: dict[str, NodeDtypes] = {}
        self.profiled_patterns: set[str] = set()
        self._model_sha = ""
        self._export_base: onnx.ModelProto | None = None
        # fingerprint of everything besides the model that measurements depend on (calibration, QDQ
        # baseline, backend, rules); a state file made under another context is refused
        self.context: str | None = None

    # ------------------------------------------------------------------ setup
    def initialize(self, config: Config | None = None, pattern_cache: PatternCache | None = None,
                   calibration: Calibration | None = None, regions: list[Region] | None = None) -> None:
        """Set up the search over ``regions`` (given by the caller, e.g. subgraph mode's fusion
        groups), else over ``self.regions`` if already set, else over ``discover_regions()``."""
        self.config = config or Config()
        self.pattern_cache = pattern_cache or PatternCache(self.config.pattern_cache_minimum_distance,
                                                           self.config.pattern_cache_max_entries_per_pattern)
        self.calibration = calibration or Calibration(default_scale=self.config.default_q_scale,
                                                      default_zero_point=self.config.default_q_zero_point)
        self._dtypes = (dict(self.config.node_dtypes) if self.config.node_dtypes is not None
                        else _uniform_dtypes(self.model, self.config.default_quant_type))
        for name in self.config.float_nodes:
            self._dtypes.pop(name, None)
        if regions is not None:
            self.regions = list(regions)
        elif not self.regions:
            self.regions = self.discover_regions()
        filters = list(self.config.node_filter_list)
        names = [n.name for n in self.model.graph.node]
        for r in self.regions:
            pattern, order = RegionPattern.with_order(r, self.model, self.index)
            self.patterns[r.id] = pattern
            self.orders[r.id] = order
            self.pattern_regions.setdefault(pattern.signature, []).append(r)
            if filters and not any(fnmatch.fnmatchcase(names[i], f) for i in order for f in filters):
                self.skipped_regions.add(r.id)
        # patterns with a region node_filter_list keeps; skipped regions still get their pattern's
        # QDQ-baseline scheme, they are just never profiled
        self.profiled_patterns = {self.patterns[r.id].signature for r in self.regions if r.id not in self.skipped_regions}
        allowed = {n for n, d in self._dtypes.items() if d.activations != "native"}
        for sig, regions in self.pattern_regions.items():
            # the points of all its regions: its first region may be left float (float_nodes) and have
            # none, and export skips the points of float nodes region by region anyway
            cands = sorted({p for r in regions for p in candidate_points(
                self.orders[r.id], self.model, self.index, self.config.placement, allowed,
                self.config.default_quant_type)})
            self.pattern_schemes[sig] = PatternSchemes(sig, cands)
        self._model_sha = model_hash(self.model)

    def discover_regions(self) -> list[Region]:
        raise NotImplementedError("QDQAutotunerBase needs regions: pass them to initialize(regions=...)")

    def dtypes_of(self, node_name: str) -> NodeDtypes | None:
        """The dtypes the search may give a node (after initialize()); None for nodes left float
        (no rule, or one of ``float_nodes``)."""
        return self._dtypes.get(node_name)

    @property
    def num_patterns(self) -> int:
        """Patterns to profile (those with a region node_filter_list keeps)."""
        return len(self.profiled_patterns)

    # ------------------------------------------------------------------ baseline import
    def import_insertion_points(self, tensor_names: set[str] | list[str]) -> int:
        """Seed each pattern with the points that quantize the given tensors (e.g. a QDQ baseline's
        get_quantized_tensors). Returns the number of patterns seeded."""
        return self._import(set(tensor_names), None)

    def import_qdq_baseline(self, baseline: onnx.ModelProto) -> int:
        """Seed from a Q/DQ model, consumer by consumer (exact for placements that quantize a tensor
        for some consumers only)."""
        return self._import(*_quantized_reads(baseline))

    def baseline_assignment(self, baseline: onnx.ModelProto) -> dict[int, InsertionScheme]:
        """Region id -> the scheme of ``baseline``'s placement in that region (regions it leaves float
        are left out): the Q/DQ model region by region rather than one vote per pattern."""
        tensors, readers = _quantized_reads(baseline)
        out = {}
        for r in self.regions:
            s = self._region_scheme(r, tensors, readers)
            if len(s):
                out[r.id] = s
        return out

    def _region_scheme(self, r: Region, tensors: set[str], readers: set[tuple[str, int]] | None) -> InsertionScheme:
        pts = []
        for p in self.pattern_schemes[self.patterns[r.id].signature].candidates:
            rp = resolve(p, r, self.orders[r.id], self.model, self.index)
            if rp is None or rp.tensor not in tensors:
                continue
            if readers is not None:
                who = rp.consumers if rp.consumers is not None else tuple(
                    (c.name, k) for c, k in self.index.consumers.get(rp.tensor, []))
                if not set(who) <= readers:
                    continue
            pts.append(p)
        return InsertionScheme(frozenset(pts))

    def _import(self, tensors: set[str], readers: set[tuple[str, int]] | None) -> int:
        seeded = 0
        for sig, regions in self.pattern_regions.items():
            ps = self.pattern_schemes[sig]
            votes: dict[InsertionScheme, int] = {}
            for r in regions:
                s = self._region_scheme(r, tensors, readers)
                votes[s] = votes.get(s, 0) + 1
            best = max(votes.items(), key=lambda kv: (kv[1], len(kv[0])))[0]
            ps.baseline_scheme = best
            seeded += 1 if len(best) else 0
        return seeded

    # ------------------------------------------------------------------ ask / tell
    def set_profile_region(self, region: Region | None, commit: bool = True) -> None:
        """Commit the current pattern's best scheme (if ``commit``) and profile ``region``'s pattern.

        ``current_profile_pattern_schemes`` is None afterwards when the pattern is already profiled
        (or the region is skipped by node_filter_list): there is nothing to generate for it."""
        if commit and self.current_profile_pattern_schemes is not None:
            self.commit_current()
        self._pending = None
        self.current_profile_region = region
        self.current_profile_pattern_schemes = None
        if region is None or region.id in self.skipped_regions:
            return
        ps = self.pattern_schemes[self.patterns[region.id].signature]
        if not ps.done:
            self.current_profile_pattern_schemes = ps

    def commit_current(self) -> None:
        ps = self.current_profile_pattern_schemes
        if ps is None:
            return
        best = ps.best_scheme
        ps.best = best.scheme if best is not None else ps.baseline_scheme
        ps.done = True
        if best is not None and self.pattern_cache is not None:
            self.pattern_cache.add(ps.pattern, best.scheme, best.ratio)

    def _seeds(self, ps: PatternSchemes) -> list[tuple[InsertionScheme, str]]:
        seeds: list[tuple[InsertionScheme, str]] = []
        if self.pattern_cache is not None:  # measured winners from an earlier run come first
            cand = set(ps.candidates)
            for s in self.pattern_cache.schemes_for(ps.pattern):
                seeds.append((InsertionScheme(frozenset(p for p in s.points if p in cand)), "seed:cache"))
        if ps.baseline_scheme is not None:
            seeds.append((ps.baseline_scheme, "seed:baseline"))
        seeds.append((InsertionScheme(), "seed:none"))
        seeds.append((InsertionScheme(frozenset(ps.candidates)), "seed:all"))
        return seeds

    def _budget(self, ps: PatternSchemes) -> int:
        """schemes_per_region; a pattern the cache already holds winners for gets
        ``warm_start_budget`` of it (its seeds are tuned results: verify and refine them)."""
        budget = self.config.schemes_per_region
        cached = self.pattern_cache.schemes_for(ps.pattern) if self.pattern_cache is not None else []
        if cached:
            budget = max(len(cached) + 2, math.ceil(budget * self.config.warm_start_budget))
        return min(budget, self.config.schemes_per_region)

    def generate(self) -> int:
        """Create the next unique scheme for the current pattern; its index, or -1 when exhausted."""
        ps = self.current_profile_pattern_schemes
        if ps is None:
            return -1
        if self._pending is not None and not self._pending.measurements:
            return ps.records.index(self._pending)
        if len(ps.records) >= self._budget(ps):
            return -1
        tried = {r.scheme for r in ps.records}
        for scheme, origin in self._seeds(ps):
            if scheme not in tried:
                return self._add(ps, scheme, origin)
        groups = point_groups(ps.candidates)
        ranked = rank_by_ratio((r for r in ps.records if r.ok), lambda r: r.ratio, lambda r: r.scheme.key)
        if ranked:
            best = ranked[0].scheme
            for grp in self._toggle_order(ps, groups, best):  # coordinate descent: flip one fused group
                s = InsertionScheme(frozenset(_flip(set(best.points), grp)))
                if s not in tried:
                    return self._add(ps, s, "toggle")
        if not groups:
            return -1
        pool = ranked[: max(self.config.minimum_schemes_to_mutate,
                            math.ceil(self.config.top_percent_to_mutate * len(ranked)))] or \
            [SchemeRecord(InsertionScheme(), "empty")]
        for _ in range(self.config.maximum_generation_attempts):
            ps.generation_attempts += 1
            rng = random.Random(f"{self.config.seed}:{ps.pattern}:{ps.generation_attempts}")
            parent = rng.choice(pool).scheme
            pts = set(parent.points)
            for grp in rng.sample(groups, k=min(len(groups), rng.randint(1, self.config.maximum_mutations))):
                pts = _flip(pts, grp)
            s = InsertionScheme(frozenset(pts))
            if s not in tried:
                return self._add(ps, s, "mutation")
        return -1

    # binary elementwise groups decide fusions like Conv+Add / QLinearAdd vs SkipLayerNorm, weighted
    # ops carry the compute; data movement rarely matters: try toggles in that order
    _TOGGLE_PRIORITY = {"Add": 0, "Mul": 0, "Concat": 0, "Conv": 1, "ConvTranspose": 1, "Gemm": 1, "MatMul": 1,
                        "AveragePool": 2, "GlobalAveragePool": 2}

    def _toggle_order(self, ps: PatternSchemes, groups: list[tuple[InsertionPoint, ...]],
                      best: InsertionScheme) -> list[tuple[InsertionPoint, ...]]:
        """Additions before removals (the baseline already quantizes what usually pays), then by op."""
        r0 = self.pattern_regions[ps.pattern][0]
        ops = self.patterns[r0.id].op_types

        def key(grp: tuple[InsertionPoint, ...]) -> tuple[int, int, int]:
            p = grp[0]
            op = ops[p.index] if p.kind in ("node_input", "node_output") and p.index < len(ops) else ""
            adding = 0 if not set(grp) <= best.points else 1
            return adding, self._TOGGLE_PRIORITY.get(op, 3), p.index

        return sorted(groups, key=key)

    def _add(self, ps: PatternSchemes, scheme: InsertionScheme, origin: str) -> int:
        rec = SchemeRecord(scheme, origin)
        ps.records.append(rec)
        self._pending = rec
        return len(ps.records) - 1

    @property
    def pending_scheme(self) -> SchemeRecord | None:
        return self._pending

    def submit(self, latency_ms: float | Measurement, success: bool = True) -> None:
        """Record the measurement of the last generated scheme (before any region: the baseline)."""
        if isinstance(latency_ms, Measurement):
            m = latency_ms
        elif not success or not math.isfinite(float(latency_ms)):
            m = Measurement.failed("measurement failed")
        else:
            ref = self.baseline_latency_ms or float(latency_ms)
            m = Measurement(float(latency_ms), float(latency_ms) / ref, ref)
        if self.current_profile_pattern_schemes is None and self._pending is None:
            if m.ok:
                self.baseline_latency_ms = m.latency_ms
            return
        if self._pending is None:
            raise RuntimeError("submit() without a scheme from generate()")
        self._pending.measurements.append(m)
        self._pending = None

    # ------------------------------------------------------------------ export
    def assignment(self, candidate: InsertionScheme | None = None) -> dict[int, InsertionScheme]:
        """Region id -> scheme used for it now: committed best, the candidate for the pattern being
        profiled, the QDQ-baseline scheme for patterns not yet profiled and for skipped regions."""
        current = self.current_profile_pattern_schemes
        if candidate is None and self._pending is not None:
            candidate = self._pending.scheme
        out: dict[int, InsertionScheme] = {}
        for r in self.regions:
            ps = self.pattern_schemes[self.patterns[r.id].signature]
            if r.id in self.skipped_regions:
                chosen = ps.baseline_scheme
            elif current is not None and ps is current and candidate is not None:
                chosen = candidate
            elif ps.done and ps.best is not None:
                chosen = ps.best
            else:
                chosen = ps.baseline_scheme
            if chosen is not None:
                out[r.id] = chosen
        return out

    def export_model(self, insert_qdq: bool = True, assignment: dict[int, InsertionScheme] | None = None,
                     check: bool = True) -> onnx.ModelProto:
        if not insert_qdq:
            m = onnx.ModelProto()
            m.CopyFrom(self.model)
            return m
        plan = self.build_plan(self.assignment() if assignment is None else assignment)
        if self._export_base is None:
            # raise the opset once, not per candidate (the version converter is the slow part)
            target = 19 if any(d.activations.startswith("fp8") or d.weights.startswith("fp8")
                               for d in self._dtypes.values()) else 13
            self._export_base = raise_opset(self.model, target)
        dq_type = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16,
                   "bfloat16": onnx.TensorProto.BFLOAT16}[self.config.default_dq_dtype]
        return apply_plan(self._export_base, plan, self.calibration, default_float_type=dq_type, check=check)

    def export_onnx(self, output_path: str | Path | None = None, insert_qdq: bool = True) -> bytes | None:
        """Write the current model (or return its bytes when ``output_path`` is None)."""
        model = self.export_model(insert_qdq)
        if output_path is None:
            return model.SerializeToString()
        save_model(model, output_path)
        return None

    @property
    def num_measurements(self) -> int:
        return sum(len(r.measurements) for ps in self.pattern_schemes.values() for r in ps.records)


class QDQAutotuner(QDQAutotunerBase):
    """Autotuner with automatic region discovery (CombinedRegionSearch)."""

    def discover_regions(self) -> list[Region]:
        from tasks.autotune.region.search import discover_regions

        return discover_regions(self.model, self.config.maximum_sequence_region_size,
                                self.config.minimum_topdown_search_size)
