"""The pipeline as one Python call, for scripts and notebooks: ``tune(overrides, model=net, data=loader)``.

It runs what the `tune` command runs: the same composition and one-line config errors, the same
Hydra job, runner, results_dir, manifest and skip-if-up-to-date; it returns a ``TuneResult`` instead
of exiting. In-memory objects reach the stages through the `custom` model and data options: their
``_target_`` is a function of ``pipeline.data.live`` that hands back the live object, and their ``args``
are the objects' fingerprints (class name, parameter and code hashes; a content hash of the data).
So the manifest records them, a re-run with the same objects skips every finished stage, and changed
weights or data re-run the stages that read them.
"""

from __future__ import annotations

import enum
import inspect
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pipeline.artifacts import Manifest
from pipeline.data.live import metric_attribute
from pipeline.errors import ConfigError, InputError
from pipeline.records.autotune import AutotuneMetrics, autotune_metrics
from pipeline.records.evaluate import EvaluateMetrics
from pipeline.stage import StageMetrics


@dataclass(frozen=True)
class TuneResult:
    """What a tune() call left in results_dir."""

    results_dir: Path
    stages: Mapping[str, str]  # each requested stage: "done" (ran) or "skipped" (up to date)
    model: Path | None  # the shipped model: autotune's, else quantize's, else export's
    speedup: float | None  # of the shipped model over the float model (p10 latency)
    accuracy: str | None  # the shipped model's accuracy verdict, in words
    accuracy_ok: bool | None  # whether it meets the accuracy budget
    # each requested stage's metrics record (ExportMetrics, QuantizeMetrics, AutotuneMetrics, DeploymentMetrics,
    # EvaluateMetrics), where it recorded some; their to_dict() is what manifest.json holds
    metrics: Mapping[str, StageMetrics] = field(repr=False)
    runtime: str | None = None  # the runtime the shipped model was tuned for (backend=auto: the winner)

    @property
    def evaluation(self) -> EvaluateMetrics | None:
        """What evaluate measured (evaluate/metrics.json as a record), where this run evaluated."""
        recorded = self.metrics.get("evaluate")
        return recorded if isinstance(recorded, EvaluateMetrics) else None

    @property
    def tuning(self) -> AutotuneMetrics | None:
        """What autotune measured and shipped (its manifest metrics as a record), where this run tuned."""
        recorded = self.metrics.get("autotune")
        return recorded if isinstance(recorded, AutotuneMetrics) else None

    def load(self, device: str = "CPU") -> Any:
        """The shipped model ready to run in its runtime's own API, with the settings it ships with (the
        runtime's ``Backend.open_deployment``): an onnxruntime.InferenceSession (``ort_session``) or an
        openvino.CompiledModel (``openvino_model``)."""
        return _open_shipped(self.results_dir, self.runtime, device)


