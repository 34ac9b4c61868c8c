"""Image classification datasets as NumPy arrays: digits, files, or TFDS.

Nothing here downloads data unless asked (`download=True`). `load_digits` reads
the copy bundled with scikit-learn; `load_tfds` reads a TensorFlow Datasets copy
that was prepared beforehand and fails at once, with instructions, when there is
none, or lets TFDS download and prepare it. `load` also reads `.npz` files and
folders of IDX files, and finds MNIST and Fashion-MNIST as IDX files on disk.
"""

import glob
import importlib.util
import os

import numpy as np

from pflax._src.data import arrays
from pflax._src.data import files

TFDS_NAMES = ("mnist", "fashion_mnist", "cifar10", "cifar100", "emnist/letters")
NAMES = ("digits",) + TFDS_NAMES
# Where Debian's package dataset-fashion-mnist installs the IDX files.
DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"

_NUM_CLASSES = {"mnist": 10, "fashion_mnist": 10, "cifar10": 10, "cifar100": 100,
                "emnist/letters": 26}
_FIRST_LABEL = {"emnist/letters": 1}  # TFDS stores letters as labels 1..26.
_SPLITS = ("train", "test")
# The subfolders of data_dir searched for IDX files, besides data_dir itself.
_IDX_SUBFOLDERS = {"fashion_mnist": ("fashion-mnist", "fashion_mnist"),
                   "mnist": ("mnist",)}

Dataset = arrays.Dataset  # Its home before `from_arrays`; kept for importers.


def load_digits() -> arrays.Dataset:
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
  return arrays.Dataset(images, table[:, 64].astype(np.int32), 10, "digits")


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
              download: bool = False) -> arrays.Dataset:
  """Loads a prepared TFDS dataset, its train and test splits.

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
      (in the array_record format, read without TensorFlow; preparing needs
      TensorFlow).

  Returns:
    A `Dataset` with the train split as `images`/`labels` and the test split as
    `test_images`/`test_labels` (`pooled` joins them).

  Raises:
    ImportError: tensorflow-datasets is not installed.
    FileNotFoundError: the dataset is not prepared in `data_dir`.
    RuntimeError: it is prepared in a format that needs TensorFlow, which is
      not installed.

  Example:
    >>> data = load_tfds("mnist", data_dir="/data/tfds")  # doctest: +SKIP
    >>> data.images.shape, data.test_images.shape, data.num_classes  # doctest: +SKIP
    ((60000, 28, 28, 1), (10000, 28, 28, 1), 10)
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
  (images, labels), (test_images, test_labels) = (
      _read_split(tfds, builder, split, prepared_now) for split in _SPLITS)
  first = _FIRST_LABEL.get(name, 0)
  return arrays.from_arrays(images, labels.astype(np.int64) - first,
                            num_classes=_NUM_CLASSES[name], name=name,
                            test_images=test_images,
                            test_labels=test_labels.astype(np.int64) - first)


def _tfds_prepared(name: str, data_dir: str | None) -> bool:
  """Whether a prepared TFDS copy of `name` sits in `data_dir` (TFDS's default
  when None), judged from its files without importing TFDS."""
  root = data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
  pattern = os.path.join(os.path.expanduser(root), name, "[0-9]*", "dataset_info.json")
  return bool(glob.glob(pattern))


def _idx_folder(name: str, data_dir: str | None) -> str | None:
  """The first folder holding IDX files for `name`: `data_dir`, its subfolders
  named after the dataset, then (Fashion-MNIST) Debian's copy."""
  folders = []
  if data_dir:
    folders += [data_dir] + [os.path.join(data_dir, s) for s in _IDX_SUBFOLDERS[name]]
  if name == "fashion_mnist":
    folders.append(DEBIAN_FASHION_MNIST)
  return next((f for f in folders if files.find_idx(f) is not None), None)


