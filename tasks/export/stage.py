"""The export stage: builds (or validates) the float model and writes export/model.onnx.

Built-in models are exported with static shapes at the configured opset, checked with
onnx.checker and verified by running ONNX Runtime against torch on the same input; the max abs
difference goes into the manifest. `model=onnx` validates and copies an existing file instead.
"""

from __future__ import annotations

import logging
import pickle
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from omegaconf import DictConfig, OmegaConf

from pipeline.artifacts import atomic_output, atomic_write_json, fingerprint, read_json, user_cache, user_path
from pipeline.backends.onnxruntime.session import inference_session
from pipeline.errors import ConfigError, InputError, StageError, StateError, first_line
from pipeline.graph import weights
from pipeline.graph.model import (
    control_flow,
    dynamic_inputs,
    ensure_node_names,
    fix_input_shapes,
    input_specs,
    load_model,
    opset_version,
    record_input_shapes,
    save_model,
)
from pipeline.records.export import (
    ControlFlow,
    ExportMetrics,
    Folding,
    Specialization,
    Training,
    Verification,
)
from pipeline.registry import import_object
from pipeline.stage import Stage, StageContext, StageResult
from pipeline.transforms.folding import (
    NOTHING_FOLDED,
    fold_batchnorm,
    fold_constant_identities,
    fold_constants,
)
from pipeline.values import enum_value, section

log = logging.getLogger("tune.export")


_NOTHING_FOLDED = {**NOTHING_FOLDED, "batchnorm": 0}


def _run_in_ort(model: onnx.ModelProto, feeds: dict[str, Any], src: Path) -> list[Any]:
    """The model's outputs on ``feeds`` in ONNX Runtime; InputError (one line) if it does not run."""
    try:
        return inference_session(model).run(None, feeds)
    except Exception as exc:  # noqa: BLE001 - ORT raises generic errors for bad models
        raise InputError(f"{src} does not run in ONNX Runtime: {first_line(exc)}") from None


def _loads_in_ort(model: onnx.ModelProto) -> str | None:
    """None if ONNX Runtime can create a session for the model, else its first error line."""
    try:
        inference_session(model)
        return None
    except Exception as exc:  # noqa: BLE001 - ORT raises generic errors for models it rejects
        return first_line(exc)


def _static_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]], source: str,
                   keep_dynamic: bool = False) -> onnx.ModelProto:
    """Every graph input made static (``fix_input_shapes``), using ``shapes`` for the dynamic ones.

    With ``keep_dynamic`` (model.keep_dynamic_shapes), or when the static graph no longer loads in
    ONNX Runtime but the original does (an If whose other branch only type-checks with other shapes,
    e.g. an audio model's 8 kHz branch), the graph keeps its dynamic dims and the shapes are stored
    in its metadata instead (``record_input_shapes``): ``input_specs`` reads them.
    """
    if not dynamic_inputs(model):  # nothing to fall back to: no copy of the weights
        return fix_input_shapes(model, shapes, source)
    original = onnx.ModelProto()
    original.CopyFrom(model)
    fixed = fix_input_shapes(model, shapes, source)
    rejected = _loads_in_ort(fixed) if shapes and dynamic_inputs(original) and not keep_dynamic else None
    if (keep_dynamic and shapes and dynamic_inputs(original)) or (
            rejected is not None and _loads_in_ort(original) is None):
        if rejected is not None:
            log.info("%s: with static input shapes ONNX Runtime rejects the model (%s); keeping its dynamic dims "
                     "and recording model.input_shapes in its metadata", source, rejected)
        return record_input_shapes(original, shapes)
    return fixed


