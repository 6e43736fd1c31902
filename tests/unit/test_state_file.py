"""Every resumable file (region state, subgraph cache, runtime search state) starts with one header
record: it round-trips in file order, and a corrupt or foreign file is refused with one line that
names the file."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from pipeline.backends.onnxruntime import OnnxRuntimeBackend
from pipeline.backends.onnxruntime.config import OnnxRuntimeBackendConfig
from pipeline.errors import StaleStateError, StateError
from pipeline.graph.model import model_hash
from tasks.autotune.runtime.search import STATE_VERSION, RuntimeSearch
from tasks.autotune.state_file import REGION_STATE, SUBGRAPH_CACHE, StateDocument, StateHeader
from tests import models

HEADER = StateHeader.of(2, "abc", "ctx", mode="subgraph")


def test_a_state_document_round_trips_in_file_order():
    doc = StateDocument(HEADER, {"groups": {"k": {"winner": "none"}}, "phase3": {"steps": []}})
    d = json.loads(json.dumps(doc.to_dict()))
    assert list(d) == ["version", "model_sha256", "context", "mode", "groups", "phase3"]
    assert StateHeader.from_dict(d, HEADER.setting_keys) == HEADER
    assert StateDocument.from_dict(d, HEADER.setting_keys) == doc
    assert StateDocument.resume(d, "autotune_cache.json", SUBGRAPH_CACHE, HEADER) == doc
    del d["version"]  # a document without a version is read as the current one
    assert StateDocument.resume(d, "autotune_cache.json", SUBGRAPH_CACHE, HEADER) == doc


@pytest.mark.parametrize(("change", "reason"), [
    ({"version": 1}, "has format version 1, this qdq-tune reads version 2"),
    ({"model_sha256": "xyz"}, "belongs to a different model"),
    ({"mode": "region"}, "was made with mode=region, this run uses subgraph"),
    ({"context": "other"}, "was measured with other inputs or settings"),
    ({"context": None}, "was measured with other inputs or settings"),
])
def test_a_foreign_header_is_refused_in_one_line_naming_the_file(tmp_path, change, reason):
    path = tmp_path / "autotune_cache.json"
    doc = {**StateDocument(HEADER, {"groups": {}}).to_dict(), **change}
    with pytest.raises(StaleStateError) as exc:
        StateDocument.resume(doc, path, SUBGRAPH_CACHE, HEADER)
    msg = str(exc.value)
    assert len(msg.splitlines()) == 1 and msg.startswith(f"autotune cache {path} {reason}")
    assert exc.value.reason.startswith(reason) and msg.endswith("delete it to tune afresh")


def test_region_state_from_before_contexts_resumes_and_checks_its_settings():
    header = StateHeader.of(1, "abc", "ctx", quant_type="int8", placement="ort")
    doc = {**header.to_dict(), "context": None, "patterns": {}}
    assert StateDocument.resume(doc, "s.yaml", REGION_STATE, header).body == {"patterns": {}}
    with pytest.raises(StaleStateError, match="s.yaml was made with placement=trt, this run uses ort"):
        header.check({**doc, "placement": "trt"}, "s.yaml", REGION_STATE)


def test_a_corrupt_or_foreign_runtime_search_state(tmp_path):
    """A corrupt state is one line naming the file; one of another kind is set aside and the search
    starts afresh."""
    backend = OnnxRuntimeBackend(OmegaConf.structured(OnnxRuntimeBackendConfig()))
    model = models.save(models.conv_chain(), tmp_path, "m")
    state = tmp_path / "runtime_search.json"
    state.write_text("{not json")
    with pytest.raises(StateError) as exc:
        RuntimeSearch(backend, model, None, None, state, "ctx").run([])
    assert len(str(exc.value).splitlines()) == 1 and f"runtime search state {state} is corrupt" in str(exc.value)
    header = {"version": STATE_VERSION, "model_sha256": model_hash(model), "context": "ctx"}
    state.write_text(json.dumps({**header, "kind": "autotune/ort_session.json", "steps": [],
                                 "settings": {"graph_optimization_level": "fastest"}, "done": False}))
    with pytest.raises(StateError, match=f"{state} is corrupt .*graph_optimization_level='fastest'"):
        RuntimeSearch(backend, model, None, None, state, "ctx").run([])
    state.write_text(json.dumps({**header, "kind": "autotune/trt_build.json", "steps": [], "settings": {},
                                 "done": False}))
    search = RuntimeSearch(backend, model, None, None, state, "ctx")
    search.run([])
    assert list((tmp_path / "stale").glob("*/runtime_search.json"))
    assert search.doc == {**header, "kind": "autotune/ort_session.json", "steps": [],
                          "settings": search.doc["settings"], "done": True}
    assert json.loads(state.read_text()) == search.doc
