"""Tests for datasets from anywhere: `from_arrays`, IDX folders, `.npz` files,
`load`'s search for MNIST and Fashion-MNIST, and the dataset's own test split
dealt to the clients (`deal_test_split`, `federate(..., test=...)`).

The IDX and `.npz` files are written here, a few bytes each; one test reads the
real Fashion-MNIST where Debian's package `dataset-fashion-mnist` installed it.
"""

import fractions
import json
import gzip
import os
import pathlib
import sys
import tracemalloc

import numpy as np
import pytest

from pflax import data
from pflax._src.data import datasets


def _idx_bytes(array: np.ndarray) -> bytes:
  """An IDX file of unsigned bytes, written independently of the reader."""
  header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
      int(d).to_bytes(4, "big") for d in array.shape)
  return header + np.ascontiguousarray(array, np.uint8).tobytes()


def _write(path: pathlib.Path, payload: bytes) -> pathlib.Path:
  path.write_bytes(gzip.compress(payload) if path.name.endswith(".gz") else payload)
  return path


def _split(rng, num, classes=(0, 1, 2, 9)):
  images = rng.integers(0, 256, size=(num, 28, 28), dtype=np.uint8)
  labels = rng.choice(np.asarray(classes, np.uint8), size=num)
  return images, labels


def _write_split(folder, prefix, images, labels, *, gz=True, dotted=False):
  ext, sep = (".gz" if gz else ""), ("." if dotted else "-")
  _write(folder / f"{prefix}-images{sep}idx3-ubyte{ext}", _idx_bytes(images))
  _write(folder / f"{prefix}-labels{sep}idx1-ubyte{ext}", _idx_bytes(labels))


def _idx_folder(folder, rng, *, test=True, **kwargs):
  folder.mkdir(parents=True, exist_ok=True)
  train = _split(rng, 6)
  _write_split(folder, "train", *train, **kwargs)
  test_split = _split(rng, 4) if test else None
  if test:
    _write_split(folder, "t10k", *test_split, **kwargs)
  return train, test_split


# --- IDX ------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("dotted", [False, True])
def test_load_idx_train_and_test(tmp_path, gz, dotted):
  folder = tmp_path / "fm"
  train, test = _idx_folder(folder, np.random.default_rng(0), gz=gz, dotted=dotted)
  ds = data.load_idx(str(folder), num_classes=10)
  assert ds.name == "fm" and ds.num_classes == 10
  assert ds.images.shape == (6, 28, 28, 1) and ds.images.dtype == np.float32
  assert ds.labels.dtype == np.int32 and ds.test_labels.dtype == np.int32
  np.testing.assert_allclose(ds.images[..., 0], train[0] / 255.0, rtol=1e-6)
  np.testing.assert_array_equal(ds.labels, train[1])
  np.testing.assert_allclose(ds.test_images[..., 0], test[0] / 255.0, rtol=1e-6)
  np.testing.assert_array_equal(ds.test_labels, test[1])


def test_load_idx_train_only_and_test_prefix(tmp_path):
  rng = np.random.default_rng(1)
  _idx_folder(tmp_path / "a", rng, test=False, gz=False)
  ds = data.load_idx(str(tmp_path / "a"), num_classes=10)
  assert ds.images.shape == (6, 28, 28, 1)
  assert ds.test_images is None and ds.test_labels is None
  _write_split(tmp_path / "a", "test", *_split(rng, 3))
  assert data.load_idx(str(tmp_path / "a"), num_classes=10).test_images.shape == (
      3, 28, 28, 1)


def test_load_idx_k_is_max_label_over_both_splits_plus_one(tmp_path):
  rng = np.random.default_rng(2)
  images = _split(rng, 4)[0]
  _write_split(tmp_path, "train", images, np.array([0, 1, 2, 3], np.uint8))
  _write_split(tmp_path, "t10k", images, np.full(4, 4, np.uint8))
  assert data.load_idx(str(tmp_path)).num_classes == 5


