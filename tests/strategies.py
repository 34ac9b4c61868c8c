"""Hypothesis strategies for the property tests of pflax's aggregators.

Shapes are kept few and tiny on purpose: every new `(M, layout, dtype)` costs a
compilation, which dominates the run time of a property test. Values are drawn
through hypothesis (not from a seeded NumPy generator), so a failure shrinks to
a small, readable example.
"""

from collections.abc import Callable
import os
from typing import Any

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np

MAX_CLIENTS = 8
MAX_CLASSES = 6
# The default (bounded) profile draws shapes from a few fixed sizes, so that
# examples share compilations; any other profile (CI's "ci") draws every size.
WIDE = os.environ.get("HYPOTHESIS_PROFILE", "pflax") != "pflax"
FEW_CLIENTS = (1, 3, 6)
FEW_CLASSES = (1, 4)
# The bounded profile's `(M, layout)` pairs.
FEW_SHAPES = ((1, "flat"), (3, "nested"), (6, "flat"), (6, "nested"))

# Per-client leaf shapes: ranks 0..3, several leaves, nested dicts, and a
# "classifier" subtree for the aggregators whose default selector needs one.
LAYOUTS = {
    "flat": {"features": {"s": ()}, "classifier": {"b": (2,)}},
    "nested": {"features": {"conv": (2, 1, 2)},
               "classifier": {"output": {"kernel": (3, 2), "bias": (2,)}}},
}

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(jnp.bfloat16), "float64": np.dtype(np.float64)}

# Typical magnitudes per dtype (float16 has to stay below 65504), then extreme
# ones at which a square or a sum of squares overflows the dtype's statistics.
MAGNITUDES = {
    "float32": (1.0, 1e-6, 1e-3, 1e3, 1e6),
    "float16": (1.0, 1e-2, 1e2, 1e4),
    "bfloat16": (1.0, 1e-6, 1e6),
    "float64": (1.0, 1e-6, 1e6),
}
EXTREME_MAGNITUDES = {
    "float32": (1e19, 1e30),
    "float16": (4e4,),
    "bfloat16": (1e19, 1e30),
    "float64": (1e150,),
}
# Power-of-two magnitudes for data on a dyadic grid (FedSA: bins and
# coefficients of variation are then decided the same way in every precision).
DYADIC_EXPONENTS = {
    "float32": (0, -20, 10, 20),
    "float16": (0, -4, 8),
    "bfloat16": (0, -20, 20),
    "float64": (0, -20, 20),
}
EXTREME_DYADIC_EXPONENTS = {
    "float32": (64, 100),
    "float16": (15,),
    "bfloat16": (64, 100),
    "float64": (500,),
}
# What masked-out clients upload instead of their parameters.
GARBAGE = (np.nan, np.inf, -np.inf, 1e30)


def num_clients(low: int = 1) -> st.SearchStrategy[int]:
  """M in [low, 8]; in the bounded profile one of a few sizes."""
  if WIDE:
    return st.integers(low, MAX_CLIENTS)
  return st.sampled_from([m for m in FEW_CLIENTS if m >= low])


def num_classes() -> st.SearchStrategy[int]:
  """K in [1, 6]; in the bounded profile one of a few sizes."""
  return st.integers(1, MAX_CLASSES) if WIDE else st.sampled_from(FEW_CLASSES)


def build(layout: dict, leaf: Callable[[tuple[int, ...]], Any]) -> dict:
  """A nested dict of the same keys as `layout` with `leaf(shape)` at each leaf."""
  return {k: build(v, leaf) if isinstance(v, dict) else leaf(v)
          for k, v in layout.items()}


def client_rows(draw: Callable, m: int) -> tuple[int, list[int]]:
  """`(r, rows)`: r distinct rows and each client's row (ties on purpose).

  Distinct clients, repeated rows (several clients sharing one row), or every
  client identical.
  """
  ties = draw(st.sampled_from(["distinct", "repeated", "identical"]))
  if ties == "distinct":
    return m, list(range(m))
  if ties == "identical":
    return 1, [0] * m
  r = draw(st.integers(1, m))
  return r, draw(st.lists(st.integers(0, r - 1), min_size=m, max_size=m))