def _not_found_message(name: str, data_dir: str | None) -> str:
  folders = ", ".join(["DIR"] + [f"DIR/{sub}" for sub in _IDX_SUBFOLDERS[name]])
  lines = [f"{name} not found: no TFDS copy prepared in "
           f"{data_dir or 'the TFDS data dir'} and no IDX files. Get it one of these "
           "ways:",
           "  pflax-run --download (load(..., download=True)) lets TFDS download it "
           "(pip install 'pflax[tfds]');"]
  if name == "fashion_mnist":
    lines.append("  apt-get install dataset-fashion-mnist puts its IDX files in "
                 f"{DEBIAN_FASHION_MNIST};")
  lines.append("  --data-dir DIR (data_dir=DIR) with the IDX files train-images-idx3-"
               f"ubyte.gz, train-labels-idx1-ubyte.gz, t10k-* in {folders}.")
  return "\n".join(lines)


def _load_mnist_like(name: str, data_dir: str | None, download: bool
                     ) -> arrays.Dataset:
  """MNIST or Fashion-MNIST from the first copy found: a prepared TFDS copy (when
  TFDS is installed), IDX files, then a TFDS download if asked."""
  prepared = _tfds_prepared(name, data_dir)
  if prepared and importlib.util.find_spec("tensorflow_datasets") is not None:
    return load_tfds(name, data_dir=data_dir)
  folder = _idx_folder(name, data_dir)
  if folder is not None:
    return files.load_idx(folder, num_classes=_NUM_CLASSES[name])._replace(name=name)
  if prepared or download:
    return load_tfds(name, data_dir=data_dir, download=download)
  raise FileNotFoundError(_not_found_message(name, data_dir))


def load(name_or_path: str, *, data_dir: str | None = None,
         download: bool = False, num_classes: int | None = None) -> arrays.Dataset:
  """Loads a dataset by name or from a file.

  `"mnist"` and `"fashion_mnist"` come from the first copy found: a TFDS copy
  prepared in `data_dir`; IDX files in `data_dir` or its subfolder `mnist/`
  (`fashion-mnist/`, `fashion_mnist/`); for Fashion-MNIST, Debian's package
  `dataset-fashion-mnist` (`DEBIAN_FASHION_MNIST`); else, if `download`, TFDS
  downloads it. The other TFDS names are read with `load_tfds`.

  Args:
    name_or_path: `"digits"` (offline), `"mnist"`, `"fashion_mnist"`,
      `"cifar10"`, `"cifar100"`, `"emnist/letters"`, a folder of IDX files
      (`load_idx`) or an `.npz` file (`load_npz`).
    data_dir: TFDS data directory, also searched for IDX files (unused for
      `"digits"` and paths).
    download: let TFDS download and prepare the dataset when no copy is found.
    num_classes: `K` of a folder of IDX files or an `.npz` file, declared (then
      classes without samples are allowed); None infers it (`from_arrays`).

  Returns:
    The `Dataset`; the dataset's own test split, if it has one, is in
    `test_images`/`test_labels` (`pooled` joins the two).

  Raises:
    FileNotFoundError: MNIST or Fashion-MNIST found nowhere (the message says
      how to get it), or a TFDS dataset not prepared.
    ImportError: TFDS is needed and not installed.
    ValueError: an unknown name, or a malformed file.

  Example:
    >>> load("digits").num_classes
    10
  """
  if name_or_path == "digits":
    return load_digits()
  if name_or_path in _IDX_SUBFOLDERS:
    return _load_mnist_like(name_or_path, data_dir, download)
  if name_or_path in TFDS_NAMES:
    return load_tfds(name_or_path, data_dir=data_dir, download=download)
  path = os.path.expanduser(name_or_path)
  if os.path.isdir(path):
    return files.load_idx(path, num_classes=num_classes)
  if path.endswith(".npz"):
    return files.load_npz(path, num_classes=num_classes)
  raise ValueError(f"name_or_path must be one of {NAMES}, an .npz file or a folder of "
                   f"IDX files, got {name_or_path!r}.")
