"""The tfds image source, offline with ``tfds.testing.mock_data`` (no TensorFlow needed)."""
import importlib.util
import sys

import pandas as pd
import pytest

from sandbox.prepare import file_checksums
from sandbox.tasks import base, tfds_source

tfds = pytest.importorskip("tensorflow_datasets")


@pytest.fixture
def mock():
    with tfds.testing.mock_data(num_examples=60, policy=tfds.testing.MockPolicy.USE_CODE):
        yield


def test_mock_source_needs_no_tensorflow(mock):
    """Where TensorFlow is absent (as here), the source reads mock data and never imports it."""
    if importlib.util.find_spec("tensorflow") is not None:
        pytest.skip("TensorFlow is installed on this host; the no-TF path is proven only where "
                    "it is absent")
    table = tfds_source.load_tfds_images("mnist", "train", num_examples=20)
    assert len(table.features) == 20
    assert sys.modules.get("tensorflow") is None


def test_mnist_mock_to_task(mock, tmp_path):
    table = tfds_source.load_tfds_images("mnist", "train", num_examples=50)
    assert table.features.shape == (50, 28 * 28)
    assert table.features.columns[0] == "p_0_0_0" and table.features.columns[-1] == "p_27_27_0"
    assert table.features.to_numpy().min() >= 0 and table.features.to_numpy().max() <= 255
    assert set(table.target["label"]) <= {str(i) for i in range(10)}

    spec = tfds_source.tfds_image_task("mnist-mock", "mnist", num_examples=50, metric="log_loss")
    task = spec.prepare(tmp_path / "a", seed=0)
    assert task.metric == "log_loss" and task.target_columns == tuple(str(i) for i in range(10))
    train = pd.read_csv(task.public_dir / "train.csv")
    test = pd.read_csv(task.public_dir / "test.csv")
    assert train.shape[1] == 1 + 784 + 1 and test.shape[1] == 1 + 784
    assert len(train) + len(test) == 50
    gold = pd.concat([pd.read_csv(task.private_dir / base.ANSWER_FILES[s], dtype={"id": str})
                      for s in ("dev", "test")])
    gold.to_csv(tmp_path / "gold.csv", index=False)
    assert task.grade(tmp_path / "gold.csv", "dev") < 1e-12
    assert "p_<row>_<col>_<channel>" in task.description

    spec.prepare(tmp_path / "b", seed=0)
    assert file_checksums(tmp_path / "a") == file_checksums(tmp_path / "b")


def test_bad_arguments(mock):
    with pytest.raises(ValueError, match="max_pixels"):
        tfds_source.load_tfds_images("mnist", "train", num_examples=5, max_pixels=100)
    with pytest.raises(KeyError, match="no feature 'picture'"):
        tfds_source.load_tfds_images("mnist", "train", num_examples=5, image_key="picture")
    with pytest.raises(ValueError, match="num_examples must be positive"):
        tfds_source.load_tfds_images("mnist", "train", num_examples=0)
    with pytest.raises(ValueError, match="support accuracy, macro_f1 or log_loss"):
        tfds_source.tfds_image_task("x", "mnist", metric="rmse")