def tune(overrides: Sequence[str] | Mapping[str, Any] = (), *, model: Any = None, data: Any = None,
         eval_data: Any = None, metric: Callable[..., float] | None = None,
         spec: str | os.PathLike | None = None) -> TuneResult:
    """Run the pipeline on the packaged config, or on the user's spec file ``spec``.

    ``overrides``: what follows `tune` on a command line, as ``["autotune.preset=quick", ...]`` or
    ``{"autotune.preset": "quick", "stages": ["export", "quantize"]}``.
    ``model``: a torch.nn.Module, an onnx.ModelProto or the path of an .onnx file.
    ``data``: calibration data, a DataLoader or any iterable of batches (read as `data=custom` reads
    them: arrays, tensors, (inputs, labels) tuples or dicts), or the whole set at once as an array, a
    tensor, an (inputs, labels) tuple of them or a dict of them by input name. A module's input shapes
    come from the first batch unless model.input_shapes is set.
    ``eval_data``: the same for evaluation; without it, evaluate scores ``data``.
    ``metric``: the accuracy that counts, ``fn(outputs, reference, labels) -> float`` (higher is better;
    see accuracy.custom_metric): sets accuracy.metric=custom, judged with accuracy.max_drop.
    The data is read once here for its fingerprint; the manifest records it and the module's hashes.
    ``spec``: the path of a spec file, as ``"specs/my_net.yaml"``: what
    ``tune --config-path specs --config-name my_net`` runs (its folder is searched next to the
    packaged configs, so its defaults list may name theirs).

    Raises the PipelineError whose message `tune` would print (a bad key: ConfigError; a spec that is
    not an existing .yaml file: ConfigError naming it).
    """
    from pipeline.app.cli import checked_config, open_dict_overrides, run_job
    from pipeline.app.scope import run_scope  # onnx, numpy: `import pipeline.api` stays light
    from pipeline.config import register_configs

    args = _override_list(overrides)
    config_dir, config_name = _spec_location(spec)
    given = {_key(a) for a in args}
    live: dict[str, Any] = {}
    extra = _model_overrides(model, live, given)
    data_extra, calibration = _data_overrides(data, eval_data, live, given)
    data_extra += _metric_overrides(metric, live, given)
    register_configs()
    training = model.training if "model=custom" in extra else None
    try:
        with run_scope(live=live):  # the runner's scope inside sets the config's threads and bars
            args = open_dict_overrides([*args, *extra, *data_extra])
            cfg = checked_config(args, config_dir, config_name)
            if training is not None and not cfg.model.input_shapes:
                args += open_dict_overrides(_shape_overrides(data, calibration, int(cfg.model.batch_size)))
            results_dir, summary = run_job(args, config_dir, config_name)
    finally:
        if training is not None:
            model.train(training)  # export puts the module in eval mode
    return _result(results_dir, summary)


def _spec_location(spec: str | os.PathLike | None) -> tuple[str | None, str]:
    """(the folder searched next to the packaged configs, the config name) of a spec file's path:
    what `--config-path` and `--config-name` say on the command line; (None, "tune") without one."""
    from pipeline.app.cli import user_config_dir

    if spec is None:
        return None, "tune"
    fix = 'give the path of your .yaml spec file, as tune(spec="specs/my_net.yaml")'
    path = Path(os.fspath(spec)).expanduser()
    if str(spec).startswith("pkg://") or path.suffix != ".yaml":
        raise ConfigError(f"spec {spec}: not a .yaml file; {fix}")
    if not path.is_file():
        where = path.resolve()
        missing = f"no such file ({where})" if where.parent.is_dir() else f"no such folder ({where.parent})"
        raise ConfigError(f"spec {spec}: {missing}; {fix}")
    return user_config_dir(path.parent, "spec"), path.stem


# ---------------------------------------------------------------------------- overrides


def _override_list(overrides: Sequence[str] | Mapping[str, Any]) -> list[str]:
    if isinstance(overrides, Mapping):
        return [f"{k}={_value(v)}" for k, v in overrides.items()]
    if isinstance(overrides, str):
        return [overrides]
    return [str(o) for o in overrides]


def _value(v: Any) -> str:
    """A Python value in Hydra's override grammar (strings quoted, so paths and hashes stay strings)."""
    from hydra.core.override_parser.types import Override, Quote, QuotedString

    def plain(x: Any) -> Any:
        if isinstance(x, enum.Enum):
            x = x.value
        if isinstance(x, (str, os.PathLike)):
            return QuotedString(text=os.fspath(x), quote=Quote.single)
        if isinstance(x, Mapping):
            return {str(k): plain(y) for k, y in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(y) for y in x]
        return x.item() if hasattr(x, "item") else x  # numpy scalars

    return Override._get_value_element_as_str(plain(v))


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _model_overrides(model: Any, live: dict[str, Any], given: set[str]) -> list[str]:
    if model is None:
        return []
    if "model" in given:
        raise ConfigError("model: given both as an override and as tune(model=...); pass one of them")
    if isinstance(model, (str, os.PathLike)):
        return ["model=onnx", f"model.onnx_path={_value(Path(model).expanduser().resolve())}"]
    import onnx

    if isinstance(model, onnx.ModelProto):
        return ["model=onnx", f"model.onnx_path={_value(_saved_model(model))}"]
    import torch

    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model: give a torch.nn.Module, an onnx.ModelProto or an .onnx path (got "
                         f"{type(model).__name__})")
    cls = type(model)
    args = {"class_name": f"{cls.__module__}.{cls.__qualname__}", "parameters": _parameters_hash(model),
            "code": _code_hash(model)}
    live[f"model:{args['class_name']}:{args['parameters']}:{args['code']}"] = model
    return ["model=custom", "model._target_=pipeline.data.live.in_memory_model", f"model.args={_value(args)}"]


