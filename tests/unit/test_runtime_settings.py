"""The runtime settings records a tuned model ships with (pipeline.backends.settings): the files
ort_session.json, openvino_compile.json and trt_build.json keep their bytes, load strictly with one line
naming the file, and every record checks its values the same way when built, loaded or changed."""

from __future__ import annotations

import pytest

from pipeline.backends.base import Backend, ShippedSettings
from pipeline.backends.onnxruntime.session import SessionSettings
from pipeline.backends.openvino.settings import CompileSettings
from pipeline.backends.settings import RuntimeSettings
from pipeline.backends.tensorrt.settings import TrtBuildSettings
from pipeline.errors import StateError

# the bytes each record wrote before the records shared a base: results dirs written then still load
FILES = [
    (SessionSettings(), '{\n  "disabled_optimizers": [],\n  "config_entries": {},\n'
                        '  "graph_optimization_level": "all",\n  "intra_op_num_threads": 0\n}\n'),
    (SessionSettings(("SkipLayerNormFusion",), (("optimization.enable_gelu_approximation", "1"),), "extended", 2),
     '{\n  "disabled_optimizers": [\n    "SkipLayerNormFusion"\n  ],\n  "config_entries": {\n'
     '    "optimization.enable_gelu_approximation": "1"\n  },\n  "graph_optimization_level": "extended",\n'
     '  "intra_op_num_threads": 2\n}\n'),
    (CompileSettings(), "{}\n"),
    (CompileSettings.from_dict({"NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": "F32"}),
     '{\n  "INFERENCE_PRECISION_HINT": "f32",\n  "NUM_STREAMS": "1"\n}\n'),
    (TrtBuildSettings(), '{\n  "builder_optimization_level": null,\n  "tiling_optimization_level": null,\n'
                         '  "max_aux_streams": null\n}\n'),
    (TrtBuildSettings(builder_optimization_level=5, max_aux_streams=0),
     '{\n  "builder_optimization_level": 5,\n  "tiling_optimization_level": null,\n  "max_aux_streams": 0\n}\n'),
]


@pytest.mark.parametrize("settings, text", FILES)
def test_files_keep_their_bytes_and_load_back_equal(tmp_path, settings, text):
    path = settings.save(tmp_path / "settings.json")
    assert path.read_text() == text
    loaded = type(settings).load(path)
    assert loaded == settings and hash(loaded) == hash(settings) and loaded.to_dict() == settings.to_dict()


@pytest.mark.parametrize("kind, text, detail", [
    (SessionSettings, '{"graph_optimization_level": "all", "fusions": []}', "unknown key 'fusions'"),
    (SessionSettings, '{"intra_op_num_threads": -1}', "intra_op_num_threads=-1, expected an integer >= 0"),
    (SessionSettings, '{"disabled_optimizers": "GeluFusion"}', "disabled_optimizers='GeluFusion'"),
    (SessionSettings, '{"config_entries": [1, 2]}', "config_entries=[1, 2]"),
    (SessionSettings, '"all"', "expected an object of disabled_optimizers"),
    (CompileSettings, '{"TURBO": "YES"}', "unknown OpenVINO property 'TURBO'"),
    (TrtBuildSettings, '{"tiling": 1}', "unknown key 'tiling'"),
    (TrtBuildSettings, "{", "corrupt"),
])
def test_a_bad_file_is_one_state_error_naming_it(tmp_path, kind, text, detail):
    path = tmp_path / "shipped.json"
    path.write_text(text)
    with pytest.raises(StateError) as exc:
        kind.load(path)
    msg = str(exc.value)
    assert len(msg.splitlines()) == 1 and str(path) in msg and detail in msg and kind.what in msg


def test_changed_checks_values_as_a_new_record_does():
    s = SessionSettings().changed(intra_op_num_threads=2, config_entries={"b": 1, "a": "x"})
    assert s.config_entries == (("a", "x"), ("b", "1")) and s == SessionSettings.from_dict(s.to_dict())
    with pytest.raises(ValueError, match="graph_optimization_level='fastest'"):
        SessionSettings().changed(graph_optimization_level="fastest")
    with pytest.raises(ValueError, match="max_aux_streams=-1, expected null or an integer >= 0"):
        TrtBuildSettings().changed(max_aux_streams=-1)
    with pytest.raises(ValueError, match="choose one of"):
        CompileSettings().changed(PERFORMANCE_HINT="FAST")
    assert CompileSettings().changed(NUM_STREAMS=2).changed(NUM_STREAMS=None) == CompileSettings()


def test_records_of_different_runtimes_are_never_equal_and_the_base_is_abstract():
    assert SessionSettings() != TrtBuildSettings() and CompileSettings() != SessionSettings()
    with pytest.raises(TypeError):
        RuntimeSettings()


class _OwnSettings(RuntimeSettings):
    pass


class SettingsRuntime(Backend):
    """A runtime of a user's own with a settings file of its own (importable by name for backend._target_)."""

    name = "own"
    shipped_settings = ShippedSettings(_OwnSettings, "autotune/own_settings.json", "own settings", "defaults")


def test_a_custom_runtimes_settings_file_is_an_input_of_the_stages_that_deploy_and_evaluate_it():
    """A shipped settings file decides what gen_trt_engine builds and evaluate measures: when it changes, both
    re-run. Each stage asks the configured runtime for its file, so a custom runtime's counts too."""
    from pipeline.registry import load_stage
    from tests.helpers import compose

    cfg = compose(["backend=custom", f"backend._target_={__name__}.SettingsRuntime"])
    ctx = type("Ctx", (), {"cfg": cfg})()
    for stage in ("gen_trt_engine", "evaluate"):
        assert "autotune/own_settings.json" in load_stage(stage).optional_input_keys(ctx), stage
    ort = type("Ctx", (), {"cfg": compose(["backend=onnxruntime"])})()
    assert "autotune/ort_session.json" in load_stage("evaluate").optional_input_keys(ort)
    assert "autotune/own_settings.json" not in load_stage("evaluate").optional_input_keys(ort)
