"""pflax's PRNG key implementation: classic threefry, whatever JAX's flags say.

Every random choice of a simulation (partition aside, which NumPy draws from
the seed) comes from a key made by `key(seed)`. Its implementation is fixed
here rather than read from the global `jax_threefry_partitionable` flag, so
`pflax-run` and `pflax.simulate` in any process draw the same numbers from the
same seed.

The implementation is JAX's threefry-2x32 in its classic (non-partitionable)
form: `split` hashes the counters `0 .. 2n-1` and `random_bits` the counters
`0 .. ceil(bits * size / 32) - 1`. It is bitwise equal to
`jax.random.PRNGKey` with `jax_threefry_partitionable=False`, and it compiles
fast on XLA-CPU, where the partitionable form of random bits of
multi-dimensional shapes took ~10 s per shape to compile (jax 0.10).
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import random as jax_random

_UINT = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}


def _split(key: chex.Array, shape: tuple[int, ...]) -> chex.Array:
  counts = jax.lax.iota(np.uint32, math.prod(shape) * 2)
  return jax_random.threefry_2x32(key, counts).reshape((*shape, 2))


def _random_bits(key: chex.Array, bit_width: int, shape: tuple[int, ...]
                 ) -> chex.Array:
  """`bit_width`-bit words from `ceil(bit_width * size / 32)` hashed counters."""
  size = math.prod(shape)
  words = -(-bit_width * size // 32)
  if words >= np.iinfo(np.uint32).max:
    raise NotImplementedError(f"random bits of {size} elements of {bit_width} bits.")
  bits = jax_random.threefry_2x32(key, jax.lax.iota(np.uint32, words))
  dtype = _UINT[bit_width]
  if bit_width == 64:
    high, low = (x.astype(dtype) for x in jnp.split(bits, 2))
    bits = jax.lax.shift_left(high, jnp.asarray(32, dtype)) | low
  elif bit_width < 32:
    per_word = 32 // bit_width
    shifts = np.uint32(bit_width) * jax.lax.iota(np.uint32, per_word)
    parts = jax.lax.shift_right_logical(bits[:, None], shifts[None, :])
    bits = (parts & np.uint32(np.iinfo(dtype).max)).reshape(-1).astype(dtype)[:size]
  return bits.reshape(shape)


IMPL = jax_random.define_prng_impl(
    key_shape=(2,), seed=jax_random.threefry_prng_impl.seed, split=_split,
    random_bits=_random_bits, fold_in=jax_random.threefry_prng_impl.fold_in,
    name="pflax_threefry2x32", tag="pfx")
"""Classic threefry-2x32 (see the module docstring)."""


def key(seed: int | chex.Array) -> chex.PRNGKey:
  """A typed PRNG key of pflax's implementation (`IMPL`) from an integer seed.

  Example:
    >>> import jax
    >>> from pflax._src.core import prng
    >>> k = prng.key(0)
    >>> jax.random.uniform(k).dtype
    dtype('float32')
  """
  return jax.random.key(seed, impl=IMPL)
