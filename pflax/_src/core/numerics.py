"""Numeric helpers below every other floor: accumulation dtypes and exact scaling.

Tree utilities, statistics and aggregators all compute in float32 (or a wider
leaf dtype) and keep large or tiny values finite by multiplying with exact
powers of two read from a value's exponent bits; this module holds those
helpers, so each floor imports them from below instead of from a sibling.
"""

import chex
import jax
import jax.numpy as jnp

from pflax._src.core import types


def accumulation_dtype(dtype: jnp.dtype) -> jnp.dtype:
  """float32, or `dtype` itself if it is a wider float."""
  return jnp.promote_types(dtype, jnp.float32)


def weight_dtype(params: types.Stacked) -> jnp.dtype:
  """The dtype of weights for `params`: float32, or its leaves' dtype if wider.

  float64 leaves (under `jax_enable_x64`) get float64 weights, so the weights
  are as precise as the parameters they mix (docs/methods.md, common rules).
  """
  return accumulation_dtype(jnp.result_type(*jax.tree.leaves(params)))


def safe_norm(x: chex.Array, axis: int | None = None) -> chex.Array:
  """Euclidean norm (over every entry if `axis` is None), zero gradient at 0."""
  sq = jnp.sum(jnp.square(x), axis=axis)
  positive = sq > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)


def _bits(dtype: jnp.dtype) -> jnp.dtype:
  """The integer type of a float32 or float64 dtype's bit pattern."""
  return jnp.int32 if jnp.finfo(dtype).bits == 32 else jnp.int64


def frexp_exponent(x: chex.Array) -> chex.Array:
  """int32 `e` with `2^(e-1) <= |x| < 2^e` (frexp's) for normal float32/64 `x`.

  Read from the exponent bits: zero and subnormals give `minexp` of the dtype
  (-126 for float32), inf and NaN `maxexp + 1`.
  """
  info = jnp.finfo(x.dtype)
  bits = _bits(x.dtype)
  field = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(x, bits),
                                      jnp.asarray(info.nmant, bits))
  return ((field & (2 * info.maxexp - 1)) - (info.maxexp - 2)).astype(jnp.int32)


def scale_exponent(top: chex.Array) -> chex.Array:
  """int32 `e` with `2^(e-1) <= top < 2^e` (frexp's), clipped to `[-L, L]`.

  For float32 or float64 `top >= 0`, read from its exponent bits.
  `L = maxexp - 8` of the dtype (120 for float32), so `2^e` and `2^-e` are
  normal numbers; `top` of 0 (or subnormal) gives `-L`, inf or NaN gives `L`.
  """
  limit = jnp.finfo(top.dtype).maxexp - 8
  return jnp.clip(frexp_exponent(top), -limit, limit)


def power_of_two(exponent: chex.Array, dtype: jnp.dtype) -> chex.Array:
  """Exactly `2.0 ** exponent` (integer), built from its bits, in float32/64 `dtype`.

  Clipped to `dtype`'s normal range. Multiplying by it never rounds, unlike a
  division by a maximum, which XLA may turn into a product with a reciprocal
  that flushes to zero near the dtype's maximum.
  """
  info = jnp.finfo(dtype)
  bias = info.maxexp - 1
  bits = _bits(dtype)
  biased = jnp.clip(exponent.astype(bits) + bias, 1, 2 * bias)
  return jax.lax.bitcast_convert_type(
      jax.lax.shift_left(biased, jnp.asarray(info.nmant, bits)), dtype)


def scale_down(x: chex.Array, axis: int | tuple[int, ...]) -> chex.Array:
  """`x / 2^e` with `2^e` about the largest `|x|` along `axis` (exact scaling).

  The scale is a constant for gradients: use it only where the result does
  not depend on it (ratios, cosines).
  """
  top = jax.lax.stop_gradient(jnp.max(jnp.abs(x), axis=axis, keepdims=True))
  return x * power_of_two(-scale_exponent(top), x.dtype)


def _safe_divide(num: chex.Array, den: chex.Array) -> chex.Array:
  """num / den where den > 0, else 0 (no NaN, finite gradients)."""
  ok = den > 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def normalize(x: chex.Array, dtype: jnp.dtype = jnp.float32) -> chex.Array:
  """`x / sum(x)` over the last axis of non-negative `x`, computed in `dtype`.

  Entries are first scaled by a power of two near their maximum (`scale_down`),
  so a sum of counts near the dtype's maximum cannot overflow. A slice that
  sums to 0 gives zeros, never NaN.
  """
  x = scale_down(jnp.asarray(x, dtype), axis=-1)
  return _safe_divide(x, jnp.sum(x, axis=-1, keepdims=True))
