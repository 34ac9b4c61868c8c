"""Datasets read from files: IDX folders (the MNIST format) and `.npz` archives.

Both readers trust nothing in the file, and a hostile file costs nothing: only
regular files are opened (a FIFO, a device or a symlink loop is refused without
blocking); every size a file declares (an IDX header, a zip member, an `.npy`
header) is checked against what the file can hold, and against `MAX_BYTES`,
before anything is allocated; decompression stops at the declared size, and data
after it is refused; `.npz` archives are read without unpickling. Every problem
is a one-line `ValueError` that names the file.
"""

import errno
import fcntl
import gzip
import math
import os
import stat
import zipfile
import zlib
from typing import BinaryIO

import numpy as np

from pflax._src.data import arrays

MAX_BYTES = 1 << 31
"""The largest array a file may declare, in bytes (2 GiB; EMNIST's largest
split is 0.55 GB)."""
MAX_RATIO = 1032
"""The most that deflate expands its input (1032:1): a compressed payload that
declares more than this times its compressed size is refused unread."""
_IDX_UINT8 = 0x08
_CHUNK = 1 << 20  # gzip payloads are read in 1 MiB pieces, up to the declared size.
_TRAIN_PREFIXES = ("train",)
_TEST_PREFIXES = ("t10k", "test")
_NPZ_KEYS = {"images": ("images", "x"), "labels": ("labels", "y"),
             "test_images": ("test_images", "x_test"),
             "test_labels": ("test_labels", "y_test"),
             "num_classes": ("num_classes",)}


def open_regular(path: str) -> BinaryIO:
  """`path` opened for reading in binary if it is a regular file (symlinks to one
  are followed); without blocking on a FIFO.

  Raises:
    FileNotFoundError: nothing is there.
    ValueError: a FIFO, a device, a folder, a symlink loop or an unreadable file.
  """
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
  except FileNotFoundError:
    raise FileNotFoundError(f"{path}: no such file.") from None
  except OSError as e:
    why = "a symlink loop" if e.errno == errno.ELOOP else e.strerror
    raise ValueError(f"{path}: cannot be read ({why}).") from None
  mode = os.fstat(fd).st_mode
  if not stat.S_ISREG(mode):
    os.close(fd)
    raise ValueError(f"{path}: not a regular file (a FIFO, device, socket or "
                     "folder); pflax reads data from files only.")
  fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
  return os.fdopen(fd, "rb")


def _check_declared(path: str, what: str, declared: int, stored: int,
                    compressed: bool) -> None:
  """Raises unless `declared` bytes fit `MAX_BYTES` and, if `compressed`, could
  come from `stored` compressed bytes (`MAX_RATIO`)."""
  if declared > MAX_BYTES:
    raise ValueError(f"{path}: {what} declares {declared} bytes, more than pflax "
                     f"reads ({MAX_BYTES}, pflax.data.files.MAX_BYTES).")
  if compressed and declared > MAX_RATIO * stored + 1024:
    raise ValueError(f"{path}: {what} declares {declared} bytes, more than "
                     f"{stored} compressed bytes can hold.")


def _idx_names(prefix: str, kind: str) -> list[str]:
  """`train-images-idx3-ubyte`, its dotted spelling `train-images.idx3-ubyte`,
  each plain or `.gz`, in that order of preference."""
  dims = 3 if kind == "images" else 1
  return [f"{prefix}-{kind}{sep}idx{dims}-ubyte{ext}"
          for sep in "-." for ext in ("", ".gz")]


def _find(folder: str, prefixes: tuple[str, ...], kind: str) -> str | None:
  for prefix in prefixes:
    for name in _idx_names(prefix, kind):
      if os.path.lexists(os.path.join(folder, name)):
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


def _payload(f, path: str, header_len: int, size: int, stored: int, gz: bool
             ) -> np.ndarray:
  """The `size` bytes after the header, checking the file holds exactly that
  many: a plain file by its size (`stored`, before reading), a gzip stream read
  into a buffer of the declared size, at most `size + 1` bytes, after checking
  `size` against `MAX_BYTES` and what `stored` compressed bytes can hold."""
  _check_declared(path, "the IDX header", size, stored, gz)
  if not gz:
    if stored - header_len != size:
      raise ValueError(f"IDX file {path}: the header declares {size} bytes of data, "
                       f"the file holds {stored - header_len}.")
  data = np.empty(size, np.uint8)
  view, total = memoryview(data), 0
  while total < size:
    got = f.readinto(view[total:total + _CHUNK])
    if not got:
      break
    total += got
  if total < size or f.read(1):
    held = f"{total}" if total < size else "more"
    raise ValueError(f"IDX file {path}: the header declares {size} bytes of data, "
                     f"the file holds {held}.")
  return data