def test_load_idx_missing_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="no IDX training files"):
    data.load_idx(str(tmp_path))
  _write(tmp_path / "train-images-idx3-ubyte", _idx_bytes(np.zeros((2, 3, 3))))
  with pytest.raises(FileNotFoundError, match="no matching labels file"):
    data.load_idx(str(tmp_path))


def _images_file(tmp_path, payload, gz=False):
  name = "train-images-idx3-ubyte" + (".gz" if gz else "")
  _write(tmp_path / "train-labels-idx1-ubyte", _idx_bytes(np.zeros(2)))
  return _write(tmp_path / name, payload)


GOOD = _idx_bytes(np.zeros((2, 3, 3)))
CORRUPT = {
    "empty": (b"", "no IDX magic number"),
    "bad_magic": (b"\x01" + GOOD[1:], "no IDX magic number"),
    "dtype_float": (GOOD[:2] + b"\x0d" + GOOD[3:], "dtype code 0x0d"),
    "labels_as_images": (_idx_bytes(np.zeros(2)), "1 dimensions, expected 3"),
    "header_truncated": (GOOD[:9], "header is truncated"),
    "payload_truncated": (GOOD[:-1], "declares 18 bytes of data, the file holds 17"),
    "payload_too_long": (GOOD + b"\x00", "declares 18 bytes of data, the file holds"),
}


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("case", CORRUPT)
def test_corrupt_idx_is_a_one_line_error_naming_the_file(tmp_path, case, gz):
  payload, match = CORRUPT[case]
  path = _images_file(tmp_path, payload, gz)
  with pytest.raises(ValueError, match=match) as info:
    data.load_idx(str(tmp_path))
  assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("payload", [b"not gzip at all", gzip.compress(GOOD)[:-12]],
                         ids=["not_gzip", "stream_cut"])
def test_broken_gzip_is_a_value_error_naming_the_file(tmp_path, payload):
  path = tmp_path / "train-images-idx3-ubyte.gz"
  path.write_bytes(payload)
  _write(tmp_path / "train-labels-idx1-ubyte", _idx_bytes(np.zeros(2)))
  with pytest.raises(ValueError, match="gzip") as info:
    data.load_idx(str(tmp_path))
  assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("gz", [False, True])
def test_header_declaring_a_terabyte_allocates_nothing(tmp_path, gz):
  header = bytes([0, 0, 8, 3]) + b"".join(
      d.to_bytes(4, "big") for d in (10**6, 1000, 1000))
  _images_file(tmp_path, header + bytes(100), gz)
  tracemalloc.start()
  try:
    with pytest.raises(ValueError, match="declares 1000000000000 bytes"):
      data.load_idx(str(tmp_path))
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 16 * 2**20, peak


def test_idx_labels_and_images_of_different_lengths(tmp_path):
  _write(tmp_path / "train-images-idx3-ubyte", _idx_bytes(np.zeros((3, 2, 2))))
  labels = _write(tmp_path / "train-labels-idx1-ubyte", _idx_bytes(np.zeros(2)))
  with pytest.raises(ValueError, match=f"{labels} holds 2 labels but .* 3 images"):
    data.load_idx(str(tmp_path))


# --- npz ------------------------------------------------------------------------


@pytest.mark.parametrize("keys", [("images", "labels", "test_images", "test_labels"),
                                  ("x", "y", "x_test", "y_test")])
def test_load_npz_both_key_spellings(tmp_path, keys):
  rng = np.random.default_rng(0)
  x, x_test = rng.random((5, 4, 4, 3)), rng.random((2, 4, 4, 3))
  path = tmp_path / "mine.npz"
  np.savez(path, **dict(zip(keys, (x, [0, 1, 2, 1, 0], x_test, [2.0, 3.0]))))
  ds = data.load_npz(str(path))
  assert ds.name == "mine" and ds.num_classes == 4
  np.testing.assert_allclose(ds.images, x.astype(np.float32))
  np.testing.assert_allclose(ds.test_images, x_test.astype(np.float32))
  assert ds.test_labels.tolist() == [2, 3] and ds.labels.dtype == np.int32


