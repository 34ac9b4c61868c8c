"""Datasets read from files: IDX folders (the MNIST format) and `.npz` archives.

Both readers trust nothing in the file: an IDX header is checked against what
the file holds before any payload is kept, and `.npz` archives are read without
unpickling. Every problem is a one-line `ValueError` that names the file.
"""

import gzip
import math
import os
import zipfile
import zlib

import numpy as np

from pflax._src.data import arrays

_IDX_UINT8 = 0x08
_CHUNK = 1 << 20  # gzip payloads are read in 1 MiB pieces, up to the declared size.
_TRAIN_PREFIXES = ("train",)
_TEST_PREFIXES = ("t10k", "test")
_NPZ_KEYS = {"images": ("images", "x"), "labels": ("labels", "y"),
             "test_images": ("test_images", "x_test"),
             "test_labels": ("test_labels", "y_test"),
             "num_classes": ("num_classes",)}


def _idx_names(prefix: str, kind: str) -> list[str]:
  """`train-images-idx3-ubyte`, its dotted spelling `train-images.idx3-ubyte`,
  each plain or `.gz`, in that order of preference."""
  dims = 3 if kind == "images" else 1
  return [f"{prefix}-{kind}{sep}idx{dims}-ubyte{ext}"
          for sep in "-." for ext in ("", ".gz")]


def _find(folder: str, prefixes: tuple[str, ...], kind: str) -> str | None:
  for prefix in prefixes:
    for name in _idx_names(prefix, kind):
      if os.path.isfile(os.path.join(folder, name)):
        return os.path.join(folder, name)
  return None


def find_idx(folder: str, prefixes: tuple[str, ...] = _TRAIN_PREFIXES
             ) -> tuple[str, str] | None:
  """The `(images, labels)` IDX files of one split in `folder`, or None when it
  has neither; raises `FileNotFoundError` when it has only one of them."""
  images = _find(folder, prefixes, "images")
  labels = _find(folder, prefixes, "labels")
  if images is None and labels is None:
    return None
  if images is None or labels is None:
    have, missing = (images, "labels") if labels is None else (labels, "images")
    raise FileNotFoundError(
        f"{have} has no matching {missing} file in {folder} (expected "
        f"{_idx_names(prefixes[0], missing)[0]}[.gz]).")
  return images, labels


def _payload(f, path: str, header_len: int, size: int, gz: bool) -> bytes:
  """Reads exactly `size` bytes after the header, checking the file holds that
  many: a plain file by its size (before reading), a gzip stream by reading at
  most `size + 1` bytes in chunks, so a lying header allocates nothing."""
  if not gz:
    held = os.path.getsize(path) - header_len
    if held != size:
      raise ValueError(f"IDX file {path}: the header declares {size} bytes of data, "
                       f"the file holds {held}.")
    return f.read(size)
  chunks, total = [], 0
  while total <= size:
    chunk = f.read(min(_CHUNK, size + 1 - total))
    if not chunk:
      break
    chunks.append(chunk)
    total += len(chunk)
  if total != size:
    held = f"{total}" if total < size else "more"
    raise ValueError(f"IDX file {path}: the header declares {size} bytes of data, "
                     f"the file holds {held}.")
  return b"".join(chunks)


def read_idx(path: str, ndim: int) -> np.ndarray:
  """Reads an IDX file of unsigned bytes with `ndim` dimensions (plain or `.gz`).

  The IDX header is two zero bytes, a dtype code (0x08: unsigned bytes), the
  number of dimensions, then each dimension as a big-endian int32.

  Args:
    path: the file; a name ending in `.gz` is read as gzip.
    ndim: the number of dimensions it must have (3 for images, 1 for labels).

  Returns:
    A uint8 array with the header's shape.

  Raises:
    ValueError: the header is malformed or does not match the data.
  """
  gz = path.endswith(".gz")
  try:
    with (gzip.open if gz else open)(path, "rb") as f:
      head = f.read(4)
      if len(head) < 4 or head[0] or head[1]:
        raise ValueError(f"IDX file {path}: no IDX magic number (00 00 08 "
                         f"{ndim:02x}), got {head.hex(' ') or 'an empty file'}.")
      if head[2] != _IDX_UINT8:
        raise ValueError(f"IDX file {path}: dtype code 0x{head[2]:02x} is not "
                         "supported (only 0x08, unsigned bytes).")
      if head[3] != ndim:
        raise ValueError(f"IDX file {path}: {head[3]} dimensions, expected {ndim}.")
      dims = f.read(4 * ndim)
      if len(dims) < 4 * ndim:
        raise ValueError(f"IDX file {path}: the header is truncated.")
      shape = tuple(int(d) for d in np.frombuffer(dims, ">u4"))
      data = _payload(f, path, 4 + 4 * ndim, math.prod(shape), gz)
  except (EOFError, zlib.error, gzip.BadGzipFile) as e:
    raise ValueError(f"IDX file {path}: not a readable gzip file ({e}).") from e
  return np.frombuffer(data, np.uint8).reshape(shape)


def _read_split(images_path: str, labels_path: str) -> tuple[np.ndarray, np.ndarray]:
  images, labels = read_idx(images_path, 3), read_idx(labels_path, 1)
  if len(images) != len(labels):
    raise ValueError(f"IDX file {labels_path} holds {len(labels)} labels but "
                     f"{images_path} holds {len(images)} images.")
  return images[..., None], labels


