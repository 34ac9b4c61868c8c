"""Small Flax models split into a feature extractor and a classifier head.

Every model has exactly two child modules, ``features`` and ``classifier``, so
its parameters look like::

  {'features': {...},
   'classifier': {'hidden_0': {...}, ..., 'output': {'kernel', 'bias'}}}

Algorithms select layers by path: FedReMa treats every fully connected layer
after the convolutions as the classifier (``classifier``); cwFedAvg "Output"
and FedClassAvg treat only the last Dense layer as the classifier
(``classifier/output``), and FedClassAvg's contrastive loss acts on the
last hidden layer's linear output, before the ReLU that precedes ``output``
(:meth:`CNN.representation`, the authors' ``fcin``).

Parameters are plain pytrees: algorithms hold ``model.apply`` and parameters,
never module objects.
"""

from collections.abc import Callable, Sequence

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from pflax._src.core import types


class Head(nn.Module):
  """Classifier head: hidden ``Dense`` + ReLU layers, then ``Dense(K)``.

  .. math::
    z_0 = h, \\quad z_{i+1} = \\mathrm{relu}(W_i z_i + b_i), \\quad
    \\text{logits} = W_{\\text{out}} z_L + b_{\\text{out}}

  Layers are named ``hidden_0, hidden_1, ...`` and ``output``.

  Attributes:
    num_classes: number of classes ``K``.
    hidden: widths of the hidden layers; the last one (or the input width when
      empty) is the representation width ``D`` seen by ``output``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> head = Head(num_classes=10, hidden=(32,))
    >>> params = head.init(jax.random.key(0), jnp.ones((2, 64)))['params']
    >>> sorted(params)
    ['hidden_0', 'output']
  """

  num_classes: int
  hidden: Sequence[int] = ()

  def setup(self):
    self.layers = [
        nn.Dense(width, name=f"hidden_{i}") for i, width in enumerate(self.hidden)
    ]
    self.output = nn.Dense(self.num_classes)

  def representation(self, h: chex.Array) -> chex.Array:
    """Returns the last hidden layer's linear output ``(B, D)``, before its ReLU.

    This is FedClassAvg's contrastive representation: in the authors' code the
    feature extractor ends with a linear layer ``fcin`` and the classifier is
    ReLU + ``fcout``, so the supervised contrastive loss sees ``fcin``'s
    output. With no hidden layer it is ``h`` itself.
    """
    for layer in self.layers[:-1]:
      h = nn.relu(layer(h))
    return self.layers[-1](h) if self.layers else h

  def embed(self, h: chex.Array) -> chex.Array:
    """Returns the representation ``(B, D)`` fed to ``output``."""
    z = self.representation(h)
    return nn.relu(z) if self.layers else z

  def __call__(self, h: chex.Array) -> chex.Array:
    """Returns logits ``(B, K)`` for features ``h`` of shape ``(B, F)``."""
    return self.output(self.embed(h))


