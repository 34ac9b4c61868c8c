"""Hostile data files cost nothing (issue 34): a lying size allocates nothing and
decompresses nothing past what it declares; a FIFO, a device or a symlink loop is
refused without blocking; trailing data is refused; a stray label is an error
naming its index. Every file here is a few kilobytes, written in tmp_path."""

import gzip
import io
import os
import signal
import tracemalloc
import zipfile

import numpy as np
import pytest

from pflax import data
from pflax._src.cli import main as cli
from pflax._src.data import files


def _idx(shape, payload: bytes) -> bytes:
  """An IDX header of unsigned bytes declaring `shape`, then `payload`."""
  return bytes([0, 0, 8, len(shape)]) + b"".join(
      int(d).to_bytes(4, "big") for d in shape) + payload


def _folder(tmp_path, images: bytes, labels: bytes, gz: bool = True):
  ext = ".gz" if gz else ""
  pack = gzip.compress if gz else (lambda b: b)
  (tmp_path / f"train-images-idx3-ubyte{ext}").write_bytes(pack(images))
  (tmp_path / f"train-labels-idx1-ubyte{ext}").write_bytes(pack(labels))
  return str(tmp_path)


def _peak_bytes(function) -> tuple[Exception, int]:
  """The exception `function()` raises and the peak memory traced meanwhile."""
  tracemalloc.start()
  try:
    with pytest.raises(ValueError) as error:
      function()
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  return error.value, peak


@pytest.fixture
def no_hang():
  """Fails a test that blocks for more than 10 s (a FIFO opened for reading)."""
  def hung(signum, frame):
    raise AssertionError("blocked: a FIFO was opened for reading")
  previous = signal.signal(signal.SIGALRM, hung)
  signal.alarm(10)
  yield
  signal.alarm(0)
  signal.signal(signal.SIGALRM, previous)


def test_a_gzip_idx_declaring_four_billion_images_reads_nothing(tmp_path):
  # 2^32 - 1 images of 28x28 declared, 16 MB of zeros behind it (16 kB gzipped).
  images = _idx((2**32 - 1, 28, 28), bytes(16 * 2**20))
  folder = _folder(tmp_path, images, _idx((2,), bytes(2)))
  error, peak = _peak_bytes(lambda: data.load_idx(folder))
  assert "more than pflax reads" in str(error) and "\n" not in str(error)
  assert peak < 2**20, peak   # today: the 16 MB were decompressed and kept


def test_a_gzip_idx_declaring_more_than_its_bytes_can_hold_reads_nothing(tmp_path):
  images = _idx((1000, 1000, 1000), bytes(8 * 2**20))   # 1 GB declared, 8 kB stored
  folder = _folder(tmp_path, images, _idx((2,), bytes(2)))
  error, peak = _peak_bytes(lambda: data.load_idx(folder))
  assert "compressed bytes can hold" in str(error)
  assert peak < 2**20, peak


@pytest.mark.parametrize("gz", [True, False])
def test_the_idx_reader_rejects_data_after_the_declared_payload(tmp_path, gz):
  images = _idx((2, 1, 1), bytes([0, 255]))
  folder = _folder(tmp_path, images, _idx((2,), bytes([0, 1])), gz)
  assert data.load_idx(folder).images.shape == (2, 1, 1, 1)
  path = os.path.join(folder, "train-images-idx3-ubyte" + (".gz" if gz else ""))
  with open(path, "ab") as f:   # a second gzip member, or plain bytes, appended
    f.write(gzip.compress(bytes(1000)) if gz else bytes(1000))
  with pytest.raises(ValueError, match="declares 2 bytes of data, the file holds "
                     "(more|1002)"):
    data.load_idx(folder)


def test_a_gzip_idx_stops_decompressing_at_its_declared_size(tmp_path):
  """2 bytes declared, 64 MiB more in the same gzip stream (64 kB stored): the
  reader decompresses at most one byte past the declared size, so it refuses
  the file without holding the 64 MiB."""
  images = _idx((2, 1, 1), bytes(64 * 2**20 + 2))
  folder = _folder(tmp_path, images, _idx((2,), bytes([0, 1])))
  error, peak = _peak_bytes(lambda: data.load_idx(folder))
  assert "declares 2 bytes of data, the file holds more" in str(error)
  assert peak < 2**20, peak


def _zip(tmp_path, members: dict[str, bytes], name="bomb.npz") -> str:
  path = tmp_path / name
  with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    for key, payload in members.items():
      z.writestr(key + ".npy", payload)
  return str(path)


def _npy_header(shape, dtype="<f8") -> bytes:
  buffer = io.BytesIO()
  np.lib.format.write_array_header_1_0(
      buffer, {"descr": dtype, "fortran_order": False, "shape": shape})
  return buffer.getvalue()


