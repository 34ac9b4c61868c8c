"""An experiment: its configuration, its data, its algorithm built from a name, and
the checks that refuse a misconfigured one before anything is compiled.

`ExperimentConfig` holds the settings; `prepare` turns one seed of it into a
`Setup` (a federation and a checked model); `build_algorithm` and `plan` build
the algorithm (by name, `"module:builder"`, or a builder) and the engine's plan;
the `check_*` functions validate a configuration at the boundary. The runner
(`pflax._src.simulation.simulate`), the tuner, Flower and the CLI read them.
"""

import dataclasses
import difflib
import functools
import importlib
import inspect
import math
import types
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from pflax._src.core import prng
from pflax._src.core import tree as tree_lib
from pflax._src.core import types as core_types
from pflax._src.data import arrays as arrays_lib
from pflax._src.data import datasets
from pflax._src.data import dirichlet as dirichlet_lib
from pflax._src.data import federation as federation_lib
from pflax._src.data import groups as label_groups_lib
from pflax._src.data import partition as partition_lib
from pflax._src.data import pathological as pathological_lib
from pflax._src.methods import algorithm as alg
from pflax._src.methods import heterogeneous as heterogeneous_lib
from pflax._src.methods import privacy as privacy_lib
from pflax._src.methods import registry
from pflax._src.simulation import engine
from pflax._src.simulation import faults as faults_lib
from pflax._src.simulation import groups as groups_lib
from pflax._src.simulation import keys as keys_lib
from pflax._src.training import adapters
from pflax._src.training import models
from pflax._src.training import parts as parts_lib
from pflax._src.training import train as train_lib

PARTITIONS = ("pathological", "dirichlet", "groups")
TEST_SPLITS = ("clients", "dataset")
"""Where the clients' test data come from (`ExperimentConfig.test_split`)."""
HEAD_SHARING = registry.HEAD_SHARING
"""pflax's algorithms whose server step and client context read only the output
layer, so `heterogeneous=True` can wrap them (`pflax.algorithms.heterogeneous`)."""
MODELS = ("auto", "cnn", "mlp")
"""`ExperimentConfig.model`: pflax's models by name (`pflax.models.get_model`)."""
STRATEGIES = ("auto", "vmap", "loop", "map")
"""`ExperimentConfig.strategy`: how clients are mapped (`pflax.train`)."""
OPTIMIZER_FIELDS = ("optimizer", "lr", "momentum", "adam_b1", "grad_clip")
"""The fields of the clients' optimizer in `ExperimentConfig` (and its overrides)."""
PARTITION_FIELDS = ("partition", "classes_per_client", "dirichlet_alpha",
                    "iid_fraction", "samples_per_client")
