"""Image classification datasets as NumPy arrays: bundled digits, or TFDS.

Nothing here downloads data unless asked (`download=True`). `load_digits` reads
the copy bundled with scikit-learn; `load_tfds` reads a TensorFlow Datasets copy
that was prepared beforehand and fails at once, with instructions, when there is
none, or lets TFDS download and prepare it.
"""

import importlib.util
import os
from typing import NamedTuple

import numpy as np

TFDS_NAMES = ("mnist", "fashion_mnist", "cifar10", "cifar100", "emnist/letters")
NAMES = ("digits",) + TFDS_NAMES

_NUM_CLASSES = {"mnist": 10, "fashion_mnist": 10, "cifar10": 10, "cifar100": 100,
                "emnist/letters": 26}
_FIRST_LABEL = {"emnist/letters": 1}  # TFDS stores letters as labels 1..26.
_SPLITS = ("train", "test")


class Dataset(NamedTuple):
  """A labelled image dataset held in memory.

  Attributes:
    images: float32 array `(N, H, W, C)` scaled to `[0, 1]`.
    labels: int32 array `(N,)` with values in `[0, num_classes)`.
    num_classes: `K`.
    name: the name it was loaded under.
  """

  images: np.ndarray
  labels: np.ndarray
  num_classes: int
  name: str


def load_digits() -> Dataset:
  """Loads scikit-learn's bundled 8x8 handwritten digits (offline).

  Returns:
    A `Dataset` with 1,797 images of shape `(8, 8, 1)`, pixel values `0..16`
    divided by 16, and 10 classes.

  Example:
    >>> load_digits().images.shape
    (1797, 8, 8, 1)

  References:
    Alpaydin and Kaynak, "Optical Recognition of Handwritten Digits", UCI Machine
    Learning Repository, 1998 (the test part, as shipped with scikit-learn).
  """
  table = np.loadtxt(_sklearn_data_file("digits.csv.gz"), delimiter=",",
                     dtype=np.float32)
  images = (table[:, :64] / 16.0).reshape(-1, 8, 8, 1)
  return Dataset(images, table[:, 64].astype(np.int32), 10, "digits")


def _sklearn_data_file(name: str) -> str:
  """The path of a data file bundled with scikit-learn, found without importing it
  (importing scikit-learn takes over a second)."""
  spec = importlib.util.find_spec("sklearn")
  if spec is None or not spec.submodule_search_locations:
    raise ImportError("the digits dataset is read from scikit-learn's bundled copy: "
                      "pip install scikit-learn")
  return os.path.join(spec.submodule_search_locations[0], "datasets", "data", name)


def _import_tfds():
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        "Loading TFDS datasets needs tensorflow-datasets: "
        "pip install 'pflax[tfds]'. The offline dataset 'digits' needs nothing.") from e
  return tfds


def _not_prepared_message(name: str, builder) -> str:
  root = builder.data_dir_root
  return (
      f"TFDS dataset {name!r} is not prepared in {root} (looked for "
      f"{builder.data_dir}) and pflax downloads nothing unless asked. On a machine with "
      "internet access, with tensorflow and tensorflow-datasets installed, run\n"
      f"  tfds build {name} --data_dir {root} --file_format array_record\n"
      "or\n"
      f"  python -c \"import tensorflow_datasets as tfds; tfds.builder('{name}', "
      f"data_dir='{root}', file_format='array_record').download_and_prepare()\"\n"
      f"then copy {root} to this machine (and pass it as data_dir), or let "
      "pflax download it here (`pflax-run --download`, `load(..., download=True)`). "
      "The array_record format is read without TensorFlow. Use the dataset "
      "'digits' to work fully offline.")