def read_idx(path: str, ndim: int) -> np.ndarray:
  """Reads an IDX file of unsigned bytes with `ndim` dimensions (plain or `.gz`).

  The IDX header is two zero bytes, a dtype code (0x08: unsigned bytes), the
  number of dimensions, then each dimension as a big-endian int32. The data
  must be exactly as long as the header declares (no trailing bytes), and at
  most `MAX_BYTES`.

  Args:
    path: a regular file; a name ending in `.gz` is read as gzip.
    ndim: the number of dimensions it must have (3 for images, 1 for labels).

  Returns:
    A uint8 array with the header's shape.

  Raises:
    ValueError: the header is malformed or does not match the data, or the file
      is not a regular file.
  """
  gz = path.endswith(".gz")
  with open_regular(path) as raw:
    stored = os.fstat(raw.fileno()).st_size
    try:
      with (gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw) as f:
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
        data = _payload(f, path, 4 + 4 * ndim, math.prod(shape), stored, gz)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
      raise ValueError(f"IDX file {path}: not a readable gzip file ({e}).") from e
  return data.reshape(shape)


def _read_split(images_path: str, labels_path: str) -> tuple[np.ndarray, np.ndarray]:
  images, labels = read_idx(images_path, 3), read_idx(labels_path, 1)
  if len(images) != len(labels):
    raise ValueError(f"IDX file {labels_path} holds {len(labels)} labels but "
                     f"{images_path} holds {len(images)} images.")
  return images[..., None], labels


def load_idx(folder: str, *, num_classes: int | None = None) -> arrays.Dataset:
  """Loads a folder of IDX files (the MNIST format), plain or gzip.

  Reads `train-images-idx3-ubyte` and `train-labels-idx1-ubyte` (also spelled
  `train-images.idx3-ubyte`; each plain or `.gz`) and, when present, the test
  split `t10k-*` (or `test-*`) named alike. Fashion-MNIST, MNIST and the EMNIST
  files (renamed) are in this format.

  Args:
    folder: the folder holding the files.
    num_classes: `K`, declared (labels must lie in `[0, K)`); None infers it.

  Returns:
    A `Dataset` named after the folder: the train split as `images` `(N, H, W, 1)`,
    float32 in `[0, 1]` (bytes / 255), and `labels`; the test split as
    `test_images`/`test_labels` (None when absent); `K = max label + 1` over both
    (every class below it must have a sample, unless `num_classes` is given).

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
    >>> ds = load_idx(folder, num_classes=4)  # classes 0 and 2 have no sample
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
  return arrays.from_arrays(images, labels, num_classes=num_classes, name=name,
                            test_images=test_images, test_labels=test_labels)


def _npz_array(found: dict[str, np.ndarray], path: str, role: str
               ) -> np.ndarray | None:
  """The array stored under one of `role`'s key spellings, or None."""
  present = [key for key in _NPZ_KEYS[role] if key in found]
  if len(present) > 1:
    raise ValueError(f"{path}: holds both {present[0]!r} and {present[1]!r}; "
                     "keep one.")
  return found[present[0]] if present else None


def _npy_header(member: BinaryIO, path: str, key: str
                ) -> tuple[tuple[int, ...], bool, np.dtype]:
  """`(shape, fortran_order, dtype)` of an `.npy` member's header; object arrays
  (which only unpickling reads) are refused."""
  version = np.lib.format.read_magic(member)
  if version == (1, 0):
    shape, fortran, dtype = np.lib.format.read_array_header_1_0(member)
  elif version in ((2, 0), (3, 0)):
    shape, fortran, dtype = np.lib.format.read_array_header_2_0(member)
  else:
    raise ValueError(f".npy format version {version}")
  if dtype.hasobject:
    raise ValueError(f"{path}: array {key!r} is an object array, which pflax never "
                     "unpickles; save numeric arrays.")
  return shape, fortran, dtype


