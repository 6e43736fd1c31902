from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.data.adapters import DataProvider, rebatch, to_feeds
from pipeline.data.digits import digits_arrays, digits_split
from pipeline.errors import InputError
from pipeline.graph.model import InputSpec, input_specs
from tests import models
from tests.helpers import compose

SPEC = [InputSpec("input", (4, 1, 8, 8), np.dtype(np.float32))]


@pytest.mark.parametrize("batch", [
    np.zeros((3, 1, 8, 8)),
    torch.zeros(3, 1, 8, 8),
    (torch.zeros(3, 1, 8, 8), torch.arange(3)),
    [np.zeros((3, 1, 8, 8)), np.arange(3)],
    {"images": np.zeros((3, 1, 8, 8)), "labels": np.arange(3)},
    {"input": torch.zeros(3, 1, 8, 8)},
    {"x": np.zeros((3, 1, 8, 8))},
    {"images_left": np.zeros((3, 1, 8, 8))},
])
def test_adapter_accepts_common_batch_forms(batch):
    feeds, labels = to_feeds(batch, SPEC)
    assert feeds["input"].shape == (3, 1, 8, 8) and feeds["input"].dtype == np.float32
    if isinstance(batch, (tuple, list)) or (isinstance(batch, dict) and "labels" in batch):
        assert labels.tolist() == [0, 1, 2]


def test_adapter_explicit_key_and_multi_input():
    feeds, _ = to_feeds({"pixels": np.zeros((2, 1, 8, 8))}, SPEC, key="pixels")
    assert feeds["input"].shape == (2, 1, 8, 8)
    two = [InputSpec("a", (2, 3), np.dtype(np.float32)), InputSpec("b", (2, 5), np.dtype(np.int64))]
    feeds, _ = to_feeds({"a": np.ones((2, 3)), "b": np.ones((2, 5))}, two)
    assert feeds["b"].dtype == np.int64
    with pytest.raises(InputError, match="none holds the input"):
        to_feeds({"pixels": np.zeros((2, 1, 8, 8))}, SPEC)
    with pytest.raises(InputError, match="sample shape"):
        to_feeds(np.zeros((2, 1, 9, 9)), SPEC)


def test_rebatch_recuts_and_pads():
    stream = [({"input": np.full((3, 1), i, np.float32)}, np.full(3, i)) for i in range(3)]  # 9 samples
    out = list(rebatch(stream, 4))
    assert [b.valid for b in out] == [4, 4, 1]
    assert all(b.feeds["input"].shape == (4, 1) for b in out)
    assert out[0].labels.tolist() == [0, 0, 0, 1]
    assert list(rebatch(stream, 4, max_batches=1))[0].valid == 4


def test_digits_split_is_fixed_by_seed_and_disjoint():
    a, ya = digits_arrays("train", 1, 0.3, (1, 16, 16))
    b, _ = digits_arrays("test", 1, 0.3, (1, 16, 16))
    a2, _ = digits_arrays("train", 1, 0.3, (1, 16, 16))
    assert a.shape[1:] == (1, 16, 16) and len(a) + len(b) == 1797
    np.testing.assert_array_equal(a, a2)
    assert set(ya.tolist()) == set(range(10))


