"""Data augmentation of image batches, in JAX (for use inside local training)."""

from collections.abc import Callable

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


# ------------------------------------------------ the authors' SimCLR-style views
#
# FedClassAvg (Jang et al., ICPP 2022) perturbs x into x' and x'' (Eq. 4) without
# saying how; the authors' code (`supcon_utils.load_dataset`) draws SimCLR views:
# RandomResizedCrop(size, scale=(0.2, 1)), RandomHorizontalFlip(), ColorJitter(0.4,
# 0.4, 0.4, 0.1) with p = 0.8, RandomGrayscale(p = 0.2), Normalize. The functions
# below draw them in JAX, every random choice per sample from an explicit key.

SIMCLR_SCALE = (0.2, 1.0)
"""RandomResizedCrop's range of the crop's area, a fraction of the image's."""
SIMCLR_RATIO = (3 / 4, 4 / 3)
"""RandomResizedCrop's range of the crop's aspect ratio (width / height)."""
SIMCLR_JITTER = 0.4
"""ColorJitter's brightness, contrast and saturation strength."""
SIMCLR_JITTER_P = 0.8
"""The probability that a view is colour-jittered."""
SIMCLR_GRAYSCALE_P = 0.2
"""RandomGrayscale's probability (3-channel images only)."""


def _check_images(name: str, x: chex.Array) -> None:
  if x.ndim != 4:
    raise ValueError(f"{name} augments images of shape (B, H, W, C), got inputs of "
                     f"shape {x.shape}.")


def _crop_and_resize(img: chex.Array, top: chex.Array, left: chex.Array,
                     height: chex.Array, width: chex.Array) -> chex.Array:
  """The window `[top, top + height) x [left, left + width)` (pixel edges, floats) of
  one image `(H, W, C)`, bilinearly resized back to `(H, W, C)`."""
  h, w, c = img.shape
  scale = jnp.stack([h / height, w / width])
  translation = -jnp.stack([top, left]) * scale
  out = jax.image.scale_and_translate(img, (h, w, c), (0, 1), scale, translation,
                                      method="linear", antialias=False)
  return out.astype(img.dtype)


def random_resized_crop(key: chex.PRNGKey, x: chex.Array, *,
                        scale: tuple[float, float] = SIMCLR_SCALE,
                        ratio: tuple[float, float] = SIMCLR_RATIO) -> chex.Array:
  """RandomResizedCrop of every image of a batch `(B, H, W, C)`, back to `(H, W)`.

  Per image: the crop's area is `U(scale) * H * W`, its aspect ratio (width /
  height) log-uniform in `ratio`, its position uniform over the positions where it
  fits; the window is resized bilinearly (`jax.image.scale_and_translate`). Unlike
  torchvision, the window has real-valued size and position, and a window that
  does not fit (large area, extreme ratio) is clipped to the image instead of
  redrawn (torchvision: up to 10 draws, then a central crop). `scale=(1, 1)`,
  `ratio=(1, 1)` returns the batch unchanged. FedClassAvg's authors' views.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from pflax._src.data.augment import random_resized_crop
    >>> random_resized_crop(jax.random.key(0), jnp.ones((2, 8, 8, 1))).shape
    (2, 8, 8, 1)
  """
  _check_images("random_resized_crop", x)
  b, h, w, _ = x.shape
  k_area, k_ratio, k_top, k_left = jax.random.split(key, 4)
  area = jax.random.uniform(k_area, (b,), minval=scale[0], maxval=scale[1]) * h * w
  log_ratio = jax.random.uniform(k_ratio, (b,), minval=jnp.log(ratio[0]),
                                 maxval=jnp.log(ratio[1]))
  aspect = jnp.exp(log_ratio)
  width = jnp.clip(jnp.sqrt(area * aspect), 1.0, w)
  height = jnp.clip(jnp.sqrt(area / aspect), 1.0, h)
  top = jax.random.uniform(k_top, (b,)) * (h - height)
  left = jax.random.uniform(k_left, (b,)) * (w - width)
  return jax.vmap(_crop_and_resize)(x, top, left, height, width)


def horizontal_flip(key: chex.PRNGKey, x: chex.Array, p: float = 0.5) -> chex.Array:
  """Each image of a batch `(B, H, W, C)` mirrored left-right with probability `p`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from pflax._src.data.augment import horizontal_flip
    >>> x = jnp.arange(4.0).reshape(1, 1, 4, 1)
    >>> horizontal_flip(jax.random.key(0), x, p=1.0)[0, 0, :, 0]
    Array([3., 2., 1., 0.], dtype=float32)
  """
  _check_images("horizontal_flip", x)
  flip = jax.random.bernoulli(key, p, (x.shape[0], 1, 1, 1))
  return jnp.where(flip, x[:, :, ::-1], x)


def _gray(x: chex.Array) -> chex.Array:
  """`(B, H, W, 1)` luminance (ITU-R 601, torchvision's weights) of RGB images;
  a 1-channel image is its own."""
  if x.shape[-1] != 3:
    return x
  weights = jnp.asarray([0.299, 0.587, 0.114], x.dtype)
  return jnp.sum(x * weights, axis=-1, keepdims=True)