def _npz_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: str
                ) -> np.ndarray:
  """One `.npy` member, its sizes checked before anything is allocated: the zip
  directory's against `MAX_BYTES` and its compressed size, the `.npy` header's
  against the member's."""
  key = info.filename[:-len(".npy")]
  compressed = info.compress_type != zipfile.ZIP_STORED
  _check_declared(path, f"array {key!r}", info.file_size, info.compress_size,
                  compressed)
  with archive.open(info) as member:
    shape, fortran, dtype = _npy_header(member, path, key)
    size = math.prod(shape) * dtype.itemsize
    if member.tell() + size != info.file_size:
      raise ValueError(f"{path}: array {key!r} declares shape {shape} of {dtype} "
                       f"({size} bytes), its member holds "
                       f"{info.file_size - member.tell()}.")
    data = member.read(size)
  if len(data) != size:
    raise ValueError(f"{path}: array {key!r} is truncated.")
  return np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C")


def _npz_arrays(f: BinaryIO, path: str) -> dict[str, np.ndarray]:
  """Every array of an `.npz` archive by key (`_npz_member`)."""
  try:
    archive = zipfile.ZipFile(f)
  except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
    raise ValueError(f"{path}: not a readable .npz file ({e}).") from None
  with archive:
    infos = archive.infolist()
    names = [info.filename for info in infos]
    if any(not n.endswith(".npy") for n in names) or len(set(names)) != len(names):
      raise ValueError(f"{path}: not an .npz file of arrays (members {names}).")
    try:
      return {info.filename[:-len(".npy")]: _npz_member(archive, info, path)
              for info in infos}
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, SyntaxError) as e:
      raise ValueError(f"{path}: not a readable .npz file ({e}).") from None
    except ValueError as e:
      if str(e).startswith(path):
        raise
      raise ValueError(f"{path}: not a readable .npz file ({e}).") from None


def _read_npz(path: str) -> dict[str, np.ndarray | None]:
  """The arrays of an `.npz` file by role (`images`, ..., `num_classes`)."""
  with open_regular(path) as f:
    if f.read(6) == b"\x93NUMPY":
      raise ValueError(f"{path}: holds a single array; save a dataset with "
                       "np.savez(path, images=..., labels=...).")
    f.seek(0)
    found = _npz_arrays(f, path)
  known = {key for keys in _NPZ_KEYS.values() for key in keys}
  unknown = sorted(set(found) - known)
  if unknown:
    raise ValueError(f"{path}: unknown arrays {unknown}; expected images, labels "
                     "(or x, y), test_images, test_labels (or x_test, y_test), "
                     "num_classes.")
  if not {"images", "x"} & set(found) or not {"labels", "y"} & set(found):
    raise ValueError(f"{path}: must hold 'images' and 'labels' (or 'x' and 'y'), "
                     f"got {sorted(found)}.")
  return {role: _npz_array(found, path, role) for role in _NPZ_KEYS}


def load_npz(path: str, *, num_classes: int | None = None) -> arrays.Dataset:
  """Loads a dataset saved with `np.savez` (never unpickles).

  Keys: `images` and `labels` (or `x` and `y`); optionally `test_images` and
  `test_labels` (or `x_test` and `y_test`) and a scalar `num_classes`. The
  arrays are validated and converted as by `from_arrays` (uint8 images / 255).

  Args:
    path: the `.npz` file.
    num_classes: `K`, declared (over the file's `num_classes`); None: the file's,
      else inferred as by `from_arrays`.

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
  stored = found.pop("num_classes")
  if stored is not None:
    if stored.ndim != 0 or stored.dtype.kind not in "ui":
      raise ValueError(f"{path}: num_classes must be a scalar integer, got shape "
                       f"{stored.shape} and dtype {stored.dtype}.")
    num_classes = int(stored) if num_classes is None else num_classes
  name = os.path.splitext(os.path.basename(path))[0]
  try:
    return arrays.from_arrays(found["images"], found["labels"],
                              num_classes=num_classes, name=name,
                              test_images=found["test_images"],
                              test_labels=found["test_labels"])
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from e