def _saved_model(model: Any) -> Path:
    """A ModelProto in a file named by its hash: the same model keeps the same model.onnx_path."""

    from pipeline.graph.model import model_hash, save_model

    path = Path(tempfile.gettempdir()) / "qdq-tune-models" / f"{model_hash(model)[:16]}.onnx"
    if not path.exists():
        save_model(model, path)
    return path


def _parameters_hash(module: Any) -> str:
    import torch

    from pipeline.artifacts import fingerprint, sha256_bytes

    state = {}
    for name, t in module.state_dict().items():
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        state[name] = [str(t.dtype), list(t.shape), sha256_bytes(raw)]
    return fingerprint(state)


def _metric_overrides(metric: Any, live: dict[str, Any], given: set[str]) -> list[str]:
    """accuracy.metric=custom naming the function in pipeline.data.live by its name and source hash (a
    changed metric re-runs what it judged)."""

    from pipeline.artifacts import fingerprint

    if metric is None:
        return []
    if not callable(metric):
        raise InputError(f"metric: give a function fn(outputs, reference, labels) -> float (got "
                         f"{type(metric).__name__})")
    if "accuracy.custom_metric" in given:
        raise ConfigError("accuracy.custom_metric: given both as an override and as tune(metric=...); pass one")
    try:
        source = inspect.getsource(metric)
    except (OSError, TypeError):  # a partial, a callable object: nothing to read, so never "unchanged"
        source = f"id {id(metric)}"
    name = getattr(metric, "__qualname__", type(metric).__name__)
    short = getattr(metric, "__name__", type(metric).__name__)
    # closures and defaults are part of what the metric computes (make(k=1) and make(k=5) share a source)
    bound = [repr(c.cell_contents) for c in getattr(metric, "__closure__", None) or ()] + \
        [repr(getattr(metric, "__defaults__", None)), repr(getattr(metric, "__kwdefaults__", None))]
    key = f"{metric_attribute(short)}__{fingerprint({'name': name, 'source': source, 'bound': bound})[:16]}"
    live[f"metric:{key}"] = metric
    return ["accuracy.metric=custom", f"accuracy.custom_metric=pipeline.data.live.{key}"]


def _code_hash(module: Any) -> str:
    """Of the module's structure and its class's source: a new activation or forward changes no weight."""

    from pipeline.artifacts import fingerprint

    try:
        source = inspect.getsource(type(module))
    except (OSError, TypeError):  # classes made at run time have no source to read
        source = None
    return fingerprint({"structure": repr(module), "source": source})


def _data_overrides(data: Any, eval_data: Any, live: dict[str, Any], given: set[str]
                    ) -> tuple[list[str], Iterable[Any] | None]:
    """The data=custom overrides for in-memory data, and the calibration batches."""
    if data is None:
        if eval_data is not None:
            raise InputError("eval_data: given without data (the calibration data)")
        return [], None
    if "data" in given:
        raise ConfigError("data: given both as an override and as tune(data=...); pass one of them")
    from pipeline.data.adapters import data_fingerprint

    calibration = _batches(data, "data")
    evaluation = calibration if eval_data is None else _batches(eval_data, "eval_data")
    fps = {"calibration": data_fingerprint(calibration)}
    fps["evaluation"] = fps["calibration"] if eval_data is None else data_fingerprint(evaluation)
    live[f"data:{fps['calibration']}"], live[f"data:{fps['evaluation']}"] = calibration, evaluation
    return ["data=custom", "data._target_=pipeline.data.live.in_memory_data", f"data.args={_value(fps)}"], calibration


def _whole_set(data: Any) -> bool:
    """An array, a tensor, a dict of them or an (inputs, labels) tuple of them: every sample at once."""
    import numpy as np

    def array(x: Any) -> bool:
        return isinstance(x, np.ndarray) or hasattr(x, "detach")

    return array(data) or isinstance(data, Mapping) or (isinstance(data, tuple) and bool(data)
                                                        and all(array(v) for v in data))