def max_pool_2x2(x: chex.Array) -> chex.Array:
  """2x2 max-pooling with stride 2 and VALID padding of NHWC inputs.

  .. math::
    y_{b,i,j,c} = \\max_{p, q \\in \\{0, 1\\}} x_{b, 2i+p, 2j+q, c},
    \\quad 0 \\le i < \\lfloor H/2 \\rfloor, \\ 0 \\le j < \\lfloor W/2 \\rfloor

  The same values as ``nn.max_pool(x, (2, 2), strides=(2, 2))``, computed as
  elementwise maxima of a reshape (an odd last row or column is dropped).

  Args:
    x: inputs of shape ``(B, H, W, C)``.

  Returns:
    The pooled array of shape ``(B, H // 2, W // 2, C)``.

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
    >>> max_pool_2x2(x)[0, ..., 0]
    Array([[ 5.,  7.],
           [13., 15.]], dtype=float32)

  Notes:
    On XLA-CPU the gradient of ``nn.max_pool`` (``select_and_scatter``,
    expanded into iotas, a variadic reduce-window and a scatter) took 55-60%
    of a FedAvg CNN training step; the gradient of this version is
    elementwise selects, and a CNN client epoch runs about 1.5x faster.
    Gradients agree with ``nn.max_pool`` except where a window holds tied
    maxima: ``jnp.maximum`` splits the gradient between them,
    ``nn.max_pool`` gives it to one. After a ReLU, ties at zero do not
    matter: the ReLU's gradient there is zero.
  """
  b, h, w, c = x.shape
  x = x[:, : h - h % 2, : w - w % 2].reshape(b, h // 2, 2, w // 2, 2 * c)
  x = jnp.maximum(x[:, :, 0], x[:, :, 1])
  return jnp.maximum(x[..., :c], x[..., c:])


class ConvFeatures(nn.Module):
  """Convolution + ReLU + 2x2 max-pool (:func:`max_pool_2x2`) blocks, then flatten.

  Attributes:
    channels: output channels of each convolution (one pooling per conv).
    kernel_size: square kernel size.
    padding: ``"VALID"`` or ``"SAME"`` convolution padding.
  """

  channels: Sequence[int] = (32, 64)
  kernel_size: int = 5
  padding: str = "VALID"

  @nn.compact
  def __call__(self, x: chex.Array) -> chex.Array:
    """Maps NHWC images ``(B, H, W, C)`` to flat features ``(B, F)``."""
    for i, width in enumerate(self.channels):
      x = nn.Conv(
          width,
          (self.kernel_size, self.kernel_size),
          padding=self.padding,
          name=f"conv_{i}",
      )(x)
      x = max_pool_2x2(nn.relu(x))
    return x.reshape(x.shape[0], -1)


class DenseFeatures(nn.Module):
  """Flatten, then ``Dense`` + ReLU layers named ``dense_0, dense_1, ...``.

  Attributes:
    widths: widths of the dense layers.
  """

  widths: Sequence[int] = (200,)

  @nn.compact
  def __call__(self, x: chex.Array) -> chex.Array:
    """Maps inputs ``(B, ...)`` to features ``(B, F)``."""
    x = x.reshape(x.shape[0], -1)
    for i, width in enumerate(self.widths):
      x = nn.relu(nn.Dense(width, name=f"dense_{i}")(x))
    return x


class SplitModel(nn.Module):
  """Base class: ``logits = classifier(features(x))``.

  Subclasses are dataclasses defining ``feature_extractor()`` and ``head()``,
  both decorated with ``nn.nowrap`` and returning fresh unbound modules.
  """

  def setup(self):
    self.features = self.feature_extractor()
    self.classifier = self.head()

  @nn.nowrap
  def feature_extractor(self) -> nn.Module:
    """Returns an unbound feature extractor module."""
    raise NotImplementedError

  @nn.nowrap
  def head(self) -> Head:
    """Returns an unbound :class:`Head`; apply it with ``params['classifier']``."""
    raise NotImplementedError

  def __call__(self, x: chex.Array) -> chex.Array:
    """Returns logits ``(B, K)``."""
    return self.classifier(self.features(x))

  def extract(self, x: chex.Array) -> chex.Array:
    """Returns the features ``h`` of shape ``(B, F)`` fed to the classifier."""
    return self.features(x)

  def embed(self, x: chex.Array) -> chex.Array:
    """Returns the representation ``(B, D)`` fed to ``classifier/output``."""
    return self.classifier.embed(self.features(x))

  def representation(self, x: chex.Array) -> chex.Array:
    """Returns the pre-ReLU representation ``(B, D)`` (:meth:`Head.representation`)."""
    return self.classifier.representation(self.features(x))


class CNN(SplitModel):
  """The FedAvg CNN: ``[conv + ReLU + max-pool] x 2``, ``Dense 512``, ``Dense K``.

  ``features`` is the convolutions plus flatten; ``classifier`` is
  ``hidden_0 = Dense(hidden)`` + ReLU and ``output = Dense(num_classes)``.
  With the defaults it has 878,538 parameters on 32x32x3 inputs with K=10, and
  582,026 on 28x28x1 inputs.

  Attributes:
    num_classes: number of classes ``K``.
    channels: output channels of each convolution; each is followed by ReLU
      and 2x2 max-pooling.
    hidden: width ``D`` of the classifier's hidden layer.
    kernel_size: square convolution kernel size.
    padding: ``"VALID"`` (the reference model) or ``"SAME"`` (for images too
      small for VALID, e.g. 8x8 digits).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> model = CNN(num_classes=10)
    >>> x = jnp.zeros((4, 28, 28, 1))
    >>> params = model.init(jax.random.key(0), x)['params']
    >>> model.apply({'params': params}, x).shape
    (4, 10)

  References:
    McMahan et al., `Communication-Efficient Learning of Deep Networks from
    Decentralized Data <https://arxiv.org/abs/1602.05629>`_, AISTATS 2017
    (Sec. 3, "CNN"); the 4-layer model of cwFedAvg and FedDWA, as
    ``FedAvgCNN`` in PFLlib (``system/flcore/trainmodel/models.py``).

  Notes:
    Inputs are NHWC, so the flattened features are ordered (H, W, C) rather
    than PyTorch's (C, H, W), and Flax's default initialisers (LeCun normal
    kernels, zero biases) replace PyTorch's; parameter counts are identical.
  """

  num_classes: int
  channels: Sequence[int] = (32, 64)
  hidden: int = 512
  kernel_size: int = 5
  padding: str = "VALID"

  @nn.nowrap
  def feature_extractor(self) -> ConvFeatures:
    return ConvFeatures(self.channels, self.kernel_size, self.padding)

  @nn.nowrap
  def head(self) -> Head:
    return Head(self.num_classes, (self.hidden,))


class MLP(SplitModel):
  """Fully connected network, e.g. 784-200-200-10 (the FedAvg "2NN").

  ``features`` is flatten + ``dense_0 = Dense(hidden[0])`` + ReLU;
  ``classifier`` is ``Head(num_classes, hidden[1:])``. With 784 inputs and
  the defaults it has 199,210 parameters.

  Attributes:
    num_classes: number of classes ``K``.
    hidden: widths of the hidden layers (at least one); the last is the
      representation width ``D``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> model = MLP(num_classes=10)
    >>> x = jnp.zeros((4, 28, 28, 1))
    >>> params = model.init(jax.random.key(0), x)['params']
    >>> model.apply({'params': params}, x, method='embed').shape
    (4, 200)

  References:
    McMahan et al., `Communication-Efficient Learning of Deep Networks from
    Decentralized Data <https://arxiv.org/abs/1602.05629>`_, AISTATS 2017
    (Sec. 3, "2NN").
  """

  num_classes: int
  hidden: Sequence[int] = (200, 200)

  @nn.nowrap
  def feature_extractor(self) -> DenseFeatures:
    return DenseFeatures(self.hidden[:1])

  @nn.nowrap
  def head(self) -> Head:
    return Head(self.num_classes, tuple(self.hidden[1:]))


def heterogeneous_family(
    num_classes: int, representation_dim: int = 512
) -> tuple[nn.Module, ...]:
  """Architectures with different feature extractors and one shared ``output``.

  Each member maps its own features through ``classifier/hidden_0`` to a
  representation of width ``D = representation_dim``, so
  ``params['classifier']['output']`` has shape ``(D, K)`` / ``(K,)`` in every
  member while all other parameters differ. Members, all using SAME padding
  (so they also fit 8x8 inputs):

  * small: 2 convs 3x3 with 16, 32 channels;
  * wide: 2 convs 3x3 with 64, 64 channels;
  * deep: 3 convs 3x3 with 32, 64, 128 channels;
  * mlp: one dense layer of width 256.

  Assign them to clients cyclically, e.g. ``family[i % len(family)]``. All
  convolutions are 3x3: on XLA-CPU a 5x5 SAME convolution over a 4x4 map is
  about 50x slower than a 3x3 one.

  Args:
    num_classes: number of classes ``K``.
    representation_dim: shared representation width ``D``.

  Returns:
    A tuple of four unbound models.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> x = jnp.zeros((1, 28, 28, 1))
    >>> shapes = [
    ...     jax.eval_shape(m.init, jax.random.key(0), x)['params']['classifier']
    ...     ['output']['kernel'].shape for m in heterogeneous_family(10)]
    >>> shapes
    [(512, 10), (512, 10), (512, 10), (512, 10)]

  References:
    Jang et al., `FedClassAvg: Local Representation Learning for Personalized
    Federated Learning on Heterogeneous Neural Networks
    <https://arxiv.org/abs/2210.14226>`_, ICPP 2022 (Sec. 3, only the
    classifier is shared across heterogeneous clients).

  Notes:
    The paper uses ResNet-18, ShuffleNetV2, GoogLeNet and AlexNet; pflax uses
    small CPU-friendly networks with the same property.
  """
  d = representation_dim
  return (
      CNN(num_classes, channels=(16, 32), hidden=d, kernel_size=3,
          padding="SAME"),
      CNN(num_classes, channels=(64, 64), hidden=d, kernel_size=3,
          padding="SAME"),
      CNN(num_classes, channels=(32, 64, 128), hidden=d, kernel_size=3,
          padding="SAME"),
      MLP(num_classes, hidden=(256, d)),
  )


def mlp_family(
    num_classes: int, representation_dim: int = 512
) -> tuple[nn.Module, ...]:
  """Four fully connected networks of different depths and widths, one ``output``.

  The CPU-sized counterpart of :func:`heterogeneous_family`: like it, every
  member ends in ``classifier/hidden_*`` of width ``D = representation_dim``
  and a shared ``classifier/output`` of shape ``(D, K)``, and nothing else
  matches across members. Members (hidden widths, the last is ``D``):

  * narrow: 128, D;
  * wide: 1024, D;
  * deep: 256, 256, D;
  * deeper: 128, 256, 256, D.

  Args:
    num_classes: number of classes ``K``.
    representation_dim: shared representation width ``D``.

  Returns:
    A tuple of four unbound :class:`MLP` models.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> x = jnp.zeros((1, 28, 28, 1))
    >>> [len(jax.eval_shape(m.init, jax.random.key(0), x)['params']['classifier'])
    ...  for m in mlp_family(10)]
    [2, 2, 3, 4]

  Notes:
    On 2 CPU cores a FedClassAvg round of 20 clients with this family
    compiles and runs in seconds, where the convolutional family takes
    minutes (XLA-CPU's convolutions); it keeps the property FedClassAvg's
    heterogeneous setting tests (only the classifier's output layer can be
    shared), not the paper's architectures.
  """
  d = representation_dim
  return (
      MLP(num_classes, hidden=(128, d)),
      MLP(num_classes, hidden=(1024, d)),
      MLP(num_classes, hidden=(256, 256, d)),
      MLP(num_classes, hidden=(128, 256, 256, d)),
  )


FAMILIES: dict[str, Callable[..., tuple[nn.Module, ...]]] = {
    "cnn": heterogeneous_family, "mlp": mlp_family}
"""Architecture families of heterogeneous clients, by name (`ExperimentConfig.family`)."""


def feature_dim(model: nn.Module, input_shape: Sequence[int]) -> int:
  """Returns the feature width ``F`` of ``model.extract`` for one input.

  Computed abstractly with ``jax.eval_shape`` (no FLOPs, no parameters).

  Args:
    model: a model with an ``extract`` method, e.g. :class:`CNN`.
    input_shape: shape of one example, without the batch axis, e.g.
      ``(28, 28, 1)``.

  Returns:
    ``F``, e.g. 1024 for the default :class:`CNN` on 28x28x1 inputs.

  Example:
    >>> feature_dim(CNN(10, padding="SAME"), (8, 8, 1))
    256
  """
  x = jax.ShapeDtypeStruct((1, *input_shape), jnp.float32)
  h, _ = jax.eval_shape(
      lambda x: model.init_with_output(jax.random.key(0), x, method="extract"),
      x,
  )
  return h.shape[-1]


def init_stacked(
    model: nn.Module,
    key: chex.PRNGKey,
    sample_input: chex.Array,
    num_clients: int,
    same_init: bool = False,
) -> types.Stacked:
  """Initialises ``num_clients`` parameter sets stacked on a leading axis.

  Every leaf gets shape ``(M, *leaf_shape)`` with ``M = num_clients``. Client
  ``m`` is initialised with ``jax.random.split(key, M)[m]`` (the same values as
  ``jax.vmap`` over the split keys), or, with ``same_init=True``, every client
  gets ``model.init(key, ...)`` (the usual FL start where the server
  broadcasts one initial model).

  Args:
    model: an unbound Flax model.
    key: PRNG key.
    sample_input: a batch of inputs for shape inference, e.g. ``(1, H, W, C)``.
    num_clients: number of clients ``M``.
    same_init: whether all clients start from the same parameters.

  Returns:
    The stacked ``params`` pytree (plain dicts, without the ``'params'``
    collection wrapper).

  Raises:
    ValueError: if ``num_clients < 1``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> params = init_stacked(MLP(10), jax.random.key(0),
    ...                       jnp.zeros((1, 784)), num_clients=5)
    >>> params['classifier']['output']['kernel'].shape
    (5, 200, 10)

  Notes:
    Clients are initialised by a Python loop over one jitted ``model.init``
    and then stacked, rather than by ``jax.vmap``: on XLA-CPU, compiling the
    client-batched PRNG sampling took about twice as long (FedAvg CNN, 20
    clients), and initialisation runs once.
  """
  if num_clients < 1:
    raise ValueError(f"init_stacked: num_clients must be >= 1, got {num_clients}.")
  init = jax.jit(model.init)
  if same_init:
    params = init(key, sample_input)["params"]
    return jax.tree.map(
        lambda p: jnp.broadcast_to(p, (num_clients, *p.shape)), params
    )
  clients = [
      init(k, sample_input)["params"]
      for k in jax.random.split(key, num_clients)
  ]
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *clients)


