"""The trtexec command line: ``TrtexecRun`` (one invocation's options -> argv), ``TrtexecEngine`` (a
saved engine and what every run of it repeats), trtexec's NAME:DxD shape syntax, and the flag groups
the backend drops (profiling flags an old trtexec rejects, the full model's shapes for subgraphs).

What trtexec prints and writes back is read by ``pipeline.backends.tensorrt.trtexec_parse``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import InputError

PROFILING_FLAGS = ("--profilingVerbosity", "--exportProfile", "--exportLayerInfo", "--separateProfileRun",
                   "--dumpProfile", "--dumpLayerInfo")

SHAPE_FLAGS = ("--minShapes", "--optShapes", "--maxShapes", "--shapes")


def parse_shape_spec(spec: str) -> dict[str, list[int]]:
    """``name:1x3x224x224,other:1x128`` (trtexec's shape syntax; names may be quoted) -> shapes."""
    out: dict[str, list[int]] = {}
    for part in spec.split(","):
        name, _, dims = part.strip().rpartition(":")
        if not name:
            raise InputError(f"trtexec shape spec '{spec}': '{part}' is not NAME:DxDx...")
        try:
            out[name.strip("'\"")] = [int(d) for d in dims.split("x")]
        except ValueError:
            raise InputError(f"trtexec shape spec '{spec}': '{dims}' is not a list of dims like 1x3x224x224") \
                from None
    return out


def option_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def strip_profiling(argv: list[str]) -> list[str]:
    return [a for a in argv if option_name(a) not in PROFILING_FLAGS]


def _shape_name(name: str) -> str:
    """A tensor name as trtexec's NAME:... lists take it: wrapped in single quotes when it holds ':' or ','."""
    return f"'{name}'" if any(c in name for c in ":,") else name


def _shape_spec(shapes: dict[str, list[int]]) -> str:
    """trtexec's `name:AxBxC,...`."""
    return ",".join(f"{_shape_name(name)}:{'x'.join(str(int(d)) for d in dims) if dims else 'scalar'}"
                    for name, dims in shapes.items())


@dataclass
class TrtexecRun:
    """One trtexec invocation; ``argv`` turns it into a command line.

    Our own flags are left out when the user's ``extra_args`` already set the same option, so a
    user's --warmUp, --percentile or --builderOptimizationLevel wins instead of being duplicated.
    """

    onnx: Path | None = None
    load_engine: Path | None = None
    save_engine: Path | None = None
    strongly_typed: bool = False
    data_type: str = "FP32"  # --fp16/--bf16 for float models only (EngineBuildConfig.data_type's value)
    workspace_size: int | None = None  # MB, as EngineBuildConfig.workspace_size
    shapes: dict[str, tuple[list[int], list[int], list[int]]] = field(default_factory=dict)
    timing_cache: Path | None = None
    plugins: list[str] = field(default_factory=list)
    skip_inference: bool = False
    warmup_ms: int | None = None
    iterations: int | None = None
    duration_s: float | None = None
    percentiles: str | None = "10,90,95,99"
    export_times: Path | None = None
    export_profile: Path | None = None
    export_layer_info: Path | None = None
    load_inputs: dict[str, Path] = field(default_factory=dict)
    export_output: Path | None = None
    build_args: list[str] = field(default_factory=list)  # tuned builder flags (TrtBuildSettings.trtexec_flags)
    extra_args: list[str] = field(default_factory=list)

    def argv(self, exe: str) -> list[str]:
        user = {option_name(a) for a in self.extra_args}
        # plugin flags repeat once per library, so a user's own ones add to ours
        ours = [*self._model_flags(), *self._run_flags(), *self._profiling_flags()]
        return [exe, *(a for a in ours if option_name(a) not in user
                       or option_name(a) in ("--staticPlugins", "--setPluginsToSerialize")), *self.extra_args]

    def _model_flags(self) -> list[str]:
        """The engine's source and destination, the build options, shapes and plugins."""
        out: list[str] = []
        if self.onnx is not None:
            out.append(f"--onnx={self.onnx}")
        if self.load_engine is not None:
            out.append(f"--loadEngine={self.load_engine}")
        if self.save_engine is not None:
            out.append(f"--saveEngine={self.save_engine}")
        if self.onnx is not None:  # build options
            if self.strongly_typed:
                out.append("--stronglyTyped")
            elif self.data_type in ("FP16", "BF16"):
                out.append(f"--{self.data_type.lower()}")
            if self.workspace_size:
                out.append(f"--memPoolSize=workspace:{int(self.workspace_size)}M")
            if self.shapes:
                out.append(f"--minShapes={_shape_spec({n: s[0] for n, s in self.shapes.items()})}")
                out.append(f"--optShapes={_shape_spec({n: s[1] for n, s in self.shapes.items()})}")
                out.append(f"--maxShapes={_shape_spec({n: s[2] for n, s in self.shapes.items()})}")
            if self.timing_cache is not None:
                out.append(f"--timingCacheFile={self.timing_cache}")
            out += self.build_args
        elif self.shapes:  # a dynamic engine runs at the profile's opt shapes
            out.append(f"--shapes={_shape_spec({n: s[1] for n, s in self.shapes.items()})}")
        for lib in self.plugins:
            out.append(f"--staticPlugins={lib}")
            if self.save_engine is not None:
                out.append(f"--setPluginsToSerialize={lib}")
        return out

    def _run_flags(self) -> list[str]:
        """--skipInference, or how long to run, what to report and which inputs and outputs to load and save."""
        if self.skip_inference:
            return ["--skipInference"]
        out: list[str] = []
        if self.warmup_ms is not None:
            out.append(f"--warmUp={int(self.warmup_ms)}")  # milliseconds, not a run count
        if self.duration_s:
            out.append(f"--duration={self.duration_s:g}")
        elif self.iterations is not None:
            out.append(f"--iterations={int(self.iterations)}")
            out.append("--duration=0")  # otherwise trtexec also runs for its default 3 s
        if self.percentiles:
            out.append(f"--percentile={self.percentiles}")
        if self.export_times is not None:
            out.append(f"--exportTimes={self.export_times}")
        if self.load_inputs:
            out.append("--loadInputs=" + ",".join(f"{_shape_name(n)}:{p}" for n, p in self.load_inputs.items()))
        if self.export_output is not None:
            out.append(f"--exportOutput={self.export_output}")
        return out

    def _profiling_flags(self) -> list[str]:
        out: list[str] = []
        if self.export_profile is not None or self.export_layer_info is not None:
            out.append("--profilingVerbosity=detailed")
        if self.export_layer_info is not None:
            out.append(f"--exportLayerInfo={self.export_layer_info}")
        if self.export_profile is not None and not self.skip_inference:
            out.append(f"--exportProfile={self.export_profile}")
            out.append("--separateProfileRun")  # the per-layer profiler would otherwise slow the timed runs
        return out


@dataclass(frozen=True)
class TrtexecEngine:
    """An engine trtexec saved, with what every --loadEngine run of it repeats: the profile's shapes
    (a dynamic engine runs at the opt shapes) and the plugin libraries it was built with."""

    path: Path
    shapes: dict[str, tuple[list[int], list[int], list[int]]]
    plugins: list[str]

    def run(self, **options: Any) -> TrtexecRun:
        """One run of this engine; ``options`` are TrtexecRun's other fields."""
        return TrtexecRun(load_engine=self.path, shapes=self.shapes, plugins=self.plugins, **options)


__all__ = ["PROFILING_FLAGS", "SHAPE_FLAGS", "TrtexecEngine", "TrtexecRun", "option_name", "parse_shape_spec",
           "strip_profiling"]
