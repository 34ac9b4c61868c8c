"""Host-side boundary checks for public functions (run before tracing).

Shapes are static even under `jax.jit`, so every shape check here runs at trace
time, before any compiled work. Value checks (non-negative counts, ranges of
hyperparameters) run only when the value is concrete; inside a user's `jit` or a
vmapped sweep they are skipped, never silently coerced.
"""

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pflax._src.core import types


def is_concrete(x: Any) -> bool:
  """True if `x` holds a value on the host (not a tracer)."""
  return not isinstance(x, jax.core.Tracer)


def _leaf_name(path: jax.tree_util.KeyPath) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


def num_clients(stacked: types.Stacked, name: str = "params") -> int:
  """Returns the common leading axis of `stacked`; raises if the leaves disagree."""
  leaves = jax.tree_util.tree_leaves_with_path(stacked)
  if not leaves:
    raise ValueError(f"{name} must be a non-empty pytree of arrays, got {stacked!r}.")
  sizes: dict[int, str] = {}
  for path, leaf in leaves:
    shape = np.shape(leaf)
    if len(shape) == 0:
      raise ValueError(
          f"{name}: every leaf needs a leading client axis M, but leaf "
          f"'{_leaf_name(path)}' is a scalar.")
    sizes.setdefault(shape[0], _leaf_name(path))
  if len(sizes) > 1:
    detail = ", ".join(f"'{leaf}' has M = {m}" for m, leaf in sizes.items())
    raise ValueError(
        f"{name}: all leaves must share the leading client axis M; {detail}.")
  return next(iter(sizes))


