"""AutotuneMetrics: manifest.json's autotune metrics as a record, read back exactly as the runs wrote them
(region and subgraph mode, backend=auto's top level with the choice, and where the winner's float ships)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.accuracy.autotune_metrics import AutotuneMetrics, autotune_metrics
from pipeline.accuracy.kinds import CheckedOn
from pipeline.errors import StateError

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