def _read_split(tfds, builder, split: str, random_access: bool
                ) -> tuple[np.ndarray, np.ndarray]:
  """Returns `(uint8 images, integer labels)` of one prepared split.

  Random-access formats (array_record, or `random_access`: just prepared as
  array_record) are read with `as_data_source`, which needs no TensorFlow;
  other formats (tfrecord) are read with `as_dataset`, which does.
  """
  formats = builder.info.available_file_formats()
  if random_access or formats & tfds.core.FileFormat.with_random_access():
    source = builder.as_data_source(split=split)
    examples = source.__getitems__(range(len(source)))
    return (np.stack([ex["image"] for ex in examples]),
            np.array([ex["label"] for ex in examples]))
  if importlib.util.find_spec("tensorflow") is not None:
    batch = tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1))
    return batch["image"], batch["label"]
  raise RuntimeError(
      f"TFDS dataset {builder.info.full_name!r} in {builder.data_dir} is stored as "
      f"{sorted(f.value for f in formats)}, which only TensorFlow can read. Install "
      "tensorflow, or prepare it again with --file_format array_record.")


def load_tfds(name: str, *, data_dir: str | None = None,
              download: bool = False) -> Dataset:
  """Loads a prepared TFDS dataset, train and test splits concatenated.

  Images are scaled from `uint8` to `[0, 1]`; `emnist/letters` labels `1..26`
  become `0..25`. EMNIST images keep TFDS's orientation (transposed relative to
  MNIST). Downloads nothing unless `download`: a dataset that is not prepared
  in `data_dir` raises a `FileNotFoundError` explaining how to prepare it.

  Args:
    name: one of `"mnist"`, `"fashion_mnist"`, `"cifar10"`, `"cifar100"`,
      `"emnist/letters"`.
    data_dir: the TFDS data directory; defaults to TFDS's own
      (`$TFDS_DATA_DIR` or `~/tensorflow_datasets`).
    download: let TFDS download and prepare a dataset that is not prepared yet
      (in the array_record format, read without TensorFlow; preparing may need
      TensorFlow).

  Returns:
    A `Dataset` with the train split followed by the test split.

  Raises:
    ImportError: tensorflow-datasets is not installed.
    FileNotFoundError: the dataset is not prepared in `data_dir`.
    RuntimeError: it is prepared in a format that needs TensorFlow, which is
      not installed.

  Example:
    >>> data = load_tfds("mnist", data_dir="/data/tfds")  # doctest: +SKIP
    >>> data.images.shape, data.num_classes  # doctest: +SKIP
    ((70000, 28, 28, 1), 10)
  """
  if name not in TFDS_NAMES:
    raise ValueError(f"name must be one of {TFDS_NAMES}, got {name!r}.")
  tfds = _import_tfds()
  builder = tfds.builder(name, data_dir=data_dir, try_gcs=False)
  prepared_now = not builder.is_prepared()
  if prepared_now:
    if not download:
      raise FileNotFoundError(_not_prepared_message(name, builder))
    builder.download_and_prepare(file_format="array_record")
    builder = tfds.builder(name, data_dir=data_dir, try_gcs=False)
  images, labels = zip(*(_read_split(tfds, builder, split, prepared_now)
                         for split in _SPLITS))
  images = np.concatenate(images).astype(np.float32) / 255.0
  labels = np.concatenate(labels).astype(np.int32) - _FIRST_LABEL.get(name, 0)
  return Dataset(images, labels, _NUM_CLASSES[name], name)


def load(name: str, *, data_dir: str | None = None, download: bool = False) -> Dataset:
  """Loads a dataset by name: `"digits"` (offline) or a TFDS name.

  Args:
    name: one of `"digits"`, `"mnist"`, `"fashion_mnist"`, `"cifar10"`,
      `"cifar100"`, `"emnist/letters"`.
    data_dir: TFDS data directory (unused for `"digits"`).
    download: let TFDS download and prepare the dataset (`load_tfds`).

  Returns:
    The `Dataset`.

  Example:
    >>> load("digits").num_classes
    10
  """
  if name == "digits":
    return load_digits()
  if name in TFDS_NAMES:
    return load_tfds(name, data_dir=data_dir, download=download)
  raise ValueError(f"name must be one of {NAMES}, got {name!r}.")