def test_an_npz_bomb_asks_for_nothing(tmp_path, monkeypatch):
  # A member of 64 MB of zeros (64 kB deflated) against a limit lowered to 1 MiB:
  # refused from the zip directory, before anything is decompressed.
  monkeypatch.setattr(files, "MAX_BYTES", 2**20)
  images = _npy_header((2**23, 1)) + bytes(64 * 2**20)
  path = _zip(tmp_path, {"images": images,
                         "labels": _npy_header((2,), "<i8") + bytes(16)})
  del images
  assert os.path.getsize(path) < 2**20
  error, peak = _peak_bytes(lambda: data.load_npz(path))
  assert "more than pflax reads" in str(error) and path in str(error)
  assert peak < 2**20, peak


def test_an_npy_header_declaring_more_than_its_member_holds_reads_nothing(tmp_path):
  # A tiny member whose .npy header declares 6 GiB: numpy would allocate it.
  path = _zip(tmp_path, {"images": _npy_header((2**18, 3 * 2**10)) + bytes(64),
                         "labels": _npy_header((2,), "<i8") + bytes(16)})
  error, peak = _peak_bytes(lambda: data.load_npz(path))
  assert "declares shape (262144, 3072)" in str(error)
  assert peak < 2**20, peak


def test_an_npz_object_array_is_refused_unread(tmp_path):
  header = _npy_header((2,), "|O")
  path = _zip(tmp_path, {"images": header + b"\x80\x04N.", "labels": header})
  with pytest.raises(ValueError, match="object array, which pflax never unpickles"):
    data.load_npz(path)


@pytest.mark.parametrize("kind", ["fifo", "loop", "device", "folder"])
def test_non_regular_files_are_refused_at_once(tmp_path, kind, no_hang):
  del no_hang
  path = str(tmp_path / "data.npz")
  if kind == "fifo":
    os.mkfifo(path)
  elif kind == "loop":
    os.symlink(path, path)
  elif kind == "device":
    os.symlink("/dev/zero", path)
  else:
    os.mkdir(path)
  with pytest.raises(ValueError) as error:
    data.load_npz(path)
  assert path in str(error.value) and "\n" not in str(error.value)
  assert ("symlink loop" if kind == "loop" else "not a regular file") in str(
      error.value)


@pytest.mark.parametrize("kind", ["fifo", "loop"])
def test_a_fifo_or_loop_in_an_idx_folder_is_refused(tmp_path, kind, no_hang):
  del no_hang
  (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx((2,), bytes(2)))
  images = str(tmp_path / "train-images-idx3-ubyte")
  os.mkfifo(images) if kind == "fifo" else os.symlink(images, images)
  with pytest.raises(ValueError, match=f"^{images}: (not a regular|cannot be read)"):
    data.load_idx(str(tmp_path))


def test_a_fifo_as_the_cli_dataset_is_one_line(tmp_path, no_hang):
  del no_hang
  os.mkfifo(tmp_path / "data.npz")
  with pytest.raises(SystemExit, match="^pflax-run: .*not a regular file") as error:
    cli.main(["--dataset", str(tmp_path / "data.npz"), "--no-progress",
              "--out", str(tmp_path / "out")])
  assert "\n" not in str(error.value)


def _digits_with(stray: int):
  labels = np.arange(30) % 10
  labels[17] = stray
  return np.zeros((30, 4), np.float32), labels


def test_one_stray_label_is_an_error_naming_its_index():
  images, labels = _digits_with(255)
  with pytest.raises(ValueError, match=r"^labels\[17\] = 255 lies outside the "
                     r"classes 0\.\.9 that the labels cover \(no sample has label 10\)"):
    data.from_arrays(images, labels)
  assert data.from_arrays(images, labels, num_classes=256).num_classes == 256
  with pytest.raises(ValueError, match=r"first outside is labels\[17\] = 255"):
    data.from_arrays(images, labels, num_classes=10)


def test_a_stray_label_in_the_test_split_is_named_there():
  images, labels = _digits_with(7)
  test = np.array([0, 1, 12, 3])
  with pytest.raises(ValueError, match=r"^test_labels\[2\] = 12 lies outside"):
    data.from_arrays(images, labels, test_images=images[:4], test_labels=test)


def test_a_stray_label_in_an_idx_file_is_an_error_unless_declared(tmp_path):
  labels = np.arange(20, dtype=np.uint8) % 10
  labels[5] = 255
  folder = _folder(tmp_path, _idx((20, 1, 1), bytes(20)), _idx((20,), labels.tobytes()))
  with pytest.raises(ValueError, match=r"labels\[5\] = 255 lies outside"):
    data.load_idx(folder)
  assert data.load_idx(folder, num_classes=256).num_classes == 256
  assert data.load(folder, num_classes=256).num_classes == 256
  path = tmp_path / "stray.npz"
  np.savez(path, x=np.zeros((20, 2)), y=labels)
  with pytest.raises(SystemExit, match=r"^pflax-run: .*labels\[5\] = 255 lies "
                     "outside") as error:
    cli.main(["--dataset", str(path), "--no-progress", "--out", str(tmp_path / "o")])
  assert "\n" not in str(error.value)
  np.savez(path, x=np.zeros((20, 2)), y=labels, num_classes=256)
  assert data.load_npz(str(path)).num_classes == 256


def test_the_limits_are_documented_values():
  assert files.MAX_BYTES == 2**31 and files.MAX_RATIO == 1032
