"""Data augmentation of image batches, in JAX (for use inside local training)."""

import chex
import jax
import jax.numpy as jnp


def translate(key: chex.PRNGKey, x: chex.Array) -> chex.Array:
  """A random translation (edge-padded shift) of every image of a batch `(B, H, W, C)`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from pflax.data import translate
    >>> translate(jax.random.key(0), jnp.ones((2, 8, 8, 1))).shape
    (2, 8, 8, 1)
  """
  if x.ndim != 4:
    raise ValueError(f"translate augments images of shape (B, H, W, C), got inputs of "
                     f"shape {x.shape} (FedClassAvg's two views are translations).")
  b, h, w, _ = x.shape
  pad = max(1, h // 8)
  padded = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="edge")
  offsets = jax.random.randint(key, (b, 2), 0, 2 * pad + 1)
  crop = lambda img, o: jax.lax.dynamic_slice(img, (o[0], o[1], 0),
                                              (h, w, img.shape[-1]))
  return jax.vmap(crop)(padded, offsets)