def _batches(data: Any, what: str) -> Iterable[Any]:
    """``data`` as batches that can be read more than once."""
    if _whole_set(data):
        return [data]  # one batch: DataProvider cuts it to the model's batch size
    if isinstance(data, Iterator):
        return list(data)  # a generator is read once here, and every stage reads the data again
    if not isinstance(data, Iterable):
        raise InputError(f"{what}: give a DataLoader, an iterable of batches or arrays (got {type(data).__name__})")
    if hasattr(data, "sampler"):  # a DataLoader: torch is imported already
        from torch.utils.data import RandomSampler

        from pipeline.config import note_once

        if isinstance(data.sampler, RandomSampler):
            note_once(f"note: {what}: the DataLoader shuffles, so every pass (and every call) reads other "
                      f"batches and no stage is skipped as up to date; give tune() one with shuffle=False")
    return data


def _shape_overrides(data: Any, calibration: Iterable[Any] | None, batch_size: int) -> list[str]:
    """model.input_shapes (and input_dtypes) of a module from the first calibration batch: a DataLoader's
    batch size, or model.batch_size for data given as whole arrays."""
    from pipeline.data.adapters import batch_inputs

    first = next(iter(calibration), None) if calibration is not None else None
    if first is None:
        raise ConfigError("model.input_shapes: required for a torch model passed without data, e.g. "
                          "{'model.input_shapes': {'input': [1, 3, 224, 224]}}")
    arrays = batch_inputs(first)
    batch = [batch_size] if _whole_set(data) else []
    shapes = {k: batch + list(a.shape[len(batch):]) for k, a in arrays.items()}
    out = [f"model.input_shapes={_value(shapes)}"]
    dtypes = {k: str(a.dtype) for k, a in arrays.items() if str(a.dtype) != "float32"}
    if dtypes:
        out.append(f"model.input_dtypes={_value(dtypes)}")
    return out


# ---------------------------------------------------------------------------- the result


def _shipped(results_dir: str | os.PathLike, settings_key: str | None) -> tuple[Path, Path | None]:
    """(the model a run shipped: autotune's, else quantize's, else export's; the runtime settings file
    ``settings_key`` autotune shipped beside it, None when the shipped model is not autotune's)."""
    from pipeline.stage import MODEL_KEYS

    manifest = Manifest(Path(results_dir))
    shipped = next(((k, p) for k in MODEL_KEYS if (p := manifest.artifact(k)) is not None), None)
    if shipped is None:
        raise InputError(f"{results_dir}: no finished stage wrote a model (run tune with results_dir={results_dir})")
    settings_path = manifest.artifact(settings_key) if settings_key and shipped[0] == "autotune/optimized_final.onnx" \
        else None
    return shipped[1], settings_path


def checked_on(results_dir: str | os.PathLike) -> Any:
    """What the deployment a run shipped was checked on, a ``pipeline.accuracy.kinds.CheckedOn`` (CPU kind,
    runtime and versions, precision, settings, each CPU kind's verdict): the stage that wrote the shipped model recorded it (None for
    the exported float, or a run made before the record existed)."""
    from pipeline.records.stages import shipped_record

    return shipped_record(Manifest(Path(results_dir)))


def host_warning(results_dir: str | os.PathLike) -> str | None:
    """One line naming the risk where this host is not what the shipped deployment was checked on (a CPU
    kind on which it misses the budget or was not judged, other runtime versions), with the command that
    checks this host; None where it is. The loaders below log it as a warning."""
    record = checked_on(results_dir)
    return record.host_warning(results_dir=results_dir) if record is not None else None


def _warn_host(results_dir: str | os.PathLike) -> None:
    import logging

    line = host_warning(results_dir)
    if line:
        logging.getLogger("tune.deploy").warning("warning: %s", line)