def test_load_npz_num_classes_and_train_only(tmp_path):
  path = tmp_path / "flat.npz"
  np.savez(path, x=np.zeros((3, 7), np.uint8), y=np.array([0, 1, 1]), num_classes=5)
  ds = data.load_npz(str(path))
  assert ds.num_classes == 5 and ds.images.shape == (3, 7) and ds.test_images is None


NPZ_BAD = {
    "object_array": (dict(images=np.array([np.zeros(2), None], dtype=object),
                          labels=[0, 1]), "object array, which pflax never unpickles"),
    "unknown_key": (dict(images=np.zeros((2, 3)), labels=[0, 1], test_label=[0]),
                    r"unknown arrays \['test_label'\]"),
    "both_spellings": (dict(images=np.zeros((2, 3)), x=np.zeros((2, 3)), labels=[0, 1]),
                       "holds both 'images' and 'x'"),
    "no_labels": (dict(images=np.zeros((2, 3))), "must hold 'images' and 'labels'"),
    "num_classes_vector": (dict(x=np.zeros((2, 3)), y=[0, 1], num_classes=[2]),
                           "num_classes must be a scalar integer"),
    "bad_arrays": (dict(x=np.zeros((2, 3, 3)), y=[0, 1]),
                   r"images must have shape \(N, H, W, C\) or \(N, D\)"),
}


@pytest.mark.parametrize("case", NPZ_BAD)
def test_load_npz_refuses(tmp_path, case):
  arrays, match = NPZ_BAD[case]
  path = tmp_path / "bad.npz"
  np.savez(path, **arrays)
  with pytest.raises(ValueError, match=match) as info:
    data.load_npz(str(path))
  assert str(path) in str(info.value)


def test_load_npz_not_an_archive(tmp_path):
  single = tmp_path / "single.npz"
  with open(single, "wb") as f:
    np.save(f, np.zeros(3))
  with pytest.raises(ValueError, match="holds a single array"):
    data.load_npz(str(single))
  garbage = tmp_path / "garbage.npz"
  garbage.write_bytes(b"PK\x03\x04 not really a zip")
  with pytest.raises(ValueError, match="not a readable .npz file"):
    data.load_npz(str(garbage))
  (tmp_path / "empty.npz").write_bytes(b"")
  with pytest.raises(ValueError, match="not a readable .npz file"):
    data.load_npz(str(tmp_path / "empty.npz"))
  with pytest.raises(FileNotFoundError):
    data.load_npz(str(tmp_path / "missing.npz"))


# --- from_arrays ----------------------------------------------------------------

_X = np.zeros((4, 3, 3, 1), np.float32)
_Y = np.array([0, 1, 2, 1])

