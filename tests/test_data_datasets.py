"""Tests for pflax.data loaders: bundled digits and prepared TFDS datasets (files
and `load`'s search for MNIST-like IDX files: tests/test_data_files.py).

No network: the TFDS tests prepare tiny copies of real TFDS datasets (same name,
version and features, a few random images) in a temporary data_dir, then read
them back through `load_tfds`'s own code path.
"""

import importlib.util
import io
import json
import pathlib
import sys

import numpy as np
import pytest
import sklearn.datasets

from pflax import data

tfds = pytest.importorskip("tensorflow_datasets")
PIL_Image = pytest.importorskip("PIL.Image")

cifar = pytest.importorskip("tensorflow_datasets.image_classification.cifar")
mnist = pytest.importorskip("tensorflow_datasets.image_classification.mnist")
mocking = pytest.importorskip("tensorflow_datasets.testing.mocking")

_HAS_TF = importlib.util.find_spec("tensorflow") is not None


def test_load_digits():
  ds = data.load_digits()
  assert ds.name == "digits" and ds.num_classes == 10
  assert ds.images.shape == (1797, 8, 8, 1) and ds.images.dtype == np.float32
  assert ds.labels.shape == (1797,) and ds.labels.dtype == np.int32
  assert ds.images.min() == 0.0 and ds.images.max() == 1.0
  np.testing.assert_array_equal(np.unique(ds.labels), np.arange(10))
  reference = sklearn.datasets.load_digits()
  np.testing.assert_allclose(ds.images[..., 0], reference.images / 16.0, rtol=1e-6)
  np.testing.assert_array_equal(ds.labels, reference.target)


def test_load_dispatches_and_lists_names():
  assert data.load("digits").images.shape == (1797, 8, 8, 1)
  with pytest.raises(ValueError,
                     match="name_or_path must be one of.*'digits'.*'emnist/letters'"):
    data.load("imagenet")
  with pytest.raises(ValueError, match="name must be one of.*'mnist'"):
    data.load_tfds("digits")


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist", "cifar10", "cifar100",
                                  "emnist/letters"])
def test_load_tfds_not_prepared_fails_with_instructions(tmp_path, name):
  # `load` looks for MNIST and Fashion-MNIST as IDX files too (tests/test_data_files.py).
  load = data.load_tfds if name in ("mnist", "fashion_mnist") else data.load
  with pytest.raises(FileNotFoundError) as info:
    load(name, data_dir=str(tmp_path))
  message = str(info.value)
  assert f"tfds build {name} --data_dir {tmp_path} --file_format array_record" in message
  assert f"tfds.builder('{name}', data_dir='{tmp_path}'" in message
  assert "'digits'" in message
  assert not any(tmp_path.iterdir())  # nothing downloaded or written


