"""Every shipped config option composes and validates; bad input fails with one line naming the key."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import pytest
import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

import conf
from pipeline.config import validate
from pipeline.errors import ConfigError
from pipeline.values import enum_value
from tests.helpers import compose, run_tune

CONF = Path(conf.__file__).parent
GROUPS = ["model", "data", "backend", "export", "quantize", "autotune", "gen_trt_engine", "evaluate"]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_option_composes(group, option, tmp_path):
    overrides = [f"{group}={option}"]
    if option == "onnx":
        f = tmp_path / "m.onnx"
        f.write_bytes(b"")
        overrides.append(f"model.onnx_path={f}")
    if option == "custom" and group == "model":
        overrides.append("model._target_=torch.nn.Identity")
    if option == "npz":
        overrides.append("data.path=x.npz")
    if option == "custom" and group == "data":
        overrides.append("data._target_=builtins.list")
    if option == "custom" and group == "backend":
        overrides.append("backend._target_=pipeline.backends.onnxruntime.OnnxRuntimeBackend")
    cfg = compose(overrides)
    validate(cfg)
    # what the option's file sets is what the composed config holds
    chosen = yaml.safe_load((CONF / group / f"{option}.yaml").read_text()) or {}
    bases = [d for d in chosen.pop("defaults", []) if isinstance(d, str) and d.startswith("base_")]
    assert len(bases) == 1, f"{group}/{option}.yaml extends one schema"
    schema = ConfigStore.instance().repo[group][f"{bases[0]}.yaml"].node
    assert OmegaConf.get_type(cfg[group]) is OmegaConf.get_type(schema), f"{group}={option} has its schema's type"
    for key, want in _leaves(chosen):
        got = OmegaConf.select(cfg, f"{group}.{key}")
        got = OmegaConf.to_container(got, enum_to_str=True) if OmegaConf.is_config(got) else got
        assert (enum_value(got) if isinstance(got, Enum) else got) == want, f"{group}.{key}"


def _leaves(node: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for k, v in node.items():
        if isinstance(v, dict) and v:
            out += _leaves(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def test_validate_collects_every_problem():
    cfg = compose(["quantize.calibration.batches=0", "autotune.performance_threshold=0.5",
                   "gen_trt_engine.tensorrt.min_batch_size=4"])
    with pytest.raises(ConfigError) as exc:
        validate(cfg)
    assert len(exc.value.problems) == 3
    assert "quantize.calibration.batches" in str(exc.value)


def test_unknown_appended_key_is_rejected():
    cfg = compose(["+quantize.algoritm=max"])
    with pytest.raises(ConfigError, match="unknown config key 'quantize.algoritm'"):
        validate(cfg)


@pytest.mark.parametrize("args,needle", [
    (["quantize.algoritm=max"], "unknown config key 'quantize.algoritm'"),
    (["quantize.algorithm=foo"], "quantize.algorithm"),
    (["model.batch_size=abc"], "model.batch_size"),
    (["model=nope"], "model/nope"),
    (["stages=[export]", "model=onnx", "model.onnx_path=/nonexistent.onnx"], "/nonexistent.onnx does not exist"),
    (["-m", "seed=1,2", "quantize.algoritm=max"], "quantize.algoritm"),
])
def test_cli_errors_are_one_line(args, needle, tmp_path):
    proc = run_tune(args, cwd=tmp_path)
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert needle in err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err


def test_spec_file_outside_package(tmp_path):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "my_spec.yaml").write_text(
        "defaults:\n  - tune\n  - override model: bert_tiny\n  - _self_\n"
        "results_dir: out/bert\nquantize:\n  algorithm: entropy\n"
    )
    cfg = compose([], config_dir=str(specs), config_name="my_spec")
    assert cfg.model.name == "bert_tiny" and cfg.quantize.algorithm.value == "entropy"
    proc = run_tune(["--config-path", "specs", "--config-name", "my_spec", "--cfg", "job"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "bert_tiny" in proc.stdout and "entropy" in proc.stdout


def test_help_and_cfg_job(tmp_path):
    assert run_tune(["--help"], cwd=tmp_path).returncode == 0
    proc = run_tune(["--cfg", "job", "quantize=fp8"], cwd=tmp_path)
    assert proc.returncode == 0 and "fp8_e4m3fn" in proc.stdout


def test_accuracy_group_and_its_deprecated_alias_compose_the_same_run(capsys):
    from omegaconf import OmegaConf

    from pipeline.config import validate
    from tests.helpers import compose

    new = compose(["accuracy.min_snr_db=25", "results_dir=/tmp/x"])
    old = compose(["autotune.accuracy.min_snr_db=25", "results_dir=/tmp/x"])
    validate(new)
    validate(old)
    assert OmegaConf.to_container(new) == OmegaConf.to_container(old)
    assert old.accuracy.min_snr_db == 25 and old.autotune.accuracy.min_snr_db is None
    assert "autotune.accuracy.min_snr_db is deprecated; use accuracy.min_snr_db" in capsys.readouterr().err


def test_a_bad_accuracy_value_names_its_key():
    with pytest.raises(ConfigError, match=r"accuracy.max_float_fraction=1.5: must be in \(0, 1\]"):
        validate(compose(["accuracy.max_float_fraction=1.5", "results_dir=/tmp/x"]))
    with pytest.raises(ConfigError, match=r"backend.min_block_ms=-1.0: must be >= 0"):
        validate(compose(["backend.min_block_ms=-1", "results_dir=/tmp/x"]))


def test_a_key_the_chosen_mode_ignores_is_named(capsys):
    from pipeline.config import validate
    from tasks.autotune.config import ignored_keys
    from tests.helpers import compose

    cfg = compose(["autotune.mode=subgraph", "autotune.schemes_per_region=5", "results_dir=/tmp/x"])
    assert ignored_keys(cfg.autotune) == ["autotune.schemes_per_region=5"]
    validate(cfg)
    assert "autotune.schemes_per_region=5: ignored in autotune.mode=subgraph" in capsys.readouterr().err
    region = compose(["autotune.incremental_validation=false", "results_dir=/tmp/x"])
    assert ignored_keys(region.autotune) == ["autotune.incremental_validation=False"]
    assert ignored_keys(compose(["results_dir=/tmp/x"]).autotune) == []


def _flat_keys(node: dict, prefix: str = "") -> set[str]:
    """Dotted keys of a config's container (the values that are maps a user fills stay one key)."""
    out = set()
    for k, v in node.items():
        key = f"{prefix}{k}"
        if str(k).startswith("_"):
            continue
        if isinstance(v, dict) and v and k not in ("input_shapes", "per_output", "runtimes", "compile_config"):
            out |= _flat_keys(v, f"{key}.")
        else:
            out.add(key)
    return out