FROM_ARRAYS_BAD = {
    "images_3d": (dict(images=np.zeros((5, 3, 3)), labels=np.zeros(5, int)),
                  r"^images must have shape \(N, H, W, C\) or \(N, D\), got \(5, 3, 3\); "
                  r"for one-channel images pass images\[\.\.\., None\]"),
    "images_1d": (dict(images=np.zeros(4), labels=_Y), r"^images must have shape"),
    "images_empty": (dict(images=np.zeros((0, 3)), labels=np.zeros(0, int)),
                     r"^images must have shape .* N >= 1"),
    "images_strings": (dict(images=np.full((4, 2), "a"), labels=_Y),
                       "^images must have an integer or float dtype"),
    "images_nan": (dict(images=np.where(np.arange(4)[:, None] == 2, np.nan,
                                        np.zeros((4, 2))), labels=_Y),
                   r"^images must be finite .* images\[2\]"),
    "images_overflow": (dict(images=np.full((4, 2), 1e300), labels=_Y),
                        r"^images must be finite \(as float32\).* images\[0\]"),
    "labels_2d": (dict(images=_X, labels=_Y[:, None]), r"^labels must have shape \(N,\)"),
    "labels_mismatched_n": (dict(images=_X, labels=_Y[:3]),
                            r"^labels must have shape \(N,\) = \(4,\).* got \(3,\)"),
    "labels_fractional": (dict(images=_X, labels=[0, 1.5, 2, 1]),
                          r"^labels must hold integers, got 1.5 in labels\[1\]"),
    "labels_bool": (dict(images=_X, labels=_Y > 0), "^labels must have an integer dtype"),
    "labels_negative": (dict(images=_X, labels=-_Y), r"^labels must lie in \[0, "),
    "labels_above_k": (dict(images=_X, labels=_Y, num_classes=2),
                       r"^labels must lie in \[0, num_classes\) = \[0, 2\)"),
    "num_classes_zero": (dict(images=_X, labels=_Y, num_classes=0), "^num_classes"),
    "test_images_alone": (dict(images=_X, labels=_Y, test_images=_X),
                          "^test_images and test_labels must be given together"),
    "test_labels_alone": (dict(images=_X, labels=_Y, test_labels=_Y),
                          "^test_images and test_labels .* got only test_labels"),
    "test_sample_shape": (dict(images=_X, labels=_Y, test_images=np.zeros((2, 3, 3, 2)),
                               test_labels=[0, 1]),
                          r"^test_images must have shape \(T,\) \+ \(3, 3, 1\)"),
    "test_images_nan": (dict(images=_X, labels=_Y, test_images=np.full((1, 3, 3, 1),
                                                                       np.inf),
                             test_labels=[0]), r"^test_images must be finite"),
    "test_labels_n": (dict(images=_X, labels=_Y, test_images=_X, test_labels=_Y[:2]),
                      r"^test_labels must have shape \(N,\) = \(4,\)"),
    "test_labels_above_k": (dict(images=_X, labels=_Y, num_classes=3, test_images=_X,
                                 test_labels=[0, 1, 2, 3]),
                            r"^test_labels must lie in \[0, num_classes\) = \[0, 3\)"),
    "name": (dict(images=_X, labels=_Y, name=3), "^name must be a string"),
}


@pytest.mark.parametrize("case", FROM_ARRAYS_BAD)
def test_from_arrays_errors_name_the_argument(case):
  kwargs, match = FROM_ARRAYS_BAD[case]
  kwargs = dict(kwargs)
  with pytest.raises(ValueError, match=match):
    data.from_arrays(kwargs.pop("images"), kwargs.pop("labels"), **kwargs)


def test_from_arrays_converts():
  images = np.arange(2 * 2 * 2 * 3, dtype=np.uint8).reshape(2, 2, 2, 3) * 10
  ds = data.from_arrays(images, np.array([1.0, 0.0]), name="mine")
  assert ds.images.dtype == np.float32 and ds.labels.dtype == np.int32
  np.testing.assert_allclose(ds.images, images / 255.0, rtol=1e-6)
  assert ds.labels.tolist() == [1, 0] and ds.num_classes == 2 and ds.name == "mine"
  assert ds.test_images is None and ds.test_labels is None
  flat = data.from_arrays(np.full((3, 5), 7, np.int64), [0, 0, 0])
  assert flat.images.shape == (3, 5) and flat.images.max() == 7.0  # not scaled
  assert flat.num_classes == 1 and flat.name == "arrays"
  floats = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
  assert data.from_arrays(floats, [0, 1, 2]).images is floats  # no copy needed


def test_from_arrays_infers_k_over_both_splits():
  ds = data.from_arrays(_X, _Y, test_images=_X[:1], test_labels=[3])
  assert ds.num_classes == 4 and ds.test_labels.dtype == np.int32