def test_load_tfds_without_tfds_installed(monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
  with pytest.raises(ImportError, match=r"pip install 'pflax\[tfds\]'"):
    data.load_tfds("mnist")


def _png(image: np.ndarray) -> io.BytesIO:
  buffer = io.BytesIO()
  PIL_Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(
      buffer, format="PNG")
  buffer.seek(0)
  return buffer


def _prepare(builder_cls, data_dir, splits, config=None):
  """Writes `splits = {split: (images, labels)}` as a prepared array_record copy
  of the real TFDS dataset `builder_cls` (PNG-encoded with PIL, no TensorFlow)."""

  class Tiny(builder_cls, skip_registration=True):
    name = builder_cls.name

    def _split_generators(self, dl_manager):
      del dl_manager
      return {split: self._generate_examples(split) for split in splits}

    def _generate_examples(self, split):
      for i, (image, label) in enumerate(zip(*splits[split])):
        example = {"image": _png(image), "label": int(label)}
        if "id" in self.info.features:
          example["id"] = f"{split}_{i}"
        yield f"{split}_{i}", example

  Tiny(config=config, data_dir=str(data_dir),
       file_format="array_record").download_and_prepare()


def _tiny_split(rng, num, shape, labels):
  images = rng.integers(0, 256, size=(num, *shape), dtype=np.uint8)
  images[:, 0, 0, 0] = np.arange(num)  # a per-image tag to undo TFDS's shuffling
  return images, np.asarray(labels)


CASES = {
    "mnist": (mnist.MNIST, None, (28, 28, 1), 10, 0),
    "emnist/letters": (mnist.EMNIST, "letters", (28, 28, 1), 26, 1),
    "cifar10": (cifar.Cifar10, None, (32, 32, 3), 10, 0),
}


@pytest.mark.parametrize("name", CASES)
def test_load_tfds_reads_prepared_dataset(tmp_path, name):
  builder_cls, config, shape, num_classes, first_label = CASES[name]
  rng = np.random.default_rng(0)
  stored = np.arange(num_classes) + first_label  # the labels as TFDS stores them
  train = _tiny_split(rng, 7, shape, stored[[0, 1, 2, 3, 4, 5, -1]])
  test = _tiny_split(rng, 4, shape, stored[[-1, 0, 1, 2]])
  test[0][:, 0, 0, 0] += 100
  _prepare(builder_cls, tmp_path, {"train": train, "test": test}, config)

  ds = data.load(name, data_dir=str(tmp_path))
  assert ds.name == name and ds.num_classes == num_classes
  assert ds.images.shape == (7, *shape) and ds.images.dtype == np.float32
  assert ds.test_images.shape == (4, *shape) and ds.test_images.dtype == np.float32
  assert ds.labels.shape == (7,) and ds.labels.dtype == np.int32
  assert ds.test_labels.shape == (4,) and ds.test_labels.dtype == np.int32
  for images, labels, split, start in ((ds.images, ds.labels, train, 0),
                                       (ds.test_images, ds.test_labels, test, 100)):
    assert 0.0 <= images.min() and images.max() <= 1.0
    # Within a split TFDS may reorder the examples: the tags say where each was.
    order = np.rint(images[:, 0, 0, 0] * 255).astype(int) - start
    assert sorted(order) == list(range(len(split[0])))
    np.testing.assert_allclose(images, split[0][order] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(labels, split[1][order] - first_label)
  pooled = data.pooled(ds)
  assert pooled.labels.min() == 0 and pooled.labels.max() == num_classes - 1


@pytest.mark.skipif(_HAS_TF, reason="TensorFlow installed: tfrecord is readable")
def test_load_tfds_tfrecord_without_tensorflow(tmp_path):
  rng = np.random.default_rng(0)
  split = _tiny_split(rng, 2, (28, 28, 1), [0, 1])
  _prepare(mnist.MNIST, tmp_path, {"train": split, "test": split})
  # Pretend the copy was prepared in the default tfrecord format.
  info_path = next(pathlib.Path(tmp_path).rglob("dataset_info.json"))
  info = json.loads(info_path.read_text())
  info["fileFormat"] = "tfrecord"
  info_path.write_text(json.dumps(info))
  with pytest.raises(RuntimeError, match="only TensorFlow can read.*array_record"):
    data.load_tfds("mnist", data_dir=str(tmp_path))


def test_load_tfds_downloads_only_when_asked(tmp_path, monkeypatch):
  """`download=True` asks TFDS to download and prepare an array_record copy. The
  download itself is replaced by writing the tiny copy (no network)."""
  calls = []
  original = tfds.core.DatasetBuilder.download_and_prepare
  rng = np.random.default_rng(0)
  split = _tiny_split(rng, 3, (28, 28, 1), [0, 1, 2])

  def fake_download(self, **kwargs):
    if type(self).__name__ == "Tiny":      # the tiny copy's own preparation
      return original(self, **kwargs)
    calls.append((self.name, kwargs.get("file_format")))
    _prepare(mnist.MNIST, tmp_path, {"train": split, "test": split})

  monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", fake_download)
  with pytest.raises(FileNotFoundError, match="pflax-run --download"):
    data.load("mnist", data_dir=str(tmp_path))
  assert not calls and not any(tmp_path.iterdir())
  ds = data.load("mnist", data_dir=str(tmp_path), download=True)
  assert calls == [("mnist", "array_record")]
  assert ds.images.shape == (3, 28, 28, 1) and ds.test_images.shape == (3, 28, 28, 1)
  data.load("mnist", data_dir=str(tmp_path), download=True)   # prepared: no download
  assert len(calls) == 1


def _mock_getitems(record_keys, generator, serialized=False):
  """TFDS 4.9's mock data source binds its batch read `__getitems__` without the
  source (`partial(_getitems, generator=...)` as an instance attribute), so a batch
  read raises TypeError; this is that read with the argument it is given."""
  return [mocking._getitem(None, key, generator, serialized) for key in record_keys]


def test_download_reads_what_tfds_prepared_under_tfds_mock_data(tmp_path, monkeypatch):
  """With TFDS's own mock data (no network, no files) `download=True` asks TFDS to
  prepare the dataset and reads the array_record splits TFDS serves."""
  monkeypatch.setattr(mocking, "_getitems", _mock_getitems)
  with tfds.testing.mock_data(num_examples=7, policy=tfds.testing.MockPolicy.USE_CODE):
    with pytest.raises(FileNotFoundError, match="pflax-run --download"):
      data.load("mnist", data_dir=str(tmp_path))
    ds = data.load("mnist", data_dir=str(tmp_path), download=True)
  assert ds.images.shape == (7, 28, 28, 1) and ds.images.dtype == np.float32
  assert ds.test_images.shape == (7, 28, 28, 1)
  assert 0.0 <= ds.images.min() and ds.images.max() <= 1.0
  assert ds.labels.shape == (7,) and set(ds.labels) <= set(range(10))
  assert not any(tmp_path.iterdir())   # nothing downloaded or written