def float_leaves(stacked: types.Stacked, name: str = "params") -> None:
  """Raises `TypeError` if a leaf is not a real floating-point array (complex too)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(stacked):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise TypeError(
          f"{name}: leaf '{_leaf_name(path)}' has dtype {jnp.result_type(leaf)}; "
          "aggregation needs real floating-point leaves.")


def same_structure(a: Any, b: Any, name_a: str, name_b: str) -> None:
  """Raises if two pytrees differ in structure or leaf shapes."""
  sa, sb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
  if sa != sb:
    raise ValueError(f"{name_b} must have the same tree structure as {name_a}: "
                     f"{sb} vs {sa}.")
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a),
                          jax.tree_util.tree_leaves(b)):
    if np.shape(x) != np.shape(y):
      raise ValueError(
          f"{name_b}: leaf '{_leaf_name(path)}' must have shape {np.shape(x)} "
          f"like {name_a}, got {np.shape(y)}.")


def shape(x: Any, name: str, expected: Sequence[int], symbols: str) -> None:
  """Raises unless `x` has exactly the shape `expected` (named by `symbols`)."""
  expected = tuple(int(e) for e in expected)
  got = np.shape(x)
  if got != expected:
    raise ValueError(
        f"{name} must have shape {symbols} = {expected}, got {tuple(got)}.")


def non_negative_finite(x: Any, name: str) -> None:
  """Raises if a concrete `x` has negative or non-finite entries."""
  if not is_concrete(x):
    return
  values = np.asarray(x)
  if not np.all(np.isfinite(values)):
    raise ValueError(f"{name} must be finite, got non-finite entries "
                     f"(NaN or inf) at {np.argwhere(~np.isfinite(values)).tolist()[:5]}.")
  if np.any(values < 0):
    raise ValueError(f"{name} must be non-negative, got min {values.min()}.")


def client_mask(m: Any, num: int, name: str = "mask") -> jax.Array | None:
  """Checks a client mask (shape `(M,)`, bool) and returns it as an array.

  A Python list or NumPy array is converted; callers must use the returned mask.
  """
  if m is None:
    return None
  if not isinstance(m, jax.Array):
    m = jnp.asarray(m)
  shape(m, name, (num,), "(M,)")
  if m.dtype != jnp.bool_:
    raise TypeError(f"{name} must be a bool array of shape (M,), got dtype {m.dtype}.")
  return m


def unstacked_sequence(stacked: Any, name: str = "params") -> None:
  """Raises `TypeError` for a list or tuple of client trees that are not stacked.

  A top-level list/tuple whose items are all non-leaf pytrees of one structure
  and the same leaf shapes is what `[tree_1, ..., tree_M]` looks like; pflax
  would read its items as parts of one model and average the wrong axis.
  """
  if type(stacked) not in (list, tuple) or not stacked:
    return
  first = jax.tree_util.tree_structure(stacked[0])
  shapes = [np.shape(x) for x in jax.tree_util.tree_leaves(stacked[0])]
  for item in stacked:
    if (jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(item))
        or jax.tree_util.tree_structure(item) != first
        or [np.shape(x) for x in jax.tree_util.tree_leaves(item)] != shapes):
      return
  raise TypeError(
      f"{name} is a {type(stacked).__name__} of {len(stacked)} trees of one "
      f"structure; pflax expects one stacked pytree whose leaves have a leading "
      f"client axis M. Use pflax.tree.stack({name}) (if a model's top level really "
      f"is a list of identical parts, wrap it in a dict).")


def stacked_clients(tree: types.Stacked, name: str = "stacked") -> int:
  """Checks a stacked pytree (not an unstacked list, M >= 1); returns M."""
  unstacked_sequence(tree, name)
  m = num_clients(tree, name)
  if m == 0:
    raise ValueError(f"{name} has M = 0 clients (every leaf's leading axis is "
                     "empty); at least one client is needed.")
  return m


def client_params(params: types.Stacked, mask: Any,
                  name: str = "params") -> tuple[int, jax.Array | None]:
  """Boundary checks every aggregator runs first; returns `(M, mask)`.

  Raises `TypeError` for an unstacked list of client trees (pointing to
  `pflax.tree.stack`) and for non-floating or complex leaves, `ValueError` for
  M = 0, leaves that disagree on M, or a mask not of shape `(M,)`, and
  `TypeError` for a non-bool mask. The mask comes back as an array (a Python
  list or NumPy array is converted): callers must use the returned one.
  """
  m = stacked_clients(params, name)
  float_leaves(params, name)
  return m, client_mask(mask, m)


def some_weight(num_samples: Any, mask: Any, name: str = "num_samples") -> None:
  """Raises if concrete inputs give every (unmasked) client zero weight.

  `num_samples` is `(M,)` counts or `(M, K)` class counts (a client has weight
  if any of its entries is positive); None means uniform. An all-False `mask`
  is named as the cause; otherwise `name` is, when no unmasked client has a
  positive entry. Skipped when an input is traced: under `jit` each aggregator
  documents its finite zero-weight result instead.
  """
  if mask is not None:
    if not is_concrete(mask):
      return
    keep = np.asarray(mask, bool)
    if not keep.any():
      raise ValueError("mask is all False: no client takes part, so the total "
                       "weight is 0. Unmask at least one client.")
  if num_samples is None or not is_concrete(num_samples):
    return
  counts = np.asarray(num_samples, np.float64)
  positive = (counts > 0).reshape(counts.shape[0], -1).any(axis=1)
  if mask is not None:
    positive &= keep
  if not positive.any():
    which = "unmasked client" if mask is not None else "client"
    raise ValueError(f"{name} gives every {which} weight 0 (no positive count), so "
                     f"the weighted mean is undefined; at least one {which} needs a "
                     f"positive count.")


def check_range(name: str, value: Any, low: float | None = None,
                high: float | None = None, *, open_low: bool = False) -> None:
  """Raises ValueError unless a concrete scalar `value` is finite and in
  `[low, high]` (`(low, high]` with `open_low`); `None` bounds are open.

  The one range check of pflax's hyperparameters (aggregators and builders).
  Traced values (a swept or differentiated hyperparameter) are not checked: a
  sweep checks every value concretely before tracing.
  """
  if np.ndim(value) != 0:
    raise ValueError(f"{name} must be a scalar, got shape {np.shape(value)}.")
  if not is_concrete(value):
    return
  v = float(value)
  below = low is not None and (v <= low if open_low else v < low)
  if not math.isfinite(v) or below or (high is not None and v > high):
    left = "(" if open_low else "["
    raise ValueError(f"{name} must be a finite number in {left}{low}, "
                     f"{high if high is not None else 'inf'}], got {value}.")


def integer_at_least(x: Any, name: str, low: int) -> None:
  """Checks a static integer argument is a Python int >= low."""
  if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
    raise TypeError(f"{name} must be a Python int, got {type(x).__name__}.")
  if x < low:
    raise ValueError(f"{name} must be >= {low}, got {x}.")