def _factor(key: chex.PRNGKey, b: int, strength: float) -> chex.Array:
  """`(B, 1, 1, 1)` jitter factors `U[max(0, 1 - s), 1 + s]` (torchvision's)."""
  return jax.random.uniform(key, (b, 1, 1, 1), minval=max(0.0, 1.0 - strength),
                            maxval=1.0 + strength)


def color_jitter(key: chex.PRNGKey, x: chex.Array, strength: float = SIMCLR_JITTER,
                 p: float = SIMCLR_JITTER_P) -> chex.Array:
  """ColorJitter(strength, strength, strength, hue=0) of each image of a batch
  `(B, H, W, C)`, applied with probability `p`.

  Brightness multiplies by `b ~ U[1 - s, 1 + s]`; contrast blends with the image's
  mean luminance, `c * x + (1 - c) * mean`; saturation (3 channels only) blends with
  the luminance image. Hue jitter (the authors' 0.1) is not done, and the order is
  fixed (brightness, contrast, saturation; torchvision permutes it at random).
  Values are clipped as torchvision clips to `[0, 1]`, widened per image to the
  image's own range when that is wider (inputs not in `[0, 1]` are not cut).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from pflax._src.data.augment import color_jitter
    >>> color_jitter(jax.random.key(0), jnp.ones((2, 8, 8, 3))).shape
    (2, 8, 8, 3)
  """
  _check_images("color_jitter", x)
  b = x.shape[0]
  k_apply, k_bright, k_contrast, k_sat = jax.random.split(key, 4)
  lo = jnp.minimum(jnp.min(x, axis=(1, 2, 3), keepdims=True), 0.0)
  hi = jnp.maximum(jnp.max(x, axis=(1, 2, 3), keepdims=True), 1.0)
  out = jnp.clip(x * _factor(k_bright, b, strength), lo, hi)
  mean = jnp.mean(_gray(out), axis=(1, 2, 3), keepdims=True)
  c = _factor(k_contrast, b, strength)
  out = jnp.clip(c * out + (1 - c) * mean, lo, hi)
  if x.shape[-1] == 3:
    s = _factor(k_sat, b, strength)
    out = jnp.clip(s * out + (1 - s) * _gray(out), lo, hi)
  apply = jax.random.bernoulli(k_apply, p, (b, 1, 1, 1))
  return jnp.where(apply, out, x).astype(x.dtype)


def random_grayscale(key: chex.PRNGKey, x: chex.Array,
                     p: float = SIMCLR_GRAYSCALE_P) -> chex.Array:
  """Each RGB image of a batch `(B, H, W, 3)` replaced by its luminance (on all three
  channels) with probability `p`; images with another channel count are returned
  unchanged (RandomGrayscale is a no-op on 1-channel images)."""
  _check_images("random_grayscale", x)
  if x.shape[-1] != 3:
    return x
  gray = jax.random.bernoulli(key, p, (x.shape[0], 1, 1, 1))
  return jnp.where(gray, jnp.broadcast_to(_gray(x), x.shape), x)


def simclr(key: chex.PRNGKey, x: chex.Array) -> chex.Array:
  """One SimCLR view of every image of a batch `(B, H, W, C)` (float, NHWC): the
  views FedClassAvg's authors train on (Jang et al., ICPP 2022, Eq. 4's `x'`,
  `x''`; their `supcon_utils.load_dataset`).

  RandomResizedCrop(scale (0.2, 1), ratio (3/4, 4/3), bilinear), horizontal flip
  (p = 0.5), brightness / contrast / saturation jitter 0.4 with p = 0.8
  (`color_jitter`: no hue jitter, fixed order), RandomGrayscale p = 0.2 (3-channel
  images only). The authors' final Normalize(0.5, 0.5) is not applied: pflax's
  models take images as loaded. Every random choice is per sample; jit- and
  vmap-able.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from pflax._src.data.augment import simclr
    >>> simclr(jax.random.key(0), jnp.ones((2, 28, 28, 1))).shape
    (2, 28, 28, 1)
  """
  _check_images("simclr", x)
  k_crop, k_flip, k_jitter, k_gray = jax.random.split(key, 4)
  out = random_resized_crop(k_crop, x)
  out = horizontal_flip(k_flip, out)
  out = color_jitter(k_jitter, out)
  return random_grayscale(k_gray, out)


def identity(key: chex.PRNGKey, x: chex.Array) -> chex.Array:
  """No augmentation: the batch itself (`key` unused)."""
  del key
  return x


VIEWS: dict[str, Callable[[chex.PRNGKey, chex.Array], chex.Array]] = {
    "translate": translate, "simclr": simclr, "none": identity}
"""The `augment=` choices of FedClassAvg and Local training: `view(key, x) -> x'`."""


def view_fn(augment: str, where: str = "augment"
            ) -> Callable[[chex.PRNGKey, chex.Array], chex.Array]:
  """The view function named `augment` (a key of `VIEWS`); ValueError otherwise,
  naming the argument `where`."""
  if not isinstance(augment, str) or augment not in VIEWS:
    raise ValueError(f"{where} must be one of {', '.join(map(repr, VIEWS))}, got "
                     f"{augment!r}.")
  return VIEWS[augment]