"""The fields of `ExperimentConfig` that only shape the clients' partition (read
where the data are partitioned and nowhere else): runs of configurations that
differ in these alone share one sweep (`pflax.simulate.sweep_settings`)."""
MAX_LR = 1e3
"""The largest learning rate (or `grad_clip`) a run accepts: a larger one diverges."""
MAX_COUNT = 10**6
"""The largest `clients`, `rounds`, `local_epochs`, `batch_size` or `eval_every`."""
MAX_MAGNITUDE = 1e6
"""The largest magnitude of a builder's numeric hyperparameter and of
`dirichlet_alpha`; `fault_scale` may reach `MAX_FAULT_SCALE`."""
MAX_FAULT_SCALE = 1e30
"""The largest magnitude of `fault_scale` (1e30 is the default of "scaled")."""


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything that defines an experiment, as plain values.

  Attributes:
    dataset, data_dir: the dataset (`pflax.data.load`).
    partition: "pathological" (`classes_per_client`), "dirichlet"
      (`dirichlet_alpha`) or "groups" (`iid_fraction`, FedReMa's s).
    samples_per_client: S, each client's samples (None: all it is dealt).
      "groups" draws exactly S per client, with exact class quotas; the other
      partitions keep a random subset of `min(n_i, S)` of each client's
      samples (NumPy, seeded by `(seed, 1)`). With `test_split` "clients" S
      counts training and test samples (FedReMa: 600 split 4:1), with
      "dataset" training samples only.
    test_fraction: each client's share of test samples, per class, in (0, 1)
      (`pflax.data.train_test_split`): 0.25, the papers' 75/25; FedReMa's 4:1
      is 0.2. Unused with `test_split` "dataset".
    test_split: "clients" (the papers' protocol): the dataset's train and test
      splits pooled (`pflax.data.pooled`), partitioned, and each client's
      data split by `test_fraction`; "dataset": the train split partitioned
      and each client tested on the dataset's own test split, dealt with its
      class mix (`pflax.data.federate(..., test=...)`).
    clients, participation: M and the fraction p of clients per round:
      `max(1, round(p M))` take part (a warning when that is more than 10%
      from p M, `participation_warning`).
    faulty_clients: fraction of each round's participants that are faulty
      (for "inflated_counts": of all clients, the same ones all run).
    fault_kind: what faulty clients do (`pflax._src.simulation.faults.FAULT_KINDS`):
      "nan" uploads NaN; "scaled" uploads `start + s (trained - start)`;
      "inflated_counts" declares its class counts times s at registration
      (its uploads are honest); the attacks "sign_flip", "gaussian", "alie"
      and "ipm" (`faults.attack_updates`, docs/robustness.md).
    fault_scale: s (None: `faults.DEFAULT_FAULT_SCALES`).
    outlier_factor: the server drops a participant whose update norm exceeds
      this many times the round's median (docs/methods.md#simulation); None
      or 0 disables the test.
    rounds, eval_every: rounds, and evaluation every this many rounds (and
      after the last).
    model: "auto" (the CNN for images of 16+ pixels, else the MLP), "cnn",
      "mlp".
    heterogeneous: clients use four architectures sharing the output layer
      (`pflax.algorithms.heterogeneous`).
    family: the architectures of heterogeneous clients
      (`pflax.models.FAMILIES`): "cnn" (`heterogeneous_family`: three CNNs
      and an MLP) or "mlp" (`mlp_family`: four MLPs, CPU-sized).
    strategy: how clients are mapped in local training (`pflax.train`).
    precision: local training's compute precision: "float32" or "bf16"
      (bfloat16 activations and matmuls, float32 parameters and optimizer
      state; `pflax.train.with_precision`). Evaluation runs in float32.
    local_epochs, batch_size: local training, shared by all algorithms.
    optimizer, lr, momentum, adam_b1, grad_clip: the clients' optimizer
      ("sgd" or "adam"), shared by all algorithms except as overridden.
    optimizers: per algorithm, overrides of the optimizer fields; by default
      the methods' own (`pflax.algorithms.Method.optimizer`): FedClassAvg
      trains with Adam (its authors' optimizer, betas (0.5, 0.999), lr 1e-3):
      its supervised contrastive loss at temperature 100 on unnormalised
      features diverged under the common SGD base (9.8% accuracy on digits,
      against 99.8% with Adam).
    hyperparameters: per algorithm, keyword arguments of its builder (the
      others keep the builder's defaults). Keys of `optimizers` and
      `hyperparameters` name algorithms (`check_algorithm_keys`).
    dp_clip, dp_noise_multiplier: client-level DP (docs/privacy.md) when
      `dp_clip` (C) is set: clients sampled by Poisson at rate
      `participation` (q), the uploads privatized by `pflax.privacy.private`
      with noise multiplier z, the outlier rule off.
    dp_epsilon, dp_delta: the privacy budget (eps, delta) of `pflax-run`, which
      calibrates `dp_noise_multiplier` to it, or stops at it.

  A configuration checks itself: `ExperimentConfig(...)`, `dataclasses.replace`
  and one loaded from JSON (a results.json, `pflax.flower.Experiment.from_json`)
  raise ValueError naming the first field out of its range, the range and the
  value. What needs the data or the algorithm is checked where a run has them.

  >>> ExperimentConfig(clients=0)
  Traceback (most recent call last):
  ValueError: clients must be >= 1, got 0.
  """
  dataset: str = "digits"
  data_dir: str | None = None
  partition: str = "pathological"
  clients: int = 20
  classes_per_client: int = 2
  dirichlet_alpha: float = 0.1
  iid_fraction: float = 0.2
  samples_per_client: int | None = None
  test_fraction: float = 0.25
  test_split: str = "clients"
  participation: float = 1.0
  faulty_clients: float = 0.0
  fault_kind: str = "nan"
  fault_scale: float | None = None
  outlier_factor: float | None = faults_lib.OUTLIER_FACTOR
  rounds: int = 40
  eval_every: int = 1
  model: str = "auto"
  heterogeneous: bool = False
  family: str = "cnn"
  strategy: str = "auto"
  precision: str = "float32"
  local_epochs: int = 5
  batch_size: int = 10
  optimizer: str = "sgd"
  lr: float = 0.05
  momentum: float = 0.0
  adam_b1: float = 0.9
  grad_clip: float | None = None
  optimizers: Mapping[str, Mapping[str, Any]] = dataclasses.field(
      default_factory=registry.default_optimizers)
  hyperparameters: Mapping[str, Mapping[str, Any]] = dataclasses.field(
      default_factory=dict)
  dp_clip: float | None = None
  dp_noise_multiplier: float | None = None
  dp_epsilon: float | None = None
  dp_delta: float = 1e-5

  def __post_init__(self):
    """Raises ValueError naming the first field out of its range, the range and
    the value (the fields alone: `check_data` and `check_algorithm` need the data
    and the algorithm)."""
    def require(ok, field, expected):
      if not ok:
        raise ValueError(f"{field} must be {expected}, got {getattr(self, field)!r}.")
    for field in dataclasses.fields(self):
      kind = _field_kind(field.type)
      if kind is not None:
        require(_of_kind(getattr(self, field.name), kind), field.name, kind)
    for field in ("clients", "rounds", "eval_every", "local_epochs", "batch_size"):
      require(getattr(self, field) <= MAX_COUNT, field, f"at most {MAX_COUNT}")
    require(self.clients >= 1, "clients", ">= 1")
    require(self.classes_per_client >= 1, "classes_per_client", ">= 1")
    require(0 < self.dirichlet_alpha <= MAX_MAGNITUDE, "dirichlet_alpha",
            f"a finite number in (0, {MAX_MAGNITUDE:g}]")
    require(0.0 <= self.iid_fraction <= 1.0, "iid_fraction", "in [0, 1]")
    require(self.samples_per_client is None or self.samples_per_client >= 1,
            "samples_per_client", "None or >= 1")
    require(0.0 < self.test_fraction < 1.0, "test_fraction", "in (0, 1)")
    require(self.test_split in TEST_SPLITS, "test_split", f"one of {TEST_SPLITS}")
    require(0.0 < self.participation <= 1.0, "participation", "in (0, 1]")
    require(self.dp_clip is None or self.dp_clip > 0, "dp_clip", "> 0")
    require(self.dp_noise_multiplier is None or self.dp_noise_multiplier >= 0,
            "dp_noise_multiplier", ">= 0")
    require(self.dp_epsilon is None or self.dp_epsilon > 0, "dp_epsilon", "> 0")
    require(0 < self.dp_delta < 1, "dp_delta", "in (0, 1)")
    require(not (self.dp_clip and self.faulty_clients), "faulty_clients",
            "0 under client-level DP (dp_clip)")
    require(not (self.dp_clip and self.heterogeneous), "heterogeneous",
            "False under client-level DP (dp_clip)")
    require(0.0 <= self.faulty_clients < 1.0, "faulty_clients", "a fraction in [0, 1)")
    require(self.fault_kind in faults_lib.FAULT_KINDS, "fault_kind",
            f"one of {faults_lib.FAULT_KINDS}")
    require(self.fault_scale is None
            or 0 < abs(self.fault_scale) <= MAX_FAULT_SCALE, "fault_scale",
            f"None or a non-zero number of magnitude at most {MAX_FAULT_SCALE:g}")
    require(self.fault_scale is None or self.fault_kind != "inflated_counts"
            or self.fault_scale > 0, "fault_scale", '> 0 for "inflated_counts"')
    require(not self.outlier_factor or 1 < self.outlier_factor <= MAX_MAGNITUDE,
            "outlier_factor", f"None, 0 or in (1, {MAX_MAGNITUDE:g}]")
    require(self.family in models.FAMILIES, "family",
            f"one of {tuple(models.FAMILIES)}")
    require(self.heterogeneous or self.family == "cnn", "family",
            '"cnn" (the default) unless heterogeneous=True: it names the '
            "heterogeneous clients' architectures")
    require(self.model in MODELS, "model", f"one of {MODELS}")
    require(self.strategy in STRATEGIES, "strategy", f"one of {STRATEGIES}")
    require(self.rounds >= 1, "rounds", ">= 1")
    require(self.eval_every >= 1, "eval_every", ">= 1")
    require(self.local_epochs >= 1, "local_epochs", ">= 1")
    require(self.precision in train_lib.PRECISIONS, "precision",
            f"one of {train_lib.PRECISIONS}")
    require(self.batch_size >= 1, "batch_size", ">= 1")
    require(self.lr > 0 and math.isfinite(self.lr), "lr", "a finite number > 0")
    require(self.data_dir is None or self.data_dir, "data_dir", "None or a folder")
    client_optimizer(**{f: getattr(self, f) for f in OPTIMIZER_FIELDS})


Family = tuple[tuple[Any, parts_lib.Parts], ...]
"""A family of architectures of your own (`heterogeneous=True`): each adapted
model with its parts."""


def _head(model: Any, where: core_types.Selector, input_shape: tuple[int, ...]
          ) -> dict[str, tuple[int, ...]]:
  """`{path: shape}` of the parameters of `model` that `where` selects."""
  x = jax.ShapeDtypeStruct((1, *input_shape), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  return {"/".join(tree_lib.path_names(path)): tuple(leaf.shape) for path, leaf
          in jax.tree_util.tree_leaves_with_path(tree_lib.selected(params, where))}


def _family(members: Sequence[Any], parts: Any, input_shape: tuple[int, ...],
            num_classes: int) -> Family:
  """Each member of a family, adapted, with its checked parts.

  Raises:
    ValueError: for an empty family, a list of parts of another length, or
      members whose output layers differ in path or shape.
  """
  if not members:
    raise ValueError("model is an empty list: a family of architectures needs at "
                     "least one model.")
  if parts is None or isinstance(parts, parts_lib.Parts):
    parts = [parts] * len(members)
  if len(parts) != len(members):
    raise ValueError(f"parts must be one Parts or a list of one per model of the "
                     f"family ({len(members)}), got {len(parts)}.")
  family = []
  for member, member_parts in zip(members, parts):
    member = adapters.as_model(member)
    family.append((member, parts_lib.checked(member, member_parts, input_shape,
                                             num_classes)))
  shared = family[0][1].output
  heads = [_head(m, shared, input_shape) for m, _ in family]
  for (member, member_parts), head in zip(family[1:], heads[1:]):
    if head != heads[0] or member_parts.output != shared:
      raise ValueError(
          "the models of a heterogeneous family must share their output layer (the "
          f"same path and shapes): {adapters.model_name(family[0][0])} has "
          f"{shared} {heads[0]}, {adapters.model_name(member)} has "
          f"{member_parts.output} {_head(member, member_parts.output, input_shape)}.")
  return tuple(family)


def checked_models(model: Any, parts: Any, input_shape: tuple[int, ...],
                   num_classes: int) -> tuple[Any, parts_lib.Parts, Family | None]:
  """`(model, parts, family)` of a model (`family` None) or of a list of models,
  a family (`model` and `parts` its first member's), each adapted
  (`pflax.models.as_model`) and checked against the inputs and classes."""
  if isinstance(model, list):
    family = _family(model, parts, tuple(input_shape), num_classes)
    return (*family[0], family)
  model = adapters.as_model(model)
  return model, parts_lib.checked(model, parts, input_shape, num_classes), None


@dataclasses.dataclass(frozen=True)
class Setup:
  """A prepared federation (host arrays) with its model, checked against each other.

  Attributes:
    federation: the clients' data (`pflax.data.federate`).
    model: any model `pflax.models.as_model` takes, mapping
      `(B, *input_shape)` to `(B, num_classes)` logits; or a list of them, a
      family of architectures sharing their output layer (`heterogeneous=True`),
      after construction its first member.
    input_shape: one example's shape (the federation's).
    num_classes: K (the federation's class counts' width).
    parts: the model's `pflax.models.Parts` (for a family, one for every member
      or a list of one per member); None: found by `pflax.models.model_parts`
      (pflax's models by name, any other by its last linear layer). After
      construction, the (first) model's parts.
    family: after construction, every member of a family with its parts; None
      for one model.

  Raises:
    ValueError: at construction, when the model, `input_shape`, `num_classes`
      and the federation disagree, or the members of a family do not share
      their output layer.
  """
  federation: federation_lib.Federation
  model: Any
  input_shape: tuple[int, ...]
  num_classes: int
  parts: Any = None
  family: Family | None = None

  def __post_init__(self):
    fed = self.federation
    if tuple(self.input_shape) != tuple(fed.x.shape[2:]):
      raise ValueError(f"input_shape must be the federation's examples' shape "
                       f"{tuple(fed.x.shape[2:])}, got {tuple(self.input_shape)}.")
    if self.num_classes != fed.counts.shape[1]:
      raise ValueError(f"num_classes must be the federation's {fed.counts.shape[1]} "
                       f"classes (its class counts' width), got {self.num_classes}.")
    model, parts, family = checked_models(self.model, self.parts, self.input_shape,
                                          self.num_classes)
    object.__setattr__(self, "model", model)
    object.__setattr__(self, "input_shape", tuple(self.input_shape))
    object.__setattr__(self, "parts", parts)
    object.__setattr__(self, "family", family)


def client_optimizer(optimizer: str = "sgd", lr: float = 0.05, momentum: float = 0.0,
                     adam_b1: float = 0.9, grad_clip: float | None = None
                     ) -> optax.GradientTransformation:
  """The clients' optimizer: SGD (optionally with momentum) or Adam (b2 0.999),
  with an optional clip of the gradient's global norm. `lr` may be traced."""
  alg.check_range("lr", lr, 0.0, MAX_LR, open_low=True)
  alg.check_range("momentum", momentum, 0.0, 0.999)
  alg.check_range("adam_b1", adam_b1, 0.0, 0.999)
  if grad_clip is not None:
    alg.check_range("grad_clip", grad_clip, 0.0, MAX_LR, open_low=True)
  if optimizer == "sgd":
    opt = optax.sgd(lr, momentum=momentum or None)
  elif optimizer == "adam":
    opt = optax.adam(lr, b1=adam_b1, b2=0.999)
  else:
    raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}.")
  if grad_clip:
    opt = optax.chain(optax.clip_by_global_norm(grad_clip), opt)
  return opt


def _partition(config: ExperimentConfig, labels: np.ndarray, num_classes: int,
               seed: int) -> partition_lib.Partition:
  """The clients' samples: `config.partition`, cut to `config.samples_per_client`."""
  size = config.samples_per_client
  if config.partition == "groups":
    return label_groups_lib.groups(labels, config.clients,
                                   iid_fraction=config.iid_fraction,
                                   samples_per_client=size, seed=seed)
  if config.partition == "pathological":
    partition = pathological_lib.pathological(labels, config.clients,
                                              config.classes_per_client,
                                              num_classes=num_classes, seed=seed)
  elif config.partition == "dirichlet":
    partition = dirichlet_lib.dirichlet(labels, config.clients, config.dirichlet_alpha,
                                        num_classes=num_classes, seed=seed,
                                        min_partition_size=min(10, len(labels)
                                                               // config.clients))
  else:
    raise ValueError(f"partition must be one of {PARTITIONS}, got "
                     f"{config.partition!r}.")
  if size is None:
    return partition
  rng = np.random.default_rng((seed, 1))  # a stream of its own, from the seed
  kept = [rng.choice(idx, min(len(idx), size), replace=False)
          for idx in partition.indices]
  return partition_lib.make_partition(labels, kept, num_classes)


def _model_name(name: str, input_shape: tuple[int, ...]) -> str:
  """"auto": the papers' CNN for images of 16 pixels or more, else the MLP.

  On the 8x8 digits the CNN trains ~6x slower per step than the MLP on XLA-CPU
  and the main job must finish in minutes.
  """
  if name != "auto":
    return name
  return "cnn" if min(input_shape[:2]) >= 16 else "mlp"


Data = datasets.Dataset | federation_lib.Federation
"""What `prepare`, `run` and `sweep` take as `dataset=`: a `pflax.data.Dataset`
(partitioned by the configuration), or a prepared `pflax.data.Federation`."""


def _federation(config: ExperimentConfig, seed: int,
                dataset: Data | None) -> federation_lib.Federation:
  """The clients' data: `dataset` itself when it is a federation, else
  `dataset` (default: `config.dataset` loaded) partitioned and split as
  `config.test_split` says."""
  if isinstance(dataset, federation_lib.Federation):
    return dataset
  if dataset is None:
    dataset = datasets.load(config.dataset, data_dir=config.data_dir)
  elif not isinstance(dataset, datasets.Dataset):
    raise ValueError(f"dataset must be a pflax.data.Dataset or a prepared "
                     f"pflax.data.Federation, got {type(dataset).__name__}.")
  if config.test_split not in TEST_SPLITS:
    raise ValueError(f"test_split must be one of {TEST_SPLITS}, got "
                     f"{config.test_split!r}.")
  test = None
  if config.test_split == "clients":
    dataset = arrays_lib.pooled(dataset)
  elif dataset.test_images is None:
    raise ValueError(f"test_split: the dataset {dataset.name!r} has no test split of "
                     f"its own; use 'clients' (each client's data split by "
                     f"test_fraction).")
  else:
    test = (dataset.test_images, dataset.test_labels)
  check_data(config, dataset.labels, dataset.num_classes)
  partition = _partition(config, dataset.labels, dataset.num_classes, seed)
  return federation_lib.federate(dataset.images, dataset.labels, partition,
                                 seed=seed, batch_size=config.batch_size,
                                 test_fraction=config.test_fraction, test=test)


def prepare(config: ExperimentConfig, seed: int, *, dataset: Data | None = None,
            model: Any = None, parts: Any = None) -> Setup:
  """An experiment's clients and model, checked against each other (NumPy data).

  Args:
    config: the experiment (its data handling and model name).
    seed: the partition's and the train/test split's seed.
    dataset: a `pflax.data.Dataset` (e.g. `pflax.data.from_arrays(x, y)`),
      partitioned over `config.clients` by `config.partition` and split as
      `config.test_split` says (by default each client's data 75/25); or a
      prepared `pflax.data.Federation`, used as it is. None: `config.dataset`
      loaded (`pflax.data.load`).
    model: any model `pflax.models.as_model` takes (Flax linen or NNX,
      Equinox, a pair of functions), or a list of them sharing their output
      layer (a family, with `heterogeneous=True`); None: `config.model`
      (pflax's CNN or MLP).
    parts: the model's `pflax.models.Parts` (for a family, one for all or a
      list of one per member); None: found from the model.

  Returns:
    The `Setup`.

  Raises:
    ValueError: when the model does not fit the data (input shape, K) or a
      part of it cannot be found.
  """
  federation = _federation(config, seed, dataset)
  input_shape = tuple(federation.x.shape[2:])
  num_classes = federation.counts.shape[1]
  if model is None:
    model = models.get_model(_model_name(config.model, input_shape), num_classes,
                             input_shape)
  check_partition(config, federation)
  return Setup(federation, model, input_shape, num_classes, parts)


Builder = Callable[..., alg.Algorithm]
"""`builder(model, optimizer, **hyperparameters) -> Algorithm`."""


def resolve_builder(name: str) -> Builder:
  """A builder by name: one of `pflax.algorithms.METHODS`, or `"module:function"`.

  Raises:
    ValueError: for an unknown name or a path that does not import.
  """
  if name in registry.METHODS:
    return registry.METHODS[name].builder
  if ":" not in name:
    raise ValueError(f"algorithm must be one of {tuple(registry.METHODS)} or "
                     f"'module:builder', got {name!r}.")
  module, _, attr = name.partition(":")
  try:
    builder = getattr(importlib.import_module(module), attr)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"cannot import the builder {name!r}: {e}") from None
  if not callable(builder):
    raise ValueError(f"{name!r} is not a builder (a callable).")
  return builder


def sweepable(builder: Builder) -> tuple[str, ...]:
  """The hyperparameters a sweep can trace: "lr" (the clients' learning rate) and
  every keyword of `builder` with a float default."""
  params = inspect.signature(builder).parameters.values()
  return ("lr",) + tuple(p.name for p in params
                         if p.kind == p.KEYWORD_ONLY and isinstance(p.default, float))


@dataclasses.dataclass(frozen=True)
class Build:
  """`build(value) -> Groups`: the algorithm of an experiment, hashable by value.

  `value` replaces the swept hyperparameter (`swept`) when it is not None.
  """
  builder: Builder
  model: nn.Module
  num_classes: int
  num_clients: int
  heterogeneous: bool
  family: str | Family
  optimizer: tuple[tuple[str, Any], ...]
  hyperparameters: tuple[tuple[str, Any], ...]
  swept: str | None
  parts: parts_lib.Parts | None = None
  dp: tuple[str, float, float, float] | None = None

  def _parts(self, model: Any) -> parts_lib.Parts | None:
    """The parts of `model`: a member's of your family, the model's own, or None
    (pflax's family members find their own)."""
    if not isinstance(self.family, str):
      return next(p for m, p in self.family if m is model)
    return self.parts if model == self.model else None

  def member(self, model: nn.Module, value: Any) -> alg.Algorithm:
    """The algorithm of the clients of `model`."""
    opt, kw = dict(self.optimizer), dict(self.hyperparameters)
    if value is not None and self.swept is not None:
      (opt if self.swept == "lr" else kw)[self.swept] = value
    parts = self._parts(model)
    if parts is not None and takes_parts(self.builder):
      kw.setdefault("parts", parts)
    built = self.builder(model, client_optimizer(**opt), **kw)
    if self.dp is None:
      return built
    name, clip, z, expected = self.dp
    return privacy_lib.private(built, clip, z, expected, name)

  def algorithm(self, value: Any) -> alg.Algorithm:
    """The algorithm of all clients: for `heterogeneous`, over pflax's family of
    architectures or yours, sharing their output layer
    (`pflax.algorithms.heterogeneous`)."""
    build = functools.partial(self.member, value=value)
    if not self.heterogeneous:
      return build(self.model)
    if isinstance(self.family, str):
      return heterogeneous_lib.heterogeneous(build, models.FAMILIES[self.family](
          self.num_classes))
    return heterogeneous_lib.heterogeneous(build, [m for m, _ in self.family],
                                           shared=self.family[0][1].output)

  def __call__(self, value: Any) -> groups_lib.Groups:
    return groups_lib.as_groups(self.algorithm(value), self.model, self.num_clients)


def takes_parts(builder: Builder) -> bool:
  """Whether `builder` reads a model's parts (has a `parts` keyword)."""
  return "parts" in inspect.signature(builder).parameters


def algorithm_name(algorithm: str | Builder) -> str:
  return algorithm if isinstance(algorithm, str) else algorithm.__name__


def builder_arguments(algorithm: str | Builder, config: ExperimentConfig
                       ) -> tuple[Builder, dict[str, Any], dict[str, Any]]:
  """`(builder, optimizer fields, builder keywords)` of an algorithm in `config`."""
  name = algorithm_name(algorithm)
  builder = resolve_builder(algorithm) if isinstance(algorithm, str) else algorithm
  optimizer = {f: getattr(config, f) for f in OPTIMIZER_FIELDS}
  optimizer.update(config.optimizers.get(name, {}))
  return builder, optimizer, dict(config.hyperparameters.get(name, {}))


def build_algorithm(algorithm: str | Builder, config: ExperimentConfig,
                    input_shape: tuple[int, ...], num_classes: int, *,
                    model: Any = None, parts: parts_lib.Parts | None = None
                    ) -> tuple[alg.Algorithm, Any, parts_lib.Parts]:
  """`(algorithm, model, parts)` of an experiment, as a run builds them, for
  inputs of `input_shape` in `num_classes` classes: with `config.heterogeneous`,
  the algorithm over pflax's family of architectures (`Algorithm.architectures`).
  `model` (None: `config.model`) and `parts` are as in `prepare`; the model is
  checked against the inputs and classes, and `parts` found where not given."""
  builder, optimizer, keywords = builder_arguments(algorithm, config)
  if model is None:
    model = models.get_model(_model_name(config.model, input_shape), num_classes,
                             input_shape)
  model, parts, family = checked_models(model, parts, input_shape, num_classes)
  _check_family(config, model, family)
  build = Build(builder, model, num_classes, config.clients, config.heterogeneous,
                 family or config.family, tuple(sorted(optimizer.items())),
                 tuple(sorted(keywords.items())), None, parts)
  return build.algorithm(None), model, parts


def _check_family(config: ExperimentConfig, model: Any, family: Family | None
                  ) -> None:
  """Raises ValueError unless heterogeneous clients train pflax's family (with
  pflax's model) or yours, and only they train a family."""
  if family is not None and not config.heterogeneous:
    raise ValueError("model is a list, a family of architectures: set "
                     "heterogeneous=True, or give one model.")
  if family is not None and config.family != "cnn":
    raise ValueError(f"family={config.family!r} names one of pflax's families; "
                     "model is a list, your own family: leave family at its default.")
  if family is None and config.heterogeneous and not parts_lib.is_pflax_model(model):
    raise ValueError(
        "heterogeneous=True trains pflax's family of architectures (family=...) or "
        "yours, a list of models sharing their output layer (model=[ModelA, "
        f"ModelB, ...]); it does not train one model of your own "
        f"({adapters.model_name(model)}).")


def plan(algorithm: str | Builder, config: ExperimentConfig, setup: Setup,
          num_clients: int, strategy: str, swept: str | None) -> engine.Plan:
  """The engine's plan of an experiment (host checks of the builder included)."""
  builder, optimizer, keywords = builder_arguments(algorithm, config)
  pflax_model = parts_lib.is_pflax_model(setup.model)
  _check_family(config, setup.model, setup.family)
  build = Build(builder, setup.model, setup.num_classes, num_clients,
                 config.heterogeneous, setup.family or config.family,
                 tuple(sorted(optimizer.items())),
                 tuple(sorted(keywords.items())), swept, setup.parts,
                 _dp(algorithm, config))
  algorithm_ = build.member(setup.model, None)  # the builder's checks, on the host
  known = pflax_model and setup.parts is parts_lib.pflax_parts(setup.model)
  if not (known and builder in [m.builder for m in registry.METHODS.values()]):
    _check_fits(algorithm_name(algorithm), algorithm_, setup)
  return engine.Plan(build=build, num_clients=config.clients,
                     participation=config.participation,
                     fault_fraction=config.faulty_clients,
                     fault_kind=config.fault_kind, fault_scale=config.fault_scale,
                     outlier_factor=(None if config.dp_clip else
                                     config.outlier_factor or None),
                     local_epochs=config.local_epochs, batch_size=config.batch_size,
                     strategy=strategy, output=setup.parts.output,
                     precision=config.precision,
                     poisson=bool(config.dp_clip))


def _dp(algorithm: str | Builder, config: ExperimentConfig
        ) -> tuple[str, float, float, float] | None:
  """`Build.dp`: `(name, C, z, q M)` under client-level DP, else None."""
  if not config.dp_clip:
    return None
  return (algorithm_name(algorithm), float(config.dp_clip),
          float(config.dp_noise_multiplier or 0.0),
          config.participation * config.clients)


def _check_fits(name: str, algorithm: alg.Algorithm, setup: Setup) -> None:
  """Raises ValueError unless `algorithm` runs on the setup's model: its init, local
  loss and server step traced abstractly on two clients (nothing is compiled)."""
  fed = setup.federation
  x = jax.ShapeDtypeStruct((2, *fed.x.shape[2:]), np.float32)
  batch = train_lib.Batch(x, jax.ShapeDtypeStruct((2,), np.int32),
                          jax.ShapeDtypeStruct((2,), np.bool_))
  counts = jax.ShapeDtypeStruct((2, setup.num_classes), np.int32)
  key = jax.eval_shape(lambda: prng.key(0))

  def trace(key, x, counts, batch):
    params = jax.vmap(lambda _: setup.model.init(key, x)["params"])(np.arange(2))
    state = algorithm.init(params, counts, key)
    start = algorithm.client_models(state)
    context = algorithm.client_context(state)
    first = lambda tree: None if tree is None else jax.tree.map(lambda v: v[0], tree)
    loss = algorithm.loss(first(start), first(context), batch, key)
    return loss, algorithm.server_update(state, start, np.ones(2, bool), key)

  try:
    jax.eval_shape(trace, key, x, counts, batch)
  except Exception as e:  # pylint: disable=broad-except
    text = str(e).splitlines()[0] if str(e) else ""
    raise ValueError(f"{name} cannot run on model {adapters.model_name(setup.model)}: "
                     f"{type(e).__name__}: {text}") from None


def _field_kind(annotation: Any) -> str | None:
  """What a field of `ExperimentConfig` annotated `annotation` must hold, in
  words, or None for a table (`optimizers`, `hyperparameters`)."""
  union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
  options = typing.get_args(annotation) if union else (annotation,)
  words = {bool: "True or False", int: "an integer", float: "a finite number",
           str: "a string"}
  kind = next((words[t] for t in (bool, int, float, str) if t in options), None)
  if kind is not None and type(None) in options:
    kind = "None or " + kind
  return kind


def _of_kind(value: Any, kind: str) -> bool:
  """Whether `value` is of `kind` (`_field_kind`): bools are not numbers, and a
  number is finite."""
  if value is None:
    return kind.startswith("None or ")
  if isinstance(value, (bool, np.bool_)):
    return kind.endswith("True or False")
  if kind.endswith("an integer"):
    return isinstance(value, (int, np.integer))
  if kind.endswith("a finite number"):
    return isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(
        value)
  return isinstance(value, str) if kind.endswith("a string") else False


def participation_warning(config: ExperimentConfig) -> str | None:
  """What to tell the user when `participation * clients` clients are asked for but
  `max(1, round(participation * clients))` take part (`pflax.simulate.run`), and the
  two differ by more than 10% of the former; else None.

  >>> participation_warning(ExperimentConfig(clients=20, participation=0.01))
  'participation 0.01 of 20 clients is 0.2 clients; 1 client takes part each round'
  """
  asked = config.participation * config.clients
  taking = keys_lib.num_participants(config.participation, config.clients)
  if abs(taking - asked) <= 0.1 * asked:
    return None
  clients = "1 client takes" if taking == 1 else f"{taking} clients take"
  return (f"participation {config.participation:g} of {config.clients} clients is "
          f"{asked:g} clients; {clients} part each round")


def warn_participation(config: ExperimentConfig) -> None:
  """Warns (UserWarning, `participation_warning`) when fewer or more clients take
  part than `config` asks for: once where a run starts (`run`, `sweep`,
  `pflax.tune.make_task`, a Flower server, `pflax-run`), not at construction."""
  message = participation_warning(config)
  if message:
    warnings.warn(message, UserWarning)


def _closest(name: str, known: Sequence[str]) -> str:
  """` (did you mean 'x'?)` for the name of `known` closest to `name`, else ''."""
  close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _keywords(builder: Builder) -> tuple[str, ...] | None:
  """The keywords `builder` takes after `(model, optimizer)`; None if any."""
  try:
    params = list(inspect.signature(builder).parameters.values())
  except (TypeError, ValueError):
    return None
  if any(p.kind == p.VAR_KEYWORD for p in params):
    return None
  return tuple(p.name for p in params[2:]
               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _named_builder(table: str, name: str, run: Mapping[str, str | Builder]
                   ) -> Builder:
  """The builder that the key `name` of `config.<table>` configures."""
  if name in registry.METHODS:
    return registry.METHODS[name].builder
  if name in run and not isinstance(run[name], str):
    return run[name]
  if name in run or ":" in name:
    try:
      return resolve_builder(name)
    except ValueError as e:
      raise ValueError(f"{table}: unknown algorithm {name!r}: {e}") from None
  known = list(registry.METHODS) + [n for n in run if n not in registry.METHODS]
  raise ValueError(f"{table}: unknown algorithm {name!r}{_closest(name, known)}; "
                   f"known: {', '.join(known)} (or 'module:builder')")


def check_algorithm_keys(config: ExperimentConfig,
                         algorithms: Sequence[str | Builder]) -> None:
  """Raises ValueError for a key of `config.hyperparameters` or `config.optimizers`
  that names no algorithm, or for a keyword its algorithm does not take.

  A key names a built-in algorithm (`pflax.algorithms.METHODS`, run or not:
  presets configure several), a `"module:builder"`, or one of the `algorithms`
  being run (a builder's `__name__`). An entry of `hyperparameters` holds keywords
  of the builder's signature, one of `optimizers` the fields `OPTIMIZER_FIELDS`.

  >>> check_algorithm_keys(ExperimentConfig(hyperparameters={"cwfedav": {}}),
  ...                      ["cwfedavg"])
  Traceback (most recent call last):
  ValueError: hyperparameters: unknown algorithm 'cwfedav' (did you mean 'cwfedavg'?)...
  """
  run = {algorithm_name(a): a for a in algorithms}
  for table in ("hyperparameters", "optimizers"):
    for name, entry in getattr(config, table).items():
      builder = _named_builder(table, name, run)
      if not isinstance(entry, Mapping):
        raise ValueError(f"{table}[{name!r}] must be a mapping of keywords, got "
                         f"{entry!r}.")
      valid = OPTIMIZER_FIELDS if table == "optimizers" else _keywords(builder)
      for key in (k for k in entry if valid is not None and k not in valid):
        if key in OPTIMIZER_FIELDS:
          raise ValueError(f"hyperparameters[{name!r}]: {key!r} is a field of the "
                           f"clients' optimizer: set it in optimizers[{name!r}].")
        what = "the optimizer" if table == "optimizers" else f"{name}'s builder"
        raise ValueError(f"{table}[{name!r}]: unknown keyword {key!r}"
                         f"{_closest(key, valid)}; {what} takes "
                         f"{', '.join(valid) or 'no keywords'}.")


def check_setups(config: ExperimentConfig, setups: Mapping[int, Setup]) -> None:
  """Raises ValueError if the federation of a prepared setup does not hold
  `config.clients` clients."""
  for seed, setup in setups.items():
    m = setup.federation.num_samples.shape[0]
    if m != config.clients:
      raise ValueError(f"setup: the federation of seed {seed} has {m} clients, "
                       f"config.clients is {config.clients}.")


def check_data(config: ExperimentConfig, labels: np.ndarray, num_classes: int) -> None:
  """Raises ValueError naming the field of `config` that the dataset (`labels` in
  `num_classes` classes) cannot partition.

  Every partition needs `clients <= N` samples. "pathological" needs
  `classes_per_client <= K` and, as each class is split among up to
  `ceil(M c / K)` clients, at least that many samples in every class: at most
  `floor(n_min K / c)` clients for the smallest class's `n_min` samples.
  ("groups" checks its own quotas and names `num_clients`.)
  """
  if config.clients > len(labels):
    raise ValueError(f"clients must be <= the dataset's {len(labels)} samples, got "
                     f"{config.clients}.")
  if config.partition != "pathological":
    return
  c = config.classes_per_client
  if c > num_classes:
    raise ValueError(f"classes_per_client must be <= the dataset's {num_classes} "
                     f"classes, got {c}.")
  sizes = np.bincount(labels, minlength=num_classes)
  holders = -(-config.clients * c // num_classes)
  if sizes.min() < holders:
    raise ValueError(
        f"clients: {config.clients} clients of {c} classes each share a class among "
        f"up to {holders} clients, but class {int(np.argmin(sizes))} has "
        f"{sizes.min()} samples; use at most {sizes.min() * num_classes // c} "
        f"clients.")


def check_partition(config: ExperimentConfig,
                    federation: federation_lib.Federation) -> None:
  """Raises ValueError if a client of `federation` has no training sample; warns
  (UserWarning) if some have fewer training samples than `config.batch_size`
  (each of their local epochs is one smaller step) or no test sample (their
  accuracy is not measured).

  The suggested numbers of clients are necessary bounds: one training sample
  per client, one full batch per client.
  """
  train = np.asarray(federation.num_samples)
  tests = np.asarray(federation.test_mask).sum(axis=1)
  m, total, batch = len(train), int(train.sum() + tests.sum()), config.batch_size
  empty = int(np.sum(train == 0))
  if empty:
    raise ValueError(f"clients: {m} clients on {total} samples leave {empty} of them "
                     f"without a training sample; use at most {total} clients.")
  small = int(np.sum(train < batch))
  if small:
    warnings.warn(
        f"clients: {small} of {m} clients have fewer training samples than "
        f"batch_size {batch} (the fewest: {train.min()}), so each of their local "
        f"epochs is a single step; the {train.sum()} training samples fill one "
        f"batch for at most {train.sum() // batch} clients.", UserWarning)
  untested = int(np.sum(tests == 0))
  if untested:
    warnings.warn(
        f"clients: {untested} of {m} clients have no test sample; their accuracy is "
        "not measured (left out of the per-client mean and std).", UserWarning)


def check_algorithm(algorithm: str | Builder, config: ExperimentConfig) -> None:
  """Raises ValueError if `algorithm`'s builder refuses its hyperparameters in `config`
  (checks the keys of `config`'s tables with `check_algorithm_keys`, then builds it
  once with a placeholder model; nothing is compiled)."""
  check_algorithm_keys(config, [algorithm])
  builder, optimizer, keywords = builder_arguments(algorithm, config)
  name = algorithm_name(algorithm)
  for key, value in keywords.items():
    _check_magnitude(builder, name, key, value)
  try:
    opt = client_optimizer(**optimizer)
  except (ValueError, TypeError) as e:
    raise ValueError(f"optimizers[{name!r}]: {e}") from None
  built = builder(models.MLP(2), opt, **keywords)
  dp = _dp(algorithm, config)
  if dp is not None:
    privacy_lib.private(built, *dp[1:], name=dp[0])
  check_byzantine_bound(algorithm, config)


def _check_magnitude(builder: Builder, name: str, key: str, value: Any) -> None:
  """Raises ValueError unless a builder keyword's `value` is a finite number of
  magnitude at most `MAX_MAGNITUDE` where it is a number or its default is."""
  try:
    default = inspect.signature(builder).parameters[key].default
  except (KeyError, TypeError, ValueError):
    default = None
  number = lambda v: isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
  if (number(value) or number(default)) and not (number(value)
                                                 and abs(value) <= MAX_MAGNITUDE):
    raise ValueError(f"hyperparameters[{name!r}]: {key} must be a finite number of "
                     f"magnitude at most {MAX_MAGNITUDE:g}, got {value!r}.")


def check_byzantine_bound(algorithm: str | Builder, config: ExperimentConfig) -> None:
  """Raises ValueError if a round's participants (`clients x participation`)
  are too few for the `robust` rule and `num_byzantine` of `algorithm`'s
  hyperparameters (Krum and Multi-Krum: n > 2f + 2; Bulyan: n >= 4f + 3)."""
  keywords = builder_arguments(algorithm, config)[2]
  participants = keys_lib.num_participants(config.participation, config.clients)
  f = keywords.get("num_byzantine", 0)
  need = {"krum": 2 * f + 3, "multi_krum": 2 * f + 3,
          "bulyan": 4 * f + 3}.get(keywords.get("robust"))
  if need is not None and participants < need:
    raise ValueError(f"robust={keywords['robust']!r} with num_byzantine={f} needs at "
                     f"least {need} participants a round, got {participants} "
                     "(clients x participation); lower num_byzantine or add clients.")


def check_heterogeneous(algorithm: str | Builder, config: ExperimentConfig) -> None:
  """Raises ValueError if `config.heterogeneous` and `algorithm` is one of pflax's
  that does not share a head (`HEAD_SHARING`)."""
  if (config.heterogeneous and isinstance(algorithm, str)
      and algorithm in registry.METHODS and algorithm not in HEAD_SHARING):
    raise ValueError(f"heterogeneous models need an algorithm that shares a head "
                     f"({', '.join(HEAD_SHARING)}), got {algorithm!r}.")


def differing_field(configs: Mapping[str, ExperimentConfig]) -> str | None:
  """The first field outside `PARTITION_FIELDS` in which `configs` differ; None
  when they agree in all of them."""
  first, *rest = configs.values()
  return next((f.name for f in dataclasses.fields(ExperimentConfig)
               if f.name not in PARTITION_FIELDS
               and any(getattr(c, f.name) != getattr(first, f.name) for c in rest)),
              None)


def check_settings(configs: Mapping[str, ExperimentConfig]) -> None:
  """Raises ValueError unless `configs` (`{setting: config}`, at least one) agree in
  every field outside `PARTITION_FIELDS`, naming the first that differs and its
  value in each setting."""
  if not configs:
    raise ValueError("configs must hold at least one setting, got none.")
  field = differing_field(configs)
  if field is not None:
    values = ", ".join(f"{s}: {getattr(c, field)!r}" for s, c in configs.items())
    raise ValueError(f"settings run side by side may differ only in "
                     f"{', '.join(PARTITION_FIELDS)}; they differ in {field} "
                     f"({values}).")


def _check_grid(seeds: Sequence[int], swept: str | None, values: Sequence[float],
                builder: Builder) -> None:
  if not seeds or any(not isinstance(s, (int, np.integer)) or not 0 <= s < 2**31
                      for s in seeds):
    raise ValueError(f"seeds must be a non-empty list of ints in [0, 2**31), got "
                     f"{list(seeds)!r}.")
  if swept is None:
    if values:
      raise ValueError("values given without a hyperparameter to sweep.")
    return
  if swept not in sweepable(builder):
    raise ValueError(f"hyperparameter must be one of {sweepable(builder)}, got "
                     f"{swept!r}.")
  if not values or any(not math.isfinite(v) for v in values):
    raise ValueError(f"values of {swept} must be a non-empty list of finite numbers, "
                     f"got {list(values)!r}.")


def check_sweep(algorithm: str | Builder, config: ExperimentConfig,
                seeds: Sequence[int], hyperparameter: str | None = None,
                values: Sequence[float] = ()) -> None:
  """Raises ValueError for seeds outside `[0, 2**31)`, a hyperparameter `algorithm`
  cannot sweep, or a value of it that `check_algorithm` refuses; nothing is
  compiled."""
  builder = resolve_builder(algorithm) if isinstance(algorithm, str) else algorithm
  _check_grid(seeds, hyperparameter, values, builder)
  name = algorithm_name(algorithm)
  table = "optimizers" if hyperparameter == "lr" else "hyperparameters"
  for value in values:
    entries = {k: dict(v) for k, v in getattr(config, table).items()}
    entries.setdefault(name, {})[hyperparameter] = value
    check_algorithm(algorithm, dataclasses.replace(config, **{table: entries}))