def test_synthetic_int_inputs_respect_embedding_size(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.zeros((50, 4), np.float32), "emb")
    g = helper.make_graph([helper.make_node("Gather", ["emb", "ids"], ["out"])], "g",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 7])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 7, 4])], [table])
    specs = input_specs(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert specs[0].int_high == 50
    cfg = compose(["model=onnx", "model.onnx_path=x.onnx", "data=synthetic", "data.num_samples=10"])
    batches = list(DataProvider(cfg, specs).batches("calibration"))
    ids = np.concatenate([b.feeds["ids"] for b in batches])
    assert ids.max() < 50 and ids.dtype == np.int64 and len(batches) == 5
    del onnx


def test_npz_source_and_none_warning(tmp_path, caplog):
    specs = input_specs(models.conv_chain(batch=2))
    np.savez(tmp_path / "calib.npz", input=np.ones((5, 3, 16, 16), np.float32), labels=np.arange(5))
    cfg = compose(["model=onnx", "model.onnx_path=x.onnx", "data=npz", f"data.path={tmp_path / 'calib.npz'}"])
    out = list(DataProvider(cfg, specs).batches("calibration"))
    assert [b.valid for b in out] == [2, 2, 1] and out[0].labels.tolist() == [0, 1]
    cfg = compose(["model=onnx", "model.onnx_path=x.onnx"])
    with caplog.at_level("WARNING"):
        list(DataProvider(cfg, specs).batches("calibration", max_batches=1))
    assert "SYNTHETIC" in caplog.text


def _loader(split: str = "calibration"):
    ds = torch.utils.data.TensorDataset(torch.randn(5, 3, 16, 16), torch.arange(5))
    return torch.utils.data.DataLoader(ds, batch_size=3)


def test_custom_dataloader_source():
    specs = input_specs(models.conv_chain(batch=2))
    cfg = compose(["model=onnx", "model.onnx_path=x.onnx", "data=custom", "data._target_=tests.unit.test_data._loader"])
    out = list(DataProvider(cfg, specs).batches("evaluation"))
    assert [b.valid for b in out] == [2, 2, 1]
    assert out[2].labels[0] == 4


def _rnn_specs():
    return input_specs(models.stateful_rnn(batch=2))


def test_folder_of_per_feed_npz_calibrates_state_inputs(tmp_path):
    """Recurrent models take h/c of shape [layers, batch, hidden]: one .npz per complete feed."""
    rng = np.random.default_rng(0)
    feeds = tmp_path / "feeds"
    feeds.mkdir()
    for i in range(3):
        np.savez(feeds / f"{i:03d}.npz", x=rng.standard_normal((5, 2, 16)).astype(np.float32),
                 h0=rng.standard_normal((1, 2, 32)), c0=np.zeros((1, 2, 32), np.float32))
    cfg = compose(["model=onnx", "model.onnx_path=x.onnx", "data=npz", f"data.path={feeds}"])
    out = list(DataProvider(cfg, _rnn_specs()).batches("calibration"))
    assert len(out) == 3 and out[0].feeds["h0"].shape == (1, 2, 32) and out[0].feeds["h0"].dtype == np.float32
    np.savez(feeds / "bad.npz", x=np.zeros((5, 2, 16), np.float32), h0=np.zeros((2, 32), np.float32),
             c0=np.zeros((1, 2, 32), np.float32))
    with pytest.raises(InputError, match=r"input 'h0' has shape \(2, 32\), the model wants \(1, 2, 32\)"):
        list(DataProvider(cfg, _rnn_specs()).batches("calibration"))


def test_single_npz_with_batch_axes(tmp_path):
    n = 6
    np.savez(tmp_path / "d.npz", x=np.arange(5 * n * 16, dtype=np.float32).reshape(5, n, 16),
             h0=np.ones((1, n, 32), np.float32), c0=np.zeros((1, 32), np.float32).reshape(1, 1, 32).repeat(2, 1))
    cfg = compose(["model=onnx", "model.onnx_path=x.onnx", "data=npz", f"data.path={tmp_path / 'd.npz'}",
                   "++data.batch_axes={x: 1, h0: 1, c0: null}"])
    out = list(DataProvider(cfg, _rnn_specs()).batches("calibration"))
    assert len(out) == 3 and all(b.feeds["x"].shape == (5, 2, 16) and b.feeds["c0"].shape == (1, 2, 32) for b in out)
    assert out[1].feeds["x"][0, 0, 0] == 2 * 16  # sample 2 of step 0: cut along axis 1, not axis 0


def test_npz_of_the_wrong_shape_names_the_input(tmp_path):
    specs = input_specs(models.conv_chain(batch=2))
    np.savez(tmp_path / "d.npz", input=np.zeros((4, 3, 8, 8), np.float32))
    cfg = compose(["model=onnx", "model.onnx_path=x.onnx", "data=npz", f"data.path={tmp_path / 'd.npz'}"])
    with pytest.raises(InputError, match=r"input 'input' has samples of shape \(3, 8, 8\).*wants \(3, 16, 16\)"):
        list(DataProvider(cfg, specs).batches("calibration"))


def test_digits_split_is_kept_in_the_cache_folder_and_a_broken_copy_is_made_again(tmp_path, monkeypatch):
    from sklearn.model_selection import train_test_split

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    made = digits_split(7, 0.25, (8, 8))
    kept = next((tmp_path / "qdq-tune").glob("digits-7-0.25-8x8-sklearn*.npz"))
    from sklearn.datasets import load_digits

    d = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split((d.images / 16.0).astype(np.float32), d.target.astype(np.int64),
                                              test_size=0.25, random_state=7, stratify=d.target)
    for parts in (made, digits_split(7, 0.25, (8, 8))):  # made here, then read from the kept copy
        assert np.array_equal(parts["x_train"], x_tr) and np.array_equal(parts["y_test"], y_te)
        assert np.array_equal(parts["x_test"], x_te) and np.array_equal(parts["y_train"], y_tr)
    kept.write_bytes(b"not an npz")
    assert np.array_equal(digits_split(7, 0.25, (8, 8))["x_test"], x_te)