def stacked(draw: Callable, m: int, layout: dict, dtype: str = "float32", *,
            extreme: bool = True, dyadic: bool = False,
            rows: tuple[int, list[int]] | None = None) -> dict:
  """Stacked parameters `(M, ...)` of a layout, in `dtype` (NumPy arrays).

  Values are `mantissa * magnitude` with mantissas either floats in [-1, 1] or
  small integers (integer-valued parameters). With `dyadic`, every value is a
  multiple of a power of two (`k / 8 * 2**e`, |k| <= 8), so it is exact in
  every dtype and statistics built from it are decided alike in each.
  """
  r, index = client_rows(draw, m) if rows is None else rows
  if dyadic:
    exps = DYADIC_EXPONENTS[dtype]
    exps += EXTREME_DYADIC_EXPONENTS[dtype] if extreme else ()
    scale = 2.0 ** draw(st.sampled_from(exps)) / 8
    elements = st.integers(-8, 8).map(float)
  else:
    mags = MAGNITUDES[dtype] + (EXTREME_MAGNITUDES[dtype] if extreme else ())
    scale = draw(st.sampled_from(mags))
    if draw(st.sampled_from(["float", "integer"]), label="values") == "float":
      elements = st.floats(-1, 1, allow_nan=False)
    else:
      elements = st.integers(-4, 4).map(float)
      scale = min(scale, float(jnp.finfo(DTYPES[dtype]).max) / 4)   # 4 * scale finite

  def leaf(shape):
    base = draw(hnp.arrays(np.float64, (r,) + shape, elements=elements))
    return (base[index] * scale).astype(DTYPES[dtype])
  return build(layout, leaf)


def like(draw: Callable, params: dict) -> dict:
  """Another stacked tree of the shapes and dtypes of `params` (e.g. the models
  FedDWA's clients received), each leaf at the magnitude of `params`' leaf,
  with rows tied like a fresh draw."""
  m = _leaves(params)[0].shape[0]
  r, index = client_rows(draw, m)

  def one(x):
    mag = float(np.max(np.abs(x.astype(np.float64)), initial=0.0)) or 1.0
    base = draw(hnp.arrays(np.float64, (r,) + x.shape[1:],
                           elements=st.floats(-1, 1, allow_nan=False)))
    return (base[index] * mag).astype(x.dtype)
  return _map(one, params)


def mask(draw: Callable, m: int) -> np.ndarray:
  """A random bool `(M,)` client mask with at least one True."""
  out = np.array(draw(st.lists(st.booleans(), min_size=m, max_size=m)), bool)
  out[draw(st.integers(0, m - 1))] = True
  return out


def counts(draw: Callable, m: int, valid: np.ndarray, high: int = 1000) -> np.ndarray:
  """float32 `(M,)` sample counts, some zero, at least one valid client positive."""
  n = np.array(draw(st.lists(st.integers(0, high), min_size=m, max_size=m)), np.float64)
  keep = np.flatnonzero(valid)
  i = keep[draw(st.integers(0, len(keep) - 1))]
  n[i] = max(n[i], 1.0)
  return n.astype(np.float32)


def class_counts(draw: Callable, m: int, k: int, valid: np.ndarray,
                 high: int = 50) -> np.ndarray:
  """float32 `(M, K)` class counts with empty rows and absent classes allowed,
  and at least one valid client holding a sample."""
  c = np.array(draw(st.lists(st.lists(st.integers(0, high), min_size=k, max_size=k),
                             min_size=m, max_size=m)), np.float64)
  keep = np.flatnonzero(valid)
  i = keep[draw(st.integers(0, len(keep) - 1))]
  c[i, draw(st.integers(0, k - 1))] += 1.0
  return c.astype(np.float32)


def soft(draw: Callable, m: int, num_classes: int = 3) -> np.ndarray:
  """float32 `(M, C)` soft logits; clients share a few prototype rows, so many
  rows are identical (the ties behind FedReMa's MDS)."""
  r, index = client_rows(draw, m)
  logits = draw(hnp.arrays(np.float64, (r, num_classes),
                           elements=st.floats(-3, 3, allow_nan=False)))
  z = logits / 0.5
  e = np.exp(z - z.max(axis=1, keepdims=True))
  return (e / e.sum(axis=1, keepdims=True))[index].astype(np.float32)


def spoil(draw: Callable, tree: Any, valid: np.ndarray) -> Any:
  """A copy of a stacked tree whose masked-out rows hold NaN, inf or 1e30."""
  bad = np.flatnonzero(~valid)

  def one(x):
    x = np.array(x, copy=True)
    for i in bad:
      x[i] = draw(st.sampled_from(GARBAGE))
    return x
  return _map(one, tree)


def permutation(draw: Callable, m: int) -> np.ndarray:
  return np.array(draw(st.permutations(list(range(m)))), int)


def _leaves(tree: Any) -> list[np.ndarray]:
  if isinstance(tree, dict):
    return [x for v in tree.values() for x in _leaves(v)]
  return [np.asarray(tree)]


def _map(fn: Callable, tree: Any) -> Any:
  if isinstance(tree, dict):
    return {k: _map(fn, v) for k, v in tree.items()}
  return fn(np.asarray(tree))