def test_dataset_stays_a_four_field_constructor():
  ds = data.Dataset(_X, _Y, 3, "four")
  assert ds.test_images is None and ds.test_labels is None
  assert datasets.Dataset is data.Dataset


def test_pooled_appends_the_test_split():
  ds = data.from_arrays(_X, _Y, test_images=_X[:2] + 1, test_labels=[2, 0])
  pool = data.pooled(ds)
  assert pool.images.shape == (6, 3, 3, 1) and pool.labels.tolist() == [0, 1, 2, 1, 2, 0]
  assert pool.test_images is None and pool.test_labels is None
  assert pool.num_classes == 3 and pool.name == ds.name
  train_only = data.from_arrays(_X, _Y)
  assert data.pooled(train_only) is train_only


# --- load: paths and the search for MNIST / Fashion-MNIST ------------------------


@pytest.fixture
def no_debian(monkeypatch, tmp_path):
  monkeypatch.setattr(datasets, "DEBIAN_FASHION_MNIST", str(tmp_path / "no-debian"))
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "no-tfds"))


def test_load_a_folder_and_an_npz_path(tmp_path):
  train, _ = _idx_folder(tmp_path / "idx", np.random.default_rng(0))
  ds = data.load(str(tmp_path / "idx"), num_classes=10)
  assert ds.name == "idx" and ds.labels.tolist() == train[1].tolist()
  path = tmp_path / "mine.npz"
  np.savez(path, x=np.zeros((3, 2)), y=[0, 1, 1])
  assert data.load(str(path)).images.shape == (3, 2)
  with pytest.raises(FileNotFoundError):
    data.load(str(tmp_path / "missing.npz"))
  with pytest.raises(ValueError, match=r"name_or_path must be one of .*'digits'.*"
                     r"an \.npz file or a folder of IDX files, got 'imagenet'"):
    data.load("imagenet")


@pytest.mark.parametrize("name,sub", [("fashion_mnist", ""),
                                      ("fashion_mnist", "fashion-mnist"),
                                      ("fashion_mnist", "fashion_mnist"),
                                      ("mnist", ""), ("mnist", "mnist")])
def test_load_finds_idx_files_in_data_dir(tmp_path, no_debian, monkeypatch, name, sub):
  del no_debian
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # not needed here
  data_dir = tmp_path / "data"
  train, test = _idx_folder(data_dir / sub, np.random.default_rng(3))
  ds = data.load(name, data_dir=str(data_dir))
  assert ds.name == name and ds.num_classes == 10
  assert ds.labels.tolist() == train[1].tolist()
  assert ds.test_labels.tolist() == test[1].tolist()


def test_not_found_names_the_three_ways(tmp_path, no_debian):
  del no_debian
  with pytest.raises(FileNotFoundError) as info:
    data.load("fashion_mnist", data_dir=str(tmp_path / "empty"))
  message = str(info.value)
  assert "--download" in message and "pip install 'pflax[tfds]'" in message
  assert "apt-get install dataset-fashion-mnist" in message
  assert "--data-dir" in message and "train-images-idx3-ubyte" in message
  assert "DIR/fashion-mnist" in message
  assert len(message.splitlines()) <= 5
  with pytest.raises(FileNotFoundError) as info:
    data.load("mnist", data_dir=str(tmp_path / "empty"))
  assert "--download" in str(info.value) and "apt-get" not in str(info.value)
  assert not (tmp_path / "empty").exists()  # nothing written


def test_tfds_is_imported_only_when_needed(tmp_path, no_debian, monkeypatch):
  del no_debian
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
  with pytest.raises(ImportError, match=r"pip install 'pflax\[tfds\]'"):
    data.load("cifar10", data_dir=str(tmp_path))
  with pytest.raises(ImportError, match=r"pip install 'pflax\[tfds\]'"):
    data.load("mnist", data_dir=str(tmp_path), download=True)
  _idx_folder(tmp_path / "mnist", np.random.default_rng(0))
  assert data.load("mnist", data_dir=str(tmp_path), download=True).name == "mnist"


