"""AutotuneMetrics: manifest.json's autotune metrics as a record, read back exactly as the runs wrote them
(region and subgraph mode, backend=auto's top level with the choice, and where the winner's float ships)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.accuracy.kinds import CheckedOn
from pipeline.errors import StateError
from pipeline.records.autotune import AutotuneMetrics, autotune_metrics

FIXTURES = Path(__file__).parents[1] / "fixtures" / "autotune_metrics"


def _recorded(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


@pytest.mark.parametrize("name", ["region.json", "subgraph.json", "auto_top_level.json", "auto_float_top_level.json"])
def test_the_record_reads_back_exactly_what_a_run_wrote(name):
    recorded = _recorded(name)
    metrics = AutotuneMetrics.from_dict(recorded, name)
    assert metrics.to_dict() == recorded
    assert json.loads(json.dumps(metrics.to_dict())) == recorded  # as manifest.json holds it
    assert AutotuneMetrics.from_dict(metrics.to_dict()) == metrics


def test_readers_get_typed_fields():
    region = AutotuneMetrics.from_dict(_recorded("region.json"))
    assert (region.search.mode, region.shipped) == ("region", "tuned")
    assert region.speedup == pytest.approx(region.baseline_ms / region.final_ms)
    assert region.accuracy.final is not None and region.accuracy.final.ok
    assert isinstance(region.checked, CheckedOn) and region.choice is None and region.runtime_choice is None
    assert "regions" in region.search.details and "mode" not in region.search.details
    sub = AutotuneMetrics.from_dict(_recorded("subgraph.json"))
    assert sub.search.mode == "subgraph" and sub.guard is not None
    assert {"group_report", "phases", "steps", "raw"} <= set(sub.search.details)
    top = AutotuneMetrics.from_dict(_recorded("auto_top_level.json"))
    assert top.choice is not None and top.choice.winner == _recorded("auto_top_level.json")["runtime_choice"]["winner"]
    assert top.headline == top.choice.headline and top.runtime_headline and top.host_choices


def test_a_changed_record_is_a_new_one_and_the_old_stays_as_read():
    recorded = _recorded("region.json")
    own = AutotuneMetrics.from_dict(recorded)
    shipped_float = replace(own, shipped="float", final_ms=own.baseline_ms, speedup=1.0)
    assert (own.shipped, own.speedup) == (recorded["shipped"], recorded["speedup"])
    assert shipped_float.to_dict()["speedup"] == 1.0 and own.to_dict() == recorded


def test_a_corrupt_entry_is_one_line_naming_where():
    where = "/r/manifest.json's autotune entry"
    for bad in ({"speedup": "fast"}, {"accuracy": []}, {"shipped": 3}, ["not", "an", "object"]):
        with pytest.raises(StateError, match="manifest.json's autotune entry has an unknown layout") as exc:
            AutotuneMetrics.from_dict(bad, where)
        assert "\n" not in str(exc.value)
    assert autotune_metrics({}, where) is None and autotune_metrics(None, where) is None


def test_where_the_winners_float_ships_the_top_level_gets_a_new_record_and_the_winners_own_stays(tmp_path):
    """publish: the top level's autotune metrics say the float ships (its latency, no speedup, the choice
    beside it); the winner's own manifest keeps the record its autotune wrote."""
    from pipeline.app.publish import publish
    from pipeline.app.runtime_runs import RuntimeRun
    from pipeline.artifacts import Manifest
    from pipeline.runtime_choice import FLOAT, Contender, RuntimeChoice, RuntimeRow
    from tests import models
    from tests.helpers import compose

    top, sub = tmp_path / "r", tmp_path / "r" / "runtimes" / "onnxruntime"
    float_model = models.save(models.conv_chain(), top / "export", "model")
    shipped = models.save(models.conv_chain(), sub / "autotune", "optimized_final")
    top_manifest = Manifest(top)
    top_manifest.stages["export"] = {"status": "done",
                                     "outputs": {"export/model.onnx": top_manifest.describe_file(float_model)}}
    top_manifest.save()
    own = _recorded("region.json")
    sub_manifest = Manifest(sub)
    sub_manifest.stages["autotune"] = {"status": "done", "metrics": own, "outputs": {
        "autotune/optimized_final.onnx": sub_manifest.describe_file(shipped)}}
    sub_manifest.save()
    winner = RuntimeRun("onnxruntime", compose(["backend=onnxruntime"]), sub)
    choice = RuntimeChoice("k", "onnxruntime FP32 float", 2.0, "onnxruntime",
                           [RuntimeRow("onnxruntime", "tuned", "FP32", "ok", p10_ms=1.0, float_p10_ms=0.5)],
                           headline="ships onnxruntime (FP32 float)",
                           contenders=[Contender("onnxruntime", FLOAT, "FP32 float", 0.5)])
    (top / "autotune").mkdir(parents=True, exist_ok=True)
    (top / "autotune" / "runtime_choice.json").write_text(json.dumps(choice.to_dict()))
    publish(top, winner, choice)
    published = AutotuneMetrics.from_dict(Manifest(top).metrics("autotune"), "the top level's autotune entry")
    assert (published.shipped, published.speedup, published.final_ms) == ("float", 1.0, own["baseline_ms"])
    assert (published.headline, published.runtime_headline) == (choice.headline, own["headline"])
    assert published.choice == choice and published.to_dict() == Manifest(top).metrics("autotune")
    assert json.loads((sub / "manifest.json").read_text())["stages"]["autotune"]["metrics"] == own


@pytest.mark.parametrize("choice", [{"rows": "x"}, {"rows": ["x"]}, {"rows": []}])
def test_a_corrupt_runtime_choice_in_the_manifest_is_one_line_naming_it_and_the_fix(choice):
    """The top level's copy of the runtime choice lives in the manifest, not in runtime_choice.json: its error
    names that place and a fix that works there."""
    metrics = AutotuneMetrics.from_dict({"runtime_choice": choice}, "manifest.json")
    with pytest.raises(StateError) as exc:
        metrics.choice  # noqa: B018 - the property reads the record
    text = str(exc.value)
    assert "\n" not in text and "manifest.json's autotune entry" in text and "run tune on the results_dir again" in text