def test_the_config_reference_is_generated_from_the_schemas_and_lists_every_key():
    """docs/config.md is what pipeline.app.config_reference renders, and every key a composed config holds, for
    every option of the groups that have several, is in it."""
    from pipeline.app.config_reference import CONF, keys, render

    doc = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert doc.read_text() == render(), "docs/config.md is stale: python -m pipeline.app.config_reference > docs/config.md"
    listed = keys()
    for group in ("model", "backend", "data", "quantize", "target"):
        for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
            extra = {"model": ["model.onnx_path=x.onnx"] if option == "onnx" else [],
                     "data": ["data.path=x"] if option == "npz" else []}.get(group, [])
            cfg = compose([f"{group}={option}", "results_dir=/tmp/x", *extra])
            container = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
            missing = sorted(k for k in _flat_keys(container) if k not in listed and not k.startswith("hydra"))
            assert missing == [], f"{group}={option}: keys the reference leaves out"


def test_a_composed_auto_config_pickles_with_its_runtime_sections():
    """auto's schema is generated from the runtime registry; its config still goes to a spawned process
    (crash guard probes, launchers) whole and section by section."""
    import pickle

    cfg = compose(["backend=auto"])
    again = pickle.loads(pickle.dumps(cfg))
    assert again.backend.runtimes == cfg.backend.runtimes and again.backend.openvino.name == "openvino"
    assert pickle.loads(pickle.dumps(cfg.backend.onnxruntime)).name == "onnxruntime"
    # a process that has composed nothing (a launcher's worker) reads it back too
    import subprocess
    import sys

    read = "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read()).backend.openvino.name)"
    proc = subprocess.run([sys.executable, "-c", read], input=pickle.dumps(cfg), capture_output=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.decode().strip() == "openvino", proc.stderr.decode()[-2000:]
