"""pipeline.graph.weights: a model stored with external data keeps its large tensors on disk, read one at a
time; every consumer (ORT sessions, saves, hashes, the checker) sees a complete model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from pipeline.backends.onnxruntime.session import inference_session
from pipeline.errors import InputError
from pipeline.graph import weights
from pipeline.graph.model import load_model, model_hash, save_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from large_model import write_big_model  # noqa: E402 - the bench's generator, one layer in memory at a time

WIDTH = 256  # 256 KB per weight: past LAZY_MIN_BYTES


@pytest.fixture
def stored(tmp_path):
    path = write_big_model(tmp_path / "src" / "m.onnx", layers=3, width=WIDTH)
    yield path
    weights.release()


def _feeds() -> dict[str, np.ndarray]:
    return {"input": np.random.default_rng(0).standard_normal((4, WIDTH)).astype(np.float32)}


def _reference(path: Path) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, _feeds())[0]


def test_large_tensors_stay_on_disk_and_read_back_exactly(stored):
    want = _reference(stored)  # before anything is linked: onnx and ORT read the file as users do
    inline = onnx.load(str(stored))
    model = load_model(stored)
    assert model.ByteSize() < 10_000 and all(weights.is_lazy(t) for t in model.graph.initializer)
    for t, full in zip(model.graph.initializer, inline.graph.initializer, strict=True):
        np.testing.assert_array_equal(weights.array(t), onnx.numpy_helper.to_array(full))
    np.testing.assert_array_equal(inference_session(model).run(None, _feeds())[0], want)
    assert model_hash(model) == model_hash(load_model(stored))  # the same content, whatever the link's name


def test_saved_models_carry_their_own_data_and_links_end_with_the_stage(stored, tmp_path):
    model = load_model(stored)
    out = save_model(model, tmp_path / "out" / "copy.onnx")
    assert sorted(p.name for p in out.parent.iterdir()) == ["copy.onnx", "copy.onnx.data"]
    shared = save_model(model, tmp_path / "work" / "w.onnx", share_weights=True)
    data, link = stored.with_name("m.onnx.data"), shared.parent / weights.referenced(model)[0]
    assert link.stat().st_ino == data.stat().st_ino and data.stat().st_nlink == 3  # source, weights folder, work
    np.testing.assert_array_equal(inference_session(shared).run(None, _feeds())[0], _reference(out))
    weights.release()
    link.unlink()  # a working folder's link goes with the folder
    assert data.stat().st_nlink == 1
    np.testing.assert_array_equal(_reference(out), _reference(stored))  # onnx's own loader accepts it again
    onnx.checker.check_model(str(stored))


def test_a_replaced_data_file_does_not_change_a_loaded_model(stored):
    model = load_model(stored)
    before = weights.array(model.graph.initializer[0]).copy()
    fresh = write_big_model(stored.parent / "new" / "m.onnx", layers=3, width=WIDTH, seed=5)
    os.replace(fresh.with_name("m.onnx.data"), stored.with_name("m.onnx.data"))  # atomic, like every save here
    np.testing.assert_array_equal(weights.array(model.graph.initializer[0]), before)
    assert model_hash(load_model(stored)) != model_hash(model)


def test_a_short_data_file_is_one_line_naming_the_tensor(stored):
    data = stored.with_name("m.onnx.data")
    with open(data, "r+b") as fh:
        fh.truncate(data.stat().st_size - 4)
    with pytest.raises(InputError, match=r"its external data cannot be read \(tensor w2 needs bytes"):
        load_model(stored)


def test_constant_folding_reads_the_weights_it_folds_and_leaves_the_rest_on_disk(tmp_path):
    """A weight kept on disk that feeds a Transpose (tf2onnx stores MatMul weights transposed) is folded
    by onnx-graphsurgeon like an in-memory one; the weight nothing folds stays a reference."""
    from onnx import TensorProto, helper

    from pipeline.transforms.folding import fold_constants

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) for _ in range(2))
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["a"], ["at"], perm=[1, 0]), helper.make_node("MatMul", ["input", "at"], ["m"]),
         helper.make_node("MatMul", ["m", "b"], ["output"])], "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [4, WIDTH])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [4, WIDTH])],
        [onnx.numpy_helper.from_array(a, "a"), onnx.numpy_helper.from_array(b, "b")])
    path = tmp_path / "t.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
              save_as_external_data=True, location="t.onnx.data", size_threshold=0)
    model = load_model(path)
    want = inference_session(model).run(None, _feeds())[0]
    folded, counts = fold_constants(model)
    assert [n.op_type for n in folded.graph.node] == ["MatMul", "MatMul"], counts
    inits = {t.name: t for t in folded.graph.initializer}
    assert weights.is_lazy(inits["b"]) and not any(weights.is_lazy(t) for n, t in inits.items() if n != "b")
    np.testing.assert_allclose(inference_session(folded).run(None, _feeds())[0], want, rtol=1e-5, atol=1e-5)
    weights.release()


def test_the_graph_ort_runs_of_a_model_with_external_data_is_written_with_it(stored, tmp_path):
    """gen_trt_engine's model.ort.onnx of an external-data model: ORT writes its weights to
    ``<name>.data`` beside it (inline, a model past 2 GB could not be written), and it runs from its path."""
    import onnxruntime as ort
    from omegaconf import OmegaConf

    from pipeline.backends.onnxruntime import OnnxRuntimeBackend
    from pipeline.backends.onnxruntime.config import OnnxRuntimeBackendConfig

    backend = OnnxRuntimeBackend(OmegaConf.structured(OnnxRuntimeBackendConfig(warmup_runs=1, timing_runs=2)))
    out = backend.build(stored, tmp_path / "model.ort.onnx").engine_path
    assert out.with_name("model.ort.onnx.data").stat().st_size >= 3 * WIDTH * WIDTH * 4
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, _feeds())[0]
    np.testing.assert_allclose(got, _reference(stored), rtol=1e-5, atol=1e-5)


def test_without_a_hard_link_the_weights_are_read_into_memory_with_one_warning(stored, monkeypatch, caplog):
    """A data file on another file system than TMPDIR cannot be linked: the model is read as before."""
    import errno

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "link", cross_device)
    with caplog.at_level("WARNING", logger="tune.weights"):
        model = load_model(stored)
    assert not weights.has_lazy(model) and model.ByteSize() > 3 * WIDTH * WIDTH * 4
    assert len(caplog.records) == 1 and "Set TMPDIR" in caplog.records[0].getMessage()
    np.testing.assert_array_equal(inference_session(model).run(None, _feeds())[0], _reference(stored))


def test_the_size_bound_is_never_below_the_serialized_size_and_close_to_it():
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    raw = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w")
    raw.doc_string = "a weight"
    typed = helper.make_tensor("shape", TensorProto.INT64, [2], [4, 64])  # int64_data, as exporters write it
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    const = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.ones(300, np.float32)))
    graph = helper.make_graph([const, node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])], [raw, typed])
    model = helper.make_model(graph)
    bound = weights.proto_size_bound(model)
    assert model.ByteSize() <= bound <= model.ByteSize() + 2 * 300
    assert weights.fits_one_proto(model)


def test_a_large_initializer_whose_bytes_do_not_match_its_shape_is_refused_without_serializing_the_model():
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((300, 300), np.float32), "w")  # past CHECKED_INLINE: checked here
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 300])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 300])], [w])
    model = helper.make_model(graph)
    weights.check_model(model)
    model.graph.initializer[0].raw_data = model.graph.initializer[0].raw_data[:-4]
    with pytest.raises(onnx.checker.ValidationError, match="initializer w: raw_data holds 359996 bytes"):
        weights.check_model(model)