class ExportStage(Stage):
    name = "export"
    outputs = ("export/model.onnx",)
    config_keys = ("model", "export", "seed", "data")

    def resolve_inputs(self, ctx: StageContext) -> dict[str, Path]:
        # the user's files are inputs: a file changed in place re-runs export like a changed config
        mcfg = ctx.cfg.model
        if mcfg.name == "onnx":
            return {"model.onnx_path": user_path(mcfg.onnx_path)}
        checkpoint = mcfg.get("checkpoint")
        if checkpoint and user_path(checkpoint).is_file():  # a missing one is run()'s one-line error
            return {"model.checkpoint": user_path(checkpoint)}
        return {}

    def run(self, ctx: StageContext) -> StageResult:
        mcfg = ctx.cfg.model
        out_dir = ctx.stage_dir("export")
        out = out_dir / "model.onnx"
        metrics = self._from_onnx(ctx.cfg, out) if mcfg.name == "onnx" else self._from_torch(ctx, mcfg, out_dir, out)
        metrics = replace(metrics, headline=metrics.headline_for(mcfg.name))
        log.info("wrote %s (%s)", out, metrics.headline)
        return StageResult(artifacts={"export/model.onnx": out}, metrics=metrics)

    # ------------------------------------------------------------------ existing ONNX
    def _from_onnx(self, cfg: DictConfig, out: Path) -> ExportMetrics:
        mcfg = cfg.model
        src = user_path(mcfg.onnx_path)
        model = load_model(src, what="model.onnx_path")
        from pipeline.transforms.specialize import bind_inputs, fixed_arrays, specialize

        fixed = fixed_arrays(model, OmegaConf.to_container(mcfg.fixed_inputs) if mcfg.get("fixed_inputs") else {},
                             str(src))
        original, inlined = model, []
        if fixed:  # decided before shapes are fixed: a static shape can break the branch not taken
            model, inlined = specialize(bind_inputs(model, fixed))
        shapes = {k: list(v) for k, v in (mcfg.input_shapes or {}).items() if k not in fixed}
        model = _static_shapes(model, shapes, source=str(src), keep_dynamic=bool(mcfg.keep_dynamic_shapes))
        if fixed:  # with static shapes, the Ifs on shapes are decided too
            model, more = specialize(model)
            inlined += more
        fold_constant_identities(model)
        ensure_node_names(model)
        # an ORT smoke run on real data proves the model runs before later stages rely on it (nothing is
        # written before that); its outputs are what constant folding must reproduce
        feeds = self._smoke_feeds(cfg, model)
        reference = _run_in_ort(model, feeds, src)
        specialized = self._check_specialized(cfg, original, model, fixed, inlined, src) if fixed else None
        model, folded = self._fold(model, src, feeds, reference)
        try:
            weights.check_model(model)
        except onnx.checker.ValidationError as exc:
            raise InputError(f"{src} fails onnx.checker after fixing shapes: {first_line(exc)}") from None
        save_model(model, out)
        control = control_flow(model)
        if control["nodes"]:
            log.warning("export: %d If/Loop/Scan nodes hold %d nodes in their bodies (%d of the model's %d weighted "
                        "ops); quantize places Q/DQ inside Loop/Scan bodies and leaves If bodies float (an If on an "
                        "input deployment fixes: model.fixed_inputs)", control["control_nodes"], control["nodes"],
                        control["weighted_inside"], control["weighted_inside"] + control["weighted_outside"])
        return _exported(out, source=str(src), folded=Folding(**folded), control_flow=ControlFlow(**control),
                         specialized=specialized)

    @staticmethod
    def _check_specialized(cfg: DictConfig, original: onnx.ModelProto, model: onnx.ModelProto,
                           fixed: dict[str, np.ndarray], inlined: list[dict[str, str]], src: Path) -> Specialization:
        """The specialized model's outputs equal the original's (fed the fixed values) on every calibration
        batch (StageError otherwise); the record for the manifest."""
        from pipeline.data.adapters import DataProvider
        from pipeline.transforms.specialize import describe

        specs = input_specs(model)
        ours, theirs = inference_session(model), inference_session(original)
        names = [o.name for o in model.graph.output]
        worst, batches = 0.0, 0
        for batch in DataProvider(cfg, specs).batches("calibration", int(cfg.quantize.calibration.batches)):
            got = ours.run(names, batch.feeds)
            want = theirs.run(names, {**batch.feeds, **fixed})
            for name, a, b in zip(names, got, want, strict=True):
                diff = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))) if a.size else 0.0
                if a.shape != b.shape or not np.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True):
                    raise StageError(f"model.fixed_inputs={describe(fixed)}: the specialized model's output '{name}' "
                                     f"differs from {src.name}'s on calibration batch {batches} (max |diff| "
                                     f"{diff:.3g}); remove model.fixed_inputs to keep the If nodes")
                worst = max(worst, diff)
            batches += 1
        log.info("export: specialized on %s: %d If nodes replaced by their taken branch; outputs equal the "
                 "original's on %d calibration batches (max |diff| %.2g)", describe(fixed), len(inlined), batches, worst)
        return Specialization(describe(fixed), inlined, batches, worst)

    @staticmethod
    def _smoke_feeds(cfg: DictConfig, model: onnx.ModelProto) -> dict[str, Any]:
        """The first calibration batch when data is configured (a model may only run on real values: an
        audio model's sample rate selects an If branch), else seeded synthetic feeds."""
        from pipeline.config import resolved_data_source
        from pipeline.data.adapters import DataProvider, fixed_feeds

        specs = input_specs(model)
        if resolved_data_source(cfg) in ("npz", "custom"):
            for batch in DataProvider(cfg, specs).batches("calibration", 1):
                return batch.feeds
        return fixed_feeds(specs)

    @staticmethod
    def _fold(model: onnx.ModelProto, src: Path, feeds: dict[str, Any], reference: list[Any]
              ) -> tuple[onnx.ModelProto, dict[str, int]]:
        """Fold Constant-node weights into initializers and BatchNormalization into Convs; keep the
        original if the folded model does not reproduce ``reference`` (the original's outputs)."""
        import numpy as np

        try:
            folded, counts = fold_constants(model)
        except Exception as exc:  # noqa: BLE001 - folding is an optimization: a graph it cannot take stays as it is
            log.warning("export: constant folding failed on %s (%s); keeping its Constant nodes", src.name,
                        first_line(exc))
            return model, _NOTHING_FOLDED
        if folded is model:
            if not any(n.op_type == "BatchNormalization" for n in model.graph.node):
                return model, _NOTHING_FOLDED  # nothing to fold: no copy of the weights
            folded = onnx.ModelProto()
            folded.CopyFrom(model)
        counts["batchnorm"] = fold_batchnorm(folded)
        if not (counts["constant_nodes"] or counts["batchnorm"] or counts["nodes_removed"]):
            return model, _NOTHING_FOLDED
        try:
            got = _run_in_ort(folded, feeds, src)
            same = all(np.allclose(x, y, rtol=1e-4, atol=1e-5, equal_nan=True) for x, y in zip(reference, got, strict=True))
        except InputError:  # a folded model that does not run is not used
            log.debug("the folded model does not run", exc_info=True)
            same = False
        if not same:
            log.warning("export: constant folding changed %s's outputs; keeping its Constant nodes (their weights "
                        "stay float)", src.name)
            return model, _NOTHING_FOLDED
        log.info("export: folded %d Constant nodes into initializers (%d of them weights of Conv/Gemm/MatMul) and "
                 "%d BatchNormalization nodes into their Convs", counts["constant_nodes"], counts["constant_weights"],
                 counts["batchnorm"])
        return folded, counts

    # ------------------------------------------------------------------ PyTorch models
    def _from_torch(self, ctx: StageContext, mcfg: DictConfig, out_dir: Path, out: Path) -> ExportMetrics:
        import torch

        torch.manual_seed(int(ctx.cfg.seed))
        module, example, in_names, out_names, training = self._build(ctx, mcfg, out_dir)
        module.eval()
        opset = int(mcfg.opset)
        exporter = enum_value(mcfg.exporter)
        with tempfile.TemporaryDirectory(prefix=".export.", dir=out_dir) as work, torch.no_grad():
            tmp = Path(work) / out.name
            kwargs: dict[str, Any] = dict(input_names=in_names, output_names=out_names, opset_version=opset)
            try:
                if exporter == "dynamo":
                    torch.onnx.export(module, tuple(example), str(tmp), dynamo=True, external_data=False, **kwargs)
                else:
                    import warnings

                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        torch.onnx.export(module, tuple(example), str(tmp), dynamo=False, do_constant_folding=True,
                                          **kwargs)
            except Exception as exc:  # noqa: BLE001 - surface the exporter's reason, keep the traceback in the log
                log.debug("export failed", exc_info=True)
                raise StageError(f"torch.onnx.export ({exporter}) failed for model {mcfg.name}: "
                                 f"{str(exc).strip().splitlines()[0]}") from exc
            model = onnx.load(str(tmp))
            fold_constant_identities(model)
            ensure_node_names(model)
            if opset_version(model) != opset:
                from onnx import version_converter

                model = version_converter.convert_version(model, opset)
            onnx.checker.check_model(model, full_check=True)
            model = onnx.shape_inference.infer_shapes(model)
        save_model(model, out)  # past EXTERNAL_FROM with external data: quantize then reads it tensor by tensor
        del model
        verification = self._verify(module, example, in_names, out, mcfg) if ctx.cfg.export.verify else None
        return _exported(out, training=training, verification=verification)

    def _build(self, ctx: StageContext, mcfg: DictConfig, out_dir: Path):
        """(module, example inputs, input names, output names, the record of its training or None) of the
        configured torch model."""
        import torch

        from tasks.export import _models

        name = mcfg.name
        bs = int(mcfg.batch_size)
        seed = int(ctx.cfg.seed)
        if name == "digits_cnn":
            module = _models.DigitsCNN(int(mcfg.image_size), tuple(mcfg.channels))
            example = self._digits_example(ctx, mcfg)
            training = self._train_or_load(ctx, mcfg, module, out_dir)
            return module, [example], ["input"], ["logits"], training
        if name.startswith("resnet"):
            module = _models.ResNet(int(mcfg.depth), int(mcfg.num_classes), int(mcfg.in_channels))
            g = torch.Generator().manual_seed(seed)
            example = torch.randn(bs, int(mcfg.in_channels), int(mcfg.input_size), int(mcfg.input_size), generator=g)
            _models.recalibrate_batchnorm(module, example, seed=seed)
            return module, [example], ["input"], ["logits"], None
        if name == "bert_tiny":
            module = _models.BertTiny(int(mcfg.vocab_size), int(mcfg.hidden_size), int(mcfg.num_layers),
                                      int(mcfg.num_heads), int(mcfg.intermediate_size), int(mcfg.seq_len),
                                      int(mcfg.num_labels))
            g = torch.Generator().manual_seed(seed)
            example = torch.randint(0, int(mcfg.vocab_size), (bs, int(mcfg.seq_len)), generator=g)
            return module, [example], ["input_ids"], ["logits"], None
        if name == "custom":
            return *self._custom(mcfg, seed), None
        raise ConfigError(f"model.name={name}: not a built-in model (digits_cnn, resnet18, resnet50, bert_tiny, "
                          f"onnx, custom)")

    @staticmethod
    def _digits_example(ctx: StageContext, mcfg: DictConfig):
        import torch

        from pipeline.data.digits import digits_arrays

        size = int(mcfg.image_size)
        x, _ = digits_arrays("test", int(ctx.cfg.seed), float(ctx.cfg.data.get("test_fraction", 0.3)), (1, size, size))
        bs = int(mcfg.batch_size)
        reps = -(-bs // len(x))
        return torch.from_numpy(np.concatenate([x] * reps)[:bs])

    def _train_or_load(self, ctx: StageContext, mcfg: DictConfig, module, out_dir: Path) -> Training:
        import torch

        from tasks.export._train import TrainingRecipe, train_digits_cnn

        key = fingerprint({"model": section(ctx.cfg, "model"), "seed": int(ctx.cfg.seed),
                           "test_fraction": float(ctx.cfg.data.get("test_fraction", 0.3)),
                           "torch": torch.__version__})
        weights, meta_path = out_dir / "digits_cnn.pt", out_dir / "digits_cnn.json"
        # this run's copy first, then the user's cache (another results_dir trained the same model)
        shared = user_cache() / f"digits_cnn-{key}.pt"
        if ctx.cfg.export.cache_trained_weights:
            for found, meta_file in ((weights, meta_path), (shared, shared.with_suffix(".json"))):
                cached = _training_record(found, meta_file, key)
                if cached is None:
                    continue
                try:
                    module.load_state_dict(torch.load(found, map_location="cpu", weights_only=True))
                except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:  # a broken copy
                    log.warning("trained digits_cnn weights in %s do not load (%s): not reused", found, first_line(exc))
                    continue
                log.info("reusing trained digits_cnn weights from %s", found)
                if found != weights:
                    _save_trained(module, weights, meta_path, _cache_record(key, cached))
                return replace(cached, weights_cached=True)
        recipe = TrainingRecipe(int(mcfg.epochs), float(mcfg.learning_rate), int(mcfg.train_batch_size))
        training = train_digits_cnn(module, int(mcfg.image_size), int(ctx.cfg.seed),
                                    float(ctx.cfg.data.get("test_fraction", 0.3)), recipe, bool(ctx.cfg.progress))
        record = _cache_record(key, training)
        _save_trained(module, weights, meta_path, record)
        if ctx.cfg.export.cache_trained_weights:
            try:
                shared.parent.mkdir(parents=True, exist_ok=True)
                _save_trained(module, shared, shared.with_suffix(".json"), record)
            except OSError:  # a read-only home: the next results_dir trains again
                pass
        return training

    @staticmethod
    def _custom(mcfg: DictConfig, seed: int):
        import torch

        target = mcfg.get("_target_")
        cls = import_object(target, "model._target_")
        args = OmegaConf.to_container(mcfg.args, resolve=True) if mcfg.args else {}
        try:
            module = cls(**args)
        except TypeError as exc:  # wrong or missing model.args for the constructor
            raise ConfigError(f"model.args={args} do not fit {target}: {exc}") from None
        if mcfg.checkpoint:
            ckpt = user_path(mcfg.checkpoint)
            if not ckpt.exists():
                raise InputError(f"model.checkpoint {ckpt} does not exist")
            try:
                state = torch.load(ckpt, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - torch raises many types for files it cannot read
                raise InputError(f"model.checkpoint {ckpt} could not be read by torch.load: "
                                 f"{str(exc).strip().splitlines()[0]}") from None
            if isinstance(state, dict) and "state_dict" in state:
                state = state["state_dict"]
            try:
                module.load_state_dict(state)
            except RuntimeError as exc:
                raise InputError(f"model.checkpoint {ckpt} does not fit {target}: {str(exc).splitlines()[0]}") from None
        if not mcfg.input_shapes:
            raise ConfigError("model.input_shapes: required for model=custom, e.g. "
                              "model.input_shapes='{input: [1,3,224,224]}'")
        g = torch.Generator().manual_seed(seed)
        names = list(mcfg.input_names) or list(mcfg.input_shapes.keys())
        examples = []
        for name in names:
            if name not in mcfg.input_shapes:
                raise ConfigError(f"model.input_names lists '{name}', which has no entry in model.input_shapes")
            shape = list(mcfg.input_shapes[name])
            dtype = str(mcfg.input_dtypes.get(name, "float32"))
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ConfigError(f"model.input_dtypes.{name}={dtype}: not a torch dtype (float32, float16, int64, ...)")
            if "int" in dtype:
                examples.append(torch.randint(0, 100, shape, generator=g, dtype=getattr(torch, dtype)))
            else:
                examples.append(torch.randn(shape, generator=g, dtype=getattr(torch, dtype)))
        out_names = list(mcfg.output_names) or None
        return module, examples, names, out_names

    @staticmethod
    def _verify(module, example, in_names, path: Path, mcfg: DictConfig) -> Verification:
        import torch

        with torch.no_grad():
            ref = module(*example)
        refs = [ref] if isinstance(ref, torch.Tensor) else list(ref)
        sess = inference_session(path)
        got = sess.run(None, {n: t.numpy() for n, t in zip(in_names, example, strict=True)})
        diffs, scale = [], 0.0
        for r, g in zip(refs, got, strict=False):
            r = r.numpy()
            diffs.append(float(np.max(np.abs(r - g))) if r.size else 0.0)
            scale = max(scale, float(np.max(np.abs(r))) if r.size else 0.0)
        max_diff = max(diffs) if diffs else 0.0
        tol = float(mcfg.verify_atol) + float(mcfg.verify_rtol) * scale
        if not max_diff <= tol:
            raise StageError(f"exported model disagrees with torch: max |diff| {max_diff:.3e} > tolerance {tol:.3e} "
                             f"(model.verify_atol/verify_rtol)")
        return Verification(max_diff, tol, scale)


def _exported(path: Path, **parts: Any) -> ExportMetrics:
    """The metrics of the exported graph at ``path`` (its opset, nodes and inputs) with how it was made."""
    model = onnx.load(str(path), load_external_data=False)
    return ExportMetrics(opset=opset_version(model), nodes=len(model.graph.node),
                         inputs={s.name: list(s.shape) for s in input_specs(model)}, **parts)


def _training_record(weights: Path, meta_path: Path, key: str) -> Training | None:
    """The training record beside trained weights, where both are there and were made for ``key``."""
    if not (weights.exists() and meta_path.exists()):
        return None
    try:
        meta = read_json(meta_path, "training cache")
        if meta.get("key") != key:
            return None
        return Training(float(meta["train_seconds"]), float(meta["torch_test_top1"]))
    except (StateError, AttributeError, KeyError, TypeError, ValueError):  # a broken record: trained again, written anew
        return None


def _cache_record(key: str, training: Training) -> dict[str, Any]:
    """What the training cache keeps beside trained weights: the key they were made for and their training."""
    return {"key": key, "train_seconds": training.train_seconds, "torch_test_top1": training.torch_test_top1}


def _save_trained(module: Any, weights: Path, meta_path: Path, meta: dict[str, Any]) -> None:
    """Trained weights and their training record, each written atomically (the weights first)."""
    import torch

    with atomic_output(weights) as tmp:
        torch.save(module.state_dict(), tmp)
    atomic_write_json(meta_path, meta)