@pytest.mark.skipif(not os.path.isdir(datasets.DEBIAN_FASHION_MNIST),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_real_fashion_mnist_from_debian(tmp_path, monkeypatch):
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))  # no TFDS copy to prefer
  ds = data.load("fashion_mnist")
  assert ds.name == "fashion_mnist" and ds.num_classes == 10
  assert ds.images.shape == (60000, 28, 28, 1) and ds.test_images.shape == (
      10000, 28, 28, 1)
  assert ds.images.dtype == np.float32 and 0.0 <= ds.images.min() <= ds.images.max() <= 1
  assert np.bincount(ds.labels).tolist() == [6000] * 10
  assert np.bincount(ds.test_labels).tolist() == [1000] * 10


# --- the dataset's own test split, dealt to the clients --------------------------


def _reference_shares(counts, totals):
  """Largest-remainder shares with exact fractions (ties to the lower client)."""
  shares = np.zeros_like(counts)
  for j, total in enumerate(totals):
    held = counts[:, j].sum()
    if held == 0:
      continue
    quotas = [fractions.Fraction(int(total * n), int(held)) for n in counts[:, j]]
    floors = [q.numerator // q.denominator for q in quotas]
    order = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - floors[i]), i))
    for i in order[:total - sum(floors)]:
      floors[i] += 1
    shares[:, j] = floors
  return shares


def _dealing_case(seed=0):
  rng = np.random.default_rng(seed)
  train_labels = rng.integers(0, 5, size=300)
  partition = data.dirichlet(train_labels, 7, 0.3, num_classes=6, seed=seed)
  test_labels = rng.integers(0, 6, size=157)  # class 5: test samples, no training
  return partition, test_labels, train_labels


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deal_test_split_rule(seed):
  partition, test_labels, _ = _dealing_case(seed)
  dealt = data.deal_test_split(partition, test_labels, seed=seed)
  everything = np.concatenate(dealt.indices)
  assert len(np.unique(everything)) == len(everything)  # disjoint
  assert everything.min() >= 0 and everything.max() < len(test_labels)
  totals = np.bincount(test_labels, minlength=6)
  np.testing.assert_array_equal(dealt.counts, _reference_shares(partition.counts, totals))
  np.testing.assert_array_equal(
      dealt.counts, data.class_counts(test_labels, dealt.indices, 6))
  assert not dealt.counts[partition.counts == 0].any()  # no class a client lacks
  held = partition.counts.sum(0) > 0
  np.testing.assert_array_equal(dealt.counts.sum(0)[held], totals[held])  # all dealt
  assert dealt.counts[:, 5].sum() == 0
  exact = partition.counts * totals / np.maximum(partition.counts.sum(0), 1)
  assert np.all(np.abs(dealt.counts - exact) < 1)  # proportional up to rounding


def test_deal_test_split_is_deterministic_given_the_seed():
  partition, test_labels, _ = _dealing_case()
  deal = lambda seed: data.deal_test_split(partition, test_labels, seed=seed).indices
  for a, b in zip(deal(4), deal(4)):
    np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(a, b) for a, b in zip(deal(4), deal(5)))


def test_deal_test_split_by_hand_and_errors():
  part = data.Partition([np.arange(3), np.arange(3, 6), np.arange(6, 7)],
                        np.array([[1, 2], [1, 2], [1, 0]]))
  # Class 0: 5 test samples for counts (1, 1, 1): 5/3 each, floors 1, 1, 1, the
  # two left go to clients 0 and 1 (equal remainders: the lower ones). Class 1:
  # 3 samples for counts (2, 2, 0): 1.5, 1.5, 0 -> 2, 1, 0.
  test_labels = np.array([0] * 5 + [1] * 3)
  assert data.deal_test_split(part, test_labels).counts.tolist() == [[2, 2], [2, 1],
                                                                     [1, 0]]
  with pytest.raises(ValueError, match=r"test_labels must lie in \[0, num_classes\)"):
    data.deal_test_split(part, [0, 2])
  with pytest.raises(ValueError, match="partition must hold M index arrays"):
    data.deal_test_split(data.Partition([np.arange(3)], np.ones((2, 2))), [0])


