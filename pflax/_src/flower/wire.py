"""What travels between a pflax server and its nodes: pytrees as Flower records.

Arrays travel as NumPy's `.npy` bytes (Flower's `Array`), which load without
pickle, each distinct array of a message once (`pack`): a loss context equal
to the model (FedProx's anchor), or an evaluated kind equal to another
(FedAvg's global and personalized models), costs no bytes. A received array's
`.npy` header is compared with the expected leaf (shape, dtype, C order)
before its data is read (`from_record`).
"""

import io
import math
from typing import Any

import jax
import numpy as np

try:
  from flwr import app as flwr_app
  from flwr.common.constant import SType
except ImportError as e:  # pragma: no cover - exercised without the extra
  raise ImportError("pflax.flower needs Flower: pip install 'pflax[flower]'") from e

QUERY, TRAIN, EVALUATE = "query", "train", "evaluate"
"""The message types of a pflax federation."""


def to_record(tree: Any) -> "flwr_app.ArrayRecord":
  """A pytree as an ArrayRecord, one `Array` per leaf named by its key path."""
  return flwr_app.ArrayRecord({jax.tree_util.keystr(path): flwr_app.Array(
      np.asarray(leaf)) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)})


def from_record(record: "flwr_app.ArrayRecord", like: Any, name: str = "record") -> Any:
  """The pytree of `like`'s structure, shapes and dtypes stored in `record`;
  each array's `.npy` header is checked before its data is read (`_decoded`).

  Raises:
    ValueError: naming `name` and the first key missing, unexpected, or of
      another shape or dtype than `like`'s, or bytes that are not its `.npy`.
  """
  paths = jax.tree_util.tree_leaves_with_path(like)
  expected = {jax.tree_util.keystr(path): leaf for path, leaf in paths}
  extra = sorted(set(record) - set(expected))
  missing = sorted(set(expected) - set(record))
  if extra or missing:
    raise ValueError(f"{name}: keys {missing} missing and {extra} unexpected.")
  leaves = [_decoded(record[key], leaf, f"{name}{key}")
            for key, leaf in expected.items()]
  return jax.tree.unflatten(jax.tree.structure(like), leaves)


_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}


def _decoded(array: "flwr_app.Array", like: Any, name: str = "array") -> np.ndarray:
  """The array of `like`'s shape and dtype that `array`'s `.npy` bytes hold.

  The `.npy` header (shape, dtype, order) is read and compared with `like`
  before anything is allocated, and the payload must be exactly that many bytes:
  bytes from another machine cannot make this allocate more than `like` (a header
  declaring 10**12 elements) or load a pickle (an object dtype).

  Raises:
    ValueError: naming `name`, for bytes that are not `.npy` of a C-ordered
      array of `like`'s shape and dtype.
  """
  shape, dtype = tuple(np.shape(like)), np.dtype(like.dtype)
  if array.stype != SType.NUMPY:
    raise ValueError(f"{name} must be serialized as {SType.NUMPY}, got "
                     f"{array.stype!r}.")
  stream = io.BytesIO(array.data)
  try:
    version = np.lib.format.read_magic(stream)
    if version not in _NPY_HEADERS:
      raise ValueError(f"format version {version} is not read")
    got_shape, fortran, got_dtype = _NPY_HEADERS[version](stream)
  except ValueError as e:
    raise ValueError(f"{name} is not .npy bytes: {e}.") from None
  if got_shape != shape or got_dtype != dtype:
    raise ValueError(f"{name} must be {dtype}{shape}, got {got_dtype}{got_shape}.")
  if fortran:
    raise ValueError(f"{name} must be in C order, got Fortran order.")
  size = math.prod(shape) * dtype.itemsize
  if len(array.data) - stream.tell() != size:
    raise ValueError(f"{name} must hold {size} bytes after its header, got "
                     f"{len(array.data) - stream.tell()}.")
  return np.frombuffer(array.data, dtype, math.prod(shape), stream.tell()
                       ).reshape(shape).copy()


def pack(tree: Any) -> tuple["flwr_app.ArrayRecord", "flwr_app.ConfigRecord"]:
  """`tree` as `(arrays, same)` records: its leaves as `to_record` names them,
  each distinct array once; `same` maps every other leaf's key to the key of the
  identical array (same dtype, shape and bytes) that is sent in its place
  (FedProx's anchor is the model it starts from: one copy travels, not two)."""
  record = to_record(tree)
  arrays, same, kept = flwr_app.ArrayRecord(), {}, []
  for key in list(record.keys()):
    array = record[key]
    twin = next((k for k, a in kept if (a.dtype, a.shape, a.data)
                 == (array.dtype, array.shape, array.data)), None)
    if twin is None:
      arrays[key] = array
      kept.append((key, array))
    else:
      same[key] = twin
  return arrays, flwr_app.ConfigRecord(same)


def unpack(arrays: "flwr_app.ArrayRecord", same: "flwr_app.ConfigRecord", like: Any,
           name: str = "record") -> Any:
  """The tree `pack` made `(arrays, same)` of, checked against `like` as
  `from_record` checks it."""
  full = {key: arrays[key] for key in arrays.keys()}
  for key, twin in same.items():
    if twin not in full:
      raise ValueError(f"{name}: {key} refers to {twin}, which was not sent.")
    full[key] = full[twin]
  return from_record(flwr_app.ArrayRecord(full), like, name)


def packed(tree: Any, config: "flwr_app.ConfigRecord | flwr_app.MetricRecord",
           name: str = "config") -> "flwr_app.RecordDict":
  """A message's content: `tree` packed (`arrays`, `same`) and `config` (or a
  reply's metrics) under `name`."""
  arrays, same = pack(tree)
  return flwr_app.RecordDict({"arrays": arrays, "same": same, name: config})


def unpacked(content: "flwr_app.RecordDict", like: Any, name: str) -> Any:
  """The tree of a message's content (`packed`), checked against `like`."""
  return unpack(content["arrays"], content["same"], like, name)