def load_idx(folder: str) -> arrays.Dataset:
  """Loads a folder of IDX files (the MNIST format), plain or gzip.

  Reads `train-images-idx3-ubyte` and `train-labels-idx1-ubyte` (also spelled
  `train-images.idx3-ubyte`; each plain or `.gz`) and, when present, the test
  split `t10k-*` (or `test-*`) named alike. Fashion-MNIST, MNIST and the EMNIST
  files (renamed) are in this format.

  Args:
    folder: the folder holding the files.

  Returns:
    A `Dataset` named after the folder: the train split as `images` `(N, H, W, 1)`,
    float32 in `[0, 1]` (bytes / 255), and `labels`; the test split as
    `test_images`/`test_labels` (None when absent); `K = max label + 1` over both.

  Raises:
    FileNotFoundError: no train files, or only one file of a split.
    ValueError: a file is malformed, truncated or does not match its header (the
      message names the file).

  Example:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> with open(os.path.join(folder, "train-images-idx3-ubyte"), "wb") as f:
    ...   _ = f.write(bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 255]))
    >>> with open(os.path.join(folder, "train-labels-idx1-ubyte"), "wb") as f:
    ...   _ = f.write(bytes([0, 0, 8, 1, 0, 0, 0, 2, 3, 1]))
    >>> ds = load_idx(folder)
    >>> ds.images.shape, ds.images.ravel().tolist(), ds.labels.tolist(), ds.num_classes
    ((2, 1, 1, 1), [0.0, 1.0], [3, 1], 4)
  """
  train = find_idx(folder, _TRAIN_PREFIXES)
  if train is None:
    raise FileNotFoundError(
        f"no IDX training files in {folder}: expected train-images-idx3-ubyte and "
        "train-labels-idx1-ubyte (plain or .gz).")
  test = find_idx(folder, _TEST_PREFIXES)
  images, labels = _read_split(*train)
  test_images, test_labels = _read_split(*test) if test else (None, None)
  name = os.path.basename(os.path.normpath(folder))
  return arrays.from_arrays(images, labels, name=name, test_images=test_images,
                            test_labels=test_labels)


def _npz_array(npz, path: str, role: str) -> np.ndarray | None:
  """The array stored under one of `role`'s key spellings, or None."""
  present = [key for key in _NPZ_KEYS[role] if key in npz.files]
  if len(present) > 1:
    raise ValueError(f"{path}: holds both {present[0]!r} and {present[1]!r}; "
                     "keep one.")
  if not present:
    return None
  try:
    return npz[present[0]]
  except ValueError as e:  # allow_pickle=False refuses object arrays.
    raise ValueError(f"{path}: array {present[0]!r} is an object array, which pflax "
                     "never unpickles; save numeric arrays.") from e


def _read_npz(path: str) -> dict[str, np.ndarray | None]:
  """The arrays of an `.npz` file by role (`images`, ..., `num_classes`)."""
  with open(path, "rb") as f:
    try:
      npz = np.load(f, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
      raise ValueError(f"{path}: not a readable .npz file ({e}).") from e
    if not isinstance(npz, np.lib.npyio.NpzFile):
      raise ValueError(f"{path}: holds a single array; save a dataset with "
                       "np.savez(path, images=..., labels=...).")
    with npz:
      known = {key for keys in _NPZ_KEYS.values() for key in keys}
      unknown = sorted(set(npz.files) - known)
      if unknown:
        raise ValueError(f"{path}: unknown arrays {unknown}; expected images, labels "
                         "(or x, y), test_images, test_labels (or x_test, y_test), "
                         "num_classes.")
      if not {"images", "x"} & set(npz.files) or not {"labels", "y"} & set(npz.files):
        raise ValueError(f"{path}: must hold 'images' and 'labels' (or 'x' and 'y'), "
                         f"got {sorted(npz.files)}.")
      return {role: _npz_array(npz, path, role) for role in _NPZ_KEYS}


def load_npz(path: str) -> arrays.Dataset:
  """Loads a dataset saved with `np.savez` (never unpickles).

  Keys: `images` and `labels` (or `x` and `y`); optionally `test_images` and
  `test_labels` (or `x_test` and `y_test`) and a scalar `num_classes`. The
  arrays are validated and converted as by `from_arrays` (uint8 images / 255).

  Args:
    path: the `.npz` file.

  Returns:
    A `Dataset` named after the file (without `.npz`).

  Raises:
    ValueError: not an `.npz` archive, missing or unknown keys, object arrays,
      or arrays `from_arrays` refuses (the message names the file).

  Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "tiny.npz")
    >>> np.savez(path, x=np.zeros((3, 4)), y=[0, 1, 1])
    >>> ds = load_npz(path)
    >>> ds.name, ds.images.shape, ds.num_classes
    ('tiny', (3, 4), 2)
  """
  found = _read_npz(path)
  num_classes = found.pop("num_classes")
  if num_classes is not None:
    if num_classes.ndim != 0 or num_classes.dtype.kind not in "ui":
      raise ValueError(f"{path}: num_classes must be a scalar integer, got shape "
                       f"{num_classes.shape} and dtype {num_classes.dtype}.")
    num_classes = int(num_classes)
  name = os.path.splitext(os.path.basename(path))[0]
  try:
    return arrays.from_arrays(found["images"], found["labels"],
                              num_classes=num_classes, name=name,
                              test_images=found["test_images"],
                              test_labels=found["test_labels"])
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from e
