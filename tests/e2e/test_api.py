"""The Python API on an nn.Module and a DataLoader built here: the CLI's results_dir, manifest and
one-line errors, every stage skipped for the same objects, export re-run for changed weights."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pipeline.api import tune
from pipeline.data.adapters import data_fingerprint
from pipeline.errors import ConfigError
from tests.helpers import PINNED_BACKEND, run_tune

STAGES = ["export", "quantize", "autotune", "evaluate"]
# one runtime (the default, backend=auto, tunes every runtime here: tests/e2e/test_auto.py)
FAST = [PINNED_BACKEND, "quantize.calibration.batches=2", "accuracy.holdout_batches=2", "backend.warmup_runs=1",
        "backend.timing_runs=6", "autotune.warmup_runs=1", "autotune.timing_runs=8", "evaluate.latency_repeats=2",
        "progress=false"]


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.fc = torch.nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _loader(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)),
                      batch_size=8)


@pytest.mark.slow
def test_module_and_dataloader_run_skip_and_rerun_on_new_weights(tmp_path):
    torch.manual_seed(0)
    net, loader = TinyNet(), _loader()
    rd = tmp_path / "r"
    args = [f"stages=[{','.join(STAGES)}]", "autotune.preset=quick", f"results_dir={rd}", *FAST]
    first = tune(args, model=net, data=loader)

    assert dict(first.stages) == dict.fromkeys(STAGES, "done")
    assert first.results_dir == rd and first.model == rd / "autotune" / "optimized_final.onnx"
    x = next(iter(loader))[0].numpy()
    (out,) = ort.InferenceSession(str(first.model), providers=["CPUExecutionProvider"]).run(None, {"input": x})
    assert out.shape == (8, 10) and np.isfinite(out).all()
    manifest = json.loads((rd / "manifest.json").read_text())
    tuned = manifest["stages"]["autotune"]["metrics"]
    assert first.speedup == tuned["speedup"] > 0
    assert first.accuracy == tuned["accuracy"]["final"]["what"] and first.accuracy_ok is tuned["accuracy"]["final"]["ok"]
    assert first.evaluation.data.labelled and first.evaluation.data.samples == 64
    for f in (".hydra/config.yaml", ".hydra/overrides.yaml", "tune.log", "evaluate/report.md"):
        assert (rd / f).is_file(), f
    assert "The model and data came from a Python session" in (rd / "evaluate" / "report.md").read_text()
    # the objects are in the manifest: the module by class name and hashes, the data by content
    config = manifest["stages"]["export"]["config"]
    assert config["model"]["args"]["class_name"] == f"{__name__}.TinyNet"
    assert config["model"]["input_shapes"] == {"input": [8, 1, 8, 8]}
    assert config["data"]["args"] == dict.fromkeys(("calibration", "evaluation"), data_fingerprint(loader))
    assert net.training  # export's eval() is undone

    again = tune(args, model=net, data=loader)
    assert dict(again.stages) == dict.fromkeys(STAGES, "skipped")
    assert (again.model, again.speedup, again.accuracy) == (first.model, first.speedup, first.accuracy)

    with torch.no_grad():
        net.fc.bias += 0.5
    changed = tune([*args, "stages=[export]"], model=net, data=loader)
    assert dict(changed.stages) == {"export": "done"}


def test_bad_key_raises_the_cli_line(tmp_path):
    cli = run_tune(["quantize.algoritm=max"], cwd=tmp_path)
    assert cli.returncode == 2
    rd = tmp_path / "r"
    with pytest.raises(ConfigError) as exc:
        tune(["quantize.algoritm=max", f"results_dir={rd}"], model=TinyNet(), data=_loader(16))
    assert f"tune: error: {exc.value}" == cli.stderr.strip()
    with pytest.raises(ConfigError) as as_dict:
        tune({"quantize.algoritm": "max"})
    assert str(as_dict.value) == str(exc.value)
    assert not rd.exists()


def test_a_spec_file_runs_and_a_missing_or_non_yaml_spec_is_one_line(tmp_path, monkeypatch):
    """tune(spec="specs/my_net.yaml") runs what `tune --config-path specs --config-name my_net` runs; a
    spec that is not an existing .yaml file is a ConfigError naming it and the fix."""
    from tests import models

    monkeypatch.chdir(tmp_path)
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "my_net.yaml").write_text("defaults:\n  - tune\n  - _self_\nstages: [export]\n"
                                                    "progress: false\n")
    path = models.save(models.conv_chain(), tmp_path, "m")
    rd = tmp_path / "r"
    assert tune([f"results_dir={rd}"], model=path, spec="specs/my_net.yaml").stages == {"export": "done"}
    assert tune([f"results_dir={rd}"], model=path, spec=tmp_path / "specs" / "my_net.yaml").stages == {
        "export": "skipped"}
    for spec, what in (("specs/other.yaml", f"no such file ({tmp_path / 'specs' / 'other.yaml'})"),
                       ("nowhere/my_net.yaml", f"no such folder ({tmp_path / 'nowhere'})"),
                       ("specs/my_net", "not a .yaml file"), ("specs/my_net.yml", "not a .yaml file"),
                       ("specs", "not a .yaml file")):
        with pytest.raises(ConfigError) as exc:
            tune(model=path, spec=spec)
        assert str(exc.value) == f'spec {spec}: {what}; give the path of your .yaml spec file, as ' \
                                 f'tune(spec="specs/my_net.yaml")', exc.value


def test_onnx_models_and_arrays_skip_when_unchanged_and_rerun_when_changed(tmp_path):
    """A ModelProto and an .onnx path (changed in place), with calibration data as one array."""
    from tests import models

    x = np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32)
    args = ["stages=[export]", f"results_dir={tmp_path / 'r'}", "progress=false"]
    assert tune(args, model=models.conv_chain(), data=x).stages == {"export": "done"}
    assert tune(args, model=models.conv_chain(), data=x).stages == {"export": "skipped"}
    assert tune(args, model=models.conv_chain(seed=1), data=x).stages == {"export": "done"}
    assert tune(args, model=models.conv_chain(seed=1), data=x[:4]).stages == {"export": "done"}

    path = models.save(models.conv_chain(), tmp_path, "m")
    args[1] = f"results_dir={tmp_path / 'p'}"
    assert tune(args, model=path).stages == {"export": "done"}
    assert tune(args, model=str(path)).stages == {"export": "skipped"}
    models.save(models.conv_chain(seed=2), tmp_path, "m")
    again = tune(args, model=path)
    assert again.stages == {"export": "done"} and again.model == tmp_path / "p" / "export" / "model.onnx"


def test_input_shapes_from_whole_arrays_take_model_batch_size_and_each_call_restores_run_wide_settings(tmp_path):
    """Whole arrays as data: the input shapes take model.batch_size. Two calls in one process with their own
    settings: each leaves the run-wide ones as it found them."""
    x, y = np.zeros((20, 1, 8, 8), np.float32), np.zeros(20, np.int64)
    before = _run_wide()
    for extra, batch in ((["backend.intra_op_threads=1"], 1), (["model.batch_size=4", "backend.intra_op_threads=2"], 4)):
        rd = tmp_path / f"b{batch}"
        tune([PINNED_BACKEND, "stages=[export]", f"results_dir={rd}", "progress=false", *extra], model=TinyNet(),
             data=(x, y))
        config = json.loads((rd / "manifest.json").read_text())["stages"]["export"]["config"]
        assert config["model"]["input_shapes"] == {"input": [batch, 1, 8, 8]}
        assert _run_wide() == before


def _run_wide() -> tuple:
    """Bars, ORT threads, held objects and weights folder: what pipeline.app.scope sets for one run."""
    from pipeline import progress
    from pipeline.backends.onnxruntime.session import configured_threads
    from pipeline.data.live import held_keys
    from pipeline.graph.weights import current_root

    return progress.is_enabled(), configured_threads(), held_keys(), current_root()


@pytest.mark.slow
def test_a_metric_function_judges_every_model_and_its_scores_are_reported(tmp_path):
    """tune(metric=fn): fn(outputs, reference, labels) is called for the float, PTQ and tuned models;
    its scores are in the manifest and report.md, and the budget is its drop."""
    calls = []

    def top1(outputs, reference, labels):
        calls.append(len(outputs))
        hits = sum(int(np.sum(np.argmax(o["logits"], axis=-1) == lab)) for o, lab in zip(outputs, labels, strict=True))
        return 100.0 * hits / sum(len(lab) for lab in labels)

    torch.manual_seed(0)
    rd = tmp_path / "r"
    res = tune([f"stages=[{','.join(STAGES)}]", "autotune.preset=quick", f"results_dir={rd}",
                "model.output_names=[logits]", "accuracy.max_drop=5", *FAST],
               model=TinyNet(), data=_loader(), metric=top1)
    assert calls and res.accuracy_ok
    assert "top1" in res.accuracy and "float" in res.accuracy and "drop" in res.accuracy
    ev = json.loads((rd / "manifest.json").read_text())["stages"]["evaluate"]["metrics"]
    scores = ev["custom_metric"]["scores"]
    assert set(scores) >= {"float", "ptq"} and all(0 <= v <= 100 for v in scores.values())
    assert ev["custom_metric"]["name"] == "top1" and ev["custom_metric"]["path"].startswith("pipeline.data.live.top1__")
    report = (rd / "evaluate" / "report.md").read_text()
    assert "Custom metric `top1` (a function passed to pipeline.api.tune()" in report
    assert f"float {scores['float']:.6g}" in report