def ort_session(results_dir: str | os.PathLike, providers: Sequence[str] = ("CPUExecutionProvider",)) -> Any:
    """An onnxruntime.InferenceSession of the model a run shipped (autotune's, else quantize's, else
    export's) with the session settings it ships with (autotune/ort_session.json: disabled fusions,
    config entries, optimization level, threads): the two lines a deployment needs are

        from pipeline.api import ort_session
        session = ort_session("results/digits_cnn")
    """
    from pipeline.backends.onnxruntime import OnnxRuntimeBackend

    model, settings_path = _shipped(results_dir, OnnxRuntimeBackend.shipped_settings.artifact)
    _warn_host(results_dir)
    return OnnxRuntimeBackend.open_deployment(model, settings_path, providers=providers)


def openvino_model(results_dir: str | os.PathLike, device: str = "CPU") -> Any:
    """An openvino.CompiledModel of the model a run shipped (autotune's, else quantize's, else
    export's) compiled for ``device`` with the compile properties it ships with
    (autotune/openvino_compile.json: inference precision, performance hint, threads, streams,
    pinning), or with OpenVINO's defaults when there are none: the two lines a deployment needs are

        from pipeline.api import openvino_model
        compiled = openvino_model("results/digits_cnn")

    then ``compiled(inputs)`` (or ``compiled.create_infer_request()``) runs it.
    """
    from pipeline.backends.openvino import OpenVinoBackend

    return _open_shipped(results_dir, OpenVinoBackend.name, device)


def _open_shipped(results_dir: str | os.PathLike, runtime: str | None, device: str) -> Any:
    """The shipped model of ``results_dir`` opened by ``runtime``'s Backend.open_deployment (None: the
    reference runtime's), with its settings file; the host warning first."""
    from pipeline.backends import named_runtime

    cls = named_runtime(runtime)
    kind = cls.shipped_settings
    model, settings_path = _shipped(results_dir, kind.artifact if kind is not None else None)
    _warn_host(results_dir)
    return cls.open_deployment(model, settings_path, device)


def _result(results_dir: Path, summary: dict[str, Any]) -> TuneResult:
    from pipeline.stage import MODEL_KEYS

    manifest = Manifest(results_dir)
    shipped = next((p for k in MODEL_KEYS if (p := manifest.artifact(k)) is not None), None)
    speedup, verdict = _shipped_numbers(manifest, shipped)
    return TuneResult(
        results_dir=Path(results_dir),
        stages=MappingProxyType({name: info["status"] for name, info in summary.items()}),
        model=shipped,
        speedup=speedup,
        accuracy=verdict.get("what"),
        accuracy_ok=verdict.get("ok"),
        metrics=MappingProxyType({name: info["metrics"] for name, info in summary.items()
                                  if info.get("metrics") is not None}),
        runtime=shipped_runtime(manifest),
    )


def shipped_runtime(manifest: Manifest) -> str | None:
    """The runtime autotune tuned the shipped model for: backend=auto's winner, else the run's backend."""
    entry = manifest.entry("autotune") or {}
    tuned = autotune_metrics(entry.get("metrics"), manifest.entry_name("autotune"))
    choice = tuned.choice if tuned is not None else None
    if choice is not None:
        return choice.winner
    name = ((entry.get("config") or {}).get("backend") or {}).get("name")
    return str(name) if name else None


def _shipped_numbers(manifest: Manifest, shipped: Path | None) -> tuple[float | None, dict[str, Any]]:
    """Speedup and accuracy verdict of the shipped model: autotune's final measurement (the one its
    final line prints), else evaluate's numbers for that model."""
    tuned = autotune_metrics(manifest.metrics("autotune"), manifest.entry_name("autotune"))
    if tuned is not None and tuned.speedup is not None:
        final = tuned.accuracy.final
        return float(tuned.speedup), final.to_dict() if final is not None else {}
    recorded = manifest.metrics("evaluate")
    if not recorded or shipped is None:
        return None, {}
    ev = EvaluateMetrics.from_dict(recorded, manifest.entry_name("evaluate"))
    key = {"optimized_final.onnx": "autotuned", "quantized_model.onnx": "ptq"}.get(shipped.name, "float")
    key = next((d.identical_to for d in ev.duplicates if d.model == key), key)
    m = ev.models.get(key)
    if m is None:
        return None, {}
    return m.speedup_p10, m.budget.to_dict() if m.budget is not None else {}