def _fits_valid_cnn(model: CNN, input_shape: Sequence[int]) -> bool:
  """Whether every VALID conv and pooling of ``model`` leaves a spatial size >= 1."""
  size = min(input_shape[:2])
  for _ in model.channels:
    size = (size - model.kernel_size + 1) // 2
    if size < 1:
      return False
  return True


def get_model(
    name: str, num_classes: int, input_shape: Sequence[int]
) -> nn.Module:
  """Returns a model by name, adapted to the input shape.

  Args:
    name: ``"cnn"`` (:class:`CNN`; the paper's 5x5 VALID convolutions when
      the image is large enough, otherwise 3x3 SAME convolutions, e.g. for
      8x8 digits: on XLA-CPU a 5x5 SAME convolution over a 4x4 map measured
      13.6 ms against 0.25 ms for 3x3, a 50x slower training step) or
      ``"mlp"``
      (:class:`MLP`).
    num_classes: number of classes ``K``.
    input_shape: shape of one example without the batch axis, ``(H, W, C)``.

  Returns:
    An unbound Flax model.

  Raises:
    ValueError: if ``name`` is unknown.

  Example:
    >>> get_model("cnn", 10, (8, 8, 1)).padding
    'SAME'
  """
  if name == "cnn":
    model = CNN(num_classes)
    if _fits_valid_cnn(model, input_shape):
      return model
    return CNN(num_classes, kernel_size=3, padding="SAME")
  if name == "mlp":
    return MLP(num_classes)
  raise ValueError(f"get_model: unknown name {name!r}; expected 'cnn' or 'mlp'.")