def test_federate_with_the_dataset_test_split():
  partition, test_labels, train_labels = _dealing_case()
  train_x = np.arange(300, dtype=np.float32)[:, None]
  test_x = -1.0 - np.arange(len(test_labels), dtype=np.float32)[:, None]  # tags < 0
  fed = data.federate(train_x, train_labels, partition, seed=3, batch_size=4,
                      test=(test_x, test_labels))
  dealt = data.deal_test_split(partition, test_labels, seed=3)
  for i, idx in enumerate(partition.indices):  # training: the whole partition
    assert sorted(fed.x[i, fed.mask[i], 0].astype(int).tolist()) == idx.tolist()
    tags = (-1 - fed.test_x[i, fed.test_mask[i], 0]).astype(int)
    assert sorted(tags.tolist()) == dealt.indices[i].tolist()
    np.testing.assert_array_equal(fed.test_y[i, fed.test_mask[i]], test_labels[tags])
  np.testing.assert_array_equal(fed.counts, partition.counts)
  assert fed.x.shape[1] % 4 == 0
  with pytest.raises(ValueError, match=r"test_images must have shape \(T,\) \+ \(1,\)"):
    data.federate(train_x, train_labels, partition, seed=0,
                  test=(np.zeros((len(test_labels), 2)), test_labels))
  with pytest.raises(ValueError, match="test must be a pair"):
    data.federate(train_x, train_labels, partition, seed=0, test=test_x)


# --- the command line -----------------------------------------------------------


def _learnable_digits(n=300):
  """Digits as uint8 8x8 images: a small dataset that a few steps can learn."""
  digits = data.load_digits()
  return (digits.images[:n, :, :, 0] * 255).astype(np.uint8), digits.labels[:n]


@pytest.mark.parametrize("kind", ["idx", "npz"])
def test_pflax_run_takes_a_folder_or_an_npz_path(tmp_path, kind):
  """`pflax-run --dataset PATH` runs an experiment on the user's files."""
  from pflax._src.cli import main as cli  # pylint: disable=import-outside-toplevel
  images, labels = _learnable_digits()
  if kind == "idx":
    path = tmp_path / "my-digits"
    path.mkdir()
    _write_split(path, "train", images, labels.astype(np.uint8))
  else:
    path = tmp_path / "my-digits.npz"
    np.savez(path, x=images[..., None], y=labels)
  out = tmp_path / "out"
  assert cli.main(["--dataset", str(path), "--algorithms", "local", "--clients", "3",
                   "--partition", "dirichlet", "--dirichlet-alpha", "1",
                   "--rounds", "1", "--local-epochs", "3", "--model", "mlp",
                   "--strategy", "vmap", "--out", str(out), "--no-progress",
                   "--no-compilation-cache"]) == 0
  results = json.loads((out / "results.json").read_text())
  assert results["config"]["dataset"] == str(path)
  assert np.sum(results["class_counts"]) == pytest.approx(0.75 * len(labels), abs=10)
  assert results["runs"][0]["personalized_accuracy"]["last"] > 0.3


def test_pflax_run_with_a_broken_file_is_one_line(tmp_path):
  from pflax._src.cli import main as cli  # pylint: disable=import-outside-toplevel
  path = tmp_path / "broken.npz"
  path.write_bytes(b"not an archive")
  with pytest.raises(SystemExit) as info:
    cli.main(["--dataset", str(path), "--out", str(tmp_path / "out"), "--no-progress"])
  message = str(info.value)
  assert message.startswith("pflax-run: ") and "\n" not in message
  assert "broken.npz" in message
